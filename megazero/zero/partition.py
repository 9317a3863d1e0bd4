"""Flat, aligned partitions of a model-parallel rank's parameters over its data-parallel group.

Parameters are laid end to end into buckets (the unit of gradient communication; at stage
3 also the unit of parameter gathering). Every parameter starts at a multiple of ALIGN
elements and every bucket is padded to a multiple of ALIGN x shards, so each DP rank owns
an equal, aligned slice of every bucket (Megatron's distributed-optimizer layout): a
bucket is reduce-scattered and all-gathered on its own, as soon as it is ready.

A rank's *shard* is the concatenation of its slices of all buckets, in bucket order. Its
optimizer state (fp32 master, Adam moments) and, at stage 2/3, its gradients are flat
tensors in that shard space. `FlatLayout.param_map()` records where every element of every
parameter lives, for checkpoints and resharding.

Frozen parameters (requires_grad False, e.g. the base model under LoRA) get buckets of
their own, placed after every trainable bucket in the shard: the trainable buckets form a
prefix of `trainable_numel` elements, and gradients and optimizer state cover that prefix
only. Frozen buckets are still sharded (stage 3) and gathered like the others.

Expert weights get buckets of their own as well: each bucket is partitioned over its own ZeRO
group (`Bucket.group`, chosen by config/sharding.parameter_groups from the parameter's
placement: dp x cp for dense parameters, expert-dp for experts), so its `shards` and this
rank's index in it (`Bucket.rank`) are the bucket's. Every rank still lays out the same buckets
at the same shard offsets (an expert-parallel rank's experts have the same shapes as another's).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch
from torch import nn

from megazero.config.sharding import DENSE, parameter_groups
from megazero.parallel.placement import placement
from megazero.zero import ALIGN  # elements: 256 B in fp32; validated against at start-up

Named = list[tuple[str, nn.Parameter]]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class FlatSlot:
    """One parameter's place in its bucket."""

    name: str
    param: nn.Parameter = field(repr=False)
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class Bucket:
    index: int
    chunk: int
    slots: list[FlatSlot]
    numel: int
    """Padded size: a multiple of ALIGN x shards."""
    shards: int
    shard_offset: int
    """Where each rank's slice of this bucket starts in that rank's flat shard (the same on every rank)."""
    trainable: bool = True
    """False for a bucket of frozen parameters: no gradient, no optimizer state."""
    group: str = DENSE.zero
    """The grid group it is partitioned and reduced over (config/sharding.parameter_groups)."""
    rank: int = 0
    """This rank's index in `group`: which slice of the bucket is its own."""

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shards

    def slice_of(self, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s slice, in bucket coordinates."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


@dataclass
class Range:
    """A run of this rank's shard with one weight-decay and one grad-norm treatment."""

    bucket: int
    start: int
    """In bucket coordinates."""
    length: int
    shard_offset: int
    decay: bool
    counted: bool
    """Whether the grad norm counts these elements (TP-replicated copies and the tied head are counted elsewhere)."""
    decoupled: bool = False
    """The input embedding or output layer: stepped at optim.decoupled_lr when that is set."""
    muon: bool = False
    """Whether Muon steps these elements (weight matrices under optim.name muon), not AdamW."""


@dataclass
class FlatLayout:
    buckets: list[Bucket]
    shards: int
    """Of the dense parameters' group (each bucket has its own `shards`)."""
    rank: int
    """This rank's index in the dense parameters' group (each bucket has its own `rank`)."""

    @property
    def shard_numel(self) -> int:
        return sum(b.shard_numel for b in self.buckets)

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def trainable_numel(self) -> int:
        """Length of the shard's trainable prefix (what gradients and optimizer state cover)."""
        return sum(b.shard_numel for b in self.buckets if b.trainable)

    def trainable_buckets(self) -> list[Bucket]:
        return [b for b in self.buckets if b.trainable]

    @property
    def param_numel(self) -> int:
        return sum(s.numel for b in self.buckets for s in b.slots)

    def slots(self) -> list[tuple[Bucket, FlatSlot]]:
        return [(b, s) for b in self.buckets for s in b.slots]

    def slot_pieces(self, buckets: list[Bucket], rank: Optional[int] = None
                    ) -> Iterator[tuple[Bucket, FlatSlot, int, int, int]]:
        """(bucket, slot, start, end, shard offset) of every non-empty piece of a parameter in
        `rank`'s slices of `buckets` (default: this rank's slice of each): [start, end) in bucket
        coordinates."""
        for b in buckets:
            lo, hi = b.slice_of(b.rank if rank is None else rank)
            for s in b.slots:
                start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
                if start < end:
                    yield b, s, start, end, b.shard_offset + start - lo

    def param_map(self) -> dict:
        """Parameter -> where its elements live on every DP rank, plus the padding.

        `params[name]["shards"]` lists (rank, offset in that rank's flat shard, length,
        offset in the flattened parameter); the pieces of a parameter cover it exactly. The rank
        is the index in the parameter's ZeRO group: dp x cp, or for a bucket over another group
        (experts) the one its `zero_group` names.
        """
        pieces: dict[str, list[dict]] = {s.name: [] for _, s in self.slots()}
        for b in self.buckets:
            for r in range(b.shards):
                for _, s, start, end, offset in self.slot_pieces([b], r):
                    pieces[s.name].append({"rank": r, "offset": offset, "length": end - start,
                                           "param_offset": start - s.offset})
        params = {s.name: {"shape": list(s.shape), **placement(s.param).record(), "bucket": b.index,
                           "bucket_offset": s.offset, "numel": s.numel, "shards": pieces[s.name],
                           "trainable": b.trainable, **_group_record(b)}
                  for b, s in self.slots()}
        buckets = [{"numel": b.numel, "padding": b.numel - sum(s.numel for s in b.slots), "shard_numel": b.shard_numel,
                    "shard_offset": b.shard_offset, "chunk": b.chunk, **_group_record(b)} for b in self.buckets]
        return {"align": ALIGN, "shards": self.shards, "shard_numel": self.shard_numel,
                "trainable_numel": self.trainable_numel, "buckets": buckets, "params": params}

    def ranges(self, decays: dict[str, bool], counted: dict[str, bool], max_len: int,
               decoupled: frozenset[str] = frozenset(), muon: frozenset[str] = frozenset()) -> list[Range]:
        """This rank's shard as runs of equal treatment, each at most `max_len` long (the
        parameters named in `muon` in runs of their own).

        Padding between two parameters with the same treatment is folded into one run: it is
        zero in parameters, gradients and moments alike, so updating it changes nothing.
        """
        def treatment(r: Range) -> tuple:
            return r.bucket, r.decay, r.counted, r.decoupled, r.muon

        runs: list[Range] = []
        for b, s, start, end, offset in self.slot_pieces(self.trainable_buckets()):
            r = Range(b.index, start, end - start, offset, decays[s.name], counted[s.name], s.name in decoupled,
                      s.name in muon)
            if runs and treatment(runs[-1]) == treatment(r):
                runs[-1].length = end - runs[-1].start
            else:
                runs.append(r)
        # long runs split, so no sub-group has to hold more than max_len
        return [replace(r, start=r.start + off, length=min(max_len, r.length - off), shard_offset=r.shard_offset + off)
                for r in runs for off in range(0, r.length, max_len)]


def _group_record(b: Bucket) -> dict[str, Any]:
    """A bucket over a group other than dense's says which, and over how many ranks (dense
    buckets record nothing: their maps read as before experts existed)."""
    return {} if b.group == DENSE.zero else {"zero_group": b.group, "group_shards": b.shards}


def with_trainable_flags(param_map: dict) -> dict:
    """A partition map saved before frozen parameters existed, with their flags added (every
    parameter trainable), so that it compares equal to the same layout's map today."""
    if "trainable_numel" in param_map:
        return param_map
    params = {n: {**e, "trainable": True} for n, e in param_map["params"].items()}
    return {**param_map, "trainable_numel": param_map["shard_numel"], "params": params}


def bucket_numel(numels: list[int], shards: int) -> int:
    """Padded size of a bucket holding parameters of `numels` elements, in order: each starts
    at a multiple of ALIGN, the bucket is a multiple of ALIGN x shards (the planner's Ψ too)."""
    offset = 0
    for n in numels:
        offset = _round_up(offset + n, ALIGN)
    return _round_up(max(offset, 1), ALIGN * shards)


class ShardableModel(Protocol):
    """What ZeRO needs from each model chunk (megazero.model.gpt.GPT provides it)."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def register_state_dict_pre_hook(self, hook: Callable[..., None]) -> Any: ...

    def tied_weight(self) -> Optional[nn.Parameter]:
        """The embedding copy whose gradient is summed over the embedding group."""

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters AdamW does not decay (read by the optimizer)."""

    def units(self) -> list:
        """Stage 3's fetch units in execution order (see GPT.units)."""

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """A parameter's starting value on this TP rank (materializes meta-device models)."""


def bucket_groups(chunks: Sequence[ShardableModel], bucket_size: int) -> list[tuple[int, Named]]:
    """Stages 0-2: parameters in reverse execution order (the order gradients become ready),
    cut into buckets of about `bucket_size` elements that never span two model chunks (each
    chunk's last backward comes at its own time). The tied embedding weight gets a bucket of
    its own, so the first and last stages partition it identically and can sum its shards."""
    groups: list[tuple[int, Named]] = []
    for ci in reversed(range(len(chunks))):
        tied = chunks[ci].tied_weight()
        named = list(chunks[ci].named_parameters())
        groups += [(ci, [(n, p)]) for n, p in named if p is tied]
        current: Named = []
        size = 0
        for n, p in reversed(named):
            if p is tied:
                continue
            if current and size + p.numel() > bucket_size:
                groups.append((ci, current))
                current, size = [], 0
            current.append((n, p))
            size += p.numel()
        if current:
            groups.append((ci, current))
    return groups


def zero_group(p: nn.Parameter) -> str:
    """The grid group ZeRO partitions p over (config/sharding.parameter_groups)."""
    return parameter_groups(placement(p)).zero


def split_frozen(groups: list[tuple[int, Named]]) -> list[tuple[int, Named]]:
    """Each group cut into its trainable and its frozen parameters, and those into dense and
    expert parameters (a bucket holds one kind, partitioned over one group)."""
    out = []
    for chunk, named in groups:
        kinds = dict.fromkeys((zero_group(p), p.requires_grad) for _, p in named)
        for group, trainable in sorted(kinds, key=lambda k: (not k[1], k[0] != DENSE.zero)):
            out.append((chunk, [(n, p) for n, p in named if (zero_group(p), p.requires_grad) == (group, trainable)]))
    return out


def build_layout(groups: list[tuple[int, Named]], shards: dict[str, tuple[int, int]]) -> FlatLayout:
    """One bucket per (chunk index, [(name, param), ...]) group, partitioned over its ZeRO
    group's ranks (`shards[group]`: how many, and this rank's index); the shard holds the
    trainable buckets first, then the frozen ones."""
    buckets = []
    for index, (chunk, named) in enumerate(groups):
        kinds = {(p.requires_grad, zero_group(p)) for _, p in named}
        if len(kinds) != 1:
            raise ValueError(f"bucket {index} mixes trainable and frozen, or dense and expert parameters; "
                             f"split_frozen first")
        trainable, group = kinds.pop()
        slots, offset = [], 0
        for name, p in named:
            slots.append(FlatSlot(name, p, offset, p.numel(), tuple(p.shape)))
            offset = _round_up(offset + p.numel(), ALIGN)
        n, rank = shards[group]
        buckets.append(Bucket(index, chunk, slots, bucket_numel([p.numel() for _, p in named], n), n,
                              0, trainable, group, rank))
    shard_offset = 0
    for b in sorted(buckets, key=lambda b: not b.trainable):  # stable: trainable first, each in bucket order
        b.shard_offset = shard_offset
        shard_offset += b.shard_numel
    return FlatLayout(buckets, *shards[DENSE.zero])


def sub_groups(ranges: list[Range], max_numel: int) -> list[list[Range]]:
    """Pack consecutive ranges into groups of at most `max_numel` elements (the optimizer's
    unit of work, and what NVMe offload will swap)."""
    groups: list[list[Range]] = [[]]
    size = 0
    for r in ranges:
        if groups[-1] and size + r.length > max_numel:
            groups.append([])
            size = 0
        groups[-1].append(r)
        size += r.length
    return [g for g in groups if g]


class FlatBuffers:
    """Per-element storage (gradients, parameters) in the layout's flat space: either every
    bucket whole (`full`, one tensor per bucket) or only this rank's shard (`shard`). With
    `trainable_only` (gradients) frozen buckets get no storage: the shard is the trainable
    prefix and their `full` tensors are empty."""

    def __init__(self, layout: FlatLayout, *, sharded: bool, dtype: torch.dtype, device: torch.device,
                 trainable_only: bool = False) -> None:
        self.layout, self.sharded = layout, sharded
        numel = layout.trainable_numel if trainable_only else layout.shard_numel
        self.shard = torch.zeros(numel if sharded else 0, dtype=dtype, device=device)
        self.full: list[torch.Tensor] = [] if sharded else [
            torch.zeros(b.numel if b.trainable or not trainable_only else 0, dtype=dtype, device=device)
            for b in layout.buckets]

    def view(self, r: Range) -> torch.Tensor:
        """The elements of one range of this rank's shard."""
        if self.sharded:
            return self.shard[r.shard_offset: r.shard_offset + r.length]
        return self.full[r.bucket][r.start: r.start + r.length]

    def own_slice(self, b: Bucket) -> torch.Tensor:
        """This rank's slice of bucket b."""
        if self.sharded:
            return self.shard[b.shard_offset: b.shard_offset + b.shard_numel]
        lo, hi = b.slice_of(b.rank)
        return self.full[b.index][lo:hi]

    def tensors(self) -> list[torch.Tensor]:
        return [self.shard] if self.sharded else [t for t in self.full if t.numel()]
