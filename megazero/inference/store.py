"""Where the offloaded transformer blocks live while they are not computing.

Every block of GPT-2 has the same parameters, so each is kept as one flat tensor of
`numel` elements laid out by a `BlockLayout`; a store hands block i out whole:

    HostWeightStore   --offload cpu: one (pinned, where CUDA exists) host tensor per block;
                      `fetch` returns it as is, nothing is copied on the host
    NvmeWeightStore   --offload nvme: one swap file (zero/swap.py) under --nvme-path, block i in its
                      own 4 KiB-aligned region; `fetch` reads it into a caller's reused, aligned
                      buffer with large O_DIRECT reads (the page cache would keep a second copy
                      of every block streamed; no mmap either, whose resident pages count in RSS)

Both are filled from a checkpoint one tensor at a time (`put`), never the whole model at once.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch

from megazero.errors import UserError
from megazero.zero.swap import SwapFile, aligned_buffer, check_space, padded

ALIGN = 16  # elements: each parameter starts on a 64-byte boundary of its block's tensor


class WeightSlot(NamedTuple):
    """One parameter's place in a block's flat tensor."""

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
            self.slots[name] = WeightSlot(tuple(p.shape), end)
            end += -(-p.numel() // ALIGN) * ALIGN
        self.numel = end
        self.nbytes = end * self.itemsize

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The block's parameters as views of `flat`, in named_parameters order."""
        return [flat[s.offset: s.offset + math.prod(s.shape)].view(s.shape) for s in self.slots.values()]


class HostWeightStore:
    """Every block in host memory (ZeRO-Inference's CPU offload)."""

    def __init__(self, layout: BlockLayout, num_blocks: int):
        self.layout = layout
        self.blocks = [aligned_buffer(layout.nbytes, True)[: layout.nbytes].view(layout.dtype).zero_()
                       for _ in range(num_blocks)]

    def put(self, block: int, offset: int, values: torch.Tensor) -> None:
        self.blocks[block][offset: offset + values.numel()].copy_(values.reshape(-1))

    def finish(self) -> None:
        """Nothing to flush: writes to host memory are immediate."""

    def fetch(self, block: int, buffer: Optional[torch.Tensor]) -> torch.Tensor:
        """Block `block`'s flat tensor (its own storage: `buffer` is not needed)."""
        return self.blocks[block]

    def close(self) -> None:
        self.blocks.clear()


class NvmeWeightStore(SwapFile):
    """Every block in one swap file under `path` (ZeRO-Inference's NVMe offload): filled through
    the page cache, then streamed back with O_DIRECT reads."""

    def __init__(self, layout: BlockLayout, num_blocks: int, path: str):
        self.layout = layout
        self.stride = padded(layout.nbytes)  # bytes from one block's region to the next
        need = num_blocks * self.stride
        if not os.path.isdir(path):
            raise UserError(f"--nvme-path {path} is not an existing directory; create it or point --nvme-path at one")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"--nvme-path {path} is not writable by this user; choose another directory")
        check_space(path, need, "weights", lambda free: f"--nvme-path {path} has {_size(free)} free but the offloaded "
                    f"weights need {_size(need)}; free space or point --nvme-path at a larger disk")
        super().__init__(path, "weights", need, key="--nvme-path", fillable=True)

    def put(self, block: int, offset: int, values: torch.Tensor) -> None:
        at = block * self.stride + offset * self.layout.itemsize
        self.io(values.detach().to(self.layout.dtype).contiguous(), at, write=True, filling=True)

    finish = SwapFile.end_fill  # every block is written: durable on the disk, out of the page cache

    def buffer(self, pin: bool) -> torch.Tensor:
        """A reusable, aligned host buffer that `fetch` can read one block into."""
        return aligned_buffer(self.stride, pin)

    def fetch(self, block: int, buffer: Optional[torch.Tensor]) -> torch.Tensor:
        """Read block `block` into `buffer` (from `buffer()`); its first `layout.numel`
        elements are the block's flat tensor."""
        assert buffer is not None and buffer.numel() == self.stride
        self.io(buffer, block * self.stride, write=False)
        return buffer[: self.layout.nbytes].view(self.layout.dtype)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
