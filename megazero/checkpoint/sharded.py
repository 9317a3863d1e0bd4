"""Reading a sharded checkpoint: the save directory training writes (save.py).

    SAVE/latest                      "iter_0000100" (rewritten by rename once a save is complete)
    SAVE/iter_0000100/metadata.json  format version, layout, iteration, config, sha256 of every file
    SAVE/iter_0000100/rank_tp00_pp000_dp000.pt   one rank's state (the trainer's `rank_state`)

Every file is checked against its sha256 before any value in it is used (digest.py), and
loaded with `torch.load(weights_only=True)`: loading never runs code from a checkpoint.

`ShardedReader` gives full tensors, a pure function of the files: each rank file holds its
flat fp32 shards (master weights, Adam moments) and the partition map saying where every
element of every parameter lives (DP rank, offset, length); a parameter's DP pieces are
joined on every TP rank, then its TP shards by its placement (tp_dim / tp_stride). An expert
weight's pieces lie on the ranks of its ZeRO group (the map's `zero_group`, expert-dp): they are
joined on every expert-parallel rank, whose experts are then stacked in rank order (the layout's
"ep" and "etp" say which file holds which expert-dp rank). Rank files are memory-mapped: only
the pieces read are brought into memory.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import torch

from megazero.atomic import existing_dir
from megazero.checkpoint import digest
from megazero.checkpoint.base import (
    FORMAT_VERSION,
    Checkpoint,
    CheckpointError,
    lora_adapters,
    rank_file_name,
    verified,
)
from megazero.checkpoint.meta import LATEST, PointerError, model_mismatch, resume_dir
from megazero.config.parse import build_config
from megazero.config.schema import Config
from megazero.config.sharding import DENSE
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.placement import Placement


def resolve(load_dir: str, iteration: int = 0) -> str:
    """The checkpoint directory to resume from: `latest`, or iter_{iteration} when given."""
    try:
        path = resume_dir(load_dir, iteration)
    except PointerError as e:  # every rank reads the same file: the same error everywhere
        raise CheckpointError(str(e)) from None
    if path is None:
        raise CheckpointError(f"no checkpoint in '{load_dir}' (no '{LATEST}' file); "
                              f"unset checkpoint.load to start from scratch")
    path = existing_dir(path)  # a kill while an iteration was being re-saved left it as PATH.old
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "metadata.json")) and any(
            name.startswith("mp_rank_") for name in os.listdir(path)):
        raise CheckpointError(f"'{path}' is a Megatron-LM checkpoint (mp_rank_* files), which megazero does not read; "
                              f"resume from a megazero checkpoint, or start from a Hugging Face export of the model "
                              f"with --checkpoint.init_from_hf")
    return path


def read_metadata(ckpt: str) -> dict:
    meta_path = os.path.join(ckpt, "metadata.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"checkpoint '{ckpt}' is incomplete (no metadata.json)", ckpt)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{ckpt}' has an unreadable metadata.json ({e})", ckpt) from None
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint '{ckpt}' has format version {meta.get('format_version')}, newer than "
                              f"this megazero's {FORMAT_VERSION}; upgrade megazero to load it")
    return meta


def check_model(meta: dict, cfg: Config, ckpt: str) -> None:
    """The saved model must have this run's shape and adapters (any layout can be resharded)."""
    why = model_mismatch(meta["config"], cfg, ckpt)
    if why:
        raise CheckpointError(why)


def checked_file(ckpt: str, meta: dict, name: str, check: Callable[[str, dict], Any] = digest.verify) -> Any:
    """One file of a checkpoint checked against the sha256 its metadata.json records before any
    value in it is used: `check` is digest.verify (one sequential read, before the file is
    memory-mapped and read piece by piece) or digest.load_torch (read once, then loaded
    without running any code from it)."""
    expected = meta["files"].get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint '{ckpt}' has no {name} in its metadata.json", ckpt)
    return verified(os.path.join(ckpt, name), expected, f"checkpoint '{ckpt}'", bad_checkpoint=ckpt, check=check)


def load_rank_state(ckpt: str, meta: dict, grid: ProcessGrid, rank: Optional[int] = None) -> dict:
    """A rank's file (default: this rank's), read once, checksum-verified, then loaded."""
    c = grid.coords(rank)
    return checked_file(ckpt, meta, rank_file_name(c.tp, c.pp, grid.dp_cp_index(c)), digest.load_torch)


