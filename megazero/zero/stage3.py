"""ZeRO stage 3: every parameter lives as 1/dp shards; full values exist only while needed.

The model is cut into *fetch units* along its execution order (per model chunk: the token
embedding, the position embedding, each transformer block, the final norm with the head).
Each unit's parameters form one bucket of the flat layout; the tied embedding weight has a
bucket of its own because two units use it on a single-stage model (embedding, head).

    forward:  pre-hook of a unit's first module  -> gather its buckets (wait), prefetch the
              next `zero.prefetch` units' buckets (async); hook after its last module ->
              free the buckets no later unit of its chunk uses
    backward: a hook on the unit's outputs fires when their gradient arrives, i.e. just
              before the unit's backward -> gather again, prefetch the previous
              `zero.prefetch` units; the gradient sync frees a bucket once every parameter
              of it has its gradient (and has reduce-scattered it)

Fixed issue points. Every rank must issue its DP collectives in one order (NCCL matches
them by position; the reduce-scatters start from autograd hooks on the same communicator),
so an all-gather is issued at a point of the schedule, never when data happens to be ready:
at unit i's hook (either pass), in this order, (1) unit i's buckets, unless already issued,
(2) those of the next `zero.prefetch` units in the pass direction, each waiting for its
slice's read if that is still running, then (3) the read of the unit after those begins
(an NVMe read on the reader thread, no communication), so that it has unit i's compute to
finish before the next hook gathers it. Nothing else issues a gather but the explicit
calls outside passes (`fetch_all`, `fetch`), in bucket order.

So every bucket is all-gathered once per forward and once per backward, and each rank
sends 3Ψ (N-1)/N bytes per micro-batch (two all-gathers, one reduce-scatter). The tied
weight is the one bucket two units share: gathered for the embedding, it stays gathered
through the whole forward until the head has used it, and from the head's backward until
the embedding's backward completes its gradient. That holds the largest single tensor
(V x h / tp) for the whole forward and backward, the price DeepSpeed and FSDP pay for a
tied weight too, instead of a second all-gather of it per forward (+V h / Ψ of the bytes,
~10% at GPT-2 124M). With pp > 1 the embedding and the head are on different stages, each
with its own copy in a unit of its own, and nothing is held.

ZB-H1 (parallel.schedule zbh1) splits backward into B and a deferred W that needs only the
saved inputs and output gradients, not the weights (see parallel/weight_grad.py). While a
chunk's B pass defers its weight gradients, a unit's buckets are released as soon as the
backward of the unit is over (when the previous unit's begins; the chunk's first unit at
the end of the pass), not when their gradients are reduced, which now happens in W: the
same two gathers per micro-batch, and no more gathered at once than in 1F1B.

A parameter's `.data` is a view into its bucket's full buffer while gathered and a shared
empty placeholder while released. Freeing also empties the buffer's storage, because
autograd keeps views of weights (e.g. the transpose inside F.linear) that would otherwise
pin the full tensor until backward; re-gathering refills the same storage object, so those
saved views see the right values again. The memory itself is handed between storages
(`SpareMemory`): a released block's memory is the next same-sized gather's, instead of a
fresh mapping whose every page faults in again.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from megazero.parallel import comm
from megazero.parallel.weight_grad import WeightGradStore
from megazero.zero.partition import FlatLayout, Named, ShardableModel, split_frozen
from megazero.zero.shard_home import ShardHome


@dataclass
class FetchUnit:
    """One of the model's units (see `GPT.units`) and the layout buckets it gathers."""

    chunk: int
    start: nn.Module
    end: nn.Module
    outputs: list[nn.Module]
    buckets: tuple[int, ...]


def fetch_units(chunks: Sequence[ShardableModel]) -> tuple[list[FetchUnit], list[tuple[int, Named]]]:
    """The fetch units of each model chunk in execution order (the chunk's own `units()`),
    and the layout's bucket groups: one per unit (two when it holds trainable and frozen
    parameters), plus one per tied weight."""
    units: list[FetchUnit] = []
    groups: list[tuple[int, Named]] = []
    for ci, chunk in enumerate(chunks):
        tied = chunk.tied_weight()
        tied_bucket = None
        if tied is not None:
            name = next(n for n, p in chunk.named_parameters() if p is tied)
            tied_bucket = len(groups)
            groups.append((ci, [(name, tied)]))
        for part in chunk.units():
            kinds = split_frozen([(ci, part.named)])
            own = tuple(range(len(groups), len(groups) + len(kinds)))
            groups += kinds
            units.append(FetchUnit(ci, part.start, part.end, part.outputs,
                                   own + ((tied_bucket,) if part.uses_tied else ())))  # type: ignore[operator]  # uses_tied: a tied bucket
    return units, groups


