"""Random state: seeding per grid coordinate, the TP-region RNG tracker, save/restore.

Two streams, as in Megatron-LM:
- the default generator, seeded identically on every TP rank of a stage, drives dropout on
  replicated activations (embeddings, residual branches) so all TP ranks drop the same
  elements;
- the tracker's "tp" stream, seeded differently per TP rank, drives dropout inside TP
  regions (attention probabilities of this rank's heads), where each rank holds distinct
  activations that need independent masks.
Context-parallel ranks hold different positions of a sequence, so both streams differ per
cp rank as well (cp rank 0 keeps the seeds of a run without context parallelism).
"""

from __future__ import annotations

import contextlib
import functools
import random
from typing import Callable, Iterator, Optional

import numpy as np
import torch

TP_STREAM_OFFSET = 2718
CP_SEED_OFFSET = 7919  # per cp rank; stages are 100 apart, so no cp rank of a stage meets another stage's seed


class RNGTracker:
    """Named RNG states that can be swapped into the default generator for a region."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        outer = self._get()
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = self._get()
        self._set(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        """Run the body with stream `name` as the default generator, then put it back."""
        outer = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(outer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def in_stream(tracker: RNGTracker, name: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """fn() with the tracker's stream `name` as the default generator. Inside a compiled
    region this runs eagerly: dynamo cannot trace RNG-state swaps, and a disabled call is one
    clean graph break where a traced fork would drop the whole frame."""
    return _eager_in_stream()(tracker, name, fn)


@functools.cache
def _eager_in_stream() -> Callable:
    """Wrapped on first use: torch.compiler.disable imports dynamo (~2 s per process), which
    only runs with per-rank dropout streams (tp > 1 with dropout) need."""
    def run(tracker: RNGTracker, name: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with tracker.fork(name):
            return fn()
    return torch.compiler.disable(run)


def seed_everything(seed: int, pp_rank: int, tp_rank: int, device: torch.device,
                    tracker: Optional[RNGTracker] = None, cp_rank: int = 0) -> RNGTracker:
    """Seed the default streams (same on all TP ranks of a stage and cp rank) and the
    tracker's TP stream (a new tracker, or `tracker` reseeded in place for the modules that
    hold it)."""
    stage_seed = seed + 100 * pp_rank + CP_SEED_OFFSET * cp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    tracker = tracker or RNGTracker(device)
    tracker.add("tp", stage_seed + TP_STREAM_OFFSET + tp_rank)
    return tracker


def get_rng_states(tracker: RNGTracker) -> dict:
    """Every RNG state of this process (for checkpoints)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
              "tracker": tracker.state_dict()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict, tracker: RNGTracker) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    tracker.load_state_dict(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def recompute_rng_context(tracker: Optional[RNGTracker]) -> Callable[[], tuple]:
    """`context_fn` for torch.utils.checkpoint: recomputation must replay the same dropout
    masks. torch restores the default RNG itself; this also snapshots the TP tracker's
    streams at forward and replays them during the recomputation."""
    if tracker is None:
        return lambda: (contextlib.nullcontext(), contextlib.nullcontext())

    def make() -> tuple:
        saved = tracker.state_dict()

        @contextlib.contextmanager
        def replay() -> Iterator[None]:
            current = tracker.state_dict()
            tracker.load_state_dict(saved)
            try:
                yield
            finally:
                tracker.load_state_dict(current)

        return contextlib.nullcontext(), replay()

    return make