class ShardedReader:
    """Full fp32 tensors (master weights or Adam moments) of a sharded checkpoint.

    Rank files are memory-mapped for each parameter and let go right after, so what stays
    resident is one parameter's pieces, not the files read so far. Each file's sha256 is
    checked when it is first opened, before any value in it is used."""

    def __init__(self, ckpt: str):
        self.ckpt = ckpt
        self.meta = read_metadata(ckpt)
        self._verified: set[str] = set()
        self.config = build_config(self.meta["config"])
        self.model_config = self.config.model
        layout = self.meta["layout"]
        self.tp, self.pp = layout["tp"], layout["pp"]
        self.ep, self.etp = layout.get("ep", 1), layout.get("etp", self.tp)  # the experts' folding
        # Partition maps are identical on every DP rank of a (tp, pp) coordinate.
        self.maps = {(tp, pp): self.optimizer_state(tp, pp, 0)["partition"]
                     for pp in range(self.pp) for tp in range(self.tp)}
        self.stage_of: dict[str, int] = {}  # name -> pipeline rank holding it (the tied head copy aside)
        for pp in range(self.pp):
            for name in self.maps[(0, pp)]["params"]:
                self.stage_of.setdefault(name, pp)

    def _open(self, tp: int, pp: int, dp: int) -> dict:
        """One rank file, memory-mapped (verified against its sha256 on first use)."""
        name = rank_file_name(tp, pp, dp)
        if name not in self._verified:
            checked_file(self.ckpt, self.meta, name)
            self._verified.add(name)
        return torch.load(os.path.join(self.ckpt, name), map_location="cpu", weights_only=True, mmap=True)

    def optimizer_state(self, tp: int, pp: int, dp: int) -> dict:
        """One rank file's optimizer state, memory-mapped."""
        state = self._open(tp, pp, dp)
        if state["optimizer"] is None:
            raise CheckpointError(f"checkpoint '{self.ckpt}': {rank_file_name(tp, pp, dp)} holds no optimizer state")
        return state["optimizer"]

    def trainer_state(self) -> dict:
        """Loop position and optimizer counters (the same on every rank)."""
        rank0 = self._open(0, 0, 0)
        opt = rank0["optimizer"]
        return {"iteration": rank0["iteration"], "consumed_samples": rank0["consumed_samples"],
                "skipped_iters": rank0["skipped_iters"], "step": int(opt["step"]), "loss_scaler": opt["loss_scaler"],
                "lr_schedule": rank0.get("lr_schedule"), "moe_expert_bias": rank0.get("moe_expert_bias"),
                "data_state": rank0.get("data_state")}

    def names(self) -> list[str]:
        """Parameter names of the non-parallel model, in its order (no tied head copy; an untied
        output layer is a parameter of its own)."""
        return [n for n in self.stage_of if n != "lm_head.weight" or not self.model_config.tie_embeddings]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.maps[(0, self.stage_of[name])]["params"][name]["full_shape"])

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        """The whole parameter (all TP shards joined), fp32, in megazero's storage shape."""
        if name == "lm_head.weight" and name not in self.stage_of:
            name = "transformer.wte.weight"
        pp = self.stage_of[name]
        entry = self.maps[(0, pp)]["params"][name]
        if entry.get("zero_group", DENSE.zero) != DENSE.zero:  # an expert weight: over the experts' folding
            return torch.cat([self._expert_shard(name, kind, pp, ep) for ep in range(self.ep)])
        shards = [self._tp_shard(name, kind, tp, pp) for tp in range(self.tp)]
        return Placement.from_record(entry).unshard(shards)

    def _expert_shard(self, name: str, kind: str, pp: int, ep: int) -> torch.Tensor:
        """Expert-parallel rank `ep`'s experts of an expert weight, their etp shards joined: each
        from the files of the expert-dp ranks holding its pieces."""
        def file_of(etp: int) -> Callable[[int], tuple[int, int, int]]:
            def coords(edp: int) -> tuple[int, int, int]:
                local = (edp * self.ep + ep) * self.etp + etp  # the grid's expert rank order, within stage pp
                return local % self.tp, pp, local // self.tp  # (tp, pp, dp x cp index): its rank file
            return coords
        shards = [self._tp_shard(name, kind, etp, pp, file_of(etp)) for etp in range(self.etp)]
        return Placement.from_record(self.maps[(0, pp)]["params"][name]).unshard(shards)

    def _tp_shard(self, name: str, kind: str, tp: int, pp: int,
                  file_of: Optional[Callable[[int], tuple[int, int, int]]] = None) -> torch.Tensor:
        """One TP rank's shard, from its pieces over the ZeRO group; `file_of(piece rank)` names the
        rank file holding a piece (default: the dp x cp rank of this TP and pipeline rank)."""
        entry = self.maps[(tp, pp)]["params"][name]
        if kind != "master" and not entry.get("trainable", True):  # frozen (LoRA's base): no moments
            return torch.zeros(entry["shape"])
        flat = torch.empty(entry["numel"], dtype=torch.float32)
        for piece in entry["shards"]:  # at ZeRO-0 one piece, on the ZeRO group's rank 0 (the state is replicated)
            values = self.optimizer_state(*(file_of or (lambda r: (tp, pp, r)))(piece["rank"]))[kind]
            if values is None:  # checkpoint.save_optimizer false kept the master weights alone
                raise CheckpointError(f"checkpoint '{self.ckpt}' holds no {kind} (saved with "
                                      f"checkpoint.save_optimizer false): its weights alone can be read")
            flat[piece["param_offset"]: piece["param_offset"] + piece["length"]] = \
                values[piece["offset"]: piece["offset"] + piece["length"]]
            del values  # unmaps the file
        return flat.view(entry["shape"])


def open_sharded(ckpt: str, kind: str) -> Checkpoint:
    """A save directory's checkpoint (`kind` says how it was named) as a Checkpoint."""
    reader = ShardedReader(ckpt)
    shapes = {n: reader.full_shape(n) for n in reader.names()}
    adapters = lora_adapters(reader.meta["config"].get("finetune"), reader.full)
    return Checkpoint(ckpt, kind, reader.model_config, reader.config.data.tokenizer, reader.meta["iteration"], shapes,
                      lambda kind: ((n, reader.full(n, kind)) for n in shapes), training=reader, adapters=adapters)
