"""The projections LoRA adapts, by name; torch-free, so finetune.lora_targets is checked before torch loads."""

from __future__ import annotations

from megazero.config.schema import ConfigError

LORA_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
"""A block's projections LoRA can adapt, by their names inside the block (HF GPT-2's)."""


def adapted_modules(targets: list[str]) -> list[str]:
    """Names inside a block (attn.c_attn, ...) of the projections `targets` select, by PEFT's rule
    for target_modules: the name is the target or ends with "." + target (so c_proj hits
    attn.c_proj and mlp.c_proj, mlp.c_proj only the MLP's)."""
    return [m for m in LORA_MODULES if any(m == t or m.endswith("." + t) for t in targets)]


def check_targets(targets: list) -> None:
    """Refuse a finetune.lora_targets entry that selects no projection."""
    for t in targets:
        if not isinstance(t, str) or not adapted_modules([t]):
            raise ConfigError(f"finetune.lora_targets names {t!r}, which matches no GPT-2 module; use c_attn, "
                              f"c_proj, c_fc, mlp.c_proj or attn.c_proj")
