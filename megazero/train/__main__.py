"""`python -m megazero.train --config FILE [--section.key value ...]` (under torchrun for N processes).

Megatron-LM's GPT pretraining flags (--num-layers 24 --fp16 --data-path ...) are accepted as
aliases of the config keys (config/megatron.py; README's "Coming from Megatron-LM").

Precedence: defaults (Megatron-LM's where they differ, for Megatron flags without a config file)
< the YAML --config < a DeepSpeed config (--deepspeed-config FILE, or a .json --config) <
command-line overrides and Megatron flags (in the order given)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from typing import NoReturn, Optional

from megazero.config.deepspeed import load_deepspeed_config
from megazero.config.help import reference
from megazero.config.megatron import translate
from megazero.config.parse import build_config, load_yaml, parse_overrides
from megazero.config.reads import unread_warning
from megazero.config.rules import schedule_warnings
from megazero.config.schema import Config, ConfigError
from megazero.errors import exit_if_failed_before, report_errors
from megazero.train import lifecycle
from megazero.train.preflight import preflight, resolve_and_validate, starting_point_line
from megazero.train.sinks import set_aside_other_runs


def main(argv: Optional[list[str]] = None) -> None:
    exit_if_failed_before()  # a restart after a config/data/checkpoint error would meet it again
    parser = argparse.ArgumentParser(
        prog="megazero-train", description=__doc__, allow_abbrev=False, formatter_class=argparse.RawTextHelpFormatter,
        epilog="config keys: override any as --section.key value or --section.key=value;\n"
               "a list key takes every value up to the next --flag (--data.prefix 0.3 A 0.7 B) or a,b,c;\n"
               "Megatron-LM's flags are accepted too (--num-layers 24 --fp16 ...: README, 'Coming from Megatron-LM')\n"
               + reference())
    parser.add_argument("--config", help="YAML config file (configs/gpt2-tiny.yaml, ...); a .json file is read as "
                                         "a DeepSpeed config")
    parser.add_argument("--deepspeed-config", "--deepspeed_config", metavar="FILE",
                        help="DeepSpeed JSON config (ds_config.json) to import on top of --config")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    parser.add_argument("--validate-only", action="store_true",
                        help="check the config for --world-size processes, and the files the run reads (data, the "
                             "checkpoint it resumes, zero.nvme_path), and exit before launching any")
    parser.add_argument("--config-only", action="store_true",
                        help="with --validate-only: the config alone, not the files (before the data is prepared)")
    parser.add_argument("--quiet", action="store_true",
                        help="print no warning or note lines, errors only (a script that validates first and then "
                             "runs prints them once, from the run)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the full resolved config at start-up (logging.print_config)")
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="processes the config is validated for (default: $WORLD_SIZE, else 1)")
    args, overrides = parser.parse_known_args(argv)
    if args.print_config:
        overrides += ["--logging.print_config", "true"]
    if args.help_config:
        print(reference())
        return
    speaks = int(os.environ.get("RANK", "0")) == 0 and not args.quiet  # the rank that prints notes and warnings
    with report_errors():
        cfg = load_config(args.config, args.deepspeed_config, overrides, 0 if speaks else 1, args.world_size)
        require_logging_packages(cfg)
        lifecycle.refuse_missing_load(cfg)
        starting = starting_point_line(cfg, args.config or args.deepspeed_config)
    if starting and speaks:
        print(starting, flush=True)
    if speaks:
        for line in schedule_warnings(cfg):
            print(line, file=sys.stderr, flush=True)
    if args.validate_only:
        with report_errors():
            if not args.config_only:
                preflight(cfg, args.world_size)
        print(f"config OK for {args.world_size} process(es)" + (" (files not checked)" if args.config_only else ""))
        return
    if not lifecycle.restart_count() and is_logging_rank(cfg, args.world_size):
        # Before any rank starts training (the others never touch the metrics outputs); a
        # restart is the run that claimed them.
        with report_errors(OSError, every_rank=True):
            for line in set_aside_other_runs(cfg):
                print(line, flush=True)
    lifecycle.die_with_launcher()
    restarted = lifecycle.resume_on_restart(cfg)
    if restarted and int(os.environ.get("RANK", "0")) == 0:
        print(restarted, flush=True)
    train(cfg)


def train(cfg: Config) -> NoReturn:
    """Train, then leave with a status that says how the run ended: 0 once its last iteration
    and save are done (a stop signal arriving later changes nothing), otherwise non-zero after
    one line saying why (see _leave)."""
    import torch.distributed as dist  # here, not at the top: --help and --validate-only need no torch

    from megazero.parallel.grid import ProcessGrid
    from megazero.train.replicas import ReplicaMismatch
    from megazero.train.trainer import Trainer

    timeout_s = cfg.train.timeout_minutes * 60
    grid = ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp, timeout_s, lifecycle.attempt_store(timeout_s),
                              cp=cfg.parallel.cp, ep=cfg.parallel.ep, etp=cfg.parallel.expert_tp)
    lost_peer = lifecycle.LostPeerExit()  # a lost peer: one line per surviving rank, exit 1, not a traceback
    watch = lifecycle.NcclErrorWatch(grid, lost_peer)
    try:
        with report_errors():  # a checkpoint, data or training error: the same on every rank
            try:
                Trainer(cfg, grid).run()
                lifecycle.remember_clean_end(lifecycle.FINISHED)  # the last checkpoint is sealed
                dist.barrier()  # no rank tears its communicators down while a peer still uses them
            except ReplicaMismatch as e:  # every rank alike; status 1 (no user error): a restart resumes
                if grid.rank == 0:
                    print(f"error: {e}", file=sys.stderr, flush=True)
                _leave(1)
            except RuntimeError as e:
                line = lifecycle.describe_comm_failure(e, grid.rank, timeout_s)
                if line is None:
                    raise
                lost_peer(line)
    except SystemExit as stop:  # the error line is printed: leave without teardown (below)
        _leave(exit_status(stop.code))
    watch.stop()
    if grid.backend == "nccl":
        dist.destroy_process_group()
    _leave(0)


def is_logging_rank(cfg: Config, world_size: int) -> bool:
    """Whether this process is the rank that writes the metrics (the grid's rule, no process group yet)."""
    from megazero.parallel.grid import ProcessGrid

    p = cfg.parallel
    layout = ProcessGrid(tp=p.tp, pp=p.pp, dp=world_size // (p.tp * p.pp * p.cp), cp=p.cp,
                         rank=int(os.environ.get("RANK", "0")))
    return layout.rank == layout.logging_rank


def exit_status(code: object) -> int:
    """The status the interpreter would end with for sys.exit(code): None is success, an int is
    itself, anything else (a message) is printed and is status 1: never a silent failure."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(f"error: {code}", file=sys.stderr, flush=True)
    return 1


def _leave(status: int) -> NoReturn:
    """Exit with `status` once every output is written and closed (metrics, checkpoints: the
    trainer closed them on its way out), without tearing the process groups' C++ state down:
    that teardown (a gloo or NCCL thread's std::thread still joinable) occasionally aborted a
    finished run, or one that had printed its one-line error, with "terminate called without an
    active exception" (SIGABRT, about 1 run in 5 of a checkpoint's model mismatch). No atexit
    handler or interpreter shutdown runs either: nothing after this line can change the status.
    A console that cannot take the last lines (a closed pipe) is said on stderr, but does not
    turn a finished run into a failed one (the interpreter's own exit would make it status 120)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError) as e:  # ValueError: the stream was closed
            with contextlib.suppress(OSError, ValueError):
                print(f"warning: rank {os.environ.get('RANK', '0')}: could not flush {stream.name}: {e}; "
                      f"its last lines may be lost (exit status {status} regardless)", file=sys.__stderr__,
                      flush=True)
    os._exit(status)


def require_logging_packages(cfg: Config) -> None:
    """A sink the config asks for needs its package: refuse at start-up, before any process
    group exists, rather than at the first log line."""
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb is true but wandb is not installed; "
                          "pip install -e '.[wandb]' or pass --logging.wandb false")
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"logging.tensorboard ({cfg.logging.tensorboard}) is set but tensorboard is not installed; "
                          f"pip install tensorboard (or pip install -e '.[tensorboard]'), or drop --logging.tensorboard")


def load_config(path: Optional[str], deepspeed: Optional[str], overrides: list[str], rank: int = 0,
                world_size: Optional[int] = None) -> Config:
    """The validated run config from the files and overrides, for `world_size` processes (default
    $WORLD_SIZE); validation runs before any process group exists, so a bad value fails fast."""
    if path and path.endswith(".json"):
        if deepspeed:
            raise ConfigError(f"two DeepSpeed configs: --config {path} and --deepspeed-config {deepspeed}; pass one")
        path, deepspeed = None, path
    megatron = translate(overrides)  # Megatron-LM flags -> --section.key overrides (the rest unchanged)
    overrides = megatron.overrides
    file_data = load_yaml(path) if path else megatron.defaults(has_config_file=bool(deepspeed))
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg = build_config(file_data, overrides)
    written: set[str] = set()  # the keys a DeepSpeed file sets
    if deepspeed:
        given = {f"{section}.{key}" for section, key, _ in parse_overrides(overrides)}
        imported = load_deepspeed_config(deepspeed, cfg, world_size, given)
        merged = {s: {**file_data.get(s, {}), **imported.sections.get(s, {})} for s in {*file_data, *imported.sections}}
        cfg = build_config(merged, overrides)
        written = imported.written()
        for line in (*imported.notes, imported.defaults_note(deepspeed), imported.warning(deepspeed)) \
                if rank == 0 else ():
            if line:
                print(line, file=sys.stderr, flush=True)
    megatron.apply(cfg)
    if rank == 0:
        for line in (megatron.defaults_note(bool(path or deepspeed)), *megatron.told, megatron.warning()):
            if line:
                print(line, file=sys.stderr, flush=True)
    resolve_and_validate(cfg, world_size)
    # Keys chosen for this run: the command line's (Megatron flags too) and a DeepSpeed file's. A YAML
    # config is a template reused across layouts (gpt2-124m.yaml names a pipeline schedule at pp 1 for
    # whoever raises pp), so its keys are not warned of.
    unread = unread_warning(cfg, cfg.cli_keys | written)
    if unread and rank == 0:
        print(unread, file=sys.stderr, flush=True)
    return cfg


if __name__ == "__main__":
    main()
