"""A run's config made ready before any process group exists: auto values resolved, then checked
without a change by config.py and by the modules that own what a check needs (a Hugging Face
config.json, LoRA's projections, ZeRO's alignment). Torch-free: --validate-only never loads torch."""

from __future__ import annotations

from megazero.checkpoint.hf_config import resolve_init_from_hf
from megazero.config import Config, ConfigError, resolve, validate
from megazero.model.lora_targets import check_targets
from megazero.zero import ALIGN


def resolve_and_validate(cfg: Config, world_size: int) -> int:
    """Resolve `cfg` in place, then check it for `world_size` processes; return the data-parallel degree."""
    if cfg.checkpoint.init_from_hf:
        resolve_init_from_hf(cfg)
    resolve(cfg)
    dp = validate(cfg, world_size)
    if cfg.finetune.lora_rank:
        check_targets(cfg.finetune.lora_targets)
    z = cfg.zero
    if z.sub_group_size < ALIGN:
        raise ConfigError(f"zero.sub_group_size ({z.sub_group_size}) must be at least {ALIGN} elements "
                          f"(the partition alignment)")
    if z.bucket_size < ALIGN * dp:
        raise ConfigError(f"zero.bucket_size ({z.bucket_size}) must hold one aligned slice per DP rank: at least "
                          f"{ALIGN} x dp ({ALIGN} x {dp} = {ALIGN * dp})")
    return dp
