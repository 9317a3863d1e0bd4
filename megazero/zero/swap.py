"""Swap files on a local disk (ZeRO-Infinity's NVMe tier): what the optimizer-state store, the
stage-3 parameter store and offloaded inference's weight store share.

A swap file is unlinked right after it is created and its space is reserved with
fallocate: it vanishes with the process however that ends, and a full disk shows at
start-up, not mid-run. Data moves in large reads and writes at BLOCK-aligned offsets,
lengths and buffer addresses, which O_DIRECT needs (taken where the filesystem allows
it: the page cache would otherwise hold a second copy of everything streamed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable, Optional

import torch

from megazero.errors import UserError

BLOCK = 4096  # bytes: O_DIRECT's alignment of offsets, lengths and buffer addresses
CHUNK = 1 << 28  # bytes per system call (Linux moves at most ~2 GiB in one)


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of blocks."""
    return -(-nbytes // BLOCK) * BLOCK


def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialised host byte buffer of padded(nbytes) whose address is BLOCK-aligned,
    page-locked when asked and a GPU exists (pinning needs CUDA)."""
    size = padded(nbytes)
    raw = torch.empty(size + BLOCK, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    start = -raw.data_ptr() % BLOCK
    return raw[start: start + size]


def check_space(path: str, need: int, what: str, refusal: Optional[Callable[[int], str]] = None) -> None:
    """Refuse to start when the disk under `path` cannot hold `need` bytes for every rank of
    this node (they all swap to the same directory); `refusal(free)` words the error for a
    caller whose directory is not zero.nvme_path."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    probe = os.path.abspath(path)
    while not os.path.exists(probe):  # a zero.nvme_path the run will create (checked by --validate-only)
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if free < need * ranks_here:
        raise UserError(refusal(free) if refusal else
                        f"zero.nvme_path {path} has {free / 2**30:.1f} GiB free but the {what} swap files "
                        f"need {need * ranks_here / 2**30:.1f} GiB ({need / 2**30:.2f} GiB x {ranks_here} ranks "
                        f"on this node); free space, point --zero.nvme_path at a larger disk, or use more ranks")


class SwapFile:
    """One unlinked, preallocated file of `nbytes` under `path` (the directory setting `key` names), with
    I/O counters. With `fillable`, a second descriptor through the page cache takes writes of any offset
    and length until `end_fill`: offloaded inference writes its weights one checkpoint tensor at a time."""

    def __init__(self, path: str, tag: str, nbytes: int, key: str = "zero.nvme_path", fillable: bool = False) -> None:
        name = os.path.join(path, f".megazero-swap-{os.getpid()}-{tag}")
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self.fill_fd = os.open(name, flags, 0o600) if fillable else -1
        try:
            self.fd = os.open(name, flags | getattr(os, "O_DIRECT", 0))
        except OSError:  # tmpfs and some others refuse O_DIRECT
            self.fd = os.open(name, flags)
        os.unlink(name)
        try:
            os.posix_fallocate(self.fd, 0, max(padded(nbytes), BLOCK))
        except OSError as e:
            self.close()
            raise UserError(f"{key} {path}: cannot reserve {nbytes / 2**30:.2f} GiB for the {tag} swap "
                            f"file ({e.strerror}); free space or choose another directory") from e
        self.bytes_read = self.bytes_written = 0
        self.read_s = self.write_s = 0.0  # seconds spent in reads / writes (on whichever thread)

    def end_fill(self) -> None:
        """Make the filled bytes durable on the disk and drop them from the page cache, so
        reads really come from the disk (and the cache does not hold them twice)."""
        os.fsync(self.fill_fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fill_fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close the file: its space is freed (it has no name left)."""
        for fd in {self.fill_fd, self.fd} - {-1}:
            os.close(fd)
        self.fill_fd = self.fd = -1

    def io(self, buffer: torch.Tensor, offset: int, write: bool, filling: bool = False) -> None:
        """Write `buffer` (an aligned host buffer, BLOCK-multiple in bytes; `filling`: any
        contiguous tensor, through the fill descriptor) at `offset`, or read it back from there."""
        tic = time.perf_counter()
        fd = self.fill_fd if filling else self.fd
        view = memoryview(buffer.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stubs omit the buffer protocol
        for off in range(0, len(view), CHUNK):
            piece, at = view[off: off + CHUNK], offset + off
            done = os.pwritev(fd, [piece], at) if write else os.preadv(fd, [piece], at)
            if done != len(piece):
                raise OSError(f"short {'write' if write else 'read'} on a swap file ({done} of {len(piece)} bytes)")
        if write:
            self.bytes_written += len(view)
            self.write_s += time.perf_counter() - tic
        else:
            self.bytes_read += len(view)
            self.read_s += time.perf_counter() - tic


def scratch_tensor(path: str, numel: int) -> torch.Tensor:
    """fp32 zeros backed by an unlinked, preallocated file under `path` (a shared mapping):
    a whole shard of swapped state can be assembled for a checkpoint as pages the kernel
    writes out and drops under memory pressure, where host memory could not hold it. The
    space is reserved first, so a full disk fails here and not as a fault mid-copy."""
    nbytes = numel * 4
    if numel == 0:
        return torch.zeros(0)
    fd, name = tempfile.mkstemp(dir=path, prefix=".megazero-scratch-")
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:  # an OSError: a checkpoint save turns it into an agreed, clean failure
            raise OSError(e.errno, f"zero.nvme_path {path}: cannot reserve {nbytes / 2**30:.2f} GiB to assemble a "
                          f"checkpoint of swapped state ({e.strerror}); free space there") from e
        return torch.from_file(name, shared=True, size=numel, dtype=torch.float32)
    finally:
        os.close(fd)
        os.unlink(name)
