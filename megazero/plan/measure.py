"""Measuring what the formulas predict: bytes of tensors autograd saves for backward."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch


class ActivationMeter:
    """Bytes of tensors autograd keeps for backward, live and at peak, while installed with
    `torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)`. A storage saved by
    several operations counts once; it is released when the last of them lets go."""

    def __init__(self, exclude: Union[set[int], Callable[[], set[int]]], held: Optional[Callable[[], int]] = None):
        # Storages of the parameters (weights are not activations); a callable when they move
        # (ZeRO-3 gathers weights into buffers that are freed and reallocated).
        self.exclude = exclude
        # Bytes kept for backward outside autograd's graph (zbh1's pending W passes hold the
        # matmul inputs and output gradients after their B freed the graph); added at each save.
        self.held = held
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.current = self.peak = 0

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in (self.exclude() if callable(self.exclude) else self.exclude):
            return t
        if key in self.live:
            self.live[key][1] += 1
        else:
            self.live[key] = [t.untyped_storage().nbytes(), 1]
            self.current += self.live[key][0]
            self.peak = max(self.peak, self.current + (self.held() if self.held else 0))
        return _Saved(self, key, t)

    @staticmethod
    def unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]


class _Saved:
    """A saved tensor; autograd drops it after the backward that used it (or with the graph)."""

    def __init__(self, meter: ActivationMeter, key: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self):
        self.meter.release(self.key)
