"""Where this rank's optimizer state lives, behind one small interface.

The optimizer steps its shard one sub-group (a list of `Range`s of at most
`zero.sub_group_size` elements) at a time, and the store hands out each sub-group's state:

    for group, state in store.iterate(groups):   # state: GroupState, fp32 tensors
        adamw_(state.master or the parameters, grads, state.exp_avg, state.exp_avg_sq, ...)

    MemoryOptimizerStore, device   zero.offload_optimizer none: views of flat tensors
    MemoryOptimizerStore, host     cpu (ZeRO-Offload): the same, in (pinned) host memory; the
                                   step runs on the CPU
    NvmeOptimizerStore             nvme (ZeRO-Infinity): swap files, a sub-group at a time through
                                   `buffer_count` host buffers: sub-group k+1 is read and k-1
                                   written back while k is updated

Offloading therefore changes where state lives, not the step. Besides `iterate`, a store
reads and writes whole kinds ("master", "exp_avg", "exp_avg_sq") for initialisation and
checkpoints.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megazero.zero.partition import Range
from megazero.zero.swap import SwapFile, aligned_buffer, check_space, padded, scratch_tensor

KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class GroupState:
    """One sub-group's optimizer state as fp32 tensors on `device`, one per range. `master`
    is None when the store keeps no separate master weights (fp32 training without
    offload: the parameters are the masters)."""

    master: Optional[list[torch.Tensor]]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    device: torch.device


def _views(flat: torch.Tensor, group: list[Range], base: int = 0) -> list[torch.Tensor]:
    return [flat[r.shard_offset - base: r.shard_offset - base + r.length] for r in group]


def host_tensor(numel: int, pin: bool) -> torch.Tensor:
    """fp32 zeros in host memory, page-locked when asked and a GPU exists (pinning needs CUDA)."""
    return torch.zeros(numel, pin_memory=pin and torch.cuda.is_available())


class MemoryOptimizerStore:
    """The shard's state as flat fp32 tensors on one device (the compute device, or the host
    for ZeRO-Offload)."""

    def __init__(self, numel: int, device: torch.device, separate_master: bool, pin: bool = False) -> None:
        self.device = device
        def alloc() -> torch.Tensor:
            return host_tensor(numel, pin) if device.type == "cpu" else torch.zeros(numel, device=device)
        self.flat = {k: alloc() for k in KINDS if k != "master" or separate_master}
        self.separate_master = separate_master
        self.reads_are_copies = False  # read() hands out views of the state itself

    def iterate(self, groups: list[list[Range]]) -> Iterator[tuple[list[Range], GroupState]]:
        for group in groups:
            yield group, GroupState(_views(self.flat["master"], group) if self.separate_master else None,
                             _views(self.flat["exp_avg"], group), _views(self.flat["exp_avg_sq"], group),
                             self.device)

    def write(self, kind: str, offset: int, values: torch.Tensor) -> None:
        """Set [offset, offset + len(values)) of one kind (initialisation, loading)."""
        if kind in self.flat:
            self.flat[kind][offset: offset + values.numel()].copy_(values)

    def read(self, kind: str) -> torch.Tensor:
        """The whole shard of one kind (checkpoints); a view, not a copy."""
        return self.flat[kind]

    def pieces(self, kind: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(shard offset, values) pieces of one kind: here, the whole shard at once."""
        yield 0, self.flat[kind]

    def flush(self) -> None:
        """Writes are immediate in memory."""

    def nbytes(self) -> dict[str, int]:
        return {self.device.type: sum(t.numel() * t.element_size() for t in self.flat.values())}


