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
checkpoints. Muon's ranges (optim.name muon) have no second moment: `exp_avg_sq` is stored
without them (`Holes`), so a Muon element costs 4 bytes of moments instead of Adam's 8; reads
and writes of the whole kind still use the shard's coordinates, the holes reading as zeros.
"""

from __future__ import annotations

import bisect
import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from megazero.zero.partition import Range
from megazero.zero.swap import SwapFile, aligned_buffer, check_space, padded, scratch_tensor

KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class GroupState:
    """One sub-group's optimizer state as fp32 tensors, one per range. `master` is None when
    the store keeps no separate master weights (fp32 training without offload: the
    parameters are the masters)."""

    master: Optional[list[torch.Tensor]]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]


class Holes:
    """Runs of the shard a kind does not store (exp_avg_sq of Muon's ranges, and of every range
    under SGD): its elements are kept end to end without them, each moved down by the holes'
    lengths before it."""

    def __init__(self, spans: Sequence[tuple[int, int]] = ()) -> None:
        """`spans`: (shard offset, length) of each hole, in shard order, not overlapping."""
        self.starts = [o for o, _ in spans]
        self.ends = [o + n for o, n in spans]
        self.before = [0, *itertools.accumulate(n for _, n in spans)]  # hole elements before hole i

    def at(self, offset: int) -> int:
        """Where shard offset `offset` is stored (inside a hole: where the hole's next stored
        element goes), i.e. `offset` less the hole elements before it."""
        i = bisect.bisect_right(self.starts, offset) - 1
        return offset if i < 0 else offset - self.before[i] - (min(offset, self.ends[i]) - self.starts[i])

    def contains(self, offset: int) -> bool:
        """Whether shard offset `offset` lies in a hole."""
        i = bisect.bisect_right(self.starts, offset) - 1
        return i >= 0 and offset < self.ends[i]

    def stored(self, numel: int) -> int:
        """Elements stored of a shard of `numel`."""
        return numel - self.before[-1]

    def kept(self, offset: int, length: int) -> list[tuple[int, int]]:
        """(shard offset, length) of the stored parts of [offset, offset + length)."""
        out, at, end = [], offset, offset + length
        for lo, hi in zip(self.starts, self.ends):
            if hi <= at or lo >= end:
                continue
            if lo > at:
                out.append((at, lo - at))
            at = max(at, hi)
        if at < end:
            out.append((at, end - at))
        return out

    def in_shard(self, stored: torch.Tensor, numel: int) -> list[torch.Tensor]:
        """The stored values in shard coordinates, as pieces laid end to end: views of `stored`
        and, for the holes, zeros (expanded, nothing allocated)."""
        if not self.starts:
            return [stored]
        zero = stored.new_zeros(1)
        out, at = [], 0
        for lo, hi in zip([*self.starts, numel], [*self.ends, numel]):
            if lo > at:
                out.append(stored[self.at(at): self.at(at) + lo - at])
            if hi > lo:
                out.append(zero.expand(hi - lo))
            at = hi
        return out


NO_HOLES = Holes()


def _views(flat: torch.Tensor, group: list[Range], base: int = 0, holes: Holes = NO_HOLES) -> list[torch.Tensor]:
    """Each range's state, `base` being where `flat` starts (in the kind's stored coordinates);
    an empty view for a range in a hole."""
    return [flat[:0] if holes.contains(r.shard_offset) else flat[holes.at(r.shard_offset) - base:
                                                                 holes.at(r.shard_offset) - base + r.length]
            for r in group]


def kind_holes(holes: Holes) -> dict[str, Holes]:
    """Each kind's holes: only the second moment has them (Muon's elements, SGD's all)."""
    return {k: holes if k == "exp_avg_sq" else NO_HOLES for k in KINDS}


def flat_zeros(numel: int, device: torch.device, pin: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros on `device`; in host memory page-locked when asked and a GPU exists (pinning needs CUDA)."""
    pin = pin and device.type == "cpu" and torch.cuda.is_available()
    return torch.zeros(numel, dtype=dtype, device=device, pin_memory=pin)


class MemoryOptimizerStore:
    """The shard's state as flat fp32 tensors on one device (the compute device, or the host
    for ZeRO-Offload)."""

    def __init__(self, numel: int, device: torch.device, separate_master: bool, pin: bool = False,
                 holes: Holes = NO_HOLES) -> None:
        self.device, self.numel, self.holes = device, numel, kind_holes(holes)
        self.flat = {k: flat_zeros(self.holes[k].stored(numel), device, pin) for k in KINDS
                     if k != "master" or separate_master}
        self.separate_master = separate_master
        self.reads_are_copies = False  # read() hands out views of the state itself

    def iterate(self, groups: list[list[Range]]) -> Iterator[tuple[list[Range], GroupState]]:
        for group in groups:
            yield group, GroupState(_views(self.flat["master"], group) if self.separate_master else None,
                             _views(self.flat["exp_avg"], group),
                             _views(self.flat["exp_avg_sq"], group, holes=self.holes["exp_avg_sq"]))

    def write(self, kind: str, offset: int, values: torch.Tensor) -> None:
        """Set [offset, offset + len(values)) of one kind (initialisation, loading; shard
        coordinates: what falls in a hole is dropped)."""
        if kind in self.flat:
            holes = self.holes[kind]
            for lo, n in holes.kept(offset, values.numel()):
                self.flat[kind][holes.at(lo): holes.at(lo) + n].copy_(values[lo - offset: lo - offset + n])

    def read(self, kind: str) -> torch.Tensor:
        """The whole shard of one kind as stored (holes left out); a view, not a copy."""
        return self.flat[kind]

    def read_pieces(self, kind: str) -> list[torch.Tensor]:
        """The whole shard of one kind in shard coordinates (checkpoints), as pieces laid end to
        end: views of the state, and zeros for its holes."""
        return self.holes[kind].in_shard(self.flat[kind], self.numel)

    def pieces(self, kind: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(shard offset, values) pieces of one kind: here, the whole shard at once."""
        yield 0, self.flat[kind]

    def view(self, kind: str, offset: int, length: int) -> torch.Tensor:
        """[offset, offset + length) of one kind in shard coordinates (a range the optimizer steps
        whole, e.g. one parameter's piece): a view of the state, empty where the kind has a hole."""
        holes = self.holes[kind]
        if kind not in self.flat or holes.contains(offset):
            return torch.empty(0, device=self.device)
        return self.flat[kind][holes.at(offset): holes.at(offset) + length]

    def flush(self) -> None:
        """Writes are immediate in memory."""

    def nbytes(self) -> dict[str, int]:
        return {self.device.type: sum(t.nbytes for t in self.flat.values())}


