"""ProcessGrid: the tp x cp x dp x pp layout of the job and every process group, built once.

Rank order follows Megatron-LM: tensor parallel innermost (adjacent ranks, so TP traffic
stays on one node), then context parallel, then data parallel, pipeline outermost. This is
the one place that states it (`rank_of`, `coords`):

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

Context parallelism (cp) splits each sequence over its ranks; they hold the same parameters,
so ZeRO shards and reduces over dp x cp (`dp_cp_group`, members ordered dp-major: index
dp_rank * cp + cp_rank), as Megatron does. At cp 1 that group is the DP group itself.

Experts fold the same ranks their own way (Megatron's "parallel folding"): within each pipeline
stage the tp x cp x dp ranks are re-read as etp x ep x edp (expert tensor, expert and expert data
parallel), expert order etp fastest, then ep, then edp, pp outermost (`expert_rank_of`,
`expert_coords`):

    rank = pp_rank * (dp * cp * tp) + edp_rank * (ep * etp) + ep_rank * etp + etp_rank

so ep can span data- and context-parallel ranks, and at etp = tp the expert_tp groups are the tp
groups. The tokens' all-to-all runs over `ep_group`; expert gradients reduce over
`expert_dp_group`. An expert group whose ranks are a dense group's is that group (no second
communicator): at ep 1 and etp = tp a dense run creates nothing new.

The grid is the only place that creates process groups; everything else receives the
`Group` objects it needs from here (no module-level state).

Devices, stated once: with CUDA the groups are NCCL's alone (one backend, no CPU side
channel), so every tensor that meets a collective, a p2p op, the loss or a metric is
created on `grid.device`; without CUDA they are gloo's and `grid.device` is the CPU.
Host copies for checkpoints go through `parallel/host.py`.

Timeouts, stated once: every group the grid creates (tp, cp, dp, dp_cp, pp, embed, stage, the
experts' expert_tp, ep and expert_dp, the world, and gloo's duplicates of ZeRO's groups for the communication thread) gets `grid.timeout_s`
(train.timeout_minutes), so a collective or p2p op that waits longer on a stopped or dead
peer fails instead of hanging (torch's default for a new group is 30 minutes on gloo). Gloo
raises the error in the thread that waits. NCCL's watchdog thread notices it; `comm_errors`
reports it to train/lifecycle.py, which ends the rank with the same one line as on gloo before
the watchdog tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3).
"""

from __future__ import annotations

import datetime
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from megazero.config.rules import expert_grid_problem, world_problem
from megazero.parallel.comm import Group


class _GroupOf:
    """`grid.tp_group` and its kin: the grid's group of one kind (read-only)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __get__(self, grid: "ProcessGrid", owner: type) -> Group:
        return grid.groups[self.kind]


class ExpertCoords(NamedTuple):
    """A rank's index along each dimension of the experts' folding."""

    etp: int
    ep: int
    edp: int
    pp: int


class Coords(NamedTuple):
    """A rank's index along each grid dimension."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


