"""Replica digests: silent data corruption (a bit flipped in one GPU's memory or arithmetic) leaves
one replica of a parameter unlike the others, and every checkpoint after it carries the damage.
Ranks that should hold equal values compare a digest of them every train.replica_check_interval
iterations and before every checkpoint save:

- the data-parallel replicas of every parameter at ZeRO 0-2 (each rank holds them whole after the
  step's all-gather), over dp x cp;
- the TP-replicated parameters (norms, biases, routers: `placement` not sharded) at every stage,
  over tp (at ZeRO 3 each rank's own DP slice of them, which its TP peers hold too);
- ZeRO 0's optimizer state (master weights when separate, the moments), replicated over dp x cp;
- at ZeRO 0-2 with tp > 1, the optimizer state of the TP-replicated parameters (each rank's DP
  slice of it at ZeRO 1-2), which the TP peers hold too (on NVMe: read from the sub-groups holding it).

A digest is the sum, in int64, of the values' bit patterns: any single flipped bit changes it. Each
rank digests what it holds (one pass over its parameters) and the world all-gathers the digests
(one all-gather of a few numbers per parameter). A mismatch stops the run in one line naming the
iteration, the ranks that disagree, the parameter and the side the majority holds; the check runs
before a save, so no checkpoint is written from that state, and the exit (status 1, no user error)
lets torchrun --max-restarts resume from the last checkpoint, which passed the check when it was saved.

At ZeRO 1-2 each rank steps its own slice and all-gathers it: a corrupted copy of another rank's
slice is overwritten at the next step, a corrupted own slice spreads to the DP peers there, so
the DP replicas are compared as the step left them, at the check's iteration. An expert weight's
replicas are its expert-data-parallel ones (config/sharding.parameter_groups): its key names the
experts it holds (the ep rank) and its expert-TP shard, so exactly those ranks compare it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megazero.config.schema import Config
from megazero.config.sharding import DENSE, parameter_groups
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.placement import Placement, placement
from megazero.zero.optimizer import ZeroOptimizer
from megazero.zero.partition import Bucket
from megazero.zero.state import MemoryOptimizerStore, NvmeOptimizerStore

_INT_VIEW = {4: torch.int32, 2: torch.int16, 8: torch.int64}


class ReplicaMismatch(RuntimeError):
    """Replicas that should be equal are not: the run stops (every rank alike), to be restarted
    from the last checkpoint (not a UserError: a restart is what fixes it)."""


def digest(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the pieces' elements' bit patterns modulo 2**bits (bits: the element size), as an
    int64: one flipped bit changes it. Summed in the elements' own integer width (wrapping), which
    vectorizes: 30x faster on CPUs than widening every element to int64; the same wherever the
    values lie in memory, so equal values on two ranks give equal digests."""
    total, width = torch.zeros((), dtype=torch.int64), 64
    for t in pieces:
        if t.numel():
            words = t.detach().reshape(-1).view(_INT_VIEW[t.element_size()])
            width = 8 * t.element_size()
            total += words.sum(dtype=words.dtype).to(torch.int64).cpu()
    return total & ((1 << width) - 1) if width < 64 else total


@dataclass(frozen=True)
class Entry:
    """One value this rank digests: `key` is the same on exactly the ranks that should hold it equal."""

    key: str
    values: Callable[[], list[torch.Tensor]]


