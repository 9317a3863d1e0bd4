"""Tensor helpers every checkpoint kind shares (with digest.py, the bottom of checkpoint/):
vocabulary padding fitted to a layout, the non-parallel model's state_dict shapes,
safetensors streamed one tensor at a time both ways (a read opens the file anew for each
tensor: safetensors maps the whole file while it is open and every page read stays resident
until it is closed), and RNG states as tensors (weights_only loading refuses numpy arrays).
"""

from __future__ import annotations

import json
import struct
from typing import Any, Iterator, Optional

import numpy as np
import torch
from safetensors import safe_open

from megazero.atomic import atomic_write
from megazero.config.schema import ModelConfig
from megazero.model.gpt import GPT
from megazero.parallel.host import HostStaging


def fit_vocab(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Vocab padding depends on tp: strip or add zero rows of the embedding to fit `shape`."""
    if name in ("transformer.wte.weight", "lm_head.weight") and t.shape[0] != shape[0]:
        if t.shape[0] > shape[0]:
            return t[: shape[0]]
        return torch.cat([t, t.new_zeros(shape[0] - t.shape[0], *t.shape[1:])])
    return t


def plain_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the non-parallel model's state_dict, in its order."""
    with torch.device("meta"):
        model = GPT(m)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def save_safetensors_streaming(path: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                               tensors: Iterator[tuple[str, torch.Tensor]], metadata: Optional[dict] = None) -> None:
    """Write a .safetensors file one tensor at a time, in any order: the header (8-byte
    length, JSON with each tensor's byte range) is known from `shapes`, so each tensor is
    written at its offset as it arrives (from any device, through a pinned buffer). Renamed
    into place only when every tensor came."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {}
    offset = 0
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


def stream_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for every tensor of the file, in its key order (opened anew for each)."""
    with safe_open(path, framework="pt") as f:
        keys = list(f.keys())
    for key in keys:
        with safe_open(path, framework="pt") as f:
            t = f.get_tensor(key)
        yield key, t


def encode_rng(states: dict) -> dict:
    kind, keys, pos, has_gauss, cached = states["numpy"]
    return {**states, "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                                "has_gauss": has_gauss, "cached": cached}}


def decode_rng(states: dict) -> dict:
    n = states["numpy"]
    numpy_state = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    return {**states, "numpy": numpy_state}
