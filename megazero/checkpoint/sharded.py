"""Sharded checkpoints: every rank writes only what it owns, atomically; exact resume.

Layout of `SAVE`:

    SAVE/latest                      "iter_0000100" (rewritten by rename once a save is complete)
    SAVE/iter_0000100/metadata.json  format version, layout, iteration, config, sha256 of every file
    SAVE/iter_0000100/rank_tp00_pp000_dp000.pt   this rank's state (see `rank_state`)

A save goes to `iter_NNNNNNN.tmp/`; after every rank has written and fsynced its file,
rank 0 writes metadata.json, renames the directory and then `latest`. A crash at any
point leaves the previous checkpoint and `latest` untouched. Files are loaded with
`torch.load(weights_only=True)`: loading never runs code from a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Callable, Optional

import numpy as np
import torch

from megazero.config import Config
from megazero.errors import UserError
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid

FORMAT_VERSION = 1
LATEST = "latest"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used (incomplete, corrupt, another model or format)."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(tp: int, pp: int, dp: int) -> str:
    return f"rank_tp{tp:02d}_pp{pp:03d}_dp{dp:03d}.pt"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- RNG encoding
# weights_only loading accepts tensors and plain containers, not numpy arrays.

def encode_rng(states: dict) -> dict:
    kind, keys, pos, has_gauss, cached = states["numpy"]
    return {**states, "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                                "has_gauss": has_gauss, "cached": cached}}


def decode_rng(states: dict) -> dict:
    n = states["numpy"]
    numpy_state = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    return {**states, "numpy": numpy_state}


# ----------------------------------------------------------------------------- save


def save(save_dir: str, iteration: int, rank_state: dict, cfg: Config, grid: ProcessGrid,
         keep_last: int = 0, extra: Optional[Callable[[str], str]] = None) -> str:
    """Collective: every rank writes its state; rank 0 seals the checkpoint. Returns its path.
    `extra(directory)`, when given, is a collective writing one more file (named by its
    return value) into the checkpoint before it is sealed."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp = final + ".tmp"
    world = grid["world"]
    if grid.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        os.makedirs(tmp)
    comm.barrier(world)

    c = grid.coords()
    name = rank_file_name(c.tp, c.pp, c.dp)
    path = os.path.join(tmp, name)
    with open(path + ".part", "wb") as f:
        torch.save(rank_state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)
    entries = comm.all_gather_object({"file": name, "sha256": _sha256(path), "bytes": os.path.getsize(path)},
                                     world)
    if extra is not None:
        extra_path = os.path.join(tmp, extra(tmp))
        entries.append({"file": os.path.basename(extra_path), "sha256": _sha256(extra_path) if grid.rank == 0 else "",
                        "bytes": os.path.getsize(extra_path) if grid.rank == 0 else 0})
    if grid.rank == 0:
        meta = {"format_version": FORMAT_VERSION, "iteration": iteration,
                "layout": layout_of(cfg, grid), "config": cfg.to_dict(),
                "files": {e["file"]: {"sha256": e["sha256"], "bytes": e["bytes"]} for e in entries}}
        _write_atomic(os.path.join(tmp, "metadata.json"), json.dumps(meta, indent=1).encode())
        _fsync_dir(tmp)
        if os.path.exists(final):  # saving the same iteration again replaces it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(save_dir)
        _write_atomic(os.path.join(save_dir, LATEST), iter_dir_name(iteration).encode())
        if keep_last:
            prune(save_dir, keep_last)
    comm.barrier(world)
    return final


def layout_of(cfg: Config, grid: ProcessGrid) -> dict:
    return {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp, "vpp": cfg.parallel.vpp,
            "pp_layers": cfg.parallel.pp_layers, "zero_stage": cfg.zero.stage, "precision": cfg.train.precision}


