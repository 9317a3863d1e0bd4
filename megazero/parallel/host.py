"""Copies from the run's device to host memory, one bounded piece at a time, through one
reusable pinned buffer: no second copy of anything is ever staged on the device.

Saving must not clone state on the GPU (that needs as much free device memory again as the
state itself), and `.numpy()` needs host memory. A `HostStaging` owns one buffer, pinned
when CUDA is present (page-locking is slow, so it is allocated once and reused) and hands
out a tensor's bytes piece by piece: file writers stream them (`write`), the optimizer's
state_dict assembles host tensors from them (`concat`). Without CUDA the buffer is plain
host memory and the results are the same.
"""

from __future__ import annotations

from typing import IO, Iterator, Optional, Sequence

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

    def host_bytes(self, t: torch.Tensor) -> Iterator[torch.Tensor]:
        """t's bytes in row-major order as pieces of the host buffer: each is valid only
        until the next one is asked for.

        Host tensors are copied through the buffer too: handing out their own memory would
        let the writer's `.numpy()` mark their storage non-resizable for good, and a ZeRO-3
        parameter whose storage cannot be freed after its save breaks the next release."""
        raw = t.contiguous().reshape(-1).view(torch.uint8)  # reshape first: a 0-d tensor has no bytes view
        for start in range(0, raw.numel(), self.piece_bytes):
            piece = raw[start: start + self.piece_bytes]
            if self._buffer is None or self._buffer.numel() < piece.numel():  # grown, never beyond piece_bytes
                # Pinning needs a CUDA driver; a CUDA tensor cannot exist without one anyway.
                self._buffer = torch.empty(piece.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            host = self._buffer[: piece.numel()]
            host.copy_(piece)  # blocking: the buffer is complete, and free of the last piece, on return
            yield host

    def write(self, f: IO[bytes], t: torch.Tensor) -> None:
        """Write t's bytes to `f` at its current position."""
        for piece in self.host_bytes(t):
            f.write(piece.numpy().data)

    def concat(self, pieces: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One flat host tensor of `dtype` holding `pieces` end to end, copied out in turn."""
        out = torch.empty(sum(p.numel() for p in pieces), dtype=dtype)
        raw, offset = out.view(torch.uint8), 0
        for p in pieces:
            for piece in self.host_bytes(p.to(dtype)):
                raw[offset: offset + piece.numel()].copy_(piece)
                offset += piece.numel()
        return out

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` (a new tensor even on CPU, so later in-place updates don't reach it)."""
        return self.concat([t], t.dtype).view(t.shape)


class HostSnapshot:
    """Host tensors kept from one save to the next, by name (pinned when CUDA is present).

    An asynchronous save copies this rank's shard into them at the save iteration and a
    background thread writes them out while training changes the originals. Keeping them
    means each save after the first allocates (and, on GPUs, page-locks) nothing, and the
    copy from the device goes straight into page-locked memory: no staging copy on the
    device, no second host buffer. The caller must not refill them before the write of
    their previous contents has ended (the next save first waits for the last one)."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def concat(self, name: str, pieces: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The host tensor `name`: `pieces` end to end, as `dtype` (allocated on first use, or
        when the size changed)."""
        numel = sum(p.numel() for p in pieces)
        out = self._tensors.get(name)
        if out is None or out.numel() != numel or out.dtype != dtype:
            out = self._tensors[name] = torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
        offset = 0
        for p in pieces:
            # One piece's dtype conversion at most is made on its device; copy_ then moves it.
            out[offset: offset + p.numel()].copy_(p.reshape(-1).to(dtype))
            offset += p.numel()
        return out

    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())
