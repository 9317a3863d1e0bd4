"""Read full tensors out of a sharded checkpoint, one parameter at a time, and write them
as one plain torch state_dict (streamed) or a Hugging Face GPT-2 directory.

`ShardedReader` is a pure function of the files: each rank file's optimizer state holds
its flat fp32 shards (master weights, Adam moments) and the partition map saying where
every element of every parameter lives (DP rank, offset, length). A full parameter is
assembled from its DP pieces on every TP rank, then its TP shards are joined with the
parameter's tp_dim / tp_stride. Rank files are memory-mapped, so only the pieces read
are brought into memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zipfile
from typing import IO, TYPE_CHECKING, Iterator, Optional

import torch

from megazero.atomic import atomic_write, write_text
from megazero.checkpoint import digest, sharded
from megazero.config import ModelConfig, build_config
from megazero.model.layers import unshard
from megazero.parallel.host import HostStaging

if TYPE_CHECKING:
    from megazero.checkpoint.load import Checkpoint

KINDS = ("master", "exp_avg", "exp_avg_sq")


class ShardedReader:
    """Full fp32 tensors (master weights or Adam moments) of a sharded checkpoint.

    Rank files are memory-mapped for each parameter and let go right after, so what stays
    resident is one parameter's pieces, not the files read so far. Each file's sha256 is
    checked when it is first opened, before any value in it is used."""

    def __init__(self, ckpt: str):
        self.ckpt = ckpt
        self.meta = sharded.read_metadata(ckpt)
        self._verified: set[str] = set()
        self.config = build_config(self.meta["config"])
        layout = self.meta["layout"]
        self.tp, self.pp, self.dp = layout["tp"], layout["pp"], layout["dp"]
        # Partition maps are identical on every DP rank of a (tp, pp) coordinate.
        self.maps = {(tp, pp): self.optimizer_state(tp, pp, 0)["partition"]
                     for pp in range(self.pp) for tp in range(self.tp)}
        self.stage_of = {}  # name -> pipeline rank holding it (the tied head copy aside)
        for pp in range(self.pp):
            for name in self.maps[(0, pp)]["params"]:
                self.stage_of.setdefault(name, pp)

    def _open(self, tp: int, pp: int, dp: int) -> dict:
        """One rank file, memory-mapped (verified against its sha256 on first use)."""
        name = sharded.rank_file_name(tp, pp, dp)
        if name not in self._verified:
            sharded.verify_file(self.ckpt, self.meta, name)
            self._verified.add(name)
        return torch.load(os.path.join(self.ckpt, name), map_location="cpu", weights_only=True, mmap=True)

    def optimizer_state(self, tp: int, pp: int, dp: int) -> dict:
        """One rank file's optimizer state, memory-mapped."""
        state = self._open(tp, pp, dp)
        name = sharded.rank_file_name(tp, pp, dp)
        if state["optimizer"] is None:
            raise sharded.CheckpointError(f"checkpoint '{self.ckpt}': {name} holds no optimizer state")
        return state["optimizer"]

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @property
    def iteration(self) -> int:
        return self.meta["iteration"]

    def trainer_state(self) -> dict:
        """Loop position and optimizer counters (the same on every rank)."""
        rank0 = self._open(0, 0, 0)
        opt = rank0["optimizer"]
        return {"iteration": rank0["iteration"], "consumed_samples": rank0["consumed_samples"],
                "skipped_iters": rank0["skipped_iters"], "step": int(opt["step"]), "loss_scaler": opt["loss_scaler"],
                "lr_schedule": rank0.get("lr_schedule")}

    def names(self) -> list[str]:
        """Parameter names of the non-parallel model, in its order (no tied head copy)."""
        return [n for n in self.stage_of if n != "lm_head.weight"]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.maps[(0, self.stage_of[name])]["params"][name]["full_shape"])

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        """The whole parameter (all TP shards joined), fp32, in megazero's storage shape."""
        if name == "lm_head.weight" and name not in self.stage_of:
            name = "transformer.wte.weight"
        pp = self.stage_of[name]
        entry = self.maps[(0, pp)]["params"][name]
        shards = [self._tp_shard(name, kind, tp, pp) for tp in range(self.tp)]
        return unshard(shards, entry["tp_dim"], entry["tp_stride"])

    def _tp_shard(self, name: str, kind: str, tp: int, pp: int) -> torch.Tensor:
        entry = self.maps[(tp, pp)]["params"][name]
        if kind != "master" and not entry.get("trainable", True):  # frozen (LoRA's base): no moments
            return torch.zeros(entry["shape"])
        flat = torch.empty(entry["numel"], dtype=torch.float32)
        for piece in entry["shards"]:  # at ZeRO-0 one piece, on DP rank 0 (the state is replicated)
            values = self.optimizer_state(tp, pp, piece["rank"])[kind]
            flat[piece["param_offset"]: piece["param_offset"] + piece["length"]] = \
                values[piece["offset"]: piece["offset"] + piece["length"]]
            del values  # unmaps the file
        return flat.view(entry["shape"])

    def tensors(self, kind: str = "master", dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            t = self.full(name, kind)
            yield name, t if dtype is None else t.to(dtype)


# ----------------------------------------------------------------------------- torch export


def save_streaming(path: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                   tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Write a torch.save-format state_dict one tensor at a time: the file's skeleton is
    saved without data, then each tensor's bytes are written at its record's offset. Host
    memory stays near one tensor however large the model (torch.save needs them all).
    Tensors may arrive on any device; device ones reach the file through a pinned buffer."""
    placeholders = {n: torch.empty(s, dtype=dtype) for n, s in shapes.items()}  # never touched: no RSS
    order = {n: i for i, n in enumerate(shapes)}  # storage keys follow the dict's order
    staging = HostStaging()
    with atomic_write(path, "w+b") as f:
        with torch.serialization.skip_data():
            torch.save(placeholders, f)
        offsets = _record_offsets(f)
        for name, t in tensors:
            if tuple(t.shape) != tuple(shapes[name]):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {shapes[name]}")
            f.seek(offsets[str(order[name])])
            staging.write(f, t.to(dtype))


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def save_safetensors_streaming(path: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                               tensors: Iterator[tuple[str, torch.Tensor]], metadata: Optional[dict] = None) -> None:
    """Write a .safetensors file one tensor at a time, in any order: the header (8-byte
    length, JSON with each tensor's byte range) is known from `shapes`, so each tensor is
    written at its offset as it arrives (from any device, through a pinned buffer). Renamed
    into place only when every tensor came."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    start = 8 + len(blob)
    written, staging = set(), HostStaging()
    with atomic_write(path) as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(start + offset)
        for name, t in tensors:
            if tuple(t.shape) != tuple(shapes[name]):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shapes[name])}")
            f.seek(start + header[name]["data_offsets"][0])
            staging.write(f, t.to(dtype))
            written.add(name)
        if written != set(shapes):
            raise ValueError(f"{len(shapes) - len(written)} tensors never arrived, "
                             f"e.g. {sorted(set(shapes) - written)[0]}")


def _record_offsets(f: IO[bytes]) -> dict[str, int]:
    """Byte offset of each data/<key> record's payload in a torch zip checkpoint (open file)."""
    out = {}
    with zipfile.ZipFile(f) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data":
                f.seek(info.header_offset)
                header = f.read(30)
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                out[parts[2]] = info.header_offset + 30 + name_len + extra_len
    return out


def write_torch(reader: "Checkpoint", output: str, dtype: torch.dtype) -> None:
    """One plain state_dict for megazero's non-parallel GPT-2 (load with strict=True), and
    OUTPUT.config.json with the model config and tokenizer needed to use it."""
    from megazero.config import padded_vocab_size

    m = reader.model_config
    shapes = {}
    for name in reader.names():
        shape = list(reader.full_shape(name))
        if name == "transformer.wte.weight":  # re-pad for tp = 1
            shape[0] = padded_vocab_size(m.vocab_size, 1)
        shapes[name] = tuple(shape)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    save_streaming(output, shapes, dtype,
                   ((n, fit_vocab(n, t, shapes[n])) for n, t in reader.tensors("master")))
    write_sidecar(output + ".config.json", reader, digest.file_entry(output))


def fit_vocab(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Vocab padding depends on tp: strip or add zero rows of the embedding to fit `shape`."""
    if name in ("transformer.wte.weight", "lm_head.weight") and t.shape[0] != shape[0]:
        if t.shape[0] > shape[0]:
            return t[: shape[0]]
        return torch.cat([t, t.new_zeros(shape[0] - t.shape[0], *t.shape[1:])])
    return t


def write_sidecar(path: str, reader: "Checkpoint", weights: dict) -> None:
    """The export's config beside it, with the weights file's digest (`weights`: sha256, bytes)."""
    info = {"model": dataclasses.asdict(reader.model_config), "tokenizer": reader.tokenizer,
            "iteration": reader.iteration, "source": os.path.abspath(reader.ckpt), **weights}
    write_text(path, json.dumps(info, indent=1))