class NvmeOptimizerStore:
    """The shard's state in three swap files (master, exp_avg, exp_avg_sq; see swap.py)
    under `path`. Each sub-group owns a region of every file starting at a block boundary,
    so whole sub-groups move with large aligned reads and writes."""

    def __init__(self, numel: int, groups: list[list[Range]], path: str, buffer_count: int, pin: bool) -> None:
        self.numel, self.groups, self.path = numel, groups, path
        self.device = torch.device("cpu")
        self.separate_master = True
        self.reads_are_copies = True  # read() assembles a private copy
        # Sub-group g covers shard elements [lo, hi) and sits at file offset self.where[g].
        self.spans = [(g[0].shard_offset, g[-1].shard_offset + g[-1].length) for g in groups]
        self.where, end = [], 0
        for lo, hi in self.spans:
            self.where.append(end)
            end += padded((hi - lo) * 4)
        self.file_bytes = end
        check_space(path, 3 * end, "optimizer")
        self.files = {k: SwapFile(path, k, end) for k in KINDS}
        window = max((hi - lo for lo, hi in self.spans), default=0)
        self.buffers = [{k: aligned_buffer(window * 4, pin).view(torch.float32) for k in KINDS}
                        for _ in range(buffer_count)]
        self.reader, self.writer = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
        self.staged: Optional[int] = None  # the sub-group buffer 0 holds for write()/read()
        self.io_wait_s = 0.0  # seconds the step waited for I/O (what the overlap did not hide)

    def _total(self, counter: str) -> float:
        return sum(getattr(f, counter) for f in self.files.values())

    # I/O counters over the three files (bytes moved, seconds the I/O threads spent).
    bytes_read = property(lambda self: self._total("bytes_read"))
    bytes_written = property(lambda self: self._total("bytes_written"))
    read_s = property(lambda self: self._total("read_s"))
    write_s = property(lambda self: self._total("write_s"))

    def _io(self, g: int, buffer: dict[str, torch.Tensor], write: bool) -> None:
        nbytes = padded((self.spans[g][1] - self.spans[g][0]) * 4)
        for kind in KINDS:
            self.files[kind].io(buffer[kind].view(torch.uint8)[:nbytes], self.where[g], write)

    # ------------------------------------------------------------------ the step

    def iterate(self, groups: list[list[Range]]) -> Iterator[tuple[list[Range], GroupState]]:
        """Sub-group k's state in buffer k % buffer_count, read ahead one sub-group and
        written back behind, each on its own thread (file I/O releases the GIL). Consume
        it to the end (not through zip, which would drop the last write-back)."""
        assert groups is self.groups, "an NvmeOptimizerStore streams the sub-groups it was laid out for"
        self.flush()
        count = len(self.buffers)
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}

        def read_ahead(k: int) -> None:
            if k - count in writes:  # the buffer is free once its previous sub-group is written back
                self._wait(writes.pop(k - count))
            reads[k] = self.reader.submit(self._io, k, self.buffers[k % count], False)

        try:
            if groups:
                read_ahead(0)
            for k, group in enumerate(groups):
                if k + 1 < len(groups):
                    read_ahead(k + 1)
                self._wait(reads.pop(k))
                buf, base = self.buffers[k % count], self.spans[k][0]
                yield group, GroupState(*(_views(buf[kind], group, base) for kind in KINDS), self.device)
                writes[k] = self.writer.submit(self._io, k, buf, True)
        finally:
            for f in [*reads.values(), *writes.values()]:
                f.result()

    def _wait(self, future: Future) -> None:
        tic = time.perf_counter()
        future.result()
        self.io_wait_s += time.perf_counter() - tic

    # ------------------------------------------------------------------ whole kinds

    def _stage(self, g: int) -> dict[str, torch.Tensor]:
        """Buffer 0 holding sub-group g (written back first if it held another)."""
        if self.staged != g:
            self.flush()
            self._io(g, self.buffers[0], False)
            self.staged = g
        return self.buffers[0]

    def flush(self) -> None:
        if self.staged is not None:
            self._io(self.staged, self.buffers[0], True)
            self.staged = None

    def _overlaps(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(sub-group, start, end) of the parts of shard range [lo, hi) that a sub-group stores."""
        for g, (a, b) in enumerate(self.spans):
            start, end = max(lo, a), min(hi, b)
            if start < end:
                yield g, start, end

    def write(self, kind: str, offset: int, values: torch.Tensor) -> None:
        """Set [offset, offset + len(values)) of one kind. Elements no sub-group covers are
        padding, zero by construction, and not stored."""
        for g, start, end in self._overlaps(offset, offset + values.numel()):
            base = self.spans[g][0]
            self._stage(g)[kind][start - base: end - base].copy_(values[start - offset: end - offset])

    def pieces(self, kind: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(shard offset, values) of each sub-group's part of one kind, one at a time (each
        valid until the next is asked for)."""
        for g, (lo, hi) in enumerate(self.spans):
            yield lo, self._stage(g)[kind][: hi - lo]

    def read(self, kind: str) -> torch.Tensor:
        """The whole shard of one kind (checkpoints; padding is zero) as a private host
        tensor backed by a scratch file under nvme_path (see swap.scratch_tensor)."""
        out = scratch_tensor(self.path, self.numel)
        for lo, values in self.pieces(kind):
            out[lo: lo + values.numel()].copy_(values)
        return out

    def nbytes(self) -> dict[str, int]:
        return {"cpu": sum(t.numel() * 4 for b in self.buffers for t in b.values()), "nvme": 3 * self.file_bytes}
