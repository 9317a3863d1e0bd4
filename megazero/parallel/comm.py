"""Every collective megazero issues, and the autograd pairs of tensor parallelism.

`Group` wraps one process group with a byte counter: each collective adds the bytes this
rank puts on the wire under a ring algorithm, so benchmarks can compare the traffic of a
ZeRO stage or a TP layout with theory. A group of one skips communication entirely.

Every rank of a group must issue the same collectives in the same order (NCCL matches them
by position on one communicator), so that order is decided by the program, never by I/O or
thread timing. `record_calls` checks it: it makes the groups append a `Call` (group, op,
shape, dtype; the peer of a point-to-point op) for each call as this rank issues it, async
ones included, so a test can compare the ranks' sequences. Off (the default) it costs one
attribute test per call.

Asynchronous collectives return a handle whose `wait()` completes them (a `Work` on NCCL,
where the current stream then waits on the collective's stream, no host sync). Gloo's
reduce-scatter is our own ring of point-to-point exchanges, so its asynchronous form runs on
the group's one communication thread, in submission order (every rank submits the same
collectives in the same order), over `side_pg`: a duplicate of the group's process group,
so the thread's messages never interleave with collectives the main thread issues meanwhile.
A peer that stops or dies makes the thread's exchange fail after the group's timeout (the
duplicate has it too); `wait()` re-raises that error on the main thread, and gives up by
itself (`CollectiveTimeout`) should the thread never come back.

The f/g pairs (Megatron's names in brackets) are one autograd Function per collective:

    copy_to_tp        identity  / all-reduce       [f: enter a TP region]
    reduce_from_tp    all-reduce / identity        [g: leave a TP region]
    gather_from_tp    all-gather last dim / split

and those of sequence parallelism (Korthikanti et al., 2022), which replace copy_to_tp /
reduce_from_tp where the activations outside TP regions are split along the sequence:

    gather_from_sequence      all-gather seq / reduce-scatter seq
                              [g: gather_from_sequence_parallel_region; the column-
                              parallel matmul fuses it: weight_grad.gathered_linear]
    reduce_scatter_to_sequence  reduce-scatter seq / all-gather seq
                              [g-bar: reduce_scatter_to_sequence_parallel_region]
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist

from megazero.errors import UserError


@dataclass(eq=False)
class Group:
    """One process group as seen from this rank: its members, our index, a byte counter."""

    name: str
    pg: Optional[dist.ProcessGroup]
    ranks: list[int]
    rank: int
    counter: Counter = field(default_factory=Counter)
    side_pg: Optional[dist.ProcessGroup] = field(default=None, repr=False)  # gloo: the comm thread's duplicate
    timeout_s: Optional[float] = None  # the process groups' timeout (ProcessGrid sets it); None: torch's default
    _thread: Optional[ThreadPoolExecutor] = field(default=None, repr=False)
    record: Optional[list["Call"]] = field(default=None, repr=False)  # see record_calls
    # Gloo ring's receive buffers, reused: by (thread, dtype, device), so the comm thread
    # and a synchronous call never share one (see _ring_reduce_scatter).
    _scratch: dict = field(default_factory=dict, repr=False)
    blocked_s: float = 0.0
    """Seconds this rank's main thread spent blocked in this group's collectives (issuing a synchronous one,
    waiting on an asynchronous one's handle): what train/stragglers.py leaves out of a rank's compute time."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def submit(self, fn, *args) -> "Handle":
        """Run fn(*args, pg=side_pg) on this group's communication thread, after everything
        submitted before it (one thread: first in, first out)."""
        if self.side_pg is None:
            raise RuntimeError(f"group {self.name} has no duplicate process group for asynchronous gloo "
                               f"collectives (ProcessGrid.build_groups creates it)")
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"megazero-{self.name}-comm")
        # A ring of n - 1 exchanges, each of which may wait up to the timeout on a slow but live
        # peer: after n timeouts the thread is stuck beyond what its own timeout catches.
        limit_s = None if self.timeout_s is None else self.timeout_s * self.size
        return _Threaded(self._thread.submit(fn, *args, pg=self.side_pg), self.name, limit_s, self)

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Count the time inside as blocked in this group (blocked_s)."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s += time.perf_counter() - tic

    def issue(self, op: str, t: Optional[torch.Tensor], nbytes: Optional[float], peer: Optional[int] = None) -> None:
        """Count one call putting `nbytes` on the wire (None: nothing counted, e.g. a receive) and
        record it as issued (see record_calls); `t` None for a picklable object."""
        if nbytes is not None:
            self.counter[op] += int(nbytes)
            self.counter[op + "_calls"] += 1
        if self.record is not None:
            shape, dtype = (tuple(t.shape), str(t.dtype)) if t is not None else ((), "object")
            self.record.append(Call(self.name, op, shape, dtype, peer))


