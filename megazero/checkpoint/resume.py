"""What a run starts from, decided here for train/parallelize (which values ZeRO
materializes) and the trainer (which state it loads):

    fresh   nothing to resume (an empty save directory too): the model's own init
    hf      checkpoint.init_from_hf and nothing to resume: each rank reads its TP shards
    resume  checkpoint.load holds a checkpoint (its `latest`, iter_{checkpoint.iteration}, a
            universal checkpoint, or a DeepSpeed one; also on a torchrun restart): it replaces every value

At the checkpoint's own layout each rank reads its own file (bitwise; at ZeRO-0 the
replicated optimizer state of a ZeRO group's buckets is in its rank 0's file alone: dp x cp's
for the dense parameters, expert-dp's for the experts). Any other layout, or a universal
checkpoint, is resharded: each rank asks the checkpoint's reader (load.open_checkpoint) for
one full fp32 tensor at a time (master weights, then each Adam moment) and keeps its new TP
shard's pieces that its new DP partition owns, never holding more than about one full
parameter beyond its own shards; the trainer then reseeds the RNG streams.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Protocol

import torch

from megazero.checkpoint.base import KINDS, CheckpointError, last_good_hint
from megazero.checkpoint.deepspeed import deepspeed_folder
from megazero.checkpoint.load import open_checkpoint
from megazero.checkpoint.meta import LATEST, MEGATRON_LATEST
from megazero.checkpoint.save import LEFT_OUT, layout_of
from megazero.checkpoint.sharded import check_model, load_rank_state, read_metadata, resolve
from megazero.checkpoint.tensors import decode_rng, fit_vocab
from megazero.config.schema import Config
from megazero.config.sharding import DENSE, parameter_groups
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.placement import Placement

FRESH, HF, RESUME = "fresh", "hf", "resume"


def starting_point(load: Optional[str], iteration: int = 0, init_from_hf: Optional[str] = "") -> str:
    """FRESH, HF or RESUME (see above), from the files alone: every rank decides alike."""
    if load and (iteration or any(os.path.isfile(os.path.join(load, n))
                                  for n in ("universal.json", LATEST, MEGATRON_LATEST)) or deepspeed_folder(load)):
        return RESUME
    return HF if init_from_hf else FRESH


def resume_state(load: str, iteration: int, cfg: Config, grid: ProcessGrid,
                 template: Callable[[], dict]) -> tuple[str, dict]:
    """Collective: the checkpoint a RESUME reads and this rank's state from it: its optimizer
    state in this layout (`template()`, the fresh optimizer's state_dict, supplies the
    partition map and keys when resharding), loop position, LR schedule and, at the same
    layout, RNG streams. A bad checkpoint raises the same CheckpointError on every rank."""
    def read() -> tuple[str, dict]:
        # A universal or DeepSpeed checkpoint is always resharded; a megazero save only when its layout differs.
        whole = os.path.isfile(os.path.join(load, "universal.json")) or deepspeed_folder(load) is not None
        ckpt = load if whole else resolve(load, iteration)
        if not whole:
            meta = read_metadata(ckpt)
            check_model(meta, cfg, ckpt)
            check_optimizer(meta, cfg, ckpt)
            check_contents(meta, cfg, ckpt)
            if meta["layout"] == layout_of(cfg, grid):
                return ckpt, _own_files(ckpt, meta, grid)
        reader = open_checkpoint(ckpt, stated=cfg).training  # a DeepSpeed one may hold the run's model
        assert reader is not None  # a megazero or DeepSpeed checkpoint: it has the optimizer state
        check_model(reader.meta, cfg, ckpt)
        kinds = KINDS if cfg.checkpoint.load_optimizer else ("master",)
        return ckpt, {**reader.trainer_state(), "rng": None,
                      "optimizer": reshard_optimizer_state(reader, template(), grid, kinds)}

    def error(rank: int, report: tuple[str, str | None]) -> CheckpointError:
        message, bad = report  # the search for the last good checkpoint hashes older ones: rank 0 alone runs it
        if bad:
            message += comm.broadcast_object(last_good_hint(bad) if grid.rank == 0 else None, 0, grid["world"])
        return CheckpointError(message)
    ckpt, state = comm.agreed(read, grid["world"], (CheckpointError, ValueError), error,
                              lambda e: (e.args[0], e.bad_checkpoint) if isinstance(e, CheckpointError) else
                              (str(e), None))
    if not cfg.checkpoint.load_optimizer:  # the weights alone: moments, step count and loss scale of a fresh optimizer
        state["optimizer"] = {**template(), "master": state["optimizer"]["master"]}
    if not cfg.checkpoint.load_rng or state.get("rng") is None:  # the trainer reseeds from (seed, iteration)
        state.pop("rng", None)
    return ckpt, state


def resume_line(ckpt: str, iteration: int, cfg: Config, rng_loaded: bool) -> str:
    """The one line saying what a resume took from the checkpoint."""
    c = cfg.checkpoint
    if c.load_optimizer:
        line = f"resumed from {ckpt} at iteration {iteration}"
    else:
        line = (f"loaded the weights, loop position and LR schedule of {ckpt} at iteration {iteration} with a fresh "
                f"optimizer state (checkpoint.load_optimizer false: Adam's moments, step count and loss scale start "
                f"afresh)")
    if not rng_loaded:
        line += (", RNG streams reseeded from train.seed (checkpoint.load_rng false)" if not c.load_rng else
                 " (resharded to this layout)")
    return line


def check_contents(meta: dict, cfg: Config, ckpt: str) -> None:
    """A checkpoint saved without optimizer or RNG state (checkpoint.save_optimizer / save_rng
    false) cannot be resumed as a whole: its loading must leave out the same."""
    for name in meta.get("without", []):
        if getattr(cfg.checkpoint, f"load_{name}"):
            what, saved_by, load_flag = LEFT_OUT[name]
            raise CheckpointError(f"checkpoint '{ckpt}' holds no {what} (saved with checkpoint.save_{name} false, "
                                  f"Megatron's {saved_by}): it can be fine-tuned from, not resumed; load its weights "
                                  f"with --checkpoint.load_{name} false ({load_flag})")


def check_optimizer(meta: dict, cfg: Config, ckpt: str) -> None:
    """Refuse optimizer state of another optim.name (AdamW's moments are no Muon buffer), unless
    checkpoint.load_optimizer false starts it fresh."""
    saved = meta.get("config", {}).get("optim", {}).get("name", "adamw")  # before Muon: AdamW's
    if saved != cfg.optim.name and cfg.checkpoint.load_optimizer:
        raise CheckpointError(f"checkpoint '{ckpt}' holds {saved} optimizer state but optim.name is "
                              f"{cfg.optim.name}; set --checkpoint.load_optimizer false to start the "
                              f"{cfg.optim.name} state fresh (or optim.name {saved})")


def _own_files(ckpt: str, meta: dict, grid: ProcessGrid) -> dict:
    """This rank's state at the checkpoint's own layout."""
    state = load_rank_state(ckpt, meta, grid)
    if state["optimizer"] is None:  # ZeRO-0: the replicated state is in its ZeRO groups' rank 0 files
        state["optimizer"] = _replicated_state(ckpt, meta, grid)
    return {**state, "rng": decode_rng(state["rng"]) if state["rng"] is not None else None}


def _replicated_state(ckpt: str, meta: dict, grid: ProcessGrid) -> dict:
    """ZeRO-0's optimizer state of this rank, which it did not save: a bucket's state is that of
    its ZeRO group's rank 0 (the partition map names a bucket's group where it is not dp x cp's)."""
    state = load_rank_state(ckpt, meta, grid, rank=grid[DENSE.zero].ranks[0])["optimizer"]  # a private copy
    owners = {}
    for b in state["partition"]["buckets"]:
        kind = b.get("zero_group", DENSE.zero)
        if kind == DENSE.zero:
            continue
        if kind not in owners:
            owners[kind] = load_rank_state(ckpt, meta, grid, rank=grid[kind].ranks[0])["optimizer"]
        span = slice(b["shard_offset"], b["shard_offset"] + b["shard_numel"])
        for key in KINDS:
            if state[key] is not None and span.start < len(state[key]):  # frozen buckets have master values only
                state[key][span] = owners[kind][key][span]
    return state


class FullTensorReader(Protocol):  # sharded.ShardedReader, universal.UniversalReader
    def full(self, name: str, kind: str = "master") -> torch.Tensor: ...

    def trainer_state(self) -> dict: ...


def reshard_optimizer_state(reader: FullTensorReader, template: dict, grid: ProcessGrid,
                            kinds: tuple[str, ...] = KINDS) -> dict:
    """This rank's optimizer state_dict in its new layout (`template` is the fresh optimizer's
    own state_dict: it supplies the partition map, each ZeRO group's shard index and the keys).
    The flat shards are built in host memory, whatever the run's device: the optimizer's
    load_state_dict copies each to the device once, so resharding needs no device memory
    beyond the optimizer's own. A parameter's shard on this rank: its experts of the
    expert-parallel group (an expert weight), then its split over its TP group."""
    partition = template["partition"]
    zero_ranks = template.get("zero_ranks", {DENSE.zero: template["dp_rank"]})
    # Frozen parameters (LoRA's base) sit after the trainable prefix and have master values only.
    flats = {k: torch.zeros(partition["shard_numel" if k == "master" else "trainable_numel"], dtype=torch.float32)
             for k in kinds}
    for name, entry in partition["params"].items():
        where = Placement.from_record(entry)
        groups = parameter_groups(where)
        mine = [p for p in entry["shards"] if p["rank"] == zero_ranks[groups.zero]]
        if not mine:
            continue
        tensor = grid[groups.tensor]
        for kind in kinds if entry["trainable"] else ("master",):
            full = fit_vocab(name, reader.full(name, kind), tuple(entry["full_shape"]))
            local = where.shard(where.expert_shard(full, grid.ep_rank, grid.ep), tensor.rank, tensor.size).reshape(-1)
            for p in mine:
                flats[kind][p["offset"]: p["offset"] + p["length"]] = \
                    local[p["param_offset"]: p["param_offset"] + p["length"]]
            del full, local
    state = reader.trainer_state()
    return {**template, **flats, "step": state["step"], "loss_scaler": state["loss_scaler"]}
