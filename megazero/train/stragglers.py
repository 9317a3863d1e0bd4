"""Stragglers: a rank whose own compute is slow (a throttled GPU, a busy host) slows every rank
while nothing fails. Each rank times its compute per phase (forward and backward; optimizer) as
the phase's wall time less the time its main thread spent blocked in collectives meanwhile
(every group's `blocked_s`, parallel/comm.py) and in pipeline receives: a rank that waits on a
slow peer spends that time blocked, not computing, so it is never the one named. Every
train.straggler_interval iterations the ranks all-gather their mean times (one all-gather of
two numbers per rank); a rank above train.straggler_factor x the median of a phase is named in
one line, and every rank's times go to the JSONL record (`rank_compute_s`) and TensorBoard.

The times are host wall-clock times: on CPUs they are the compute itself; on GPUs kernels run
asynchronously, so a phase is charged for the host's issue time plus whatever the step's one
device-to-host read waits for (use logging.timers, which synchronizes, for per-kernel phases).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Iterator, Optional

import torch

from megazero.config.schema import Config
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid

PHASES = ("forward_backward", "optimizer")


class StragglerWatch:
    """Per-rank compute times by phase, compared across the world every `interval` iterations."""

    def __init__(self, cfg: Config, grid: ProcessGrid):
        t = cfg.train
        self.grid = grid
        self.interval = t.log_interval if t.straggler_interval is None else t.straggler_interval
        self.factor = t.straggler_factor
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def _blocked(self) -> float:
        # A group may stand under two names (dp_cp is dp at cp 1): each counted once.
        return sum(g.blocked_s for g in {id(g): g for g in self.grid.groups.values()}.values())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the compute inside (wall time less collective waits) to phase `name`."""
        if not self.enabled:
            yield
            return
        tic, blocked = time.perf_counter(), self._blocked()
        try:
            yield
        finally:
            self.seconds[name] += (time.perf_counter() - tic) - (self._blocked() - blocked)

    def discount(self, name: str, seconds: float) -> None:
        """Waits a phase measured itself (pipeline receives) are not compute either."""
        if self.enabled:
            self.seconds[name] -= seconds

    def after_step(self, iteration: int) -> Optional[tuple[dict, list[str]]]:
        """Collective at every interval's end (else nothing): (JSONL fields, lines naming stragglers)."""
        if not self.enabled:
            return None
        self.steps += 1
        if iteration % self.interval:
            return None
        mine = torch.tensor([self.seconds[p] / self.steps for p in PHASES], dtype=torch.float64,
                            device=self.grid.device)
        everyone = torch.zeros(self.grid.world_size * len(PHASES), dtype=torch.float64, device=self.grid.device)
        comm.all_gather_into(everyone, mine, self.grid["world"])
        self.seconds, self.steps = dict.fromkeys(PHASES, 0.0), 0
        times = everyone.view(self.grid.world_size, len(PHASES)).tolist()
        per_phase = {p: [max(0.0, row[i]) for row in times] for i, p in enumerate(PHASES)}
        return {"rank_compute_s": per_phase}, stragglers(iteration, per_phase, self.factor)


NOISE = 0.1
"""A phase's excess over its median must also reach this share of the median rank's whole compute:
a phase of a millisecond or two (a tiny model's optimizer step) varies by more than the factor
from scheduling alone, and such a rank slows nobody."""


def stragglers(iteration: int, per_phase: dict[str, list[float]], factor: float) -> list[str]:
    """One line per rank whose compute in a phase exceeds `factor` x the ranks' median (and NOISE
    of the median whole compute)."""
    lines = []
    whole = statistics.median(sum(t) for t in zip(*per_phase.values()))
    for phase, times in per_phase.items():
        median = statistics.median(times)
        for rank, seconds in enumerate(times):
            if median > 0 and seconds > factor * median and seconds - median >= NOISE * whole:
                lines.append(f"iteration {iteration}: straggler: rank {rank} computes {phase.replace('_', ' ')} in "
                             f"{1e3 * seconds:.1f} ms, {seconds / median:.1f}x the ranks' median "
                             f"{1e3 * median:.1f} ms (train.straggler_factor {factor:g}); check that rank's device "
                             f"and host")
    return lines
