"""Where this rank's optimizer state lives, behind one small interface.

The optimizer steps its shard one sub-group (a list of `Range`s of at most
`zero.sub_group_size` elements) at a time and asks the store for that sub-group's state:

    with store.open(group) as state:    # GroupState: lists of fp32 views, one per range
        adamw_(state.master or the parameters, grads, state.exp_avg, state.exp_avg_sq, ...)

`DeviceStore` keeps everything in flat tensors on the grid's device and hands out views. An
offloaded store keeps the same tensors in host memory or in files and copies a sub-group in
on open and back on close, so offloading changes where state lives, not the step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megazero.zero.partition import Range


@dataclass
class GroupState:
    """One sub-group's optimizer state as fp32 tensors, one per range. `master` is None when
    the store keeps no separate master weights (fp32 training: the parameters are the masters)."""

    master: Optional[list[torch.Tensor]]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]


class DeviceStore:
    """fp32 master weights (only when the model computes in 16 bits) and Adam moments of this
    rank's shard, as flat tensors on `device`."""

    def __init__(self, numel: int, device: torch.device, separate_master: bool) -> None:
        self.master: Optional[torch.Tensor] = torch.zeros(numel, device=device) if separate_master else None
        self.exp_avg = torch.zeros(numel, device=device)
        self.exp_avg_sq = torch.zeros(numel, device=device)

    @staticmethod
    def _views(flat: torch.Tensor, group: list[Range]) -> list[torch.Tensor]:
        return [flat[r.shard_offset: r.shard_offset + r.length] for r in group]

    @contextlib.contextmanager
    def open(self, group: list[Range]) -> Iterator[GroupState]:
        """The state of one sub-group; what is written into it is kept."""
        yield GroupState(self._views(self.master, group) if self.master is not None else None,
                         self._views(self.exp_avg, group), self._views(self.exp_avg_sq, group))

    def write_master(self, offset: int, values: torch.Tensor) -> None:
        """Set master weights [offset, offset + len(values)) of the shard (initialisation, loading)."""
        if self.master is not None:
            self.master[offset: offset + values.numel()].copy_(values)

    def moments(self) -> dict[str, torch.Tensor]:
        """The whole shard's Adam moments (for checkpoints)."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_moments(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        self.exp_avg.copy_(exp_avg)
        self.exp_avg_sq.copy_(exp_avg_sq)

    def tensors(self) -> list[torch.Tensor]:
        return [self.exp_avg, self.exp_avg_sq] + ([self.master] if self.master is not None else [])
