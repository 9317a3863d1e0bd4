"""Copies from the run's device to host memory that never stage a second full copy on the device.

Saving a checkpoint must not clone the optimizer state on the GPU (that would need as much
free device memory again as the state itself). Device tensors are copied out piece by
piece through one reusable pinned buffer, so the device holds nothing extra and the host
holds the result plus one staging buffer. On CPU a plain copy is all there is to do.
"""

from __future__ import annotations

from typing import Sequence

import torch

STAGING_NUMEL = 1 << 24
"""Elements of the pinned staging buffer (64 MiB in fp32)."""


class HostCopier:
    """Copies device tensors to pageable host memory through one pinned staging buffer."""

    def __init__(self, dtype: torch.dtype = torch.float32, staging_numel: int = STAGING_NUMEL) -> None:
        self.dtype, self.staging_numel = dtype, staging_numel
        self._staging: torch.Tensor | None = None

    def _buffer(self, numel: int) -> torch.Tensor:
        """The staging buffer, grown to min(numel, staging_numel) elements when needed."""
        numel = min(numel, self.staging_numel)
        if self._staging is None or self._staging.numel() < numel:
            self._staging = torch.empty(numel, dtype=self.dtype, pin_memory=True)
        return self._staging

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (host, contiguous) <- src (any device), one staging buffer at a time."""
        src, out = src.reshape(-1), dst.view(-1)
        if src.device.type == "cpu":
            out.copy_(src)
            return
        staging = self._buffer(src.numel())
        for lo in range(0, src.numel(), staging.numel()):
            n = min(staging.numel(), src.numel() - lo)
            staging[:n].copy_(src[lo: lo + n], non_blocking=True)
            torch.cuda.current_stream(src.device).synchronize()
            out[lo: lo + n].copy_(staging[:n])

    def concat(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """One flat host tensor holding `pieces` end to end (each copied out in turn)."""
        out = torch.empty(sum(p.numel() for p in pieces), dtype=self.dtype)
        offset = 0
        for p in pieces:
            self.copy_into(out[offset: offset + p.numel()], p.to(self.dtype) if p.dtype != self.dtype else p)
            offset += p.numel()
        return out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (a new tensor even on CPU, so later in-place updates don't reach it)."""
    return HostCopier(t.dtype).concat([t]).view(t.shape)
