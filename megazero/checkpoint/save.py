"""Saving a sharded checkpoint during training: every rank writes only what it owns,
atomically, and resume is exact (the directory's layout: sharded.py).

A save goes to `iter_NNNNNNN.tmp/`; after every rank has written and fsynced its file
(hashed as it is written), rank 0 writes metadata.json, renames the directory into place
(an existing one of the same iteration is renamed aside first, see atomic.commit_dir) and
then `latest`, fsyncing the directory after each rename. A crash or kill at any point
leaves `latest` naming a complete checkpoint. A failed write on any rank (disk full, no
permission) is agreed on by all ranks (comm.agreed): the save is abandoned, the previous
checkpoint and `latest` stay as they were, every rank raises the same CheckpointSaveError.
`Save` holds these phases; with checkpoint.async_save the rank files are written between
them by a background thread (background.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable, Optional

import torch

from megazero.atomic import TMP_SUFFIX, atomic_write, commit_dir, prepare_dir, remove_dir, write_bytes
from megazero.checkpoint import digest
from megazero.checkpoint.base import (
    FORMAT_VERSION,
    CheckpointSaveError,
    complete_checkpoints,
    iter_dir_name,
    rank_file_name,
)
from megazero.checkpoint.meta import LATEST, MEGATRON_LATEST
from megazero.config.schema import Config
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid


def save_sharded(save_dir: str, iteration: int, rank_state: Callable[[], dict], cfg: Config, grid: ProcessGrid,
         keep_last: int = 0, extra: Optional[Callable[[str], list[str]]] = None) -> str:
    """Collective: every rank writes its state; rank 0 seals the checkpoint. Returns its path.
    `extra(directory)`, when given, is a collective writing more files (their paths relative
    to the directory are its return value) into the checkpoint before it is sealed. Raises CheckpointSaveError on
    every rank when any rank's write failed (nothing of the new checkpoint is kept)."""
    save = Save(save_dir, iteration, cfg, grid, keep_last)
    save.open()
    # Built inside the step: assembling state can fail on one rank (scratch space for
    # NVMe-swapped state) and must stop every rank alike.
    save.record_rank_files(lambda: write_rank_file(save.rank_file, rank_state()))
    if extra is not None:
        save.add_extra(extra)
    return save.seal()


class Save:
    """One checkpoint being written, in collective phases that every rank runs in the same
    order (a failed write on any rank stops them all at the phase it failed in):
    open() makes ITER.tmp, each rank writes its file into it (write_rank_file, now or on a
    background thread: background.py), record_rank_files() collects their digests,
    add_extra() writes the optional gathered files, seal() renames it into place."""

    def __init__(self, save_dir: str, iteration: int, cfg: Config, grid: ProcessGrid, keep_last: int):
        self.save_dir, self.iteration, self.cfg, self.grid, self.keep_last = save_dir, iteration, cfg, grid, keep_last
        self.final = os.path.join(save_dir, iter_dir_name(iteration))
        self.tmp = self.final + TMP_SUFFIX
        c = grid.coords()
        self.rank_file = os.path.join(self.tmp, rank_file_name(c.tp, c.pp, grid.dp_cp_index(c)))
        self.files: dict[str, Optional[dict]] = {}

    def step(self, fn: Callable[[], Any], gather: bool = False) -> Any:
        """fn() on every rank; a failed write on any stops all here with CheckpointSaveError."""
        return comm.agreed(fn, self.grid["world"], (OSError,),
                           lambda rank, e: _abandoned(self.final, self.iteration, rank, e, self.grid), gather=gather)

    def open(self) -> None:
        self.step(lambda: prepare_dir(self.final) if self.grid.rank == 0 else None)

    def record_rank_files(self, entry: Callable[[], dict]) -> None:
        """entry() is this rank's file's digest entry (raising OSError if writing it failed)."""
        entries = self.step(entry, gather=True)
        coords = map(self.grid.coords, range(self.grid.world_size))
        self.files.update({rank_file_name(c.tp, c.pp, self.grid.dp_cp_index(c)): e for c, e in zip(coords, entries)})

    def add_extra(self, extra: Callable[[str], list[str]]) -> None:
        def write_extra() -> dict[str, Optional[dict]]:
            written = extra(self.tmp)  # rank 0 writes them (by offsets: hashed once complete)
            return {n: digest.file_entry(os.path.join(self.tmp, n)) if self.grid.rank == 0 else None for n in written}
        self.files.update(self.step(write_extra, gather=True)[0])

    def seal(self) -> str:
        meta = {"format_version": FORMAT_VERSION, "iteration": self.iteration,
                "layout": layout_of(self.cfg, self.grid), "config": self.cfg.to_dict(), "files": self.files}
        if left_out(self.cfg):  # a weights-only checkpoint says so (full ones keep their metadata as it was)
            meta["without"] = left_out(self.cfg)
        self.step(lambda: _seal(self.save_dir, self.final, meta, self.keep_last) if self.grid.rank == 0 else None)
        return self.final