def complete_checkpoints(save_dir: str) -> list[str]:
    """Sealed checkpoint directories (with metadata.json), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    names = [n for n in os.listdir(save_dir) if n.startswith("iter_") and not n.endswith(".tmp")
             and os.path.isfile(os.path.join(save_dir, n, "metadata.json"))]
    return sorted(names)


def prune(save_dir: str, keep_last: int) -> None:
    for name in complete_checkpoints(save_dir)[:-keep_last]:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


# ----------------------------------------------------------------------------- load


def resolve(load_dir: str, iteration: int = 0) -> str:
    """The checkpoint directory to resume from: `latest`, or iter_{iteration} when given."""
    if iteration:
        path = os.path.join(load_dir, iter_dir_name(iteration))
    else:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"no checkpoint in '{load_dir}' (no '{LATEST}' file); "
                                  f"unset checkpoint.load to start from scratch")
        with open(latest) as f:
            path = os.path.join(load_dir, f.read().strip())
    return path


def read_metadata(ckpt: str) -> dict:
    meta_path = os.path.join(ckpt, "metadata.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"checkpoint '{ckpt}' is incomplete (no metadata.json)" + _last_good_hint(ckpt))
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{ckpt}' has an unreadable metadata.json ({e})" + _last_good_hint(ckpt))
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint '{ckpt}' has format version {meta.get('format_version')}, newer than "
                              f"this megazero's {FORMAT_VERSION}; upgrade megazero to load it")
    return meta


def check_model(meta: dict, cfg: Config, ckpt: str) -> None:
    """The saved model must have this run's shape (any layout can be resharded)."""
    saved_model = meta["config"]["model"]
    for key in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "ffn_hidden_size"):
        if saved_model.get(key) != getattr(cfg.model, key):
            raise CheckpointError(f"checkpoint '{ckpt}' holds a model with model.{key} = {saved_model.get(key)}, "
                                  f"but this run has {getattr(cfg.model, key)}; use the checkpoint's model config")


def load_rank_state(ckpt: str, meta: dict, grid: ProcessGrid, rank: Optional[int] = None) -> dict:
    """A rank's file (default: this rank's), checksum-verified, loaded without running any code from it."""
    c = grid.coords(rank)
    name = rank_file_name(c.tp, c.pp, c.dp)
    path = os.path.join(ckpt, name)
    expected = meta["files"].get(name)
    if expected is None or not os.path.isfile(path):
        raise CheckpointError(f"checkpoint '{ckpt}' is missing shard {name}" + _last_good_hint(ckpt))
    if os.path.getsize(path) != expected["bytes"] or _sha256(path) != expected["sha256"]:
        raise CheckpointError(f"checkpoint '{ckpt}' is corrupt: {name} fails its sha256 check"
                              + _last_good_hint(ckpt))
    return torch.load(path, map_location="cpu", weights_only=True)


def _last_good_hint(ckpt: str) -> str:
    save_dir, bad = os.path.split(os.path.normpath(ckpt))
    good = [n for n in complete_checkpoints(save_dir) if n < bad and _verifies(os.path.join(save_dir, n))]
    if not good:
        return "; no earlier good checkpoint exists there"
    it = int(good[-1].split("_")[1])
    return f"; the last good checkpoint is {good[-1]}: resume from it with --checkpoint.iteration {it}"


def _verifies(ckpt: str) -> bool:
    try:
        with open(os.path.join(ckpt, "metadata.json")) as f:
            meta = json.load(f)
        return all(os.path.isfile(os.path.join(ckpt, n)) and os.path.getsize(os.path.join(ckpt, n)) == e["bytes"]
                   and _sha256(os.path.join(ckpt, n)) == e["sha256"] for n, e in meta["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def first_error(message: Optional[str], grid: ProcessGrid) -> Optional[str]:
    """Share the first rank's error message with all ranks (None when every rank is fine).

    Under NCCL, all_gather_object pickles through a CUDA tensor on the current device, so
    each rank's device must be set first (ProcessGrid.create does it); otherwise every rank
    would use cuda:0."""
    messages: list[Any] = comm.all_gather_object(message, grid["world"])
    return next((m for m in messages if m), None)
