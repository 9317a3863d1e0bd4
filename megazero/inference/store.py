"""Where the offloaded transformer blocks live while they are not computing.

Every block of GPT-2 has the same parameters, so each is kept as one flat tensor of
`numel` elements laid out by a `BlockLayout`; a store hands block i out whole:

    HostWeightStore   --offload cpu: one (pinned, where CUDA exists) host tensor per block;
                      `fetch` returns it as is, nothing is copied on the host
    NvmeWeightStore   --offload nvme: one file under --nvme-path, block i in its own 4 KiB-aligned
                      region; `fetch` reads it into a caller's reused, aligned buffer with large
                      O_DIRECT reads (the page cache would keep a second copy of every block
                      streamed; no mmap either, whose resident pages count in the RSS)

Both are filled from a checkpoint one tensor at a time (`put`), never the whole model at once.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import NamedTuple, Optional

import torch

from megazero.errors import UserError

BLOCK = 4096  # bytes: O_DIRECT's alignment of file offsets, lengths and buffer addresses
CHUNK = 1 << 28  # bytes per system call (Linux moves at most ~2 GiB in one)
ALIGN = 16  # elements: each parameter starts on a 64-byte boundary of its block's tensor


class WeightSlot(NamedTuple):
    """One parameter's place in a block's flat tensor."""

    name: str
    """Its name inside the block (attn.c_attn.weight, ...)."""
    shape: tuple[int, ...]
    offset: int


class BlockLayout:
    """The layout shared by every block: each parameter's offset in one flat tensor."""

    def __init__(self, block: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.slots: dict[str, WeightSlot] = {}
        end = 0
        for name, p in block.named_parameters():
            self.slots[name] = WeightSlot(name, tuple(p.shape), end)
            end += -(-p.numel() // ALIGN) * ALIGN
        self.numel = end
        self.nbytes = end * self.itemsize

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The block's parameters as views of `flat`, in named_parameters order."""
        return [flat[s.offset: s.offset + math.prod(s.shape)].view(s.shape) for s in self.slots.values()]


def aligned_host(nbytes: int, pin: bool) -> torch.Tensor:
    """Uninitialised host bytes whose address is BLOCK-aligned; page-locked when `pin` and
    CUDA exists (pinning needs a driver; copies from pinned memory can run asynchronously)."""
    raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    start = -raw.data_ptr() % BLOCK
    return raw[start: start + nbytes]


class HostWeightStore:
    """Every block in host memory (ZeRO-Inference's CPU offload)."""

    def __init__(self, layout: BlockLayout, num_blocks: int):
        self.layout = layout
        self.blocks = [aligned_host(layout.nbytes, True).view(layout.dtype).zero_() for _ in range(num_blocks)]

    def put(self, block: int, offset: int, values: torch.Tensor) -> None:
        self.blocks[block][offset: offset + values.numel()].copy_(values.reshape(-1))

    def finish(self) -> None:
        """Nothing to flush: writes to host memory are immediate."""

    def fetch(self, block: int, buffer: Optional[torch.Tensor]) -> torch.Tensor:
        """Block `block`'s flat tensor (its own storage: `buffer` is not needed)."""
        return self.blocks[block]

    def close(self) -> None:
        self.blocks.clear()

    def nbytes(self) -> dict[str, int]:
        return {"host": len(self.blocks) * self.layout.nbytes}


class NvmeWeightStore:
    """Every block in one file under `path` (ZeRO-Inference's NVMe offload). The file is
    unlinked as soon as it is opened: it vanishes with the process however that ends, and
    its space is reserved up front, so a full disk shows at start-up, not mid-generation."""

    def __init__(self, layout: BlockLayout, num_blocks: int, path: str):
        self.layout = layout
        self.stride = -(-layout.nbytes // BLOCK) * BLOCK  # bytes from one block's region to the next
        check_nvme_path(path, num_blocks * self.stride)
        name = os.path.join(path, f".megazero-inference-{os.getpid()}")
        # Filling goes through the page cache (writes at any offset, any length); streaming
        # reads through a second descriptor with O_DIRECT where the filesystem takes it.
        self.fill_fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self.read_fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:  # tmpfs and some others refuse O_DIRECT
            self.read_fd = os.open(name, os.O_RDONLY)
        os.unlink(name)
        try:
            os.posix_fallocate(self.fill_fd, 0, max(num_blocks * self.stride, BLOCK))
        except OSError as e:
            self.close()
            raise UserError(f"--nvme-path {path}: cannot reserve {_size(num_blocks * self.stride)} for "
                            f"the offloaded weights ({e.strerror}); free space or choose another directory") from e
        self.num_blocks = num_blocks
        self.bytes_read = 0

    def put(self, block: int, offset: int, values: torch.Tensor) -> None:
        data = values.detach().to(self.layout.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        at = block * self.stride + offset * self.layout.itemsize
        view = memoryview(data)
        for start in range(0, len(view), CHUNK):
            piece = view[start: start + CHUNK]
            if os.pwrite(self.fill_fd, piece, at + start) != len(piece):
                raise OSError("short write to the offloaded weights file")

    def finish(self) -> None:
        """Make the filled blocks durable on the disk and drop them from the page cache, so
        each step really reads them back (and the cache does not hold the model twice)."""
        os.fsync(self.fill_fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fill_fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(self.fill_fd)
        self.fill_fd = -1

    def close(self) -> None:
        """Close the file: its space is freed (it has no name left)."""
        for fd in (self.fill_fd, self.read_fd):
            if fd >= 0:
                os.close(fd)
        self.fill_fd = self.read_fd = -1

    def buffer(self, pin: bool) -> torch.Tensor:
        """A reusable, aligned host buffer that `fetch` can read one block into."""
        return aligned_host(self.stride, pin)

    def fetch(self, block: int, buffer: Optional[torch.Tensor]) -> torch.Tensor:
        """Read block `block` into `buffer` (from `buffer()`); its first `layout.numel`
        elements are the block's flat tensor."""
        assert buffer is not None and buffer.numel() == self.stride
        view = memoryview(buffer.numpy())
        for start in range(0, self.stride, CHUNK):
            piece = view[start: start + CHUNK]
            done = os.preadv(self.read_fd, [piece], block * self.stride + start)
            if done != len(piece):
                raise OSError(f"short read from the offloaded weights file ({done} of {len(piece)} bytes)")
        self.bytes_read += self.stride
        return buffer[: self.layout.nbytes].view(self.layout.dtype)

    def nbytes(self) -> dict[str, int]:
        return {"nvme": self.num_blocks * self.stride}


def check_nvme_path(path: str, need: int) -> None:
    """One clear line for a directory that cannot hold the offloaded weights."""
    if not os.path.isdir(path):
        raise UserError(f"--nvme-path {path} is not an existing directory; create it or point --nvme-path at one")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"--nvme-path {path} is not writable by this user; choose another directory")
    free = shutil.disk_usage(path).free
    if free < need:
        raise UserError(f"--nvme-path {path} has {_size(free)} free but the offloaded weights need {_size(need)}; "
                        f"free space or point --nvme-path at a larger disk")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
