"""Reading a universal checkpoint (`python -m megazero.convert --to universal`, written by
export.write_universal): parallelism-agnostic, it resumes at any layout (resume.py).

    DIR/universal.json                      format version, iteration, data position, optimizer step,
                                            loss scaler, LR schedule, config, sha256 of every file
    DIR/{master,exp_avg,exp_avg_sq}.safetensors   full fp32 tensors by parameter name (no padding)
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from megazero.checkpoint.base import KINDS, Checkpoint, CheckpointError, lora_adapters, verified
from megazero.checkpoint.tensors import plain_shapes
from megazero.config.parse import build_config
from megazero.model.lora import is_adapter

UNIVERSAL_VERSION = 2  # 2: universal.json records the files' sha256


class UniversalReader:
    """Full tensors from a universal checkpoint directory (read lazily, tensor by tensor;
    each file's sha256 is checked, in one sequential read, before it is opened)."""

    def __init__(self, path: str):
        meta_path = os.path.join(path, "universal.json")
        if not os.path.isfile(meta_path):
            raise CheckpointError(f"'{path}' is not a universal checkpoint (no universal.json)")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"universal checkpoint '{path}' has an unreadable universal.json ({e})"
                                  f"{_remake(path)}") from None
        version = self.meta.get("format_version")
        if version != UNIVERSAL_VERSION:
            why = "newer than this megazero's; upgrade megazero" if (version or 0) > UNIVERSAL_VERSION else \
                "which records no checksums"
            raise CheckpointError(f"universal checkpoint '{path}' has format version {version}, {why}"
                                  f"{_remake(path, self.meta.get('source'))}")
        for name in (f"{k}.safetensors" for k in KINDS):  # each checked in one sequential read before use
            verified(os.path.join(path, name), self.meta["files"][name], f"universal checkpoint '{path}'",
                     _remake(path, self.meta.get("source")))
        self.files = {k: safe_open(os.path.join(path, f"{k}.safetensors"), framework="pt") for k in KINDS}
        self.config = build_config(self.meta["config"])
        self.model_config = self.config.model

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        if name == "lm_head.weight" and self.model_config.tie_embeddings:
            name = "transformer.wte.weight"  # the tied head's copy
        return self.files[kind].get_tensor(name)

    def trainer_state(self) -> dict:
        state = {k: self.meta[k] for k in ("iteration", "consumed_samples", "skipped_iters", "step", "loss_scaler")}
        return {**state, "lr_schedule": self.meta.get("lr_schedule"), "moe_expert_bias": self.meta.get("moe_expert_bias"),
                "data_state": self.meta.get("data_state")}


def _remake(path: str, source: str | None = None) -> str:
    src = source or "ITS_SOURCE_CHECKPOINT"
    return f"; re-create it with: python -m megazero.convert --load {src} --to universal --output {path}"


def open_universal(path: str) -> Checkpoint:
    """A universal checkpoint directory as a Checkpoint."""
    reader = UniversalReader(path)
    master = reader.files["master"]
    stored = set(master.keys())
    names = [n for n in plain_shapes(reader.model_config) if n in stored] + [n for n in master.keys() if is_adapter(n)]
    shapes = {n: tuple(master.get_slice(n).get_shape()) for n in names}
    return Checkpoint(path, "universal checkpoint", reader.model_config, reader.config.data.tokenizer,
                      reader.meta["iteration"], shapes, lambda kind: ((n, reader.full(n, kind)) for n in shapes),
                      training=reader, adapters=lora_adapters(reader.meta["config"].get("finetune"), reader.full))
