"""Sharded checkpoints: every rank writes only what it owns, atomically; exact resume.

Layout of `SAVE`:

    SAVE/latest                      "iter_0000100" (rewritten by rename once a save is complete)
    SAVE/iter_0000100/metadata.json  format version, layout, iteration, config, sha256 of every file
    SAVE/iter_0000100/rank_tp00_pp000_dp000.pt   this rank's state (see `rank_state`)

A save goes to `iter_NNNNNNN.tmp/`; after every rank has written and fsynced its file
(hashed as it is written), rank 0 writes metadata.json, renames the directory into place
(an existing one of the same iteration is renamed aside first, see atomic.commit_dir) and
then `latest`, fsyncing the directory after each rename. A crash or kill at any point
leaves `latest` naming a complete checkpoint. A failed write on any rank (disk full, no
permission) is agreed on by all ranks: the save is abandoned, the previous checkpoint and
`latest` stay as they were, and every rank raises the same `CheckpointSaveError`.

Every file is checked against its sha256 before any value in it is used (digest.py), and
loaded with `torch.load(weights_only=True)`: loading never runs code from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any, Callable, Optional

import numpy as np
import torch

from megazero.atomic import TMP_SUFFIX, atomic_write, commit_dir, existing_dir, prepare_dir, remove_dir, write_bytes
from megazero.checkpoint import digest
from megazero.config import Config
from megazero.errors import UserError
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid

FORMAT_VERSION = 1
LATEST = "latest"
ITER_DIR = re.compile(r"iter_\d{7}$")  # not iter_*.tmp (being written) nor iter_*.old (being replaced)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used (incomplete, corrupt, another model or format).

    With `bad_checkpoint` set, the message is completed, when first shown, by the last good
    checkpoint before it (a search that hashes older checkpoints: in distributed code rank 0
    alone runs it, see the trainer's load_checkpoint)."""

    def __init__(self, message: str, bad_checkpoint: Optional[str] = None):
        super().__init__(message)
        self.bad_checkpoint = bad_checkpoint
        self._hint: Optional[str] = None

    def __str__(self) -> str:
        if self.bad_checkpoint and self._hint is None:
            self._hint = last_good_hint(self.bad_checkpoint)
        return super().__str__() + (self._hint or "")


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank (disk full, unwritable directory); the same on every rank."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(tp: int, pp: int, dp: int) -> str:
    return f"rank_tp{tp:02d}_pp{pp:03d}_dp{dp:03d}.pt"


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


def save(save_dir: str, iteration: int, rank_state: dict | Callable[[], dict], cfg: Config, grid: ProcessGrid,
         keep_last: int = 0, extra: Optional[Callable[[str], list[str]]] = None) -> str:
    """Collective: every rank writes its state; rank 0 seals the checkpoint. Returns its path.
    `extra(directory)`, when given, is a collective writing more files (their paths relative
    to the directory are its return value) into the checkpoint before it is sealed. Raises CheckpointSaveError on
    every rank when any rank's write failed (nothing of the new checkpoint is kept)."""
    final = os.path.join(save_dir, iter_dir_name(iteration))

    def step(fn: Callable[[], Any]) -> list[Any]:  # fn() on every rank; a failed write on any stops all here
        return comm.agreed(fn, grid["world"], (OSError,), lambda rank, e: _abandoned(final, iteration, rank, e, grid),
                           gather=True)
    step(lambda: prepare_dir(final) if grid.rank == 0 else None)
    tmp = final + TMP_SUFFIX
    c = grid.coords()
    name = rank_file_name(c.tp, c.pp, c.dp)
    # Built inside the step when given as a callable: assembling state can fail on one rank
    # (scratch space for NVMe-swapped state) and must stop every rank alike.
    entries = step(lambda: _write_rank_file(os.path.join(tmp, name),
                                            rank_state() if callable(rank_state) else rank_state))
    files = dict(zip(_names(grid), entries))
    if extra is not None:
        def write_extra() -> dict[str, Optional[dict]]:
            written = extra(tmp)  # rank 0 writes them (by offsets: hashed once complete)
            return {n: digest.file_entry(os.path.join(tmp, n)) if grid.rank == 0 else None for n in written}
        files.update(step(write_extra)[0])
    meta = {"format_version": FORMAT_VERSION, "iteration": iteration,
            "layout": layout_of(cfg, grid), "config": cfg.to_dict(), "files": files}
    step(lambda: _seal(save_dir, final, meta, keep_last) if grid.rank == 0 else None)
    return final


def _names(grid: ProcessGrid) -> list[str]:
    coords = [grid.coords(r) for r in range(grid.world_size)]
    return [rank_file_name(c.tp, c.pp, c.dp) for c in coords]


def _write_rank_file(path: str, rank_state: dict) -> dict:
    with atomic_write(path) as f:
        writer = digest.HashingWriter(f)
        try:
            torch.save(rank_state, writer)
        except RuntimeError:
            if writer.error is not None:  # the disk's own error (full, too large), not torch's wrapper
                raise writer.error from None
            raise
    return writer.entry()


def _seal(save_dir: str, final: str, meta: dict, keep_last: int) -> None:
    """Rank 0: metadata, the directory renamed into place, then `latest` (each fsynced)."""
    write_bytes(os.path.join(final + TMP_SUFFIX, "metadata.json"), json.dumps(meta, indent=1).encode())
    commit_dir(final)
    write_bytes(os.path.join(save_dir, LATEST), os.path.basename(final).encode())
    prune(save_dir, keep_last)