class Call(NamedTuple):
    """One communication call as this rank issued it."""

    group: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    peer: Optional[int] = None  # point-to-point: the other side's global rank


def record_calls(groups: Iterable[Group]) -> list[Call]:
    """From now on, every call on `groups` is appended to the one list returned, in the order
    this rank issues it: collectives (asynchronous ones when launched, gloo's threaded
    reduce-scatter when submitted to its thread, under its group's name) and point-to-point
    sends and receives (with their peer). Groups of one issue nothing and record nothing.
    Every member of a group must record the same collectives on it; the sends one rank
    records to a peer must be the receives that peer records from it."""
    calls: list[Call] = []
    for g in groups:
        g.record = calls
    return calls


# The flat-tensor collectives: torch 2.13 names them *_single and warns on every call of the
# old names; older torch (>= 2.4, setup.cfg's floor) has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle(Protocol):
    """An asynchronous collective: `wait()` returns once its result may be used."""

    def wait(self) -> Any: ...


class _Done:
    """A collective that completed when it was issued (a group of one)."""

    def wait(self) -> None:
        return None


class CollectiveTimeout(RuntimeError):
    """A group's communication thread did not finish a collective in time (a peer stopped)."""


@dataclass
class _Threaded:
    """A collective running on a group's communication thread; its errors surface in wait(),
    which waits `limit_s` at most (None: for ever)."""

    future: Future
    group: str
    limit_s: Optional[float] = None
    owner: Optional[Group] = None  # whose blocked_s the wait adds to

    def wait(self) -> None:
        try:
            with self.owner.blocking() if self.owner is not None else contextlib.nullcontext():
                self.future.result(timeout=self.limit_s)
        except FutureTimeout:
            if self.future.done():  # the collective's own error, not our wait's
                raise
            raise CollectiveTimeout(f"Timed out waiting {self.limit_s:g} s for the {self.group} group's "
                                    f"communication thread to finish a collective") from None


@dataclass
class _Async:
    """One of torch's asynchronous collectives, waited here: a lost peer's error, raised by the
    backend's C++ wait (no torch.distributed frame, on gloo no "gloo" in its text), then carries
    this file's frame, by which the trainer tells a failed collective (one line) from a bug."""

    work: dist.Work
    owner: Optional[Group] = None  # whose blocked_s the wait adds to

    def wait(self) -> None:
        with self.owner.blocking() if self.owner is not None else contextlib.nullcontext():
            self.work.wait()


