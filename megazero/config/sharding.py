"""What a ZeRO stage partitions over data parallelism, chosen once from `zero.stage` by
`sharding()` (like FSDP's ShardingStrategy): the config's rules, its Megatron front-end,
pre-flight, ZeRO, the planner, the trainer and the checkpoint readers learn what a stage does
from this object, never by comparing stage numbers. Torch-free and beside the schema, so the
rules can ask it before torch loads.

    stage 0  nothing partitioned: gradient buckets are all-reduced, every rank holds the same
             gradients and optimizer state and steps everything
    stage 1  optimizer states: each rank steps its shard; gradients are reduce-scattered once,
             in the last backward; updated parameters are all-gathered after the step
    stage 2  gradients as well: reduce-scattered every backward, a rank keeps only its shard
    stage 3  parameters as well: gathered per unit around its use (stage3.py), never
             all-gathered after the step

Over which ranks a parameter is partitioned is decided here too, once, from its placement
(`parameter_groups`): a dense parameter is replicated over dp x cp (ZeRO's group "dp_cp") and
split by its TP placement over "tp"; an expert weight (Placement.experts) is distinct on each
expert-parallel rank, replicated over the expert-data-parallel group ("expert_dp") and split
over "expert_tp". ZeRO puts each kind in buckets of its own, reduced, sharded and gathered over
its group; the gradient norm counts each element once over these groups; checkpoints record
the group of each parameter. Nothing else in zero/, checkpoint/ or train/ asks whether a
parameter is an expert's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from megazero.config.schema import ConfigError


class _Group(Protocol):
    """A process group as `shards` needs it (parallel/comm.Group): its size and our index."""

    @property
    def size(self) -> int: ...

    rank: int


@dataclass(frozen=True)
class Sharding:
    """One ZeRO stage: which model states each DP rank holds only its 1/N of."""

    stage: int
    optimizer: bool
    """Optimizer states (fp32 master weights, Adam moments) partitioned: each rank steps its shard."""
    gradients: bool
    """Gradients partitioned: reduce-scattered every backward, only the shard accumulates."""
    parameters: bool
    """Parameters partitioned: gathered per unit on demand (stage3.py) rather than after the step."""

    @property
    def replicated(self) -> bool:
        """Every DP rank holds the same reduced gradients and optimizer state (stage 0): their
        buckets are all-reduced, and one rank of dp x cp stands for all (norm, saved state)."""
        return not self.optimizer

    @property
    def gathers_after_step(self) -> bool:
        """Each rank updates its shard of full parameters, then all-gathers them (stages 1-2)."""
        return self.optimizer and not self.parameters

    def shards(self, zero: _Group) -> tuple[int, int]:
        """(shards, this rank's index) of the flat layout over the ZeRO group (dp x cp): one
        shard that every rank owns when nothing is partitioned."""
        return (zero.size, zero.rank) if self.optimizer else (1, 0)

    def model_state_bytes(self, psi: int, dp: int, element_bytes: tuple[int, int, int]) -> dict[str, int]:
        """Model-state bytes of one rank holding Ψ (padded) parameter elements over N = dp ranks,
        with `element_bytes` per parameter, gradient and optimizer element: each partitioned
        kind is held as Ψ/N (plan/formulas.py gives the per-stage totals)."""
        params, grads, optim = (size * (psi // dp if partitioned else psi) for size, partitioned in
                                zip(element_bytes, (self.parameters, self.gradients, self.optimizer)))
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


@dataclass(frozen=True)
class ParameterGroups:
    """The grid groups (by kind, as ProcessGrid names them) over which one kind of parameter lives."""

    zero: str
    """Its data-parallel replicas: ZeRO shards it and reduces its gradient over this group."""
    tensor: str
    """The group its TP placement splits it over; one it does not split is replicated over this
    group, and counted on the group's rank 0 alone (the gradient norm)."""


DENSE = ParameterGroups(zero="dp_cp", tensor="tp")
EXPERTS = ParameterGroups(zero="expert_dp", tensor="expert_tp")


class _Placed(Protocol):
    """A parameter's placement as `parameter_groups` reads it (parallel/placement.Placement)."""

    @property
    def experts(self) -> int: ...


def parameter_groups(where: _Placed) -> ParameterGroups:
    """Where a parameter of placement `where` lives: an expert weight's experts are split over the
    expert-parallel group and replicated over expert-dp (etp x ep x edp, the grid's folding), every
    other parameter is replicated over dp x cp. The one place that tells them apart."""
    return EXPERTS if where.experts else DENSE


STAGES = {s.stage: s for s in (Sharding(0, optimizer=False, gradients=False, parameters=False),
                                Sharding(1, optimizer=True, gradients=False, parameters=False),
                                Sharding(2, optimizer=True, gradients=True, parameters=False),
                                Sharding(3, optimizer=True, gradients=True, parameters=True))}
"""Every ZeRO stage by its number, from the least partitioned to the most."""


def sharding(stage: int, key: str = "zero.stage") -> Sharding:
    """ZeRO stage `stage` as what it partitions; a number that names no stage is refused, naming
    `key` (where it was given)."""
    if stage not in STAGES:  # the one range check: validation and the planner's --zero-stage call here
        *first, last = STAGES
        raise ConfigError(f"{key} ({stage}) must be {', '.join(map(str, first))} or {last}")
    return STAGES[stage]