class ReplicaCheck:
    """Which replicas this layout has, and their comparison (see the module docstring)."""

    def __init__(self, cfg: Config, grid: ProcessGrid, optimizer: ZeroOptimizer):
        t = cfg.train
        self.grid, self.optimizer = grid, optimizer
        self.interval = t.log_interval if t.replica_check_interval is None else t.replica_check_interval
        self.entries = replicated_entries(grid, optimizer) if self.interval else []
        self.verified: Optional[int] = None  # the last iteration found consistent
        # Every rank's keys, once (metadata): the check itself then gathers numbers only.
        self.keys: list[list[str]] = (comm.all_gather_object([e.key for e in self.entries], grid["world"])
                                      if self.interval else [])
        self.width = max((len(k) for k in self.keys), default=0)
        # Nothing anywhere has a peer to agree with: the check does nothing, on every rank alike.
        counts = Counter(k for keys in self.keys for k in keys)
        self.compared = sum(1 for n in counts.values() if n > 1)

    @property
    def enabled(self) -> bool:
        return self.interval > 0 and self.compared > 0

    def coverage(self, cfg: Config) -> str:
        """The start-up line: what the check compares at this layout."""
        if self.interval == 0:
            return "replica check: off (train.replica_check_interval 0)"
        stage, p = self.optimizer.sharding.stage, cfg.parallel
        if not self.compared:
            return (f"replica check: nothing to compare at ZeRO {stage} with tp {p.tp}: no rank holds a replica of "
                    f"another's values (ZeRO 3 shards the parameters over dp; tp 1 leaves no TP replicas)")
        what = []
        if not self.optimizer.sharding.parameters and self.grid.dp * self.grid.cp > 1:
            what.append(f"every parameter over its {self.grid.dp * self.grid.cp} data-parallel replicas")
        if p.tp > 1:
            what.append(f"the TP-replicated parameters (norms, biases, routers{'' if stage < 3 else ': own DP slices'})"
                        f" over the {p.tp} TP ranks")
        if self.optimizer.sharding.replicated and self.grid.dp * self.grid.cp > 1:
            what.append("the replicated optimizer state")
        if p.tp > 1 and any(e.key.startswith(TP_STATE) for e in self.entries):
            what.append("the TP-replicated parameters' optimizer state")
        return (f"replica check: {'; '.join(what)}; every {self.interval} iterations and before every checkpoint "
                f"save ({self.compared} values compared)")

    def due(self, iteration: int) -> bool:
        return self.enabled and iteration % self.interval == 0

    def check(self, iteration: int) -> None:
        """Collective over the world: compare the digests; raises ReplicaMismatch on every rank alike."""
        if not self.enabled or self.verified == iteration:
            return
        self.optimizer.params.wait_all()  # the step's all-gather has landed
        mine = torch.zeros(self.width, dtype=torch.int64, device=self.grid.device)
        if self.entries:
            mine[: len(self.entries)] = torch.stack([digest(e.values()) for e in self.entries]).to(mine.device)
        everyone = torch.zeros(self.grid.world_size * self.width, dtype=torch.int64, device=self.grid.device)
        comm.all_gather_into(everyone, mine, self.grid["world"])
        problem = mismatch(iteration, self.keys, everyone.view(self.grid.world_size, self.width).tolist())
        if problem:
            raise ReplicaMismatch(problem)
        self.verified = iteration


def mismatch(iteration: int, keys: list[list[str]], digests: list[list[int]]) -> Optional[str]:
    """The line naming the values whose holders disagree, or None when all agree. A corrupted value
    spreads through the next steps' computation to others: the one named is the first with the
    fewest dissenters behind a strict majority (the likeliest origin), the others counted."""
    holders: dict[str, list[tuple[int, int]]] = {}
    for rank, rank_keys in enumerate(keys):
        for key, value in zip(rank_keys, digests[rank]):
            holders.setdefault(key, []).append((rank, value))
    split = {key: held for key, held in holders.items() if len({v for _, v in held}) > 1}
    if not split:
        return None

    def dissent(key: str) -> tuple[int, int]:
        held = split[key]
        top = Counter(v for _, v in held).most_common(1)[0][1]
        return (0 if top * 2 > len(held) else 1), len(held) - top
    key = min(split, key=dissent)  # min() keeps the first of equals: the same key on every rank
    held = split[key]
    values = Counter(v for _, v in held).most_common()
    if dissent(key)[0] == 0:  # a strict majority
        top = values[0][0]
        side = (f"ranks {', '.join(str(r) for r, v in held if v == top)} (the majority) agree, rank(s) "
                f"{', '.join(str(r) for r, v in held if v != top)} hold another value")
    else:
        groups = [[r for r, v in held if v == value] for value, _ in values]
        side = "no majority: " + " vs ".join("ranks " + ", ".join(map(str, g)) for g in groups)
    others = f" (and {len(split) - 1} other value(s))" if len(split) > 1 else ""
    return (f"replica mismatch at iteration {iteration}: {label(key)}{others} differs between ranks that should hold "
            f"it equal: {side}; silent data corruption: stopping with no checkpoint of this state, a restart resumes "
            f"from the last checkpoint (check the disagreeing ranks' device)")


def label(key: str) -> str:
    """How a line names a key: the parameter or the optimizer state (of a parameter), with its DP
    slice where the key has one (ZeRO 3's parameters, ZeRO 1-2's state)."""
    name, *coords = key.split("#")
    for prefix in (TP_STATE, "optimizer."):
        if name.startswith(prefix):
            name = "optimizer state " + name[len(prefix):]
            break
    dp = [c[2:].split("@")[0] for c in coords if c.startswith("dp")]
    return f"{name} (DP slice {dp[0]})" if dp else name