def solo_group() -> Group:
    """A group of this process alone: every collective on it is a no-op (tp = 1 layers)."""
    return Group("solo", None, [0], 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------- wire volume
# Bytes one rank puts on the wire per call under a ring algorithm: what the counters add and
# what the layout planner (megazero.plan) predicts, from these same functions.


def all_reduce_volume(nbytes: int, n: int) -> int:
    """All-reduce of an `nbytes` tensor over n ranks: reduce-scatter + all-gather, 2 (n-1)/n."""
    return int(2 * (n - 1) / n * nbytes)


def all_gather_volume(shard_nbytes: int, n: int) -> int:
    """All-gather of n shards of `shard_nbytes`: every rank forwards n - 1 of them."""
    return (n - 1) * shard_nbytes


def reduce_scatter_volume(shard_nbytes: int, n: int) -> int:
    """Reduce-scatter into shards of `shard_nbytes`: n - 1 partial shards pass each rank."""
    return (n - 1) * shard_nbytes


# ----------------------------------------------------------------------------- collectives


def all_reduce(t: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               async_op: bool = False) -> Optional[dist.Work]:
    """In-place all-reduce. Ring traffic per rank: 2 (n-1)/n of the tensor."""
    if group.size == 1:
        return None
    group.issue("all_reduce", t, all_reduce_volume(_nbytes(t), group.size))
    with group.blocking():
        return dist.all_reduce(t, op=op, group=group.pg, async_op=async_op)


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: Group,
                    async_op: bool = False) -> Optional[Handle]:
    """Concatenate every rank's `shard` (dim 0) into `out`. Traffic: (n-1) shards."""
    if group.size == 1:
        out.copy_(shard)
        return None
    group.issue("all_gather", shard, all_gather_volume(_nbytes(shard), group.size))
    with group.blocking():
        work = _ALL_GATHER(out, shard.contiguous(), group=group.pg, async_op=async_op)
    return _Async(work, group) if async_op else None


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group: Group,
                        async_op: bool = False, consume: bool = False) -> Optional[Handle]:
    """Sum `full` over the group and keep this rank's 1/n slice of dim 0 in `out`. With
    `async_op` it returns a handle: `out` is final, and `full` free to change, after wait().
    With `consume` the caller gives `full` up (a temporary it drops after): gloo's ring then
    sums in it instead of in a copy, so a reduction holds no second full-size buffer.

    NCCL has a true reduce-scatter. Gloo's reduce_scatter_tensor is an all-reduce
    underneath (2x the traffic), so on gloo we run a ring of point-to-point exchanges that
    moves exactly (n-1)/n of the tensor, as the ZeRO communication volume assumes.
    """
    n = group.size
    if n == 1:
        out.copy_(full)
        return _Done() if async_op else None
    group.issue("reduce_scatter", full, reduce_scatter_volume(_nbytes(out), n))
    if dist.get_backend(group.pg) != "gloo":
        with group.blocking():
            return _REDUCE_SCATTER(out, full.contiguous(), group=group.pg, async_op=async_op)
    if async_op:
        return group.submit(_ring_reduce_scatter, out, full, group, consume)
    with group.blocking():
        _ring_reduce_scatter(out, full, group, consume, pg=group.pg)
    return None


def _ring_reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Group, consume: bool,
                         pg: Optional[dist.ProcessGroup]) -> None:
    """Gloo's reduce-scatter over `pg` (the group's own, or its duplicate on the comm thread);
    partial sums go into `full` itself when the caller gave it up (`consume`), else into a copy."""
    n = group.size
    rows = full.reshape(n, -1)
    chunks = list((rows if consume else rows.clone()).unbind(0))
    nxt, prv = group.ranks[(group.rank + 1) % n], group.ranks[(group.rank - 1) % n]
    incoming = _scratch_like(group, chunks[0])
    for step in range(n - 1):
        send_idx = (group.rank - 1 - step) % n
        recv_idx = (group.rank - 2 - step) % n
        ops = [dist.P2POp(dist.isend, chunks[send_idx], nxt, pg),
               dist.P2POp(dist.irecv, incoming, prv, pg)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        chunks[recv_idx] += incoming
    out.copy_(chunks[group.rank].view_as(out))


def _scratch_like(group: Group, t: torch.Tensor) -> torch.Tensor:
    """A buffer shaped like 1-d `t` (contents undefined): the front of one buffer kept on the
    group per thread, dtype and device, grown to the largest size asked for. A fresh multi-MiB
    buffer per reduction is a fresh mmap (the trainer's mmap threshold, parallel/heap.py) whose
    every page faults on first write; one kept per exact size would keep one per bucket size."""
    key = (threading.get_ident(), t.dtype, t.device)
    buf = group._scratch.get(key)
    if buf is None or buf.numel() < t.numel():
        buf = group._scratch[key] = torch.empty_like(t)
    return buf[: t.numel()]


def all_to_all_volume(nbytes: int, n: int) -> int:
    """All-to-all of an `nbytes` tensor over n ranks: all but this rank's own 1/n leave it."""
    return int((n - 1) / n * nbytes)


def all_to_all(out: torch.Tensor, t: torch.Tensor, group: Group) -> None:
    """Split `t` into n equal pieces along dim 0, piece i to member i; `out` gets member i's
    piece for this rank at its i-th place. Gloo implements it too (all_to_all_single)."""
    if group.size == 1:
        out.copy_(t)
        return
    group.issue("all_to_all", t, all_to_all_volume(_nbytes(t), group.size))
    with group.blocking():
        dist.all_to_all_single(out, t.contiguous(), group=group.pg)


def all_to_all_uneven(t: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: Group) -> torch.Tensor:
    """Rows [sum(send_rows), ...] of `t`, send_rows[i] of them to member i in order -> the rows
    each member sent here, member by member ([sum(recv_rows), ...]). Counts every row that leaves."""
    out = t.new_empty((sum(recv_rows),) + tuple(t.shape[1:]))
    if group.size == 1:
        return out.copy_(t)
    row = _nbytes(t[:1]) if t.shape[0] else 0
    group.issue("all_to_all", t, row * (sum(send_rows) - send_rows[group.rank]))
    with group.blocking():
        dist.all_to_all_single(out, t.contiguous(), recv_rows, send_rows, group=group.pg)
    return out


def reduce(t: torch.Tensor, dst_index: int, group: Group) -> None:
    """Sum `t` over the group into the member with index `dst_index` (not a global rank);
    elsewhere `t` is left undefined."""
    if group.size > 1:
        group.issue("reduce", t, _nbytes(t))
        with group.blocking():
            dist.reduce(t, dst=group.ranks[dst_index], group=group.pg)


def broadcast(t: torch.Tensor, src_index: int, group: Group) -> None:
    """Broadcast from the group member with index `src_index` (not a global rank)."""
    if group.size > 1:
        group.issue("broadcast", t, _nbytes(t))
        with group.blocking():
            dist.broadcast(t, src=group.ranks[src_index], group=group.pg)


def send(t: torch.Tensor, dst_rank: int, group: Group) -> dist.Work:
    group.issue("send", t, _nbytes(t), dst_rank)
    work = dist.isend(t, dst_rank, group=group.pg)
    assert work is not None  # None only on a rank outside the group
    return work


def recv(t: torch.Tensor, src_rank: int, group: Group) -> dist.Work:
    group.issue("recv", t, None, src_rank)
    work = dist.irecv(t, src_rank, group=group.pg)
    assert work is not None
    return work


def batch_p2p(ops: list[tuple[str, torch.Tensor, int]], group: Group) -> list[dist.Work]:
    """Issue a batch of ('send'|'recv', tensor, global_rank) exchanges at once."""
    p2p = []
    for kind, t, peer in ops:
        group.issue(kind, t, _nbytes(t) if kind == "send" else None, peer)
        p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group.pg))
    return dist.batch_isend_irecv(p2p) if p2p else []


