"""What a checkpoint's metadata says about the model it holds, read without torch: the
trainer's resume check (sharded.check_model) and `--validate-only`'s pre-flight share it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from megazero.config.schema import Config, ModelConfig
from megazero.errors import UserError

LATEST = "latest"
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"
"""Megatron-LM's name for `latest`: the iteration number (or `release`), written beside it."""
MODEL_KEYS = ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "ffn_hidden_size",
              "normalization", "position_embedding", "rope_base", "rope_scaling", "activation", "num_query_groups",
              "bias", "tie_embeddings", "zero_centered_norm", "qk_layernorm", "kv_channels", "qkv_bias",
              "qk_layernorm_scope")
"""The model keys a resume must match (the architecture); a checkpoint from before a key existed
holds that key's default (GPT-2)."""


def resume_dir(load_dir: str, iteration: int = 0) -> Optional[str]:
    """The iter_ directory a resume from `load_dir` reads (`latest`, else Megatron's
    latest_checkpointed_iteration.txt, or iter_{iteration}); None when there is neither to follow."""
    if iteration:
        return os.path.join(load_dir, f"iter_{iteration:07d}")
    latest = os.path.join(load_dir, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(load_dir, f.read().strip())
    megatron = os.path.join(load_dir, MEGATRON_LATEST)
    if not os.path.isfile(megatron):
        return None
    with open(megatron) as f:  # Megatron-LM's save directory: "100" names iter_0000100, "release" release/
        text = f.read().strip()
    if text != "release" and not text.isdigit():
        raise PointerError(f"'{megatron}' holds {text!r}, not an iteration number; write the iteration to resume "
                           f"(e.g. 100) or pass --checkpoint.iteration")
    return os.path.join(load_dir, "release" if text == "release" else f"iter_{int(text):07d}")


class PointerError(UserError, ValueError):
    """latest_checkpointed_iteration.txt names no iteration."""


_DEFAULTS = dataclasses.asdict(ModelConfig())


def model_mismatch(saved: dict, cfg: Config, ckpt: str) -> Optional[str]:
    """Why a checkpoint whose metadata config is `saved` cannot be resumed by `cfg` (another
    model shape, or other LoRA adapters); None when it can (any layout can be resharded)."""
    saved_model = {**_DEFAULTS, **saved["model"]}
    for key in MODEL_KEYS:
        if saved_model.get(key) != getattr(cfg.model, key):
            return (f"checkpoint '{ckpt}' holds a model with model.{key} = {saved_model.get(key)}, but this run has "
                    f"{getattr(cfg.model, key)}; {_model_fix(saved, cfg, key, saved_model.get(key))}")
    theirs = _adapters(saved.get("finetune") or {"lora_rank": 0})
    mine = _adapters(dataclasses.asdict(cfg.finetune))
    if mine == theirs:
        return None
    # Each fix is whole: starting from an export with checkpoint.load still set would be refused next.
    start = "--checkpoint.init_from_hf HF_DIR --checkpoint.load null"
    fix = (f"to fine-tune it with LoRA, export it (python -m megazero.convert --load {ckpt} --to hf --output HF_DIR) "
           f"and start from that: {start}" if not theirs["lora_rank"] else
           f"use the checkpoint's finetune settings, or fold its adapters in (python -m megazero.convert --load "
           f"{ckpt} --to hf --merge-lora --output HF_DIR) and start a new run from that: {start}")
    return f"checkpoint '{ckpt}' was saved with LoRA {theirs} but this run has {mine}; {fix}"


def _model_fix(saved: dict, cfg: Config, key: str, value: object) -> str:
    """The fix for a model key that differs from the checkpoint's. A run whose model comes from
    checkpoint.init_from_hf cannot set the key against that directory's config.json: it names
    the directory the checkpoint's run started from, or starting from its own instead."""
    mine = cfg.checkpoint.init_from_hf
    if not mine:
        return f"use the checkpoint's model config (--model.{key} {value})"
    theirs = (saved.get("checkpoint") or {}).get("init_from_hf")
    if theirs and os.path.abspath(theirs) != os.path.abspath(mine):
        return f"pass --checkpoint.init_from_hf {theirs}, the directory that run started from"
    return f"pass --checkpoint.load null to start from {mine} instead"


def _adapters(f: dict) -> dict:
    return {"lora_rank": f["lora_rank"], "lora_targets": list(f["lora_targets"])} if f["lora_rank"] else {"lora_rank": 0}


def saved_config(ckpt: str) -> Optional[dict]:
    """The config a sharded checkpoint's metadata.json records; None when there is none to read
    (the resume itself then says what is wrong with the directory)."""
    try:
        with open(os.path.join(ckpt, "metadata.json")) as f:
            return json.load(f)["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