@dataclass
class ProcessGrid:
    """Degrees of each parallelism and this rank's groups. Build with `ProcessGrid.create`."""

    tp: int
    pp: int
    dp: int
    rank: int = 0
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence (ring attention or Ulysses)."""
    backend: str = "gloo"
    timeout_s: float = 600.0
    """Every group's timeout: a collective or p2p op waiting longer on a peer fails."""
    ep: int = 1
    """Expert-parallel degree: ranks that split the routed experts."""
    etp: int = 0
    """Expert tensor-parallel degree (0: tp); etp x ep x edp = tp x cp x dp in each pipeline stage."""
    groups: dict[str, Group] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel degree {name} ({getattr(self, name)}) must be at least 1")
        if self.timeout_s <= 0:
            raise ValueError(f"the process-group timeout ({self.timeout_s:g} s) must be positive")
        self.etp = self.etp or self.tp
        problem = expert_grid_problem(self.tp, self.cp, self.dp, self.ep, self.etp)
        if problem:
            raise ValueError(problem)
        self.tp_rank, self.dp_rank, self.pp_rank, self.cp_rank = self.coords()  # this rank's coordinates
        self.etp_rank, self.ep_rank, self.edp_rank, _ = self.expert_coords()

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    # ------------------------------------------------------------------ layout

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coords(self, rank: Optional[int] = None) -> Coords:
        """(tp, dp, pp, cp) coordinates of `rank` (default: this process)."""
        r = self.rank if rank is None else rank
        return Coords(tp=r % self.tp, cp=(r // self.tp) % self.cp, dp=(r // (self.tp * self.cp)) % self.dp,
                      pp=r // (self.tp * self.cp * self.dp))

    def rank_of(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    @property
    def logging_rank(self) -> int:
        """The rank that holds the loss and speaks for the run: the last stage's first rank."""
        return self.rank_of(0, 0, self.pp - 1)

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the replicas of one expert shard in a pipeline stage."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    def expert_coords(self, rank: Optional[int] = None) -> ExpertCoords:
        """(etp, ep, edp, pp) coordinates of `rank` (default: this process) in the experts' folding."""
        r = self.rank if rank is None else rank
        stage = self.tp * self.cp * self.dp
        local = r % stage  # pp is outermost in both orders, so a stage's ranks are one contiguous block
        return ExpertCoords(etp=local % self.etp, ep=(local // self.etp) % self.ep,
                            edp=local // (self.etp * self.ep), pp=r // stage)

    def expert_rank_of(self, etp: int, ep: int, edp: int, pp: int) -> int:
        return ((pp * self.edp + edp) * self.ep + ep) * self.etp + etp

    def dp_cp_index(self, c: Coords) -> int:
        """The member index of coordinates `c` in their dp x cp group: ZeRO's shard rank."""
        return c.dp * self.cp + c.cp

    def group_ranks(self, kind: str) -> list[list[int]]:
        """Every group of one kind as lists of global ranks (the same on all processes)."""
        t, d, p, c = range(self.tp), range(self.dp), range(self.pp), range(self.cp)
        if kind == "tp":
            return [[self.rank_of(i, j, k, m) for i in t] for k in p for j in d for m in c]
        if kind == "cp":
            return [[self.rank_of(i, j, k, m) for m in c] for k in p for j in d for i in t]
        if kind == "dp":
            return [[self.rank_of(i, j, k, m) for j in d] for k in p for m in c for i in t]
        if kind == "dp_cp":  # ZeRO's group: the replicas of one (tp, pp) shard of the parameters
            return [[self.rank_of(i, j, k, m) for j in d for m in c] for k in p for i in t]
        if kind == "pp":
            return [[self.rank_of(i, j, k, m) for k in p] for j in d for m in c for i in t]
        if kind == "stage":  # every rank of one pipeline stage (tp x cp x dp): Muon's matrix owners
            return [[self.rank_of(i, j, k, m) for j in d for m in c for i in t] for k in p]
        if kind == "embed":  # first and last stage hold the tied embedding
            return [sorted({g[0], g[-1]}) for g in self.group_ranks("pp")]
        return self._expert_group_ranks(kind)

    def _expert_group_ranks(self, kind: str) -> list[list[int]]:
        """The experts' groups, over their folding of each stage (etp x ep x edp)."""
        t, e, d, p = range(self.etp), range(self.ep), range(self.edp), range(self.pp)
        if kind == "expert_tp":  # ranks that split each expert's MLP
            return [[self.expert_rank_of(i, j, k, m) for i in t] for m in p for k in d for j in e]
        if kind == "ep":  # ranks that split the experts: the tokens' all-to-all
            return [[self.expert_rank_of(i, j, k, m) for j in e] for m in p for k in d for i in t]
        if kind == "expert_dp":  # replicas of one expert shard: expert gradients reduce over these
            return [[self.expert_rank_of(i, j, k, m) for k in d] for m in p for j in e for i in t]
        raise KeyError(kind)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the given pipeline stage that shares this rank's tp, cp and dp coordinates."""
        c = self.coords()
        return self.rank_of(c.tp, c.dp, pp_rank % self.pp, c.cp)

    # ------------------------------------------------------------------ groups

    def __getitem__(self, kind: str) -> Group:
        return self.groups[kind]

    tp_group = _GroupOf("tp")
    dp_group = _GroupOf("dp")
    cp_group = _GroupOf("cp")
    dp_cp_group = _GroupOf("dp_cp")  # what ZeRO shards and reduces over
    pp_group = _GroupOf("pp")
    stage_group = _GroupOf("stage")  # tensor x context x data: one pipeline stage's ranks
    embed_group = _GroupOf("embed")
    expert_tp_group = _GroupOf("expert_tp")
    ep_group = _GroupOf("ep")  # the experts' all-to-all
    expert_dp_group = _GroupOf("expert_dp")  # what expert gradients reduce over

    def build_groups(self) -> None:
        """Create every process group once, each with the grid's timeout. All ranks call
        new_group for all groups in the same order (a torch.distributed requirement), keeping
        only their own. At cp 1 the dp x cp group is the DP group (no second communicator).
        On gloo ZeRO's groups (dp x cp, and expert-dp for the experts) also get a duplicate for
        their asynchronous reduce-scatters."""
        kinds = ("tp", "dp", "pp", "embed", "stage") + (("cp", "dp_cp") if self.cp > 1 else ())
        for kind in kinds:
            for ranks in self.group_ranks(kind):
                pg = _new_group(ranks, self.world_size, self.timeout)
                if self.rank in ranks:
                    self.groups[kind] = Group(kind, pg, ranks, ranks.index(self.rank), timeout_s=self.timeout_s)
        world = list(range(self.world_size))
        self.groups["world"] = Group("world", _new_group(world, self.world_size, self.timeout), world, self.rank,
                                     timeout_s=self.timeout_s)
        self.complete_cp_groups()
        self.build_expert_groups()
        if self.backend == "gloo":  # ZeRO's comm thread gets a communicator of its own (see comm.py)
            for kind in ("dp_cp", "expert_dp"):
                # expert-dp may be dp x cp's own Group (then it has its duplicate already): every
                # rank sees the same sharing, so all skip or all create.
                if self.groups[kind].side_pg is not None:
                    continue
                for ranks in self.group_ranks(kind):
                    side = dist.new_group(ranks, timeout=self.timeout) if len(ranks) > 1 else None
                    if self.rank in ranks:
                        self.groups[kind].side_pg = side

    def build_expert_groups(self) -> None:
        """The experts' groups, after the dense ones. A kind whose groups hold the same ranks, in the
        same order, as a dense kind's is that kind's Group (no communicator of its own), so a dense
        layout (ep 1, etp = tp) creates no process group here; every rank still walks every kind in
        the same order, as new_group requires."""
        for kind in ("expert_tp", "ep", "expert_dp"):
            ranks_of = self.group_ranks(kind)
            shared = len(ranks_of[0]) > 1  # a group of one needs no communicator: it stays its own
            same = next((k for k in ("tp", "dp", "cp", "dp_cp") if shared and self.group_ranks(k) == ranks_of), None)
            for ranks in ranks_of:
                if same is not None:
                    if self.rank in ranks:
                        self.groups[kind] = self.groups[same]
                    continue
                pg = _new_group(ranks, self.world_size, self.timeout)
                if self.rank in ranks:
                    self.groups[kind] = Group(kind, pg, ranks, ranks.index(self.rank), timeout_s=self.timeout_s)

    def complete_cp_groups(self) -> None:
        """At cp 1: the cp group is this rank alone and the dp x cp group is the DP group (no
        communicators of their own); for groups built by build_groups or by hand."""
        if self.cp == 1:
            self.groups["cp"] = Group("cp", None, [self.rank], 0, timeout_s=self.timeout_s)
            self.groups["dp_cp"] = self.groups["dp"]

    def comm_errors(self) -> dict[str, str]:
        """This rank's groups whose NCCL watchdog has seen a collective time out or a peer fail,
        by name: TIMEOUT, COMM_ERROR or REMOTE_ERROR. Empty on gloo (its collectives raise in
        the thread that waits) and where torch does not report process-group errors."""
        errors: dict[str, str] = {}
        for name, group in self.groups.items():
            if group.pg is None or self.backend != "nccl":
                continue
            backend = group.pg._get_backend(torch.device("cuda"))
            error = getattr(backend, "get_error", lambda: None)()
            if error is not None and error.name != "SUCCESS":
                errors[name] = error.name
        return errors

    @classmethod
    def create(cls, tp: int, pp: int, timeout_s: float = 600, store: Optional[dist.Store] = None,
               cp: int = 1, ep: int = 1, etp: int = 0) -> "ProcessGrid":
        """Join torch.distributed from torchrun's environment (or as a lone process) and
        build the grid; dp is inferred from the world size; every group waits `timeout_s` on a
        peer at most. `store`: rendezvous through it instead of torchrun's (a restart's own
        namespace, see train/lifecycle.py). `ep`, `etp`: the experts' folding (etp 0: tp)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        problem = world_problem(world_size, tp, pp, cp) or \
            expert_grid_problem(tp, cp, world_size // (tp * pp * cp), ep, etp or tp)  # validation's rules
        if problem:
            raise ValueError(problem)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        grid = cls(tp=tp, pp=pp, dp=world_size // (tp * pp * cp), rank=rank, backend=backend, timeout_s=timeout_s,
                   cp=cp, ep=ep, etp=etp)
        options = _bind_cuda_device() if backend == "nccl" else {}
        if not dist.is_initialized():
            if store is None and "MASTER_ADDR" not in os.environ:  # plain `python -m megazero.train`: a world of one
                store, rank, world_size = dist.HashStore(), 0, 1
            joined: dict[str, Any] = {} if store is None else {"store": store, "rank": rank, "world_size": world_size}
            dist.init_process_group(backend, timeout=grid.timeout, **joined, **options)
        grid.build_groups()
        return grid

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def bytes_moved(self) -> dict[str, dict[str, int]]:
        """Bytes each group's collectives moved from this rank, by group and operation."""
        return {name: dict(g.counter) for name, g in self.groups.items()}

    def reset_counters(self) -> None:
        for g in self.groups.values():
            g.counter.clear()


def _new_group(ranks: list[int], world_size: int, timeout: datetime.timedelta) -> Optional[dist.ProcessGroup]:
    """A process group for `ranks`; a group of one needs no communicator (collectives skip it).
    The whole world is the default group, which init_process_group gave the same timeout."""
    if len(ranks) == 1:
        return None
    if len(ranks) == world_size:
        return dist.group.WORLD
    return dist.new_group(ranks, timeout=timeout)


def _bind_cuda_device() -> dict:
    """NCCL as it wants to be started: this process's GPU chosen (LOCAL_RANK) before any group
    exists, and named to init_process_group (device_id: communicators are created at once on
    it and new groups split from them, instead of guessing a device at the first collective).
    A timed-out or failed NCCL collective tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING
    3, torch's default, kept unless set) after `comm_errors` has let lifecycle print why."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if "device_id" not in inspect.signature(dist.init_process_group).parameters:  # torch < 2.3
        return {}
    return {"device_id": torch.device("cuda", local_rank)}
