"""Where a parameter's values live across the tensor-parallel group: its `Placement`.

A placement says which dimension is split over TP ranks (None: replicated), how many equal
blocks of it are split separately (`stride`, e.g. 3 for a fused q|k|v projection: each of
q, k and v is cut over the ranks on its own), the full (unsharded) shape, and whether its
gradient is a partial sum over TP under sequence parallelism. Every reader asks
`placement(param)`, every writer calls `place(param, ...)`; `shard` / `unshard` / `ranges`
turn a placement into tensors, so initialization, resharding, HF import and export never
special-case a layer.

An expert's weight ([E, out, in], one slice per expert of an MoE layer) says so in `experts`
(E): its dimension 0 is split over the expert-parallel group, whole experts per rank, before
its `dim` is split over the expert-tensor-parallel group.

Blocks of unequal size along the split dimension (fused q|k|v under grouped-query attention,
where k and v have fewer rows than q) are listed in `parts`, their full sizes; each is cut
over the ranks on its own, as `stride`'s equal blocks are.

The placement is kept on the Parameter object itself (one private attribute, touched only
here), not in a side table keyed by parameter: ZeRO points `.data` at its own buffers
(same object, placement kept), and code that re-creates a Parameter copies its `__dict__`
(zero.materialize), which carries it along. A parameter never placed is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

_ATTR = "_megazero_placement"


@dataclass(frozen=True)
class Placement:
    full_shape: tuple[int, ...]
    dim: Optional[int] = None  # the dimension split over TP ranks; None: every rank holds it whole
    stride: int = 1  # equal blocks of `dim` split separately (3 for a fused q|k|v)
    sequence_parallel: bool = False  # replicated, but each TP rank's gradient is partial (sum it over TP)
    parts: tuple[int, ...] = ()  # unequal blocks' full sizes along `dim` (q|k|v with grouped K/V); else `stride`
    experts: int = 0  # an expert weight: dim 0 holds this many experts, split over expert-parallel ranks

    def _blocks(self, length: int) -> list[int]:
        """The blocks' sizes along `dim` of a tensor `length` long there (full, or one shard of
        length / size: each block is cut over the ranks alike)."""
        if not self.parts:
            return [length // self.stride] * self.stride
        scale = sum(self.parts) // length
        return [part // scale for part in self.parts]

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This TP rank's shard of a full tensor (`full` itself when replicated)."""
        if self.dim is None or size == 1:
            return full
        blocks = full.split(self._blocks(full.shape[self.dim]), dim=self.dim)  # e.g. q, k, v: each split on its own
        return torch.cat([b.chunk(size, dim=self.dim)[rank] for b in blocks], dim=self.dim)

    def expert_shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This expert-parallel rank's experts of a full expert weight (`full` itself otherwise)."""
        lo, hi = self.expert_range(rank, size)
        return full if (lo, hi) == (0, full.shape[0]) else full[lo:hi]

    def expert_range(self, rank: int, size: int) -> tuple[int, int]:
        """[lo, hi) along dim 0 of the full tensor: the experts this expert-parallel rank keeps (all
        of dim 0 for a tensor that is not an expert weight, or at ep 1), for readers that fetch
        only those."""
        if not self.experts or size == 1:
            return 0, self.full_shape[0]
        if self.experts % size:
            raise ValueError(f"{self.experts} experts cannot be split over {size} expert-parallel ranks")
        per_rank = self.experts // size
        return rank * per_rank, (rank + 1) * per_rank

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard`: the full tensor from every TP rank's shard, in rank order."""
        if self.dim is None or len(shards) == 1:
            return shards[0]
        dim = self.dim
        per_rank = [s.split(self._blocks(s.shape[dim]), dim=dim) for s in shards]
        return torch.cat([torch.cat([p[b] for p in per_rank], dim=dim) for b in range(len(per_rank[0]))], dim=dim)

    def ranges(self, rank: int, size: int) -> list[tuple[int, int]]:
        """[lo, hi) along `dim` of the full tensor, for each block this TP rank keeps (what
        `shard` cuts out, for readers that fetch only those rows)."""
        assert self.dim is not None, "a replicated parameter is read whole"
        out, start = [], 0
        for block in self._blocks(self.full_shape[self.dim]):
            chunk = block // size
            out.append((start + rank * chunk, start + (rank + 1) * chunk))
            start += block
        return out

    def record(self) -> dict[str, Any]:
        """The JSON fields of a sharded checkpoint's partition map (their names are on disk). A
        replicated tensor's blocks are cut nowhere: its stride is recorded as 1 (an expert weight's
        gate | up, which only Muon reads, leaves the maps of earlier checkpoints equal)."""
        parts = {"tp_parts": list(self.parts)} if self.parts else {}
        experts = {"experts": self.experts} if self.experts else {}
        return {"tp_dim": self.dim, "tp_stride": self.stride if self.sharded else 1, "full_shape": list(self.full_shape),
                **parts, **experts}

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> Placement:
        return cls(tuple(entry["full_shape"]), entry["tp_dim"], entry["tp_stride"],
                   parts=tuple(entry.get("tp_parts", ())), experts=entry.get("experts", 0))


def placement(param: torch.Tensor) -> Placement:
    """`param`'s placement; replicated at its own shape when it was never placed."""
    found = getattr(param, _ATTR, None)
    return found if isinstance(found, Placement) else Placement(tuple(param.shape))


def place(param: torch.nn.Parameter, where: Placement) -> torch.nn.Parameter:
    """Record where `param` lives (returns it, to place a parameter as it is made)."""
    setattr(param, _ATTR, where)
    return param