def replicated_entries(grid: ProcessGrid, optimizer: ZeroOptimizer) -> list[Entry]:
    """What this rank holds that others hold too, keyed by what must match. A key names the
    parameter, its pipeline stage (tied copies on two stages are not compared), and the coordinates
    its values depend on (`_coordinates`), the DP slice at ZeRO 3."""
    sharding, layout = optimizer.sharding, optimizer.layout
    stage = f"#pp{grid.pp_rank}"
    entries = []
    if not sharding.parameters:  # ZeRO 0-2: every parameter whole on every rank of its ZeRO group
        for _, slot in layout.slots():
            entries.append(Entry(slot.name + stage + _coordinates(grid, placement(slot.param)), _whole(slot.param)))
    elif grid.tp > 1:  # ZeRO 3: this rank's DP slice of each TP-replicated parameter
        for bucket, slot, start, end, _ in layout.slot_pieces(layout.buckets, layout.rank):
            where = placement(slot.param)
            if where.sharded or where.experts:  # an expert weight's ZeRO-3 slices are each on one rank
                continue
            lo = bucket.slice_of(layout.rank)[0]
            key = f"{slot.name}{stage}#dp{layout.rank}@{start}"
            entries.append(Entry(key, _own_piece(optimizer, bucket, start - lo, end - lo)))
    if sharding.replicated:  # ZeRO 0: each bucket's optimizer state is the same over its ZeRO group
        kinds = ("master", "exp_avg", "exp_avg_sq") if optimizer.state.separate_master else ("exp_avg", "exp_avg_sq")
        for group, (where, ranges) in _state_ranges(layout.trainable_buckets()).items():
            for kind in kinds:
                entries.append(Entry(f"optimizer.{kind}{'' if group == DENSE.zero else '.' + group}{stage}"
                                     f"{_coordinates(grid, where, always=True)}", _state(optimizer, kind, ranges)))
    return entries + _tp_replicated_state(grid, optimizer)


TP_STATE = "optimizer.tp."
"""Keys of the TP-replicated parameters' optimizer state (`label` names them)."""


def _tp_replicated_state(grid: ProcessGrid, optimizer: ZeroOptimizer) -> list[Entry]:
    """ZeRO 0-2 at tp > 1: the optimizer state of each TP-replicated dense parameter in this rank's
    shard. TP peers have the same layout (a TP-sharded parameter's shards are of one shape), so the
    same key names the same elements on every TP rank (and, at ZeRO 0, on every DP rank)."""
    sharding, layout, state = optimizer.sharding, optimizer.layout, optimizer.state
    if sharding.parameters or grid.tp == 1:
        return []
    kinds = ("master", "exp_avg", "exp_avg_sq") if state.separate_master else ("exp_avg", "exp_avg_sq")
    dp = "" if sharding.replicated else f"#dp{layout.rank}"
    entries = []
    for _, slot, start, end, offset in layout.slot_pieces(layout.trainable_buckets()):
        where = placement(slot.param)
        if where.sharded or where.experts:  # (an expert weight's replicas are compared as parameters)
            continue
        for kind in kinds:
            entries.append(Entry(f"{TP_STATE}{kind} of {slot.name}#pp{grid.pp_rank}{dp}@{start}",
                                 _state_range(state, kind, offset, end - start)))
    return entries


def _coordinates(grid: ProcessGrid, where: Placement, always: bool = False) -> str:
    """Which copy of a parameter (or of its group's optimizer state) this rank holds: its TP shard
    (over tp, or expert_tp for an expert weight) when split there (`always`: the optimizer state,
    which is each TP rank's own), and the experts it holds when ep splits them."""
    tensor = parameter_groups(where).tensor
    key = f"#{tensor}{grid[tensor].rank}" if where.sharded or always else ""
    return key + (f"#ep{grid.ep_rank}" if where.experts and grid.ep > 1 else "")


def _state_ranges(buckets: list[Bucket]) -> dict[str, tuple[Placement, list[tuple[int, int]]]]:
    """The trainable buckets' shard ranges by ZeRO group (dense, experts), with a placement of the
    group's kind (what `_coordinates` reads)."""
    out: dict[str, tuple[Placement, list[tuple[int, int]]]] = {}
    for b in buckets:
        where = placement(b.slots[0].param)
        out.setdefault(b.group, (where, []))[1].append((b.shard_offset, b.shard_offset + b.shard_numel))
    return out


def _whole(param: torch.nn.Parameter) -> Callable[[], list[torch.Tensor]]:
    return lambda: [param.data]


def _own_piece(optimizer: ZeroOptimizer, bucket: Bucket, lo: int, hi: int) -> Callable[[], list[torch.Tensor]]:
    return lambda: [optimizer.params.own_slice(bucket)[lo:hi]]


def _state(optimizer: ZeroOptimizer, kind: str, ranges: list[tuple[int, int]]) -> Callable[[], list[torch.Tensor]]:
    """The values of one kind of optimizer state in `ranges` of the shard (its pieces: the whole
    shard in memory, sub-groups on NVMe)."""
    def values() -> list[torch.Tensor]:
        out = []
        for offset, piece in optimizer.state.pieces(kind):
            for lo, hi in ranges:
                a, b = max(lo, offset), min(hi, offset + piece.numel())
                if a < b:
                    out.append(piece[a - offset: b - offset])
        return out
    return values


def _state_range(state: MemoryOptimizerStore | NvmeOptimizerStore, kind: str, offset: int, length: int
                 ) -> Callable[[], list[torch.Tensor]]:
    return lambda: [state.view(kind, offset, length)]
