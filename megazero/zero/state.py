"""Where this rank's optimizer state lives, behind one small interface.

The optimizer steps its shard one sub-group (a list of `Range`s of at most
`zero.sub_group_size` elements) at a time, and the store hands out each sub-group's state:

    for group, state in store.iterate(groups):   # state: GroupState, fp32 tensors
        adamw_(state.master or the parameters, grads, state.exp_avg, state.exp_avg_sq, ...)

    MemoryStore on the device   zero.offload_optimizer none: views of flat tensors
    MemoryStore on the host     cpu (ZeRO-Offload): the same, in (pinned) host memory; the
                                step runs on the CPU
    NvmeStore                   nvme (ZeRO-Infinity): swap files, a sub-group at a time through
                                `buffer_count` host buffers: sub-group k+1 is read and k-1
                                written back while k is updated

Offloading therefore changes where state lives, not the step. Besides `iterate`, a store
reads and writes whole kinds ("master", "exp_avg", "exp_avg_sq") for initialisation and
checkpoints.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megazero.errors import UserError
from megazero.zero.partition import Range

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


class MemoryStore:
    """The shard's state as flat fp32 tensors on one device (the compute device, or the host
    for ZeRO-Offload)."""

    def __init__(self, numel: int, device: torch.device, separate_master: bool, pin: bool = False) -> None:
        self.device = device
        def alloc() -> torch.Tensor:
            return host_tensor(numel, pin) if device.type == "cpu" else torch.zeros(numel, device=device)
        self.flat = {k: alloc() for k in KINDS if k != "master" or separate_master}
        self.separate_master = separate_master

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

    def flush(self) -> None:
        """Writes are immediate in memory."""

    def nbytes(self) -> dict[str, int]:
        return {self.device.type: sum(t.numel() * t.element_size() for t in self.flat.values())}


class NvmeStore:
    """The shard's state in three swap files (master, exp_avg, exp_avg_sq) under `path`.

    Each sub-group owns a region of every file starting at a 4 KiB boundary, so whole
    sub-groups move with large aligned reads and writes (O_DIRECT where the filesystem
    takes it: the page cache would hold a second copy of what is being streamed). The files
    are unlinked right after they are created and space is reserved with fallocate: they
    vanish with the process however it ends, and a full disk shows at start-up, not mid-run.
    """

    BLOCK = 4096  # bytes: O_DIRECT's alignment of offsets, lengths and buffer addresses
    CHUNK = 1 << 28  # bytes per system call (Linux moves at most ~2 GiB in one)

    def __init__(self, numel: int, groups: list[list[Range]], path: str, buffer_count: int, pin: bool) -> None:
        self.numel, self.groups = numel, groups
        self.device = torch.device("cpu")
        self.separate_master = True
        # Sub-group g covers shard elements [lo, hi) and sits at file offset self.where[g].
        self.spans = [(g[0].shard_offset, g[-1].shard_offset + g[-1].length) for g in groups]
        self.where, end = [], 0
        for lo, hi in self.spans:
            self.where.append(end)
            end += self._padded((hi - lo) * 4)
        self.file_bytes = end
        self._check_space(path, 3 * end)
        self.fds = {k: self._open_swap(path, k) for k in KINDS}
        window = max((hi - lo for lo, hi in self.spans), default=0)
        self.buffers = [{k: self._aligned(window, pin) for k in KINDS} for _ in range(buffer_count)]
        self.reader, self.writer = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
        self.staged: Optional[int] = None  # the sub-group buffer 0 holds for write()/read()
        self.bytes_read = self.bytes_written = 0
        self.read_s = self.write_s = 0.0  # seconds the I/O threads spent reading / writing
        self.io_wait_s = 0.0  # seconds the step waited for I/O (what the overlap did not hide)

    # ------------------------------------------------------------------ files

    def _padded(self, nbytes: int) -> int:
        return -(-nbytes // self.BLOCK) * self.BLOCK

    def _check_space(self, path: str, need: int) -> None:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        free = shutil.disk_usage(path).free
        if free < need * ranks_here:
            raise UserError(f"zero.nvme_path {path} has {free / 2**30:.1f} GiB free but the optimizer swap files "
                            f"need {need * ranks_here / 2**30:.1f} GiB ({need / 2**30:.2f} GiB x {ranks_here} ranks "
                            f"on this node); free space, point --zero.nvme_path at a larger disk, or use more ranks")

    def _open_swap(self, path: str, kind: str) -> int:
        name = os.path.join(path, f".megazero-swap-{os.getpid()}-{kind}")
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(name, flags | getattr(os, "O_DIRECT", 0))
        except OSError:  # tmpfs and some others refuse O_DIRECT
            fd = os.open(name, flags)
        os.unlink(name)
        try:
            os.posix_fallocate(fd, 0, max(self.file_bytes, self.BLOCK))
        except OSError as e:
            os.close(fd)
            raise UserError(f"zero.nvme_path {path}: cannot reserve {self.file_bytes / 2**30:.2f} GiB for the "
                            f"optimizer swap file ({e.strerror}); free space or choose another directory") from e
        return fd

    def _aligned(self, numel: int, pin: bool) -> torch.Tensor:
        """A host buffer of `numel` fp32 whose address and padded size are BLOCK-aligned."""
        nbytes = self._padded(numel * 4)
        raw = torch.empty(nbytes + self.BLOCK, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
        start = -raw.data_ptr() % self.BLOCK
        return raw[start: start + nbytes].view(torch.float32)

    def _io(self, g: int, buffer: dict[str, torch.Tensor], write: bool) -> None:
        tic = time.perf_counter()
        nbytes = self._padded((self.spans[g][1] - self.spans[g][0]) * 4)
        for kind in KINDS:
            view = memoryview(buffer[kind].numpy()).cast("B")[:nbytes]
            for off in range(0, nbytes, self.CHUNK):
                piece, at = view[off: off + self.CHUNK], self.where[g] + off
                done = os.pwritev(self.fds[kind], [piece], at) if write else os.preadv(self.fds[kind], [piece], at)
                if done != len(piece):
                    raise OSError(f"short {'write' if write else 'read'} on the optimizer swap file "
                                  f"({done} of {len(piece)} bytes)")
        if write:
            self.bytes_written += 3 * nbytes
            self.write_s += time.perf_counter() - tic
        else:
            self.bytes_read += 3 * nbytes
            self.read_s += time.perf_counter() - tic

    # ------------------------------------------------------------------ the step

    def iterate(self, groups: list[list[Range]]) -> Iterator[tuple[list[Range], GroupState]]:
        """Sub-group k's state in buffer k % buffer_count, read ahead one sub-group and
        written back behind, each on its own thread (file I/O releases the GIL). Consume
        it to the end (not through zip, which would drop the last write-back)."""
        assert groups is self.groups, "an NvmeStore streams the sub-groups it was laid out for"
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

    def read(self, kind: str) -> torch.Tensor:
        """The whole shard of one kind in host memory (checkpoints; padding is zero)."""
        out = torch.zeros(self.numel)
        for g, (lo, hi) in enumerate(self.spans):
            out[lo:hi].copy_(self._stage(g)[kind][: hi - lo])
        return out

    def nbytes(self) -> dict[str, int]:
        return {"cpu": sum(t.numel() * 4 for b in self.buffers for t in b.values()), "nvme": 3 * self.file_bytes}
