"""`python -m megazero.train --config FILE [--section.key value ...]` (under torchrun for N processes)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional

from megazero.config import Config, ConfigError, build_config, load_yaml, validate
from megazero.errors import report_errors
from megazero.train import lifecycle


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="megazero-train", description=__doc__,
                                     epilog="Any config key can be overridden: --model.num_layers 4 --zero.stage=2")
    parser.add_argument("--config", help="YAML config file (configs/gpt2-tiny.yaml, ...)")
    parser.add_argument("--validate-only", action="store_true",
                        help="check the config for --world-size processes and exit (before launching any)")
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="processes the config is validated for (default: $WORLD_SIZE, else 1)")
    args, overrides = parser.parse_known_args(argv)
    with report_errors():
        cfg = load_config(args.config, overrides, args.world_size)
    if args.validate_only:
        print(f"config OK for {args.world_size} process(es)")
        return
    lifecycle.die_with_launcher()
    restarted = lifecycle.resume_on_restart(cfg)
    if restarted and int(os.environ.get("RANK", "0")) == 0:
        print(restarted, flush=True)
    train(cfg)


def load_config(path: Optional[str], overrides: list[str], world_size: int) -> Config:
    """Build and validate the config before any process group exists: a bad layout fails fast on every rank."""
    cfg = build_config(load_yaml(path) if path else {}, overrides)
    validate(cfg, world_size)
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb is true but wandb is not installed; "
                          "pip install -e '.[wandb]' or pass --logging.wandb false")
    return cfg


def train(cfg: Config) -> None:
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer

    import torch.distributed as dist

    timeout_s = round(cfg.train.timeout_minutes * 60)
    grid = ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp, timeout_s, lifecycle.attempt_store(timeout_s))
    with report_errors():  # a checkpoint, data or training error: the same on every rank
        try:
            Trainer(cfg, grid).run()
        except RuntimeError as e:  # a lost peer: one line per surviving rank, not a traceback
            line = lifecycle.describe_comm_failure(e, grid.rank)
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr, flush=True)
            os._exit(1)  # leave without gloo's teardown, which would wait on the lost peer
    dist.barrier()  # no rank tears its communicators down while a peer still uses them
    if grid.backend == "nccl":
        dist.destroy_process_group()
        return
    # Gloo: every output is written and closed (metrics, checkpoints), so leave without
    # tearing gloo's C++ state down; that teardown occasionally aborted a finished run with
    # "terminate called without an active exception" (SIGABRT after the last iteration).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