LEFT_OUT = {"optimizer": ("optimizer state", "--no-save-optim", "--no-load-optim"),
            "rng": ("RNG state", "--no-save-rng", "--no-load-rng")}
"""What checkpoint.save_X false leaves out: (what it is, Megatron's flags to save and load without it)."""


def left_out(cfg: Config) -> list[str]:
    """What checkpoint.save_optimizer / save_rng false leave out of a checkpoint: "optimizer", "rng"."""
    return [name for name in LEFT_OUT if not getattr(cfg.checkpoint, f"save_{name}")]


def without_left_out(state: dict, cfg: Config) -> dict:
    """A rank's state without what the config leaves out: the optimizer keeps its master weights
    (the model's values), partition map and counters, not Adam's moments."""
    out = left_out(cfg)
    if "optimizer" in out and state["optimizer"] is not None:
        state = {**state, "optimizer": {**state["optimizer"], "exp_avg": None, "exp_avg_sq": None}}
    if "rng" in out:
        state = {**state, "rng": None}
    return state


def weights_only_note(cfg: Config) -> str:
    """The save line's note on a checkpoint without optimizer or RNG state ('' for a full one)."""
    out = left_out(cfg)
    if not out:
        return ""
    options = " and ".join(f"--checkpoint.load_{n} false" for n in out)
    return (f" (without {' and '.join(LEFT_OUT[n][0] for n in out)}: it can be fine-tuned from, loaded with "
            f"{options}, but not resumed bitwise)")


def write_rank_file(path: str, rank_state: dict) -> dict:
    """Write one rank's state atomically, hashed as it is written; its digest entry."""
    with atomic_write(path) as f:
        writer = digest.HashingWriter(f)
        try:
            torch.save(rank_state, writer)  # type: ignore[arg-type]  # torch.save takes any object with write()
        except RuntimeError:
            if writer.error is not None:  # the disk's own error (full, too large), not torch's wrapper
                raise writer.error from None
            raise
    return writer.entry()


def _seal(save_dir: str, final: str, meta: dict, keep_last: int) -> None:
    """Rank 0: metadata, the directory renamed into place, then `latest` and Megatron-LM's name
    for it (each written atomically and fsynced; either names a complete checkpoint)."""
    write_bytes(os.path.join(final + TMP_SUFFIX, "metadata.json"), json.dumps(meta, indent=1).encode())
    commit_dir(final)
    write_bytes(os.path.join(save_dir, LATEST), os.path.basename(final).encode())
    write_bytes(os.path.join(save_dir, MEGATRON_LATEST), str(meta["iteration"]).encode())
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
    """The layout a checkpoint's rank files follow. Its "dp" counts ZeRO's shards (dp x cp: rank
    files are named by the dp x cp index), so readers need not know context parallelism; "cp"
    appears only above 1, so that a cp change reshards (RNG streams differ) while checkpoints
    written before cp existed keep their layout. Likewise the experts' folding: "ep" above 1,
    "etp" where it is not tp (readers find an expert-dp rank's file from them)."""
    cp = {"cp": grid.cp} if grid.cp > 1 else {}
    experts = {**({"ep": grid.ep} if grid.ep > 1 else {}), **({"etp": grid.etp} if grid.etp != grid.tp else {})}
    return {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp * grid.cp, **cp, **experts, "vpp": cfg.parallel.vpp,
            "pp_layers": cfg.parallel.pp_layers, "zero_stage": cfg.zero.stage, "precision": cfg.train.precision}


def prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (0: none) and the leftovers of
    saves or deletions a crash interrupted (rank 0, between saves)."""
    for name in complete_checkpoints(save_dir)[:-keep_last] if keep_last else []:
        remove_dir(os.path.join(save_dir, name))
    for name in os.listdir(save_dir):
        if re.match(r"iter_\d{7}\.(tmp|del)$", name):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