def _abandoned(final: str, iteration: int, rank: int, error: str, grid: ProcessGrid) -> CheckpointSaveError:
    """Remove the partial checkpoint (every rank returns once it is gone); the error to raise."""
    if grid.rank == 0:
        shutil.rmtree(final + TMP_SUFFIX, ignore_errors=True)
    comm.barrier(grid["world"])
    return CheckpointSaveError(
        f"saving iteration {iteration} to {os.path.dirname(final)} failed on rank {rank}: {error}; "
        f"the previous checkpoint and '{LATEST}' are untouched; free disk space or fix the directory "
        f"(checkpoint.save) and resume with --checkpoint.load")


def layout_of(cfg: Config, grid: ProcessGrid) -> dict:
    return {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp, "vpp": cfg.parallel.vpp,
            "pp_layers": cfg.parallel.pp_layers, "zero_stage": cfg.zero.stage, "precision": cfg.train.precision}


def complete_checkpoints(save_dir: str) -> list[str]:
    """Sealed checkpoint directories (with metadata.json), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    names = [n for n in os.listdir(save_dir)
             if ITER_DIR.match(n) and os.path.isfile(os.path.join(save_dir, n, "metadata.json"))]
    return sorted(names)


def prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (0: none) and the leftovers of
    saves or deletions a crash interrupted (rank 0, between saves)."""
    for name in complete_checkpoints(save_dir)[:-keep_last] if keep_last else []:
        remove_dir(os.path.join(save_dir, name))
    for name in os.listdir(save_dir):
        if re.match(r"iter_\d{7}\.(tmp|del)$", name):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


# ----------------------------------------------------------------------------- load


def holds_checkpoint(load_dir: str, iteration: int = 0) -> bool:
    """Whether checkpoint.load names something to resume from (a save directory with a
    `latest`, a universal checkpoint, or an explicit iteration); else a run starts fresh."""
    return bool(iteration or os.path.isfile(os.path.join(load_dir, "universal.json"))
                or os.path.isfile(os.path.join(load_dir, LATEST)))


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
    return existing_dir(path)  # a kill while an iteration was being re-saved left it as PATH.old


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
    """The saved model must have this run's shape (any layout can be resharded)."""
    saved_model = meta["config"]["model"]
    for key in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "ffn_hidden_size"):
        if saved_model.get(key) != getattr(cfg.model, key):
            raise CheckpointError(f"checkpoint '{ckpt}' holds a model with model.{key} = {saved_model.get(key)}, "
                                  f"but this run has {getattr(cfg.model, key)}; use the checkpoint's model config")
    check_adapters(meta, cfg, ckpt)


def check_adapters(meta: dict, cfg: Config, ckpt: str) -> None:
    """A LoRA run resumes a checkpoint with the same adapters (their parameters and which
    weights are frozen are part of the model)."""
    def adapters(f: dict) -> dict:
        return {"lora_rank": f["lora_rank"], "lora_targets": list(f["lora_targets"])} if f["lora_rank"] else \
            {"lora_rank": 0}
    theirs = adapters(meta["config"].get("finetune") or {"lora_rank": 0})
    mine = adapters(dataclasses.asdict(cfg.finetune))
    if mine != theirs:
        fix = ("to fine-tune a pretrained checkpoint with LoRA, export it (convert --to hf) and start from it with "
               "--checkpoint.init_from_hf" if not theirs["lora_rank"] else
               "use the checkpoint's finetune settings, or fold its adapters in (convert --merge-lora --to hf) and "
               "start a new run from that with --checkpoint.init_from_hf")
        raise CheckpointError(f"checkpoint '{ckpt}' was saved with LoRA {theirs} but this run has {mine}; {fix}")


def _checked(ckpt: str, meta: dict, name: str, check: Callable[[str, dict], Any]) -> Any:
    expected = meta["files"].get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint '{ckpt}' has no {name} in its metadata.json", ckpt)
    try:
        return check(os.path.join(ckpt, name), expected)
    except digest.DigestError as e:
        raise CheckpointError(f"checkpoint '{ckpt}' is corrupt: {e}", ckpt) from None


def load_file(ckpt: str, meta: dict, name: str) -> Any:
    """One file of a checkpoint, read once and its sha256 checked before any value is used,
    loaded without running any code from it."""
    return _checked(ckpt, meta, name, digest.load_torch)


def verify_file(ckpt: str, meta: dict, name: str) -> str:
    """Check one file against its sha256 (one sequential read) before it is memory-mapped
    and read piece by piece; returns its path."""
    _checked(ckpt, meta, name, digest.verify)
    return os.path.join(ckpt, name)


def load_rank_state(ckpt: str, meta: dict, grid: ProcessGrid, rank: Optional[int] = None) -> dict:
    """A rank's file (default: this rank's), read once, checksum-verified, then loaded."""
    c = grid.coords(rank)
    return load_file(ckpt, meta, rank_file_name(c.tp, c.pp, c.dp))


def last_good_hint(ckpt: str) -> str:
    """"; the last good checkpoint is ...": the newest older checkpoint whose every file
    verifies (older ones are not hashed once one is found)."""
    save_dir, bad = os.path.split(os.path.normpath(ckpt))
    bad = bad.removesuffix(".old")
    for name in reversed([n for n in complete_checkpoints(save_dir) if n < bad]):
        if is_intact(os.path.join(save_dir, name)):
            it = int(name.split("_")[1])
            return f"; the last good checkpoint is {name}: resume from it with --checkpoint.iteration {it}"
    return "; no earlier good checkpoint exists there"


def is_intact(ckpt: str) -> bool:
    """Does every file of checkpoint `ckpt` match the digest its metadata.json records?"""
    try:
        with open(os.path.join(ckpt, "metadata.json")) as f:
            files = json.load(f)["files"]
        for name, expected in files.items():
            digest.verify(os.path.join(ckpt, name), expected)
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
