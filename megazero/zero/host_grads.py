"""ZeRO-Offload's gradient path: each bucket's reduced fp32 gradient slice goes to host
memory as soon as it is final, while backward goes on, so the CPU step finds every
gradient there and the device never waits for one large copy after backward.

On a GPU the copies run on a side stream that first waits for the compute stream (which
produced the slice, or waited for its reduce-scatter), into page-locked host memory, so
they overlap the rest of backward; `wait()` before the step blocks on their events only.
Where the device is the host itself there is nothing to copy and this path is not used.
"""

from __future__ import annotations

from typing import Optional

import torch

from megazero.zero.partition import Bucket, Range
from megazero.zero.state import flat_zeros


class HostGradients:
    """An fp32 host copy of this rank's trainable gradient shard, filled bucket by bucket."""

    def __init__(self, numel: int, device: torch.device, pin: bool) -> None:
        self.flat = flat_zeros(numel, torch.device("cpu"), pin)
        self.device = device
        self.stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events: list[torch.cuda.Event] = []
        self.copied_numel = 0  # elements copied this iteration (a bucket once, or again when re-reduced)

    def copy(self, b: Bucket, grad: torch.Tensor) -> None:
        """Start copying bucket b's final gradient slice `grad` (on the device) to the host."""
        dst = self.flat[b.shard_offset: b.shard_offset + b.shard_numel]
        self.copied_numel += b.shard_numel
        if self.stream is None:
            dst.copy_(grad)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(grad, non_blocking=True)
        # The slice lives in the persistent gradient buffer, so no record_stream is needed:
        # it is only zeroed by the next zero_grad(), after `wait()`.
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events.append(event)

    def wait(self) -> None:
        """Every copy started so far has landed (before the CPU step reads them)."""
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def view(self, r: Range) -> torch.Tensor:
        return self.flat[r.shard_offset: r.shard_offset + r.length]

    def reset(self) -> None:
        self.copied_numel = 0
