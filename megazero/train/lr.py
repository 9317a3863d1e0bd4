"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr."""

from __future__ import annotations

import math

from megazero.config import OptimConfig


def learning_rate(it: int, optim: OptimConfig, total_iters: int) -> float:
    """LR for iteration `it` (0-based: the step that produces iteration it + 1)."""
    if optim.warmup_iters and it < optim.warmup_iters:
        return optim.lr * (it + 1) / optim.warmup_iters
    if optim.decay_style == "constant":
        return optim.lr
    decay_iters = optim.decay_iters or total_iters
    span = max(1, decay_iters - optim.warmup_iters)
    progress = min(1.0, (it - optim.warmup_iters) / span)
    if optim.decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.min_lr + coeff * (optim.lr - optim.min_lr)
