"""Device tensors to host bytes, one bounded piece at a time, through one reusable pinned buffer.

Every file writer in `megazero.checkpoint` receives tensors that may live on the GPU (the
16-bit save writes parameters as they are gathered on the device). `.numpy()` needs host
memory, and a plain `.cpu()` of each tensor would allocate a fresh pageable copy per
tensor (and copy at pageable speed). Instead a writer owns one `HostStaging`: its pinned
buffer is allocated once (page-locking is slow) and reused for every piece, so the host
holds one piece and the device holds nothing beyond the tensor itself. Without CUDA the
buffer is plain host memory and the bytes written are the same.

(`megazero.parallel.host.HostCopier` is the sibling for state that must end up as host
tensors, such as the optimizer's state_dict; this one streams bytes into files.)
"""

from __future__ import annotations

from typing import BinaryIO, Iterator, Optional

import torch

PIECE_BYTES = 64 << 20
"""Bytes moved per device-to-host copy: large enough to run at full copy bandwidth, small
enough that the pinned buffer is a rounding error next to the model."""


class HostStaging:
    """One pinned host buffer, reused for every device-to-host copy a writer makes."""

    def __init__(self, piece_bytes: int = PIECE_BYTES):
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes ({piece_bytes}) must be at least 1")
        self.piece_bytes = piece_bytes
        self._buffer: Optional[torch.Tensor] = None

    def _staging(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the buffer, grown (never beyond piece_bytes) when needed."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            # Pinning needs a CUDA driver; a CUDA tensor cannot exist without one anyway.
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._buffer[:nbytes]

    def host_bytes(self, t: torch.Tensor) -> Iterator[torch.Tensor]:
        """t's bytes in row-major order as pieces of the host buffer: each is valid only
        until the next one is asked for.

        Host tensors are copied through the buffer too: handing out their own memory would
        let the writer's `.numpy()` mark their storage non-resizable for good, and a ZeRO-3
        parameter whose storage cannot be freed after its save breaks the next release."""
        raw = t.contiguous().reshape(-1).view(torch.uint8)  # reshape first: a 0-d tensor has no bytes view
        for start in range(0, raw.numel(), self.piece_bytes):
            piece = raw[start: start + self.piece_bytes]
            host = self._staging(piece.numel())
            host.copy_(piece)  # blocking: the buffer is complete, and free of the last piece, on return
            yield host

    def write(self, f: BinaryIO, t: torch.Tensor) -> None:
        """Write t's bytes to `f` at its current position."""
        for piece in self.host_bytes(t):
            f.write(piece.numpy().data)
