"""The model's parameters in the compute dtype, laid out in the optimizer's flat buckets.

    stages 0-2  every bucket whole on every rank (`full`); each parameter is a view into its
                bucket, so an all-gather of the updated slices refreshes the model in place
    stage 3     only this rank's slice of every bucket (`shard`); stage3.ParamGatherer points
                the parameters at gathered buffers while a module runs

Initial values are written element by element from `initial(bucket, slot)`: at stage 3 a
rank writes only the elements it owns, so a model built on the meta device is never whole.
"""

from __future__ import annotations

from typing import Callable

import torch

from megazero.parallel import comm
from megazero.zero.partition import Bucket, FlatBuffers, Layout, Slot

Initial = Callable[[Bucket, Slot], torch.Tensor]


class ParamStore(FlatBuffers):
    def __init__(self, layout: Layout, *, sharded: bool, dtype: torch.dtype, device: torch.device,
                 initial: Initial, write_master: Callable[[int, torch.Tensor], None]) -> None:
        super().__init__(layout, sharded=sharded, dtype=dtype, device=device)
        for b in layout.buckets:
            if sharded:
                self._fill_shard(b, initial, write_master)
            else:
                self._fill_bucket(b, initial, write_master)

    def _fill_bucket(self, b: Bucket, initial: Initial, write_master: Callable) -> None:
        flat = torch.zeros(b.numel, device=self.shard.device)  # fp32: the master slice comes from it
        for s in b.slots:
            flat[s.offset: s.offset + s.numel].copy_(initial(b, s))
        lo, hi = b.slice_of(self.layout.rank)
        write_master(b.shard_offset, flat[lo:hi])
        bucket = self.full[b.index]
        bucket.copy_(flat)
        for s in b.slots:
            s.param.data = bucket[s.offset: s.offset + s.numel].view(s.shape)

    def _fill_shard(self, b: Bucket, initial: Initial, write_master: Callable) -> None:
        """This rank's slice of bucket b, written parameter by parameter (never the whole
        bucket); the gatherer points the parameters at placeholders."""
        lo, hi = b.slice_of(self.layout.rank)
        for s in b.slots:
            start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start >= end:
                continue
            piece = initial(b, s)[start - s.offset: end - s.offset]
            offset = b.shard_offset + start - lo
            self.shard[offset: offset + end - start].copy_(piece)
            write_master(offset, piece)

    def own_slices(self, frozen_only: bool = False) -> list[torch.Tensor]:
        """This rank's shard (padding included), or its frozen part, as pieces laid end to end."""
        if self.sharded:
            return [self.shard[self.layout.trainable_numel if frozen_only else 0:]]
        in_shard_order = sorted(self.layout.buckets, key=lambda b: b.shard_offset)
        return [self.own_slice(b) for b in in_shard_order if not (frozen_only and b.trainable)]

    def pieces(self) -> list[tuple[str, torch.Tensor]]:
        """Stage 3: (name, the view of the shard holding this rank's piece of it) per
        parameter; a piece is empty when the parameter lies wholly in other ranks' slices."""
        out = []
        for b, s in self.layout.slots():
            lo, hi = b.slice_of(self.layout.rank)
            start = max(lo, s.offset)
            length = max(0, min(hi, s.offset + s.numel) - start)
            base = b.shard_offset + min(start, hi) - lo
            out.append((s.name, self.shard[base: base + length]))
        return out

    def all_gather(self, dp: comm.Group, frozen_too: bool = False) -> None:
        """Stages 1/2: every rank updated its slices; put the full buckets everywhere (after a
        step only the trainable ones: frozen ones never change)."""
        for b in self.layout.buckets if frozen_too else self.layout.trainable_buckets():
            lo, hi = b.slice_of(self.layout.rank)
            comm.all_gather_into(self.full[b.index], self.full[b.index][lo:hi], dp)
