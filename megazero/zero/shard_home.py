"""Where a stage-3 rank's parameter shard (compute dtype) lives between uses.

    MemoryShard on the device   zero.offload_param none: one flat tensor; a bucket's slice
                                goes into the all-gather as it is
    MemoryShard on the host     cpu: the same tensor in (pinned) host memory; a slice is
                                copied to the device just before its all-gather
    NvmeShard                   nvme: a swap file with one block-aligned region per bucket
                                (per fetch unit); a slice is read into a fresh aligned host
                                buffer on a reader thread, ahead of use, and dropped after

The gatherer asks for a bucket's slice with `load(b)` (a Future, so a read can run while
the previous unit computes) and the optimizer writes updated values with `write`, then
`flush`es once per step. Everything else (checkpoints) uses `read` and `write` in shard
coordinates.
"""

from __future__ import annotations

import bisect
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Protocol

import torch

from megazero.zero.partition import Bucket, Layout
from megazero.zero.swap import SwapFile, aligned_buffer, check_space, padded


class ShardHome(Protocol):
    def load(self, b: Bucket) -> Future:
        """This rank's slice of bucket b (a host or device tensor), when it is available."""

    def read(self, offset: int, numel: int) -> torch.Tensor:
        """Shard elements [offset, offset + numel) (a view where they are in memory)."""

    def write(self, offset: int, values: torch.Tensor) -> None:
        """Set shard elements [offset, offset + len(values)); they lie in one bucket."""

    def flush(self) -> None:
        """Make every write visible to `load`."""

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by where: the device type, "cpu", "nvme"."""


def _done(value: torch.Tensor) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class MemoryShard:
    """The shard as one flat tensor on `device` (the compute device, or the host)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool = False) -> None:
        self.flat = torch.zeros(numel, dtype=dtype, device=device,
                                pin_memory=pin and device.type == "cpu" and torch.cuda.is_available())

    def load(self, b: Bucket) -> Future:
        return _done(self.flat[b.shard_offset: b.shard_offset + b.shard_numel])

    def read(self, offset: int, numel: int) -> torch.Tensor:
        return self.flat[offset: offset + numel]

    def write(self, offset: int, values: torch.Tensor) -> None:
        self.flat[offset: offset + values.numel()].copy_(values)

    def flush(self) -> None:
        """Writes are immediate in memory."""

    def nbytes(self) -> dict[str, int]:
        return {self.flat.device.type: self.flat.numel() * self.flat.element_size()}


class NvmeShard:
    """The shard in one swap file under `path`, a block-aligned region per bucket. Writes
    go through one staging buffer holding a whole bucket region (the optimizer updates a
    bucket's ranges one after another), so each bucket costs one read and one write per step."""

    def __init__(self, layout: Layout, dtype: torch.dtype, path: str, pin: bool) -> None:
        self.layout, self.dtype, self.pin = layout, dtype, pin
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.in_shard_order = sorted(layout.buckets, key=lambda b: b.shard_offset)
        self.starts = [b.shard_offset for b in self.in_shard_order]
        self.where, end = [], 0
        for b in layout.buckets:
            self.where.append(end)
            end += padded(b.shard_numel * self.itemsize)
        self.file_bytes = end
        check_space(path, end, "parameter")
        self.file = SwapFile(path, "params", end)
        self.reader = ThreadPoolExecutor(1)  # reads release the GIL: they overlap compute
        self.staged: Optional[int] = None
        self.stage_buffer: Optional[torch.Tensor] = None

    def _region(self, b: int, write: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Bucket b's region read into a fresh aligned buffer, or `write` written to it."""
        nbytes = padded(self.layout.buckets[b].shard_numel * self.itemsize)
        if write is not None:
            self.file.io(write.view(torch.uint8)[:nbytes], self.where[b], write=True)
            return write
        buffer = aligned_buffer(nbytes, self.pin)
        self.file.io(buffer, self.where[b], write=False)
        return buffer.view(self.dtype)

    def load(self, b: Bucket) -> Future:
        self.flush()
        return self.reader.submit(lambda: self._region(b.index)[: b.shard_numel])

    def _stage(self, offset: int) -> tuple[torch.Tensor, int]:
        """The staging buffer holding the bucket that contains shard element `offset`, and
        that bucket's first shard element."""
        bucket = self.in_shard_order[bisect.bisect_right(self.starts, offset) - 1]
        if self.staged != bucket.index:
            self.flush()
            self.stage_buffer, self.staged = self._region(bucket.index), bucket.index
        return self.stage_buffer, bucket.shard_offset

    def read(self, offset: int, numel: int) -> torch.Tensor:
        out, at = [], offset
        while at < offset + numel:  # bucket by bucket
            buffer, base = self._stage(at)
            b = self.staged
            end = min(offset + numel, base + self.layout.buckets[b].shard_numel)
            out.append(buffer[at - base: end - base].clone())
            at = end
        return out[0] if len(out) == 1 else torch.cat(out) if out else torch.empty(0, dtype=self.dtype)

    def write(self, offset: int, values: torch.Tensor) -> None:
        buffer, base = self._stage(offset)
        buffer[offset - base: offset - base + values.numel()].copy_(values)

    def flush(self) -> None:
        if self.staged is not None:
            self._region(self.staged, write=self.stage_buffer)
            self.staged = self.stage_buffer = None

    def nbytes(self) -> dict[str, int]:
        return {"nvme": self.file_bytes}
