"""Learning-rate schedule: linear (or log) warmup, then cosine / linear / constant decay to min_lr.

As in Megatron's OptimizerParamScheduler, the schedule is part of the checkpoint and counts
applied steps only: a step skipped for an fp16 overflow or a non-finite gradient does not
advance it, and a resumed run keeps the checkpoint's schedule (a raised train.iters extends
training at min_lr instead of re-deriving the curve) unless optim.override_schedule is true.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megazero.config.rules import warmup_length
from megazero.config.schema import OptimConfig, TrainConfig

SHAPE = ("lr", "min_lr", "warmup_iters", "decay_iters", "decay_style", "warmup_style")
"""What defines the curve; a change of any of them on resume is reported."""


@dataclass
class LRSchedule:
    lr: float
    min_lr: float
    warmup_iters: float
    """Warm-up length in iterations (fractional with optim.warmup_fraction, as Megatron's)."""
    decay_iters: float
    """Decay length in iterations (fractional when given in samples)."""
    decay_style: str
    steps: int = 0
    """Applied optimizer steps so far (skipped steps excluded), or applied samples when unit > 1."""
    unit: int = 1
    """1: the schedule counts iterations. With a batch-size ramp-up, the global batch size: it counts
    samples (each applied step adds its own batch) against warmup_iters x unit and decay_iters x unit
    samples, as Megatron's scheduler does."""
    warmup_style: str = "linear"
    """linear, or log (DeepSpeed's WarmupLR default)."""

    @classmethod
    def from_config(cls, optim: OptimConfig, train: TrainConfig | int) -> "LRSchedule":
        iters = train if isinstance(train, int) else train.iters
        in_samples = bool(optim.warmup_samples or optim.decay_samples)
        unit = 1 if isinstance(train, int) or (train.rampup_batch_size is None and not in_samples) \
            else train.global_batch_size
        # Lengths given in samples become (fractional) iterations of the full global batch: the
        # schedule then counts samples against length x unit, as Megatron's does.
        decay = optim.decay_samples / unit if optim.decay_samples else optim.decay_iters or iters
        warmup = optim.warmup_samples / unit if optim.warmup_samples else (
            optim.warmup_fraction * decay if optim.warmup_fraction else warmup_length(optim, iters))
        return cls(optim.lr, optim.min_lr, warmup, decay, optim.decay_style, unit=unit,
                   warmup_style=optim.warmup_style)  # type: ignore[arg-type]

    def decoupled(self, optim: OptimConfig) -> Optional["LRSchedule"]:
        """The same curve for the embedding and output layer at optim.decoupled_lr (Megatron's
        --decoupled-lr); None when they follow the main one."""
        if optim.decoupled_lr is None:
            return None
        min_lr = optim.decoupled_min_lr if optim.decoupled_min_lr is not None else self.min_lr
        return dataclasses.replace(self, lr=optim.decoupled_lr, min_lr=min_lr)

    def at(self, step: int, increment: int = 1) -> float:
        """LR of the step that starts at `step` (0-based: iterations, or samples when unit > 1) and
        applies `increment` (1 iteration, or its batch of samples)."""
        done = (step + increment) / self.unit  # iterations done once this step is applied
        if self.warmup_iters and done <= self.warmup_iters:
            if self.warmup_style == "log":
                return self.lr * math.log1p(done) / math.log1p(self.warmup_iters)
            return self.lr * done / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        span = max(1, self.decay_iters - self.warmup_iters)
        progress = min(1.0, max(0.0, (step / self.unit - self.warmup_iters) / span))  # a step across the warm-up's end: 0
        coeff = 1.0 - progress if self.decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def current(self, batch: int = 1) -> float:
        """LR of the next step; `batch`: its global batch (counted when unit > 1)."""
        return self.at(self.steps, batch if self.unit > 1 else 1)

    def step(self, batch: int = 1) -> None:
        self.steps += batch if self.unit > 1 else 1

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def resume(self, saved: dict, override: bool) -> Optional[str]:
        """Continue from a checkpoint's schedule: its step count always; its shape unless
        `override`. Returns one line describing a shape change (None when nothing changed)."""
        self.steps = int(saved["steps"])
        self.unit = int(saved.get("unit", 1))  # what `steps` counts is the checkpoint's
        saved = {"warmup_style": "linear", **saved}  # a checkpoint from before log warm-ups
        changed = [k for k in SHAPE if saved[k] != getattr(self, k)]
        if not changed:
            return None
        diff = ", ".join(f"{k} {saved[k]} -> {getattr(self, k)}" for k in changed)
        if override:
            return f"lr schedule: optim.override_schedule is true, using the config's ({diff})"
        for k in changed:
            setattr(self, k, saved[k])
        return (f"lr schedule: keeping the checkpoint's; the config's change ({diff}) is ignored; "
                f"pass --optim.override_schedule true to apply it")