class NvmeOptimizerStore:
    """The shard's state in three swap files (master, exp_avg, exp_avg_sq; see swap.py)
    under `path`. Each sub-group owns a region of every file starting at a block boundary,
    so whole sub-groups move with large aligned reads and writes."""

    def __init__(self, numel: int, groups: list[list[Range]], path: str, buffer_count: int, pin: bool,
                 holes: Holes = NO_HOLES) -> None:
        self.numel, self.groups, self.path, self.holes = numel, groups, path, kind_holes(holes)
        self.separate_master = True
        self.reads_are_copies = True  # read() assembles a private copy
        # Sub-group g covers stored elements [lo, hi) of each kind and sits at file offset where[kind][g].
        shard = [(g[0].shard_offset, g[-1].shard_offset + g[-1].length) for g in groups]
        self.spans = {k: [(h.at(lo), h.at(hi)) for lo, hi in shard] for k, h in self.holes.items()}
        sizes = {k: [padded((hi - lo) * 4) for lo, hi in spans] for k, spans in self.spans.items()}
        self.where = {k: [0, *itertools.accumulate(n)] for k, n in sizes.items()}  # the file's length last
        self.file_bytes = {k: where[-1] for k, where in self.where.items()}
        check_space(path, sum(self.file_bytes.values()), "optimizer")
        self.files = {k: SwapFile(path, k, self.file_bytes[k]) for k in KINDS}
        windows = {k: max((hi - lo for lo, hi in spans), default=0) for k, spans in self.spans.items()}
        self.buffers = [{k: aligned_buffer(windows[k] * 4, pin).view(torch.float32) for k in KINDS}
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
        for kind in KINDS:
            lo, hi = self.spans[kind][g]
            if hi > lo:
                self.files[kind].io(buffer[kind].view(torch.uint8)[:padded((hi - lo) * 4)], self.where[kind][g], write)

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
                buf = self.buffers[k % count]
                yield group, GroupState(*(_views(buf[kind], group, self.spans[kind][k][0], self.holes[kind])
                                          for kind in KINDS))  # type: ignore[arg-type]  # one list per kind
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

    def write(self, kind: str, offset: int, values: torch.Tensor) -> None:
        """Set [offset, offset + len(values)) of one kind (shard coordinates: what falls in a
        hole is dropped). Elements no sub-group covers are padding, zero by construction, and
        not stored."""
        holes = self.holes[kind]
        for piece, n in holes.kept(offset, values.numel()):
            at = holes.at(piece)
            for g, (lo, hi) in enumerate(self.spans[kind]):  # the sub-groups storing part of [at, at + n)
                start, end, src = max(at, lo), min(at + n, hi), piece - offset - at
                if start < end:
                    self._stage(g)[kind][start - lo: end - lo].copy_(values[src + start: src + end])

    def pieces(self, kind: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(stored offset, values) of each sub-group's part of one kind, one at a time (each
        valid until the next is asked for)."""
        for g, (lo, hi) in enumerate(self.spans[kind]):
            yield lo, self._stage(g)[kind][: hi - lo]

    def view(self, kind: str, offset: int, length: int) -> torch.Tensor:
        """[offset, offset + length) of one kind in shard coordinates (a range the optimizer steps
        whole), as a private copy read from the sub-groups storing it (empty where the kind has a
        hole); consecutive ranges of one sub-group read it once."""
        holes = self.holes[kind]
        if holes.contains(offset):
            return torch.empty(0)
        at, out = holes.at(offset), []
        for g, (lo, hi) in enumerate(self.spans[kind]):
            start, end = max(at, lo), min(at + length, hi)
            if start < end:
                out.append(self._stage(g)[kind][start - lo: end - lo].clone())
        return torch.cat(out) if out else torch.empty(0)

    def read(self, kind: str) -> torch.Tensor:
        """The whole shard of one kind as stored (checkpoints; padding is zero) as a private
        host tensor backed by a scratch file under nvme_path (see swap.scratch_tensor)."""
        out = scratch_tensor(self.path, self.holes[kind].stored(self.numel))
        for lo, values in self.pieces(kind):
            out[lo: lo + values.numel()].copy_(values)
        return out

    def read_pieces(self, kind: str) -> list[torch.Tensor]:
        """The whole shard of one kind in shard coordinates: read()'s copy, with zeros for its holes."""
        return self.holes[kind].in_shard(self.read(kind), self.numel)

    def nbytes(self) -> dict[str, int]:
        return {"cpu": sum(t.numel() * 4 for b in self.buffers for t in b.values()), "nvme": sum(self.file_bytes.values())}
