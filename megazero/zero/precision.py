"""Mixed precision: the compute dtype of each `train.precision`, and fp16's dynamic loss scaler.

The model is built and initialised in fp32; the optimizer keeps those values as fp32 master
weights, ZeRO's sharded parameters hold them in the compute dtype. bf16 has fp32's exponent range, so its
gradients need no scaling; fp16 gradients underflow without it.
"""

from __future__ import annotations

import torch

COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DynamicLossScaler:
    """Multiply the loss by `scale` so small fp16 gradients survive; on overflow skip the
    step and, after `hysteresis` consecutive overflows, halve the scale (never below
    `min_scale`); after `window` clean steps in a row, double it.

    Hysteresis tolerates a rare inf (one bad batch) without paying a permanent halving.
    """

    def __init__(self, initial_scale: float, window: int, hysteresis: int, min_scale: float) -> None:
        self.scale = float(initial_scale)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, float(min_scale)
        self.clean_steps = 0
        self.hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
