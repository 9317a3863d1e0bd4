"""train.rerun_on: rerun an iteration whose loss or gradient norm is non-finite (nan), or whose
loss spikes (spike), from the same state and the same batch, and let the rerun say who is to blame
(Megatron's rerun state machine, --rerun-mode validate_results):

- the rerun fires again: the data is the cause. The batch is skipped (no weight changes) and its
  samples are named, with their dataset and document ids, in one line and a JSONL record;
- the rerun is clean: the fault was transient (hardware). The ranks whose own loss differed
  between the two executions are named, and training goes on with the rerun's result.

What the rerun needs is saved before each iteration: the RNG streams (dropout draws again what it
drew) and the fp16 loss scaler's few numbers; nothing else. The optimizer needs no copy: a
non-finite step is skipped whole by the optimizer (zero/optimizer.py), and a spike is caught
before the step (`spike` all-reduces the loss first: one scalar per iteration). The decision is
taken from world-wide sums, so every rank reruns the same iterations; naming the ranks costs one
all-gather, only when a rerun happened.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch

from megazero.config.schema import Config
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.random import RNGTracker, get_rng_states, set_rng_states
from megazero.zero.optimizer import StepResult
from megazero.zero.precision import DynamicLossScaler

RECENT = 100
"""train.rerun_on spike: the iterations whose largest loss a new loss is compared with."""


class NamedSamples(Protocol):
    """A dataset that says where its samples come from (data/: provenance): document ids for
    indexed data, FILE:LINE (or SPEC row N) for data.stream."""

    def provenance(self, i: int) -> tuple[str, Sequence[int | str]]: ...


@dataclass
class Saved:
    """What one execution of an iteration changes besides the weights, as it was before."""

    rng: dict
    scaler: Optional[dict]


@dataclass
class Execution:
    """One execution of an iteration: the world's verdict and this rank's own loss share."""

    fired: Optional[str]  # why it is suspect ("loss nan", "loss spike ...") or None
    result: Optional[StepResult]  # None when a spike stopped it before the step
    own_loss: Optional[torch.Tensor]  # this rank's loss share (None off the last pipeline stage)
    loss: float  # the global loss


class RerunGuard:
    """Decides when an iteration reruns and what its two executions say (see the module docstring)."""

    def __init__(self, cfg: Config, grid: ProcessGrid):
        self.mode, self.factor, self.grid = cfg.train.rerun_on, cfg.train.spike_factor, grid
        self.fp16 = cfg.train.precision == "fp16"
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.spike_loss = math.nan  # the global loss the last spike check saw

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def save(self, tracker: RNGTracker, scaler: Optional[DynamicLossScaler]) -> Optional[Saved]:
        if not self.enabled:
            return None
        return Saved(get_rng_states(tracker), scaler.state_dict() if scaler is not None else None)

    @staticmethod
    def restore(saved: Saved, tracker: RNGTracker, scaler: Optional[DynamicLossScaler]) -> None:
        set_rng_states(saved.rng, tracker)
        if scaler is not None and saved.scaler is not None:
            scaler.load_state_dict(saved.scaler)

    def spike(self, loss: Optional[torch.Tensor]) -> Optional[str]:
        """spike mode, before the step (collective: one scalar over the world): why the global loss is
        suspect, or None. Each loss replica counted once (the last stage's first TP rank)."""
        if self.mode != "spike":
            return None
        total = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        if loss is not None and self.grid.tp_rank == 0:
            total += loss.detach().double()
        comm.all_reduce(total, self.grid["world"])
        value = self.spike_loss = float(total)
        if not math.isfinite(value):
            return f"loss {value}"
        if self.recent and value > self.factor * max(self.recent):
            return f"loss {value:.4g} above {self.factor:g} x the recent maximum {max(self.recent):.4g}"
        return None

    def non_finite(self, result: StepResult) -> Optional[str]:
        """Why a step is suspect, from its world-wide sums (fp16: only a non-finite loss; its
        gradient overflows are the loss scaler's business)."""
        if not self.enabled:
            return None
        if not math.isfinite(result.loss):
            return f"loss {result.loss}"
        if result.skipped and not self.fp16:
            return f"gradient norm {result.grad_norm} (or a rank's loss share non-finite)"
        return None

    def accepted(self, loss: float) -> None:
        """The global loss of a step that went through (the spike reference)."""
        if self.mode == "spike" and math.isfinite(loss):
            self.recent.append(loss)

    def ranks_that_differ(self, first: Execution, second: Execution) -> list[int]:
        """Collective (one all-gather of a flag): the ranks whose own loss share was not the same
        in both executions (bit for bit; NaN equals NaN)."""
        differs = torch.zeros(1, dtype=torch.float64, device=self.grid.device)
        a, b = first.own_loss, second.own_loss
        if a is not None and b is not None:
            same = torch.equal(a, b) or bool(torch.isnan(a).all() and torch.isnan(b).all())
            differs += float(not same)
        flags = torch.zeros(self.grid.world_size, dtype=torch.float64, device=self.grid.device)
        comm.all_gather_into(flags, differs, self.grid["world"])
        return [r for r, f in enumerate(flags.tolist()) if f]


def describe_samples(dataset: Any, first: int, count: int) -> list[dict]:
    """The samples first .. first + count - 1 (modulo the dataset's length, as the loader takes
    them): each one's index, dataset and document ids where the dataset can say."""
    out = []
    for j in range(count):
        i = (first + j) % len(dataset)
        name, documents = (dataset.provenance(i) if hasattr(dataset, "provenance")
                           else (type(dataset).__name__, []))
        out.append({"sample": i, "dataset": name, "documents": documents})
    return out


def samples_line(samples: Sequence[dict]) -> str:
    """`samples 32-39 of DATASET (documents 4, 17, ...)`, grouped by dataset."""
    by_dataset: dict[str, tuple[list[int], list[int]]] = {}
    for s in samples:
        indices, documents = by_dataset.setdefault(s["dataset"], ([], []))
        indices.append(s["sample"])
        documents.extend(d for d in s["documents"] if d not in documents)
    parts = []
    for name, (indices, documents) in by_dataset.items():
        span = (f"{indices[0]}-{indices[-1]}" if indices == list(range(indices[0], indices[-1] + 1))
                else ", ".join(map(str, indices)))
        docs = f" (documents {', '.join(map(str, documents))})" if documents else ""
        parts.append(f"samples {span} of {name}{docs}")
    return "; ".join(parts)
