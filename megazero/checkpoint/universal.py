"""Resharding: resume a checkpoint saved at any (tp, pp, vpp, dp, ZeRO stage) at any other.

The optimizer state is rebuilt per parameter: each rank asks a reader (the sharded
checkpoint itself, or its universal export) for one full fp32 tensor at a time — master
weights, then each Adam moment — keeps its new TP shard of it and copies the pieces its
new DP partition owns into its flat shards. No rank ever holds more than about one full
parameter beyond its own shards.

The universal format (`python -m megazero.convert --to universal`) is parallelism-agnostic:

    DIR/universal.json                      format version, iteration, data position, optimizer step,
                                            loss scaler, LR schedule, config, sha256 of every file
    DIR/{master,exp_avg,exp_avg_sq}.safetensors   full fp32 tensors by parameter name (no padding)
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Protocol

import torch

from megazero.atomic import write_text
from megazero.checkpoint import digest, sharded
from megazero.checkpoint.export import KINDS, ShardedReader, fit_vocab, save_safetensors_streaming
from megazero.config import ModelConfig, build_config
from megazero.model.layers import shard_of

if TYPE_CHECKING:
    from megazero.checkpoint.load import Checkpoint

UNIVERSAL_VERSION = 2  # 2: universal.json records the files' sha256


class FullTensorReader(Protocol):
    model_config: ModelConfig

    def full(self, name: str, kind: str = "master") -> torch.Tensor: ...

    def trainer_state(self) -> dict: ...


class UniversalReader:
    """Full tensors from a universal checkpoint directory (read lazily, tensor by tensor;
    each file's sha256 is checked, in one sequential read, before it is opened)."""

    def __init__(self, path: str):
        meta_path = os.path.join(path, "universal.json")
        if not os.path.isfile(meta_path):
            raise sharded.CheckpointError(f"'{path}' is not a universal checkpoint (no universal.json)")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except (OSError, ValueError) as e:
            raise sharded.CheckpointError(f"universal checkpoint '{path}' has an unreadable universal.json ({e})"
                                          f"{_remake(path)}") from None
        version = self.meta.get("format_version")
        if version != UNIVERSAL_VERSION:
            why = "newer than this megazero's; upgrade megazero" if (version or 0) > UNIVERSAL_VERSION else \
                "which records no checksums"
            raise sharded.CheckpointError(f"universal checkpoint '{path}' has format version {version}, {why}"
                                          f"{_remake(path, self.meta.get('source'))}")
        from safetensors import safe_open
        self.files = {k: safe_open(self._verified(path, f"{k}.safetensors"), framework="pt") for k in KINDS}
        self.config = build_config(self.meta["config"])
        self.model_config = self.config.model

    def _verified(self, path: str, name: str) -> str:
        try:
            digest.verify(os.path.join(path, name), self.meta["files"][name])
        except digest.DigestError as e:
            raise sharded.CheckpointError(f"universal checkpoint '{path}' is corrupt: {e}"
                                          f"{_remake(path, self.meta.get('source'))}") from None
        return os.path.join(path, name)

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        if name == "lm_head.weight":
            name = "transformer.wte.weight"
        return self.files[kind].get_tensor(name)

    def trainer_state(self) -> dict:
        state = {k: self.meta[k] for k in ("iteration", "consumed_samples", "skipped_iters", "step", "loss_scaler")}
        return {**state, "lr_schedule": self.meta.get("lr_schedule")}


def _remake(path: str, source: str | None = None) -> str:
    src = source or "ITS_SOURCE_CHECKPOINT"
    return f"; re-create it with: python -m megazero.convert --load {src} --to universal --output {path}"


def open_reader(path: str):
    """A reader for a universal directory, a sharded iter_ directory or a save dir (its latest)."""
    if os.path.isfile(os.path.join(path, "universal.json")):
        return UniversalReader(path)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        path = sharded.resolve(path)
    return ShardedReader(path)


def reshard_optimizer_state(reader: FullTensorReader, template: dict, tp_rank: int, tp_size: int) -> dict:
    """This rank's optimizer state_dict in its new layout (`template` is the fresh optimizer's
    own state_dict: it supplies the partition map and the keys). The flat shards are built
    in host memory, whatever the run's device: the optimizer's load_state_dict copies each
    to the device once, so resharding needs no device memory beyond the optimizer's own."""
    partition = template["partition"]
    dp_rank = template["dp_rank"]
    # Frozen parameters (LoRA's base) sit after the trainable prefix and have master values only.
    flats = {k: torch.zeros(partition["shard_numel" if k == "master" else "trainable_numel"], dtype=torch.float32)
             for k in KINDS}
    for name, entry in partition["params"].items():
        mine = [p for p in entry["shards"] if p["rank"] == dp_rank]
        if not mine:
            continue
        for kind in KINDS if entry["trainable"] else ("master",):
            full = fit_vocab(name, reader.full(name, kind), tuple(entry["full_shape"]))
            local = shard_of(full, entry["tp_dim"], entry["tp_stride"], tp_rank, tp_size).reshape(-1)
            for p in mine:
                flats[kind][p["offset"]: p["offset"] + p["length"]] = \
                    local[p["param_offset"]: p["param_offset"] + p["length"]]
            del full, local
    state = reader.trainer_state()
    return {**template, **flats, "step": state["step"], "loss_scaler": state["loss_scaler"]}


def write_universal(reader: "Checkpoint", output: str) -> None:
    """Convert a checkpoint with optimizer state (load.Checkpoint) into the universal format
    (streamed, tensor by tensor)."""
    state = reader.trainer_state()  # first: a weights-only source fails before anything is written
    m = reader.model_config
    os.makedirs(output, exist_ok=True)
    shapes = {}
    for name in reader.names():
        shape = list(reader.full_shape(name))
        if name == "transformer.wte.weight":
            shape[0] = m.vocab_size  # no padding in the universal format
        shapes[name] = tuple(shape)
    files = {}
    for kind in KINDS:
        path = os.path.join(output, f"{kind}.safetensors")
        save_safetensors_streaming(path, shapes, torch.float32,
                                   ((n, fit_vocab(n, t, shapes[n])) for n, t in reader.tensors(kind)))
        files[os.path.basename(path)] = digest.file_entry(path)  # written by offset: hashed once complete
    meta = {"format_version": UNIVERSAL_VERSION, **state, "config": reader.meta["config"],
            "source": os.path.abspath(reader.ckpt), "files": files}
    write_text(os.path.join(output, "universal.json"), json.dumps(meta, indent=1))
