"""The model's parameters in the compute dtype, laid out in ZeRO's flat buckets.

    stages 0-2  every bucket whole on every rank (`full`); each parameter is a view into its
                bucket, so an all-gather of the updated slices refreshes the model in place.
                Stages 1-2 launch those all-gathers asynchronously, one per bucket, and
                `wait` completes them (a forward pre-hook, or `wait_all` before reading)
    stage 3     only this rank's slice of every bucket, kept by a shard home (shard_home.py:
                on the device, or offloaded to host memory or NVMe by zero.offload_param);
                stage3.ParamGatherer points the parameters at gathered buffers while a
                module runs

Initial values are written element by element from `initial(bucket, slot)`: at stage 3 a
rank writes only the elements it owns, so a model built on the meta device is never whole.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import torch

from megazero.parallel import comm
from megazero.zero.partition import Bucket, FlatBuffers, FlatLayout, FlatSlot, Range
from megazero.zero.shard_home import ShardHome

Initial = Callable[[Bucket, FlatSlot], torch.Tensor]


class ParamStore:
    def __init__(self, layout: FlatLayout, *, home: Optional[ShardHome], dtype: torch.dtype,
                 device: torch.device) -> None:
        """`home` keeps the shard at stage 3; None at stages 0-2 (every bucket whole on `device`)."""
        self.layout, self.home, self.device = layout, home, device
        self.sharded = home is not None
        self.buckets = None if self.sharded else FlatBuffers(layout, sharded=False, dtype=dtype, device=device)
        self.gathering: dict[int, comm.Handle] = {}  # bucket -> its all-gather in flight

    @property
    def _whole(self) -> FlatBuffers:
        """The whole buckets (stages 0-2)."""
        assert self.buckets is not None
        return self.buckets

    def fill(self, initial: Initial, write_master: Callable[[int, torch.Tensor], None]) -> None:
        """Write every bucket's starting values from `initial`, each fp32 piece of this rank's
        shard also to `write_master(shard offset, values)`. At stage 3 only this rank's slices,
        parameter by parameter (never a whole bucket); the gatherer points the parameters at placeholders."""
        if self.home is not None:
            for b, s, start, end, offset in self.layout.slot_pieces(self.layout.buckets):
                piece = initial(b, s)[start - s.offset: end - s.offset]
                self.home.write(offset, piece)
                write_master(offset, piece)
            self.home.flush()
            return
        for b in self.layout.buckets:
            flat = torch.zeros(b.numel, device=self.device)  # fp32: the master slice comes from it
            for s in b.slots:
                flat[s.offset: s.offset + s.numel].copy_(initial(b, s))
            lo, hi = b.slice_of(b.rank)
            write_master(b.shard_offset, flat[lo:hi])
            bucket = self._whole.full[b.index]
            bucket.copy_(flat)
            for s in b.slots:
                s.param.data = bucket[s.offset: s.offset + s.numel].view(s.shape)

    def view(self, r: Range) -> torch.Tensor:
        """The elements of one range of this rank's shard, in place (the shard in memory)."""
        if self.home is not None:
            return self.home.read(r.shard_offset, r.length)
        return self._whole.view(r)

    def set_ranges(self, ranges: list[Range], values: list[torch.Tensor]) -> None:
        """Write updated values of this rank's ranges (after a step; then `flush`)."""
        if self.home is not None:
            for r, v in zip(ranges, values):
                self.home.write(r.shard_offset, v)
            return
        params = [self._whole.view(r) for r in ranges]
        if values and values[0].device == params[0].device:
            torch._foreach_copy_(params, values)
        else:
            for p, v in zip(params, values):
                p.copy_(v)

    def flush(self) -> None:
        if self.home is not None:
            self.home.flush()

    def own_slice(self, b: Bucket) -> torch.Tensor:
        """This rank's slice of bucket b (in place where the shard is in memory)."""
        if self.home is not None:
            return self.home.read(b.shard_offset, b.shard_numel)
        return self._whole.own_slice(b)

    def own_slices(self, frozen_only: bool = False) -> list[torch.Tensor]:
        """This rank's shard (padding included), or its frozen part, as pieces laid end to end."""
        if self.home is not None:
            start = self.layout.trainable_numel if frozen_only else 0
            return [self.home.read(start, self.layout.shard_numel - start)]
        in_shard_order = sorted(self.layout.buckets, key=lambda b: b.shard_offset)
        return [self.own_slice(b) for b in in_shard_order if not (frozen_only and b.trainable)]

    def set_own_slice(self, b: Bucket, values: torch.Tensor) -> None:
        """Set this rank's slice of bucket b (then `flush`)."""
        if self.home is not None:
            self.home.write(b.shard_offset, values)
        else:
            self._whole.own_slice(b).copy_(values)

    def pieces(self) -> list[tuple[str, int, int]]:
        """Stage 3: (name, shard offset, length) of this rank's piece of each parameter; a
        piece is empty when the parameter lies wholly in other ranks' slices."""
        out = []
        for b, s in self.layout.slots():
            lo, hi = b.slice_of(b.rank)
            start = max(lo, s.offset)
            length = max(0, min(hi, s.offset + s.numel) - start)
            out.append((s.name, b.shard_offset + min(start, hi) - lo, length))
        return out

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by where they live (the device type, "cpu" or "nvme")."""
        if self.home is not None:
            return self.home.nbytes()
        return {self.device.type: sum(t.nbytes for t in self._whole.tensors())}

    def all_gather(self, groups: Mapping[str, comm.Group], buckets: Iterable[Bucket]) -> None:
        """Stages 1/2: every rank updated its slices of `buckets`; launch the all-gathers over
        each bucket's group (`groups[bucket.group]`) that put them whole everywhere, in the given
        order (the same on every rank)."""
        for b in buckets:
            lo, hi = b.slice_of(b.rank)
            full = self._whole.full[b.index]
            work = comm.all_gather_into(full, full[lo:hi], groups[b.group], async_op=True)
            if work is not None:
                self.gathering[b.index] = work

    def wait(self, indices: Iterable[int]) -> None:
        """Complete the all-gathers of these buckets (their parameters may be read after)."""
        for index in indices:
            work = self.gathering.pop(index, None)
            if work is not None:
                work.wait()

    def wait_all(self) -> None:
        """Complete every post-step all-gather (stages 1-2): every parameter holds its value after."""
        self.wait(list(self.gathering))