class SpareMemory:
    """Memory of released buckets, by size, for the next gathers of that size: at each hook of a
    pass only as many as the pass's later gathers of that size will take are kept (`trim`), so
    that none waits through the end of a pass (the end of backward, where the embedding's
    gradient is formed, is the peak), and none is held through the optimizer step.

    A bucket's storage object must stay the same while its memory comes and goes (autograd's
    saved views refer to the storage object), so memory moves between storage objects by
    swapping their data pointers. Transformer blocks' buckets are all one size, so a pass
    reuses the few block buffers of its prefetch window: on a CPU a fresh mapping of tens of
    MiB per gather costs its page faults again every time, ~1/4 of ZeRO-3's iteration. Where
    torch lacks the swap, storages are resized (freed and mapped again) as before."""

    def __init__(self) -> None:
        self.free: dict[int, list[torch.UntypedStorage]] = {}  # nbytes -> spares (one device: the gatherer's)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty `storage` `nbytes` of memory: a spare block of that size if any."""
        spares = self.free.get(nbytes)
        if spares and _SWAP is not None:
            _SWAP(storage, spares.pop())
        else:
            storage.resize_(nbytes)

    def take(self, storage: torch.UntypedStorage) -> None:
        """Empty `storage`, keeping its memory as a spare."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if _SWAP is None:
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        _SWAP(storage, holder)
        self.free.setdefault(nbytes, []).append(holder)

    def trim(self, wanted: Counter) -> None:
        """Keep at most wanted[nbytes] spares of each size."""
        for nbytes, spares in self.free.items():
            del spares[wanted[nbytes]:]

    def clear(self) -> None:
        self.free.clear()

    @property
    def nbytes(self) -> int:
        return sum(nbytes * len(spares) for nbytes, spares in self.free.items())


_SWAP = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
"""Exchanges two storages' memory (and sizes); private in torch, hence the fallback."""


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. recomputing a checkpointed block)."""
    return torch._C._current_graph_task_id() != -1


class ParamGatherer:
    """Gathers and frees the full parameters of stage-3 buckets; counts what is materialized.

    A bucket's slice comes from its shard home (at once from memory; from NVMe on a reader
    thread, started by `read_ahead` a unit before it is due, so the read overlaps compute),
    then is all-gathered. `fetch` is the issue point of that all-gather: it waits for the
    read if need be and issues at once, so which collectives a rank issues, and in what
    order, follow from the sequence of hooks alone, however long the reads take (see the
    module docstring for where the hooks issue them)."""

    def __init__(self, layout: FlatLayout, home: ShardHome, units: list[FetchUnit], groups: Mapping[str, comm.Group],
                 prefetch: int, dtype: torch.dtype, device: torch.device,
                 weight_grads: Sequence[Optional[WeightGradStore]] = ()) -> None:
        """`groups`: ZeRO's groups by kind (a bucket is gathered over `groups[bucket.group]`);
        `weight_grads`: each model chunk's store of deferred weight gradients (zbh1), if any."""
        self.layout, self.home, self.units = layout, home, units
        self.dp = [groups[b.group] for b in layout.buckets]  # the group each bucket is gathered over
        self.weight_grads = list(weight_grads)
        self.prefetch, self.device = prefetch, device
        self.placeholder = torch.empty(0, dtype=dtype, device=device)
        self.full = [torch.empty(b.numel, dtype=dtype, device=device) for b in layout.buckets]
        self.spare = SpareMemory()
        self.later: dict[tuple[int, int], Counter] = {}  # (unit, pass direction) -> _gathers_after
        # One rank's slice is the whole bucket: when the shard lies in memory on the device, the
        # parameters view it and nothing is gathered. A fresh read or host copy is still copied
        # into the bucket's buffer, which release frees: autograd's saved views of a weight would
        # otherwise keep every unit's read alive until its backward. Per bucket: experts' group
        # may be of one rank where dp x cp is not.
        self.alone = [g.size == 1 and home.resident_on(device) for g in self.dp]
        self.reads: dict[int, Future] = {}  # bucket -> its slice read ahead, not yet gathered
        self.pending: dict[int, Optional[comm.Handle]] = {}  # bucket -> in-flight gather
        self.gathered: set[int] = set()
        self.materialized_numel = 0
        self.peak_materialized_numel = 0
        self.done_after_forward = [self._last_use(i) for i in range(len(units))]
        self.pass_end_queued = False  # a deferring B pass's end is to release its chunk's first units
        # per unit, the first and last units of its chunk
        self.chunk_span = [(min(j for j, v in enumerate(units) if v.chunk == u.chunk),
                            max(j for j, v in enumerate(units) if v.chunk == u.chunk)) for u in units]
        for full in self.full:
            full.untyped_storage().resize_(0)
        for i, unit in enumerate(units):
            unit.start.register_forward_pre_hook(lambda m, a, i=i: self._before_forward(i))
            unit.end.register_forward_hook(lambda m, a, o, i=i: self._after_forward(i))
            for module in unit.outputs:
                module.register_forward_hook(lambda m, a, o, i=i: self._watch_output(i, o))

    # ------------------------------------------------------------------ buckets

    def release_storage(self) -> None:
        """Point every parameter at the placeholder (their values are in the shard home)."""
        for b in range(len(self.full)):
            self._free_storage(b)

    def _free_storage(self, b: int) -> None:
        for slot in self.layout.buckets[b].slots:
            slot.param.data = self.placeholder
        if not self.alone[b]:
            self.spare.take(self.full[b].untyped_storage())

    def read_ahead(self, b: int) -> None:
        """Start loading this rank's slice of bucket b from its shard home (an NVMe read runs
        on the reader thread), to be all-gathered later. Moves no data between ranks."""
        if b not in self.gathered and b not in self.pending and b not in self.reads:
            self.reads[b] = self.home.load(self.layout.buckets[b])

    def fetch(self, b: int, wait: bool = True) -> None:
        """Issue bucket b's all-gather now if it is not issued yet (this call is its issue
        point: when b's slice is still being read, it waits for the read first); with `wait`,
        complete it and point the parameters at the full buffer."""
        if b not in self.gathered and b not in self.pending:
            source = self.reads.pop(b, None)
            if source is None:
                source = self.home.load(self.layout.buckets[b])
            mine = source.result().to(self.device, non_blocking=True)
            if self.alone[b]:  # the slice is the bucket, in the shard itself: nothing to gather or wait for
                self._point(b, mine)
                return
            full = self.full[b]
            self.spare.fill(full.untyped_storage(), full.nbytes)
            self.materialized_numel += self.layout.buckets[b].numel
            self.peak_materialized_numel = max(self.peak_materialized_numel, self.materialized_numel)
            self.pending[b] = comm.all_gather_into(full, mine, self.dp[b], async_op=True)
        if wait and b in self.pending:
            work = self.pending.pop(b)
            if work is not None:
                work.wait()
            self._point(b, self.full[b])

    def _point(self, b: int, full: torch.Tensor) -> None:
        """Bucket b is gathered: its parameters view `full`."""
        for slot in self.layout.buckets[b].slots:
            slot.param.data = full[slot.offset: slot.offset + slot.numel].view(slot.shape)
        self.gathered.add(b)

    def release(self, b: int) -> None:
        if b in self.pending:
            self.fetch(b)  # never free a buffer a collective is still writing into
        if b in self.gathered:
            self.gathered.discard(b)
            if not self.alone[b]:
                self.materialized_numel -= self.layout.buckets[b].numel
            self._free_storage(b)

    def fetch_all(self, buckets: Optional[Iterable[int]] = None) -> list[int]:
        """Gather these buckets (every one by default); return those that were not gathered before."""
        newly = [b for b in (range(len(self.full)) if buckets is None else buckets) if b not in self.gathered]
        for b in newly:
            self.fetch(b, wait=False)
        for b in newly:
            self.fetch(b)
        return newly

    def release_all(self) -> None:
        """Free every bucket, and drop the slices read ahead (the step is about to change them)."""
        for b in range(len(self.full)):
            self.release(b)
        for source in self.reads.values():
            source.result()
        self.reads.clear()
        self.spare.clear()

    def _last_use(self, i: int) -> tuple[int, ...]:
        """Unit i's buckets that no later unit of its chunk uses in forward (all but the tied
        one, when the head comes later): freed after unit i's forward."""
        later = {b for u in self.units[i + 1:] if u.chunk == self.units[i].chunk for b in u.buckets}
        return tuple(b for b in self.units[i].buckets if b not in later)

    def deferring(self, chunk: int) -> bool:
        """Whether a B pass of `chunk` is deferring its weight gradients (zbh1) right now."""
        store = self.weight_grads[chunk] if chunk < len(self.weight_grads) else None
        return store is not None and store.deferring

    def reduced(self, b: int) -> None:
        """Bucket b's gradient is complete and reduced: release it, unless a B pass of its
        chunk is running (its units release their buckets themselves, when done with them)."""
        if not self.deferring(self.layout.buckets[b].chunk):
            self.release(b)

    def _end_pass(self, first: int, last: int) -> None:
        self.pass_end_queued = False
        self._release_after_backward(range(first, last + 1))

    def _release_after_backward(self, units: range, keep: tuple[int, ...] = ()) -> None:
        """The backward of `units` is over. Their trainable buckets are released once their
        gradients are reduced; frozen ones get no gradient to wait for, nor, in a deferring B
        pass, do the weights (their W needs none): those are released here, but for `keep`."""
        for unit in (self.units[j] for j in units):
            deferring = self.deferring(unit.chunk)
            for b in unit.buckets:
                if b not in keep and (deferring or not self.layout.buckets[b].trainable):
                    self.release(b)

    # ------------------------------------------------------------------ hooks

    def _neighbours(self, i: int, step: int, count: int) -> list[FetchUnit]:
        """Up to `count` units after (step 1) or before (step -1) unit i in its chunk."""
        out: list[FetchUnit] = []
        j = i + step
        while len(out) < count and 0 <= j < len(self.units) and self.units[j].chunk == self.units[i].chunk:
            out.append(self.units[j])
            j += step
        return out

    def _prefetch(self, i: int, step: int) -> None:
        """The fixed issue points at unit i's hook (step 1 in forward, -1 in backward): the
        all-gathers of the next `prefetch` units, in pass order, each waiting for its slice
        if the read is not done; then the read of the unit after them, which has unit i's
        compute to finish before the next hook gathers it."""
        ahead = self._neighbours(i, step, self.prefetch + 1)
        for unit in ahead[:self.prefetch]:
            for b in unit.buckets:
                self.fetch(b, wait=False)
        for unit in ahead[self.prefetch:]:
            for b in unit.buckets:
                self.read_ahead(b)
        self.spare.trim(self._gathers_after(i, step))

    def _gathers_after(self, i: int, step: int) -> Counter:
        """Bytes of the buckets this pass gathers after unit i's hook has issued its prefetches,
        by size (a pass's later demand for spare memory)."""
        key = (i, step)
        if key not in self.later:
            units = self._neighbours(i, step, len(self.units))[self.prefetch:]
            self.later[key] = Counter(self.layout.buckets[b].numel * self.placeholder.element_size()
                                      for u in units for b in u.buckets)
        return self.later[key]

    def _before_forward(self, i: int) -> None:
        for b in self.units[i].buckets:
            self.fetch(b)
        if not in_backward():  # a recomputation inside backward would prefetch the wrong way
            self._prefetch(i, 1)

    def _after_forward(self, i: int) -> None:
        if in_backward():  # recomputed forward: backward needs these parameters next
            return
        for b in self.done_after_forward[i]:
            self.release(b)

    def _watch_output(self, i: int, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad and torch.is_grad_enabled():
            output.register_hook(lambda grad: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        first, last = self.chunk_span[i]
        self._release_after_backward(range(i + 1, last + 1), keep=self.units[i].buckets)
        if self.deferring(self.units[i].chunk) and not self.pass_end_queued:
            # the backward of the chunk's first unit is over when the B pass is
            self.pass_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_pass(first, last))
        for b in self.units[i].buckets:
            self.fetch(b)
        self._prefetch(i, -1)