def all_gather_object(obj: Any, group: Group) -> list[Any]:
    """Every member's picklable `obj`, in group order (small metadata only)."""
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    group.issue("all_gather_object", None, 0)
    with group.blocking():
        dist.all_gather_object(out, obj, group=group.pg)
    return out


def broadcast_object(obj: Any, src_index: int, group: Group) -> Any:
    """The picklable `obj` of the member with index `src_index`, on every member (small
    metadata only; under NCCL it travels through a tensor on the current CUDA device)."""
    if group.size == 1:
        return obj
    box = [obj]
    group.issue("broadcast_object", None, 0)
    with group.blocking():
        dist.broadcast_object_list(box, src=group.ranks[src_index], group=group.pg)
    return box[0]


def barrier(group: Group) -> None:
    if group.size > 1:
        group.issue("barrier", None, None)
        with group.blocking():
            dist.barrier(group=group.pg)


# ----------------------------------------------------------------------------- f/g pairs


def _summed_in_place(x: torch.Tensor, group: Group) -> torch.Tensor:
    """x summed over the group, in x's own memory (a copy only when x is not contiguous:
    collectives need dense memory, and an expanded gradient shares its storage)."""
    x = x.contiguous()
    all_reduce(x, group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # Each TP rank computed a partial input-gradient from its weight shard: sum them, in
        # place (as Megatron does). Safe because copy_to_tp's output only ever feeds a matmul
        # (column-parallel linear, LM head, LoRA B) or, entering experts split over TP
        # (dispatch.enter_expert_tp), a row gather and a broadcast product: `grad` is then that
        # op's fresh input gradient, handed to this node alone (autograd sums several consumers'
        # gradients into a new buffer), never a tensor also passed elsewhere, as a residual's is.
        return _summed_in_place(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # Summed in place: x is a matmul's (or the embedding's) fresh partial output, which
        # no backward saves. mark_dirty tells autograd, so any use of x saved for backward
        # would fail loudly (version check) rather than see the sum.
        out = _summed_in_place(x, group)
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _TransposedPair(torch.autograd.Function):
    """A collective forward, its transpose backward: an all-gather's transpose is a
    reduce-scatter (each rank's gradient of the whole tensor is partial, from its weight
    shard: sum them, keep this rank's part) or a split, and vice versa."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def transposed_pair(x: torch.Tensor, group: Group, forward_fn: Callable, backward_fn: Callable) -> torch.Tensor:
    """forward_fn(x, group) forward, backward_fn(grad, group) backward: a collective whose
    transpose is another (e.g. Ulysses' two all-to-alls, parallel/context.py)."""
    return _TransposedPair.apply(x, group, forward_fn, backward_fn)


class _AllToAllRows(torch.autograd.Function):
    """all_to_all_uneven forward; backward, the same exchange reversed (the rows' gradients go
    back to where the rows came from)."""

    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, group):
        ctx.send_rows, ctx.recv_rows, ctx.group = send_rows, recv_rows, group
        return all_to_all_uneven(x, send_rows, recv_rows, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_uneven(grad, ctx.recv_rows, ctx.send_rows, ctx.group), None, None, None


def exchange_rows(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: Group) -> torch.Tensor:
    """all_to_all_uneven with its transpose as the backward (expert parallelism's token exchange)."""
    return x if group.size == 1 else _AllToAllRows.apply(x, send_rows, recv_rows, group)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else transposed_pair(x, group, _gather_last, _split_last)


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    moved = x.movedim(-1, 0).contiguous()
    out = torch.empty((group.size * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, moved, group)
    return out.movedim(0, -1).contiguous()


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


# ----------------------------------------------------------------------------- sequence parallelism
# Activations are batch-first, [b, s, h]; sequence parallelism splits dim 1. A rank's shard
# [b, s/n, h] goes on the wire as it is (contiguous, no copy) and the flat collectives
# stack the shards rank-major, [n, b, s/n, h]; one permutation to [b, s, h] follows. At
# micro-batch 1 (the usual case where memory is tight) that permutation is a view, so the
# collectives run on the activations' own memory; above it costs one copy, where Megatron
# instead keeps the whole model sequence-first ([s, b, h]).


def gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, s/n, ...] on each rank -> [b, s, ...], the shards in rank order."""
    n, b, rest = group.size, x.shape[0], tuple(x.shape[2:])
    stacked = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    all_gather_into(stacked.view(-1), x.contiguous().view(-1), group)
    return stacked.transpose(0, 1).reshape((b, n * x.shape[1]) + rest)


def reduce_scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, s, ...] partial on each rank -> this rank's [b, s/n, ...] of the sum."""
    n, b, s, rest = group.size, x.shape[0], x.shape[1], tuple(x.shape[2:])
    if s % n:
        raise ValueError(f"sequence length {s} must be divisible by the tensor-parallel size {n} "
                         f"under sequence parallelism")
    stacked = x.reshape((b, n, s // n) + rest).transpose(0, 1).contiguous()
    out = torch.empty((b, s // n) + rest, dtype=x.dtype, device=x.device)
    reduce_scatter_into(out.view(-1), stacked.view(-1), group)
    return out


def gather_from_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP region from the sequence-split stream: [b, s/n, h] -> [b, s, h]."""
    return x if group.size == 1 else transposed_pair(x, group, gather_sequence, reduce_scatter_sequence)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region into the sequence-split stream: partial [b, s, h] -> summed [b, s/n, h]."""
    return x if group.size == 1 else transposed_pair(x, group, reduce_scatter_sequence, gather_sequence)


def leave_tp(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """A TP region's partial output summed: everywhere (g) or each rank its sequence slice."""
    return reduce_scatter_to_sequence(x, group) if sequence_parallel else reduce_from_tp(x, group)


def agreed(fn: Callable[[], Any], group: Group, catch: tuple[type[Exception], ...] = (UserError,),
           error: Optional[Callable[[int, Any], Exception]] = None, report: Callable[[Exception], Any] = str,
           gather: bool = False) -> Any:
    """Collective: fn() on every member, then every member learns whether all could, so that a
    failure on one (a full disk, a corrupt file) stops them all at the same point instead of
    leaving the others waiting in their next collective: every member raises error(index,
    report(e)) of the first member where fn raised one of `catch` (default: UserError "rank
    INDEX: MESSAGE"; `error` runs on every member, and may be collective). Returns fn()'s
    result, or with `gather` every member's in group order (small picklable values only)."""
    failure, result = None, None
    try:
        result = fn()
    except catch as e:
        failure = (report(e),)
    outcomes = all_gather_object((failure, result if gather else None), group)
    failed = [(i, f[0]) for i, (f, _) in enumerate(outcomes) if f is not None]
    if failed:
        index, message = failed[0]
        raise error(index, message) if error else UserError(f"rank {index}: {message}")
    return [r for _, r in outcomes] if gather else result
