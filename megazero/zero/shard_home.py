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
import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Protocol

import torch

from megazero.zero.partition import Bucket, FlatLayout
from megazero.zero.state import flat_zeros
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

    def resident_on(self, device: torch.device) -> bool:
        """Whether `load` gives views of memory the shard keeps on `device` for the whole run
        (not a fresh read or copy), which parameters may view in place of a gathered copy."""


class MemoryShard:
    """The shard as one flat tensor on `device` (the compute device, or the host)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool = False) -> None:
        self.flat = flat_zeros(numel, device, pin, dtype)

    def load(self, b: Bucket) -> Future:
        done: Future = Future()
        done.set_result(self.flat[b.shard_offset: b.shard_offset + b.shard_numel])
        return done

    def read(self, offset: int, numel: int) -> torch.Tensor:
        return self.flat[offset: offset + numel]

    def write(self, offset: int, values: torch.Tensor) -> None:
        self.flat[offset: offset + values.numel()].copy_(values)

    def flush(self) -> None:
        """Writes are immediate in memory."""

    def nbytes(self) -> dict[str, int]:
        return {self.flat.device.type: self.flat.nbytes}

    def resident_on(self, device: torch.device) -> bool:
        return self.flat.device == device


class NvmeShard:
    """The shard in one swap file under `path`, a block-aligned region per bucket.

    The optimizer updates a bucket's ranges one after another, in shard order, through a
    staging buffer holding the bucket's whole region: when it moves on, the buffer is
    written back on a writer thread while the next bucket's region, already read ahead on
    the reader thread, is updated. A bucket therefore costs one read and one write per step,
    overlapped with the update of its neighbours; host memory holds at most the staged
    bucket, the one read ahead and the one being written. A read of a region waits for
    that region's write, so `load` always sees the latest values."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, path: str, pin: bool) -> None:
        self.layout, self.dtype, self.pin = layout, dtype, pin
        self.in_shard_order = sorted(layout.buckets, key=lambda b: b.shard_offset)
        self.starts = [b.shard_offset for b in self.in_shard_order]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.region_bytes = [padded(b.shard_numel * itemsize) for b in layout.buckets]
        self.where = [0, *itertools.accumulate(self.region_bytes)]  # the file's length last
        self.file_bytes = self.where[-1]
        check_space(path, self.file_bytes, "parameter")
        self.file = SwapFile(path, "params", self.file_bytes)
        self.reader = ThreadPoolExecutor(1)  # file I/O releases the GIL: it overlaps compute
        self.writer = ThreadPoolExecutor(1)
        self.writing: dict[int, Future] = {}  # bucket -> its region's write in flight
        self.ahead: Optional[tuple[int, Future]] = None  # the next staging region, being read
        self.staged: Optional[int] = None
        self.stage_buffer: Optional[torch.Tensor] = None

    def _read_region(self, b: int) -> torch.Tensor:
        """Bucket b's region in a fresh aligned buffer (after its pending write, if any)."""
        pending = self.writing.get(b)
        if pending is not None:
            pending.result()
        buffer = aligned_buffer(self.region_bytes[b], self.pin)
        self.file.io(buffer, self.where[b], write=False)
        return buffer.view(self.dtype)

    def _write_region(self, b: int, buffer: torch.Tensor) -> None:
        """Write bucket b's staged region on the writer thread, once the previous write is done."""
        for previous in list(self.writing):
            # Wait before forgetting it: a read on the reader thread that finds no pending
            # write for a bucket must be able to trust the file.
            self.writing[previous].result()
            del self.writing[previous]
        self.writing[b] = self.writer.submit(self.file.io, buffer.view(torch.uint8)[: self.region_bytes[b]],
                                             self.where[b], True)

    def load(self, b: Bucket) -> Future:
        self.flush()
        return self.reader.submit(lambda: self._read_region(b.index)[: b.shard_numel])

    def _stage(self, offset: int) -> tuple[torch.Tensor, int, int]:
        """The staging buffer holding the bucket that contains shard element `offset`, and
        that bucket's [first, last + 1) shard elements; the bucket after it is read ahead."""
        at = bisect.bisect_right(self.starts, offset) - 1
        bucket = self.in_shard_order[at]
        if self.staged != bucket.index:
            self.flush()
            ahead, self.ahead = self.ahead, None
            if ahead is not None and ahead[0] == bucket.index:
                self.stage_buffer = ahead[1].result()
            else:
                if ahead is not None:
                    ahead[1].result()  # a stale read-ahead: let it finish, drop it
                self.stage_buffer = self._read_region(bucket.index)
            self.staged = bucket.index
            nxt = self.in_shard_order[at + 1] if at + 1 < len(self.in_shard_order) else None
            if nxt is not None and nxt.trainable == bucket.trainable:  # a step stops at the frozen buckets
                self.ahead = (nxt.index, self.reader.submit(self._read_region, nxt.index))
        assert self.stage_buffer is not None
        return self.stage_buffer, bucket.shard_offset, bucket.shard_offset + bucket.shard_numel

    def read(self, offset: int, numel: int) -> torch.Tensor:
        out, at = [], offset
        while at < offset + numel:  # bucket by bucket
            buffer, base, bucket_end = self._stage(at)
            end = min(offset + numel, bucket_end)
            out.append(buffer[at - base: end - base].clone())
            at = end
        return out[0] if len(out) == 1 else torch.cat(out) if out else torch.empty(0, dtype=self.dtype)

    def write(self, offset: int, values: torch.Tensor) -> None:
        buffer, base, _ = self._stage(offset)
        buffer[offset - base: offset - base + values.numel()].copy_(values)

    def flush(self) -> None:
        """Send the staged bucket to its writer; `load` and reads wait for it where needed."""
        if self.staged is not None:
            assert self.stage_buffer is not None  # staged together
            self._write_region(self.staged, self.stage_buffer)
            self.staged = self.stage_buffer = None

    def nbytes(self) -> dict[str, int]:
        return {"nvme": self.file_bytes}

    def resident_on(self, device: torch.device) -> bool:
        return False  # every load is a fresh read
