"""Gradient synchronisation over data parallelism: fp32 gradient buffers, the hooks that
fill them, and their reduction as buckets complete.

    full buffers (stages 0/1)   autograd accumulates into fp32 buckets over micro-batches;
                                in the last backward (outside no_sync) each bucket is
                                all-reduced asynchronously (stage 0) or reduce-scattered
                                into its own slice (stage 1) the moment it is complete
    sharded (stages 2/3)        every backward fills a full fp32 bucket, taken from a pool
                                reused through the iteration, and reduce-scatters it into
                                this rank's shard at once, so a rank only ever keeps (and
                                accumulates) its shard; the bucket goes back to the pool once
                                its reduction is waited. Alone (dp 1) in fp32 the shard is
                                the whole bucket: gradients are added straight into it

Every reduction is asynchronous: launched when its bucket is complete (so it overlaps the
rest of backward) and waited, in launch order, before the step (`finish`), before the
buffers are zeroed, or early, to bound memory: at stages 2/3 a launched reduction keeps its
full bucket until waited, so the oldest are waited while the launched ones hold more than
`IN_FLIGHT_BYTES` (always allowing `MIN_IN_FLIGHT` of them: a bucket reduced again in the
next micro-batch simply queues behind its previous reduction, whose result is added to the
shard first); with ZeRO-Offload the last backward's reductions are bounded alike, so
`on_final` hands slices to the host during backward. The gradient values never depend on
when a reduction is waited: the fp32 additions into a shard happen in launch order.

Gradients accumulate in fp32 whatever the compute dtype (Megatron's main_grad: summing 16
bf16 micro-batch gradients in bf16 would lose ~4 bits); `reduce_dtype` is only the dtype
they travel in. The tied embedding's gradient is summed over the embedding group last.

Under ZeRO the token embedding's gradient arrives as the rows looked up (a sparse tensor:
VocabParallelEmbedding.sparse_grad, chosen by train/parallelize.py) and is added into its
bucket row by row, so no dense V x h gradient exists beside the bucket; a gradient that is a whole bucket by itself (the tied
embedding's, once autograd has summed the head's part into it) becomes the bucket to reduce.

Each bucket is reduced over its own ZeRO group (`Bucket.group`: dp x cp, or expert-dp for the
experts' buckets). Only trainable buckets take part: frozen parameters (the base model under LoRA) have no
gradient buffer, no hook and no DP traffic. `reduced_numel` counts the gradient elements
this rank has put into DP reductions (trainable buckets only, by construction), beside the
DP group's byte counter.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from megazero.config.sharding import Sharding
from megazero.parallel import comm
from megazero.zero.partition import Bucket, FlatBuffers, FlatLayout, FlatSlot

# Bounded reductions in flight (see _InFlight.held) are capped by the bytes they hold, not by
# their number: a count that suits 100 MB buckets (two: one on the wire while the next fills)
# stalls backward behind the wire with small buckets, and a count that suits small buckets
# would hold gigabytes with large ones. 64 MiB is a few default-sized stage-3 units or
# small-bucket reductions: enough to keep the link busy through backward, little beside the
# model states. MIN_IN_FLIGHT keeps double buffering when one bucket alone exceeds it.
IN_FLIGHT_BYTES = 64 * 2 ** 20
MIN_IN_FLIGHT = 2


@dataclass(eq=False)
class _InFlight:
    """A launched reduction: its handle, what completes it once waited (copy or add into the
    fp32 slice), and the tensor on the wire, kept alive until then."""

    handle: Optional[comm.Handle]
    then: Optional[Callable[[], object]]
    wire: torch.Tensor
    # Bytes counted against IN_FLIGHT_BYTES (0: unbounded, waited only by finish/wait): it holds
    # a full bucket (stages 2/3), or its final slice is awaited by on_final (ZeRO-Offload's host copy).
    held: int
    final: Optional[Bucket]  # its gradient slice is final for the iteration once completed (on_final)
    pooled: tuple[torch.Tensor, ...] = ()  # pool buffers it uses, given back once it is completed


class _Pool:
    """Reused buffers: the stage-2/3 full buckets, their 16-bit wire copies and reduced slices.
    A buffer is taken when a bucket starts filling and given back once its reduction is
    waited, so an iteration allocates only as many as are in use at once, not one per bucket
    and backward (a fresh full-size allocation costs page faults and a memset on CPU). Bucket
    sizes differ (zero.bucket_size groups whole parameters), so a request takes the smallest
    free buffer of its dtype that holds it and gets a view of its front: buffers kept per exact
    size would each be used once and all be held until `finish` empties the pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._base: dict[int, torch.Tensor] = {}  # a taken view's data_ptr -> the buffer it is the front of

    def take(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer of numel elements, contents undefined."""
        free = self._free.setdefault(dtype, [])
        fits = [i for i, t in enumerate(free) if t.numel() >= numel]
        if fits:
            base = free.pop(min(fits, key=lambda i: free[i].numel()))
        else:
            base = torch.empty(numel, dtype=dtype, device=self.device)
        view = base[:numel]
        self._base[view.data_ptr()] = base
        return view

    def give(self, t: torch.Tensor) -> None:
        self._free.setdefault(t.dtype, []).append(self._base.pop(t.data_ptr()))

    def clear(self) -> None:
        self._free.clear()
        self._base.clear()


@dataclass(eq=False)
class _Filling:
    """A stage-2/3 bucket's full fp32 gradient being filled in one backward. A pooled buffer
    holds the last use's values: the first gradient into a slot is copied rather than added
    (no memset of the whole bucket per backward), and what got none (padding, parameters
    without a gradient) is zeroed when the bucket is complete."""

    buf: torch.Tensor
    pooled: bool
    written: set[str] = field(default_factory=set)

    def put(self, s: FlatSlot, grad: torch.Tensor) -> None:
        view = self.buf[s.offset: s.offset + s.numel].view(s.shape)
        if s.name in self.written:
            add_gradient(view, grad)
        elif grad.is_sparse:
            view.zero_()
            add_gradient(view, grad)
        else:
            view.copy_(grad)  # exactly 0 + grad, in fp32 whatever grad's dtype
        self.written.add(s.name)

    def complete(self, b: Bucket) -> torch.Tensor:
        """The bucket's gradient, every element not written zeroed."""
        end = 0
        for s in sorted(b.slots, key=lambda s: s.offset):
            self.buf[end: s.offset].zero_()
            if s.name not in self.written:
                self.buf[s.offset: s.offset + s.numel].zero_()
            end = s.offset + s.numel
        self.buf[end:].zero_()
        return self.buf


def add_gradient(into: torch.Tensor, grad: torch.Tensor) -> None:
    """into += grad, in into's dtype; a sparse gradient (an embedding's looked-up rows) row by row."""
    if grad.is_sparse:
        into.index_add_(0, grad._indices()[0], grad._values().to(into.dtype))
    else:
        into.add_(grad)


class GradientSync:
    """fp32 gradients of one model-parallel rank's buckets and their DP reduction."""

    def __init__(self, layout: FlatLayout, *, sharding: Sharding, model_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, groups: Mapping[str, comm.Group], embed: Optional[comm.Group],
                 tied_buckets: list[int],
                 device: torch.device, on_reduced: Optional[Callable[[int], None]] = None,
                 on_final: Optional[Callable[[Bucket, torch.Tensor], None]] = None):
        """`on_reduced(bucket)`: a sharded bucket's gradient is reduced (stage 3 releases its
        parameters); `on_final(bucket, slice)`: a reduced gradient slice is final for the
        iteration (last backward; tied ones after their embedding sum: ZeRO-Offload's host copy).
        `groups`: ZeRO's groups by kind; a bucket's gradient is reduced over `groups[bucket.group]`."""
        self.layout, self.sharding, self.embed = layout, sharding, embed
        self.dp = [groups[b.group] for b in layout.buckets]  # the group each bucket is reduced over
        self.model_dtype, self.reduce_dtype, self.device = model_dtype, reduce_dtype, device
        self.sharded = sharding.gradients
        self.tied_buckets = tied_buckets  # summed over `embed` (None on stages without the embedding)
        self.on_reduced, self.on_final = on_reduced, on_final
        # This rank's fp32 gradients: buffers.view(range), buffers.own_slice(bucket) (its reduced slice).
        self.buffers = FlatBuffers(layout, sharded=self.sharded, dtype=torch.float32, device=device,
                                   trainable_only=True)
        self.reduced_numel = 0
        self._sync = True
        self._ready: dict[int, set[str]] = {}
        self._reduced: set[int] = set()
        self._in_flight: deque[_InFlight] = deque()  # launched, not yet waited, in launch order
        self._pending: dict[int, _Filling] = {}  # sharded: bucket -> full fp32 gradient being filled
        self._pool = _Pool(device)
        # Nothing to sum with and nothing to round to a wire dtype: a full bucket filled only to be
        # added into the shard would be a second copy of it (the largest, a block's, at the peak).
        self._direct = [self.sharded and g.size == 1 and reduce_dtype == torch.float32 for g in self.dp]
        self._slots = [(b, s) for b in layout.trainable_buckets() for s in b.slots]
        self._slot_of = {id(s.param): (b, s) for b, s in self._slots}
        for b, s in self._slots:
            s.param.register_post_accumulate_grad_hook(lambda p, b=b, s=s: self._grad_ready(b, s, p))

    # ------------------------------------------------------------------ views

    def bucket_view(self, b: Bucket, s: FlatSlot) -> torch.Tensor:
        """Full buffers: parameter s's place in the fp32 gradient bucket b."""
        return self.buffers.full[b.index][s.offset: s.offset + s.numel].view(s.shape)

    # ------------------------------------------------------------------ accumulation

    def zero_grad(self) -> None:
        self.wait()  # nothing may still write into the buffers zeroed here
        self._ready.clear()
        self._reduced.clear()
        for g in self.buffers.tensors():
            g.zero_()
        # fp32 model with full buffers: gradients are views into the buckets, so autograd
        # accumulates in place and a bucket is ready to send without a copy. Otherwise the
        # hook adds each backward's gradient into fp32 storage and drops it.
        in_place = not self.sharded and self.model_dtype == torch.float32
        for b, s in self._slots:
            s.param.grad = self.bucket_view(b, s) if in_place else None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication.
        Sharded gradients are reduced every micro-batch anyway, so for them it changes nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def add_grad(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Sharded stages: take p's gradient `grad` as its hook takes p.grad, without p holding
        it (ZB-H1's deferred weight gradients at ZeRO-3, when p is released)."""
        b, s = self._slot_of[id(p)]
        self._add_sharded(b, s, grad)
        self._mark_ready(b, s)

    def _add_sharded(self, b: Bucket, s: FlatSlot, grad: torch.Tensor, owned: bool = False) -> None:
        """Add p's gradient into bucket b's full fp32 gradient being filled. An `owned` gradient
        (autograd's, already dropped by p) that is the whole bucket becomes that buffer itself:
        no second copy of the largest gradient (the tied embedding's) while it waits to be reduced."""
        if self._direct[b.index]:
            add_gradient(self.buffers.own_slice(b)[s.offset: s.offset + s.numel].view(s.shape), grad)
            return
        filling = self._pending.get(b.index)
        if filling is None:
            whole = (owned and len(b.slots) == 1 and grad.numel() == b.numel and grad.dtype == torch.float32
                     and grad.layout == torch.strided and grad.is_contiguous())
            if whole:
                self._pending[b.index] = _Filling(grad.view(-1), pooled=False, written={s.name})
                return
            filling = self._pending[b.index] = _Filling(self._pool.take(b.numel), pooled=True)
        filling.put(s, grad)

    def _grad_ready(self, b: Bucket, s: FlatSlot, p: nn.Parameter) -> None:
        """Called by autograd once p's gradient of this backward pass is accumulated."""
        if self.sharded:
            grad, p.grad = p.grad, None  # the full gradient lives on only in the bucket until it is reduced
            assert grad is not None
            self._add_sharded(b, s, grad, owned=True)
        else:
            if p.grad is not None and p.grad.dtype != torch.float32:
                add_gradient(self.bucket_view(b, s), p.grad)  # fp32 accumulation of a 16-bit gradient
                p.grad = None
            if not self._sync:
                return
            if b.index in self._reduced:
                raise RuntimeError(f"zero stage {self.sharding.stage} reduces gradients once per iteration, but bucket "
                                   f"{b.index} ({s.name}) got a second synchronised backward; wrap every backward "
                                   f"but the last of each model chunk in optimizer.no_sync()")
        self._mark_ready(b, s)

    def _mark_ready(self, b: Bucket, s: FlatSlot) -> None:
        ready = self._ready.setdefault(b.index, set())
        ready.add(s.name)
        if len(ready) == len(b.slots):
            self._reduce(b)

    # ------------------------------------------------------------------ reduction

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        """An fp32 gradient as it is communicated (zero.reduce_dtype)."""
        return t if self.reduce_dtype == torch.float32 else t.to(self.reduce_dtype)

    def _reduce(self, b: Bucket) -> None:
        self._ready.pop(b.index, None)
        self.reduced_numel += b.numel
        pooled: tuple[torch.Tensor, ...] = ()
        if self.sharded:
            if self._direct[b.index]:  # already in the shard
                handle, then, wire = None, None, self.buffers.own_slice(b)[:0]
            else:
                filling = self._pending.pop(b.index)
                handle, then, wire, pooled = self._reduce_scatter(b, filling.complete(b), add=True,
                                                                  pooled=filling.pooled)
            if self.on_reduced is not None:
                self.on_reduced(b.index)
        elif self.sharding.replicated:  # every rank keeps the whole reduced bucket
            full = self.buffers.full[b.index]
            wire = self._on_wire(full)
            handle = comm.all_reduce(wire, self.dp[b.index], async_op=True)
            then = None if wire is full else (lambda: full.copy_(wire))
        else:
            handle, then, wire, pooled = self._reduce_scatter(b, self.buffers.full[b.index], add=False)
        self._reduced.add(b.index)
        final = self.on_final is not None and self._sync and b.index not in self.tied_buckets
        # Stages 2/3 hold the bucket on the wire and its reduced slice until waited (nothing at one rank).
        held = wire.nbytes + sum(t.nbytes for t in pooled if t is not wire) if self.sharded and handle else 0
        self._launched(_InFlight(handle, then, wire, held, b if final else None, pooled))

    def _reduce_scatter(self, b: Bucket, full: torch.Tensor, add: bool, pooled: bool = False) -> tuple:
        """Launch the sum of fp32 bucket `full` over DP in the reduce dtype: (handle, what
        completes it, tensor on the wire, pool buffers to give back once it is completed).
        Once waited, it writes (stage 1) or adds (stages 2/3, once per micro-batch) this rank's
        slice into its fp32 gradient slice. A `pooled` full bucket goes back to the pool once
        nothing reads it any more."""
        into = self.buffers.own_slice(b)
        dp = self.dp[b.index]
        if dp.size == 1:  # nothing to sum with: no wire, no second full-size buffer kept in flight
            (into.add_ if add else into.copy_)(self._on_wire(full).to(into.dtype))
            if pooled:
                self._pool.give(full)
            return None, None, into[:0], ()
        wire = full
        if self.reduce_dtype != torch.float32:  # the 16-bit copy travels; the fp32 bucket is free at once
            wire = self._pool.take(full.numel(), self.reduce_dtype)
            wire.copy_(full)
            if pooled:
                self._pool.give(full)
        if wire is full and not add:  # stage 1 in fp32: reduced in place, into full's own slice
            # Only that slice is read after the reduction (the step, the norm, the host copy), and
            # zero_grad clears the rest: gloo's ring may leave its partial sums in the others.
            return comm.reduce_scatter_into(into, full, dp, async_op=True, consume=True), None, full, ()
        out = self._pool.take(b.shard_numel, wire.dtype)
        # The wire is a temporary (the stage-2/3 bucket being filled, or a 16-bit copy): the
        # reduction may sum in it rather than in a second full-size buffer.
        handle = comm.reduce_scatter_into(out, wire, dp, async_op=True, consume=add or wire is not full)
        back = (out,) + ((wire,) if wire is not full or pooled else ())
        return handle, (lambda: into.add_(out)) if add else (lambda: into.copy_(out)), wire, back

    def _launched(self, f: _InFlight) -> None:
        """Record a launched reduction; while the bounded ones in flight exceed their bound,
        wait for the oldest. Nothing else is waited before finish(): the persistent buffers of
        stages 0/1 need no early completion."""
        self._in_flight.append(f)
        while self._over_bound():
            self._complete_oldest()

    def _over_bound(self) -> bool:
        """More than MIN_IN_FLIGHT bounded reductions in flight, and together they hold more than
        IN_FLIGHT_BYTES, or one of them awaits ZeRO-Offload's host copy: those keep double
        buffering, so slices leave for the host during backward however small the buckets."""
        bounded = [x for x in self._in_flight if x.held or x.final is not None]
        if len(bounded) <= MIN_IN_FLIGHT:
            return False
        return any(x.final is not None for x in bounded) or sum(x.held for x in bounded) > IN_FLIGHT_BYTES

    def _complete_oldest(self) -> None:
        f = self._in_flight.popleft()
        if f.handle is not None:
            f.handle.wait()
        if f.then is not None:
            f.then()
        for t in f.pooled:  # nothing reads them any more: the next bucket filled may take them
            self._pool.give(t)
        if f.final is not None:  # the slice holds the iteration's reduced gradient now
            assert self.on_final is not None  # set when `final` is
            self.on_final(f.final, self.buffers.own_slice(f.final))

    @property
    def in_flight(self) -> int:
        """Reductions launched and not yet waited."""
        return len(self._in_flight)

    def wait(self) -> None:
        """Complete every launched reduction, in launch order."""
        while self._in_flight:
            self._complete_oldest()

    def finish(self) -> None:
        """Complete the DP reduction (buckets some parameter of which got no gradient are sent
        now, in bucket order on every rank), then sum the tied embedding over its group."""
        if self.sharded:
            for index in sorted(self._ready):  # those with a gradient in this iteration but not for all their slots
                self._reduce(self.layout.buckets[index])
        else:
            for b in self.layout.trainable_buckets():
                if b.index not in self._reduced:
                    self._reduce(b)
        self.wait()
        # Reuse is within one backward: kept until the next one, the pool would sit resident
        # through the step, above the peak the planner counts.
        self._pool.clear()
        for index in self.tied_buckets:
            b = self.layout.buckets[index]
            assert self.embed is not None  # given with the tied buckets
            comm.all_reduce(self.buffers.own_slice(b), self.embed)
            if self.on_final is not None:
                self.on_final(b, self.buffers.own_slice(b))
