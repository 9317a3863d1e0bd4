"""train.inject_fault KIND:RANK:ITER: one silent fault, injected on purpose so that tests (and an
operator trying the detectors out) can see it caught. Like Megatron's error injection, it is for
testing only, and the run says so loudly at start-up.

    bitflip         after iteration ITER's step, flip one exponent bit of one element of one
                    replicated parameter on RANK (a TP-replicated one where tp > 1), in RANK's own
                    slice of it, so that the corruption stays until the replica check looks
    transient_nan   RANK's loss is NaN on the first execution of iteration ITER only (the rerun is clean)
    persistent_nan  RANK's loss is NaN on every execution of iteration ITER (the data's fault)
    slow            from iteration ITER on, RANK sleeps as long as its forward and backward took,
                    every iteration, as part of its compute (a straggler)

The NaN is the loss times NaN: the loss and, through backward, the gradients are NaN, as a fault
in the rank's arithmetic would leave them. A fault fires in a job's first attempt only: a torchrun
restart (TORCHELASTIC_RESTART_COUNT > 0) resumes clean, as a real transient fault would leave it.
Iterations count from 1, as the log lines do.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from megazero.config.rules import fault_spec
from megazero.config.schema import Config
from megazero.errors import UserError
from megazero.model.gpt import GPT
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.placement import placement
from megazero.train.lifecycle import restart_count
from megazero.zero.optimizer import ZeroOptimizer

EXPONENT_BIT = 29
"""The bit flipped: the second-highest of a float32's exponent (the value scales by 2**+-64)."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    iteration: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.rank}:{self.iteration}"


class FaultInjector:
    """The trainer's hooks for one injected fault; every one is a no-op on other ranks and iterations."""

    def __init__(self, spec: FaultSpec, grid: ProcessGrid, chunks: Sequence[GPT],
                 optimizer: ZeroOptimizer):
        self.spec, self.grid, self.chunks, self.optimizer = spec, grid, chunks, optimizer
        self.mine = grid.rank == spec.rank
        self.executions = 0  # of iteration spec.iteration on this rank
        if spec.kind.endswith("_nan") and self.mine and not grid.is_last_stage:
            raise UserError(f"train.inject_fault {spec}: rank {spec.rank} is on pipeline stage {grid.pp_rank} of "
                            f"{grid.pp} and holds no loss; name a rank of the last stage")

    @classmethod
    def from_config(cls, cfg: Config, grid: ProcessGrid, chunks: Sequence[GPT],
                    optimizer: ZeroOptimizer) -> Optional["FaultInjector"]:
        """The injector train.inject_fault asks for; None without one, or after a torchrun restart."""
        if cfg.train.inject_fault is None or restart_count():
            return None
        return cls(FaultSpec(*fault_spec(cfg.train.inject_fault, grid.world_size)), grid, chunks, optimizer)

    def announce(self) -> str:
        return (f"WARNING: FAULT INJECTION (train.inject_fault {self.spec}, for testing): {self.spec.kind} on rank "
                f"{self.spec.rank} at iteration {self.spec.iteration}; this run is corrupted on purpose")

    @contextlib.contextmanager
    def loss(self, iteration: int) -> Iterator[None]:
        """Around one execution of `iteration`'s forward and backward: transient_nan and
        persistent_nan make this rank's loss NaN (its last-stage chunk's loss function)."""
        s = self.spec
        due = self.mine and iteration == s.iteration and s.kind in ("transient_nan", "persistent_nan")
        if due:
            self.executions += 1
        if not due or (s.kind == "transient_nan" and self.executions > 1):
            yield
            return
        chunk = self.chunks[-1]
        clean = chunk.loss  # the GPT's per-token loss

        def nan_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return clean(logits, labels) * float("nan")
        object.__setattr__(chunk, "loss", nan_loss)  # an instance attribute: shadows the method, this execution only
        try:
            yield
        finally:
            object.__delattr__(chunk, "loss")

    def slow(self, iteration: int, compute_s: float) -> None:
        """After forward and backward: sleep as long as they took (`compute_s`), from spec.iteration on."""
        if self.mine and self.spec.kind == "slow" and iteration >= self.spec.iteration:
            time.sleep(compute_s)

    @torch.no_grad()
    def after_step(self, iteration: int) -> Optional[str]:
        """bitflip: after `iteration`'s step, flip the bit; returns what was flipped (for the test's log)."""
        if not (self.mine and self.spec.kind == "bitflip" and iteration == self.spec.iteration):
            return None
        self.optimizer.params.wait_all()  # the step's all-gather must not overwrite (or send) the flip mid-way
        name, values = self._replicated_target()
        flat = values.view(-1)
        index = flat.numel() // 2
        if flat.dtype == torch.float32:
            bits = flat[index: index + 1].view(torch.int32)
            bits ^= 1 << EXPONENT_BIT
        else:  # bf16, fp16: bit 13 is the second-highest of their exponents too
            bits16 = flat[index: index + 1].view(torch.int16)
            bits16 ^= 1 << 13
        self.optimizer.params.flush()
        return f"flipped bit of element {index} of {name} on rank {self.grid.rank}"

    def _replicated_target(self) -> tuple[str, torch.Tensor]:
        """(name, this rank's own slice of) a replicated parameter: TP-replicated where tp > 1,
        in this rank's DP slice, where a flip stays (it is stepped from there, not overwritten by
        the next all-gather) until the replica check compares it."""
        layout = self.optimizer.layout
        pieces = list(layout.slot_pieces(layout.trainable_buckets(), layout.rank))
        candidates = [p for p in pieces if not placement(p[1].param).sharded] or pieces
        bucket, slot, start, end, _ = candidates[len(candidates) // 2]
        lo, _ = bucket.slice_of(layout.rank)
        own = self.optimizer.params.own_slice(bucket)
        return slot.name, own[start - lo: end - lo]
