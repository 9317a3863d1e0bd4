"""The projections LoRA adapts, by name; torch-free, so finetune.lora_targets is checked before torch loads."""

from __future__ import annotations

from typing import NamedTuple, Optional

from megazero.config.schema import ConfigError, ModelConfig

LORA_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
"""A block's projections LoRA can adapt, by their names inside the block (HF GPT-2's)."""


def adapted_modules(targets: list[str]) -> list[str]:
    """Names inside a block (attn.c_attn, ...) of the projections `targets` select, by PEFT's rule
    for target_modules: the name is the target or ends with "." + target (so c_proj hits
    attn.c_proj and mlp.c_proj, mlp.c_proj only the MLP's)."""
    return [m for m in LORA_MODULES if any(m == t or m.endswith("." + t) for t in targets)]


FAMILY_PARTS = {"q_proj": ("attn.c_attn", 0), "k_proj": ("attn.c_attn", 1), "v_proj": ("attn.c_attn", 2),
                "o_proj": ("attn.c_proj", None), "gate_proj": ("mlp.c_fc", 0), "up_proj": ("mlp.c_fc", 1),
                "down_proj": ("mlp.c_proj", None)}
"""The Llama family's projections by Hugging Face's names: a part of a fused megazero projection
(q | k | v of c_attn, gate | up of a SwiGLU c_fc), or a whole one."""
_FAMILY_ALIASES = {"c_attn": ("q_proj", "k_proj", "v_proj"), "c_proj": ("o_proj", "down_proj"),
                   "attn.c_proj": ("o_proj",), "mlp.c_proj": ("down_proj",), "c_fc": ("gate_proj", "up_proj"),
                   "mlp.c_fc": ("gate_proj", "up_proj"), "w1": ("gate_proj",), "w3": ("up_proj",),
                   "w2": ("down_proj",)}
"""GPT-2's names on a model of the family: every part they cover (so the default c_attn adapts q, k and v);
and Mixtral's expert names (w1 gate, w3 up, w2 down)."""


class Target(NamedTuple):
    module: str
    """The projection inside a block (attn.c_attn, ...)."""
    part: Optional[str]
    """The HF name of the part of its fused rows it adapts (q_proj, ...), None for all of them."""
    position: Optional[int]
    """That part's place among the fused parts."""


def uses_hf_names(m: ModelConfig) -> bool:
    """The Llama family (rotary positions) names its adapters as LlamaForCausalLM does."""
    return m.position_embedding == "rope"


def adapted(targets: list[str], m: ModelConfig) -> list[Target]:
    """The adapters finetune.lora_targets gives model `m`, in a fixed order."""
    if not uses_hf_names(m):
        return [Target(module, None, None) for module in adapted_modules(targets)]
    names = {n for t in targets for n in _FAMILY_ALIASES.get(t, (t,))}
    # Without SwiGLU there is one c_fc: gate_proj and up_proj both mean all of it.
    whole = () if m.activation == "swiglu" else ("mlp.c_fc",)
    out = [Target(module, None, None) if index is None or module in whole else Target(module, name, index)
           for name, (module, index) in FAMILY_PARTS.items() if name in names]
    return list(dict.fromkeys(out))


def hf_target_names(targets: list[str], m: ModelConfig) -> list[str]:
    """PEFT's target_modules on LlamaForCausalLM for what `targets` adapts in model `m` of the
    family (c_attn: q_proj, k_proj, v_proj), in FAMILY_PARTS' order."""
    chosen = adapted(targets, m)
    return [name for name, (module, index) in FAMILY_PARTS.items()
            if Target(module, name if index is not None else None, index) in chosen]


def part_rows(m: ModelConfig, module: str, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` among the rows of fused projection `module` (full, unsharded)."""
    q, kv, ffn = m.q_width, m.kv_width, m.ffn_size
    sizes = (q, kv, kv) if module == "attn.c_attn" else (ffn, ffn)
    return sum(sizes[:index]), sum(sizes[: index + 1])


def check_targets(targets: list, m: Optional[ModelConfig] = None) -> None:
    """Refuse a finetune.lora_targets entry that selects no projection."""
    family = m is not None and uses_hf_names(m)
    for t in targets:
        if not isinstance(t, str):
            raise ConfigError(f"finetune.lora_targets names {t!r}, which is not a module name")
        if family and not (t in FAMILY_PARTS or t in _FAMILY_ALIASES):
            raise ConfigError(f"finetune.lora_targets names {t!r}, which matches no projection of the Llama family; "
                              f"use {', '.join(FAMILY_PARTS)} (Hugging Face's names)")
        if not family and not adapted_modules([t]):
            raise ConfigError(f"finetune.lora_targets names {t!r}, which matches no GPT-2 module; use c_attn, "
                              f"c_proj, c_fc, mlp.c_proj or attn.c_proj")
