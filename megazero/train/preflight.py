"""A run's config made ready before any process group exists: auto values resolved, then checked
without a change by rules.py and by the modules that own what a check needs (a Hugging Face
config.json, LoRA's projections, ZeRO's alignment). Torch-free: --validate-only loads torch only to
size NVMe swap files."""

from __future__ import annotations

import os
from typing import Optional

from megazero.checkpoint.hf_config import resolve_init_from_hf
from megazero.checkpoint.meta import model_mismatch, resume_dir, saved_config
from megazero.config.resolve import resolve
from megazero.config.rules import nvme_path_problem, validate
from megazero.config.schema import Config, ConfigError
from megazero.config.sharding import sharding
from megazero.data.gpt_dataset import parse_blend
from megazero.data.indexed import IndexedDataset
from megazero.errors import UserError
from megazero.model.lora_targets import check_targets
from megazero.train.stream_data import check_stream_sources
from megazero.zero import ALIGN


def resolve_and_validate(cfg: Config, world_size: int) -> int:
    """Resolve `cfg` in place, then check it for `world_size` processes; return the data-parallel degree."""
    if cfg.checkpoint.init_from_hf:
        resolve_init_from_hf(cfg)
    resolve(cfg)
    dp = validate(cfg, world_size)
    if cfg.finetune.lora_rank:
        check_targets(cfg.finetune.lora_targets, cfg.model)
    z = cfg.zero
    if z.sub_group_size < ALIGN:
        raise ConfigError(f"zero.sub_group_size ({z.sub_group_size}) must be at least {ALIGN} elements "
                          f"(the partition alignment)")
    if z.bucket_size < ALIGN * dp:
        raise ConfigError(f"zero.bucket_size ({z.bucket_size}) must hold one aligned slice per DP rank: at least "
                          f"{ALIGN} x dp ({ALIGN} x {dp} = {ALIGN * dp})")
    return dp


class PreflightError(UserError):
    """What start-up would refuse, found before any process is launched."""


def preflight(cfg: Config, world_size: int = 1) -> None:
    """`--validate-only`'s checks beyond the config itself, on the files a run reads (headers and
    metadata only): the data prefixes open as Megatron datasets, the checkpoint a resume would
    read holds this model, and zero.nvme_path is a writable directory with room for the swap
    files (as start-up checks it: the same line). The tokenizer and the
    init_from_hf directory were read by resolve_and_validate already."""
    for prefix in parse_blend(cfg.data.prefix)[0] if cfg.data.prefix else []:
        IndexedDataset(prefix)  # a missing or foreign .bin/.idx is its one-line DataError
    check_stream_sources(cfg)  # data.stream: every source exists and holds documents with the text key
    c = cfg.checkpoint
    ckpt = resume_dir(c.load, c.iteration) if c.load else None
    saved = saved_config(ckpt) if ckpt else None
    z = cfg.zero
    nvme = "nvme" in (z.offload_optimizer, z.offload_param)
    why = (model_mismatch(saved, cfg, ckpt) if saved and ckpt else None) or \
        (nvme_path_problem(z.nvme_path) if nvme else None)
    if why:
        raise PreflightError(why)
    if nvme and not cfg.finetune.lora_rank:
        check_nvme_space(cfg, world_size)


def origin(cfg: Config, key: str, config_path: Optional[str]) -> str:
    """Where `key`'s value came from, as a start-up line names it."""
    if key in cfg.cli_keys:
        return "from the command line"
    return f"from {config_path or 'the config file'}" if key in cfg.set_keys else "the default"


def starting_point_line(cfg: Config, config_path: Optional[str] = None) -> Optional[str]:
    """When a checkpoint in checkpoint.load meets a setting that asks for another start, one line
    naming which wins and where each came from, or a refusal (PreflightError):
    - checkpoint.init_from_hf: refused, unless checkpoint.load is the run's own save directory
      (a restart or re-run of a run that started from those weights: the resume wins, said once;
      the directory still gives the model's shape to a config without model keys);
    - checkpoint.load and checkpoint.save from different places (a file's and the command
      line's) naming different directories: the run starts from one and saves into the other."""
    c = cfg.checkpoint
    if not c.load or not (resume_dir(c.load, c.iteration) or os.path.isfile(os.path.join(c.load, "universal.json"))):
        return None
    load = f"checkpoint.load {c.load} ({origin(cfg, 'checkpoint.load', config_path)})"
    own = os.path.abspath(c.save or "") == os.path.abspath(c.load) if c.save else False
    if c.init_from_hf:
        hf = f"checkpoint.init_from_hf {c.init_from_hf} ({origin(cfg, 'checkpoint.init_from_hf', config_path)})"
        if not own:
            # Both fixes keep init_from_hf: a config without model keys (configs/llama-finetune.yaml)
            # takes the model's shape from it, so dropping it would leave a GPT-2 of the defaults.
            raise PreflightError(f"{load} holds a checkpoint, which a run resumes from in place of {hf}; pass "
                                 f"--checkpoint.load null to start from {c.init_from_hf}, or --checkpoint.save "
                                 f"{c.load} to resume that run in its own save directory")
        return f"resuming from the checkpoint in {load}, this run's save directory: {hf} is for a fresh start"
    save_origin = origin(cfg, "checkpoint.save", config_path)
    if c.save and not own and save_origin != origin(cfg, "checkpoint.load", config_path):
        return f"starting from the checkpoint in {load}; saving into checkpoint.save {c.save} ({save_origin})"
    return None


def check_nvme_space(cfg: Config, world_size: int) -> None:
    """The swap files' space on zero.nvme_path, checked as start-up will (zero/swap.check_space,
    $LOCAL_WORLD_SIZE ranks on this node), for the largest ZeRO shard of any pipeline stage:
    optimizer files hold fp32 master weights and two moments, the parameter file one copy in
    the model's dtype. (Under LoRA only adapters swap: start-up checks those.) Loads torch."""
    from megazero.plan.formulas import NVME_STEP_BYTES, STATE_BYTES
    from megazero.plan.ranks import rank_params
    from megazero.zero.swap import check_space

    p, z = cfg.parallel, cfg.zero
    shards = world_size // (p.tp * p.pp)  # ZeRO shards over dp x cp
    shard = max(sum(rank_params(cfg.model, p.tp, p.pp, p.vpp, r, sharding(z.stage).parameters, z.bucket_size, p.pp_layers)
                    .padded(shards)) // shards for r in range(p.pp))
    if z.offload_optimizer == "nvme":
        check_space(z.nvme_path, NVME_STEP_BYTES * shard, "optimizer")
    if z.offload_param == "nvme":
        check_space(z.nvme_path, shard * STATE_BYTES[cfg.train.precision][0], "parameter")
