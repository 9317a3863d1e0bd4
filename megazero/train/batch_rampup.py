"""Megatron's batch-size ramp-up (train.rampup_batch_size START INCREMENT SAMPLES): the global
batch of each step, a pure function of the samples consumed before it, so a resumed run (which
restores consumed_samples) and every DP layout see the same sequence of batches. Checked by
config.rampup_steps before any process group exists."""

from __future__ import annotations

from megazero.config.rules import rampup_steps
from megazero.config.schema import TrainConfig


def rampup_batch(t: TrainConfig, dp: int, consumed_samples: int) -> int:
    """The global batch of the step that starts after `consumed_samples` samples."""
    if t.rampup_batch_size is None:
        return t.global_batch_size
    start, increment, per_increment = rampup_steps(t, dp)
    samples = int(t.rampup_batch_size[2])
    if not per_increment or consumed_samples > samples:
        return t.global_batch_size
    return min(t.global_batch_size, start + increment * int(consumed_samples / per_increment))


def samples_after(t: TrainConfig, dp: int, iters: int) -> int:
    """The samples `iters` steps from the start consume: iters x global batch, less during a ramp-up."""
    consumed = 0
    for done in range(iters):
        if t.rampup_batch_size is None or consumed > t.rampup_batch_size[2]:  # the rest at the full batch
            return consumed + (iters - done) * t.global_batch_size
        consumed += rampup_batch(t, dp, consumed)
    return consumed
