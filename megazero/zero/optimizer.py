"""ZeRO-sharded data parallelism: gradient reduction over DP replicas, global-norm clipping,
fp16 loss scaling and AdamW on fp32 master weights, at stages 0 to 3.

    stage 0  every rank keeps everything; gradient buckets are all-reduced (async) as they
             become ready during the last backward of the iteration
    stage 1  optimizer state (fp32 master, Adam moments) partitioned over DP: buckets are
             reduce-scattered in that last backward, each rank steps its shard, updated
             parameters are all-gathered
    stage 2  gradients partitioned as well: every backward reduce-scatters each bucket as it
             fills and a rank accumulates only its shard across micro-batches
    stage 3  parameters partitioned as well (see stage3.py): gathered per module on demand,
             never all-gathered after the step

Gradients accumulate in fp32 buffers at every stage and precision (zero.reduce_dtype sets
only the DP wire dtype). A step whose gradient norm or any rank's loss is inf/NaN is
skipped on every rank, in every precision. A model built on the meta device is
materialized here: each rank writes only the elements it owns (see materialize.py).

Interface used by the trainer and the pipeline schedules:
    zero_grad()           before the first micro-batch of an iteration
    scale_loss(loss)      loss multiplier before backward (fp16 loss scaling)
    no_sync()             context for every backward but the last of each model chunk
    finish_grad_sync()    after the last backward: complete DP reduction, sum tied embeddings
    step(lr, loss) -> StepResult                 skipped everywhere on inf/NaN
    all_finite()          whether every rank's master weights are finite (before saving)
    state_dict() / load_state_dict()           this rank's shard plus the partition map
    model_state_dict() / load_model_state_dict()  the model's parameters (shards at stage 3)
    gathered_parameters() / full_state_dict()  full parameters on request at stage 3
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from megazero.config import Config
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.host import HostStaging
from megazero.zero.materialize import replace_meta_parameters
from megazero.zero.partition import Bucket, Layout, Range, Slot, build_layout, sub_groups
from megazero.zero.precision import COMPUTE_DTYPE, DynamicLossScaler
from megazero.zero.stage3 import Named, ParamGatherer, fetch_units


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: Optional[float] = None


class ShardableModel(Protocol):
    """What ZeRO needs from each model chunk (megazero.model.gpt.GPT provides it)."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def tied_weight(self) -> Optional[nn.Parameter]:
        """The embedding copy whose gradient is summed over the embedding group."""

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters AdamW does not decay."""

    def units(self) -> list:
        """Stage 3's fetch units in execution order (see GPT.units)."""

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """A parameter's starting value on this TP rank (materializes meta-device models)."""


def bucket_groups(chunks: list[nn.Module], bucket_size: int) -> list[tuple[int, Named]]:
    """Stages 0-2: parameters in reverse execution order (the order gradients become ready),
    cut into buckets of about `bucket_size` elements that never span two model chunks (each
    chunk's last backward comes at its own time). The tied embedding weight gets a bucket of
    its own, so the first and last stages partition it identically and can sum its shards."""
    groups: list[tuple[int, Named]] = []
    for ci in reversed(range(len(chunks))):
        tied = chunks[ci].tied_weight()
        named = list(chunks[ci].named_parameters())
        groups += [(ci, [(n, p)]) for n, p in named if p is tied]
        current: Named = []
        size = 0
        for n, p in reversed(named):
            if p is tied:
                continue
            if current and size + p.numel() > bucket_size:
                groups.append((ci, current))
                current, size = [], 0
            current.append((n, p))
            size += p.numel()
        if current:
            groups.append((ci, current))
    return groups


def adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], decayed: list[torch.Tensor], *, lr: float, weight_decay: float,
           beta1: float, beta2: float, eps: float, step: int) -> None:
    """AdamW on lists of flat fp32 tensors. On the CPU element for element what
    torch.optim.AdamW (foreach=False) computes, so sharded and unsharded runs agree bitwise
    per element; on a GPU PyTorch's fused kernel (one launch per list, same update up to
    rounding)."""
    if params and params[0].device.type == "cuda":
        _fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, decayed, lr=lr, weight_decay=weight_decay,
                      beta1=beta1, beta2=beta2, eps=eps, step=step)
        return
    if decayed and weight_decay:
        torch._foreach_mul_(decayed, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2 ** step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


def _fused_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], decayed: list[torch.Tensor], *, lr: float, weight_decay: float,
                  beta1: float, beta2: float, eps: float, step: int) -> None:
    """The kernel behind torch.optim.AdamW(fused=True), once for the decayed tensors and
    once for the rest."""
    is_decayed = {id(t) for t in decayed}
    for wd, keep in ((weight_decay, True), (0.0, False)):
        idx = [i for i, p in enumerate(params) if (id(p) in is_decayed) == keep]
        if not idx:
            continue
        step_t = torch.tensor(float(step), device=params[idx[0]].device)  # read, not updated, by the kernel
        torch._fused_adamw_([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                            [exp_avg_sqs[i] for i in idx], [], [step_t] * len(idx), lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=wd, eps=eps, amsgrad=False, maximize=False)


class ZeroOptimizer:
    """ZeRO stages 0-3 over one model-parallel rank's model chunks (see the module docstring)."""

    def __init__(self, chunks: list[ShardableModel], cfg: Config, grid: ProcessGrid):
        self.cfg, self.grid, self.chunks = cfg, grid, chunks
        # A model built on the meta device gets its values from its init, drawn here: each
        # rank writes only the elements it owns.
        self.sharded_init = replace_meta_parameters(chunks, grid.device, hollow=True)
        z = cfg.zero
        self.stage = z.stage
        self.dtype = COMPUTE_DTYPE[cfg.train.precision]
        # Gradients accumulate over micro-batches in fp32 whatever the compute dtype (Megatron's
        # main_grad: summing 16 bf16 micro-batch gradients in bf16 would lose ~4 bits);
        # zero.reduce_dtype is only the dtype they travel in over DP.
        self.reduce_dtype = COMPUTE_DTYPE[z.reduce_dtype]
        self.dp = grid.dp_group
        # Stage 0 is the same machinery with a single shard: every rank owns everything.
        shards, rank = (1, 0) if self.stage == 0 else (grid.dp, grid.dp_rank)
        units = None
        if self.stage == 3:
            units, groups = fetch_units(chunks)
        else:
            groups = bucket_groups(chunks, z.bucket_size)
        self.layout: Layout = build_layout(groups, shards, rank)
        slots = self.layout.slots()
        tied = {id(c.tied_weight()) for c in chunks if c.tied_weight() is not None}
        self.tied_buckets = [b.index for b, s in slots if id(s.param) in tied]
        no_decay = [c.no_weight_decay() for c in chunks]
        decays = {s.name: s.name not in no_decay[b.chunk] for b, s in slots}
        # Each gradient element counted once: TP-replicated parameters on TP rank 0 only, and the
        # last stage's copy of the tied embedding not at all (its sum lives in wte's grad).
        counted = {s.name: (s.param.tp_dim is not None or grid.tp_rank == 0) and s.name != "lm_head.weight"
                   for _, s in slots}
        self.ranges = self.layout.ranges(decays, counted, z.sub_group_size)
        self.groups = sub_groups(self.ranges, z.sub_group_size)
        self.scaler = (DynamicLossScaler(z.initial_loss_scale, z.loss_scale_window, z.hysteresis, z.min_loss_scale)
                       if cfg.train.precision == "fp16" else None)
        self.step_count = 0
        self._sync = True
        self._ready: dict[int, set[str]] = {}
        self._reduced: set[int] = set()
        # In-flight stage-0 all-reduces: (work, tensor on the wire, fp32 bucket it lands in).
        self._works: list[tuple[Optional[dist.Work], torch.Tensor, torch.Tensor]] = []
        self._pending: dict[int, torch.Tensor] = {}  # stage 2/3: bucket -> full fp32 gradient being filled

        self._build_storage()
        n = self.layout.shard_numel
        self.exp_avg = torch.zeros(n, device=grid.device)
        self.exp_avg_sq = torch.zeros(n, device=grid.device)
        self.gatherer = (ParamGatherer(self.layout, self.param_shard, units, self.dp, z.prefetch)
                         if self.stage == 3 else None)
        if self.gatherer is not None:
            for c in chunks:
                c.register_state_dict_pre_hook(self._refuse_sharded_state_dict)
        for b, s in slots:
            s.param.register_post_accumulate_grad_hook(lambda p, b=b, s=s: self._grad_ready(b, s, p))
        self.zero_grad()

    def _initial(self, b: Bucket, s: Slot) -> torch.Tensor:
        """Parameter s's starting value, flat: drawn from its chunk's init when the model was
        built on the meta device, else the values it holds."""
        if self.sharded_init:
            return self.chunks[b.chunk].initial_value(s.name, self.cfg.train.seed).reshape(-1)
        return s.param.detach().reshape(-1)

    def _build_storage(self) -> None:
        """Put the initial parameters into flat buckets: fp32 master values for this rank's
        shard, the model in the compute dtype (stage 3: only this rank's shard of it)."""
        device, n = self.grid.device, self.layout.shard_numel
        fp32 = self.dtype == torch.float32
        # In fp32 the model's own values are the master weights; a copy would be waste.
        self.master: Optional[torch.Tensor] = None if fp32 else torch.zeros(n, device=device)
        self.param_flat: list[torch.Tensor] = []
        self.param_shard = torch.zeros(n if self.stage == 3 else 0, dtype=self.dtype, device=device)
        for b in self.layout.buckets:
            if self.stage == 3:
                self._fill_shard(b)  # the gatherer points the parameters at placeholders
                continue
            flat = torch.zeros(b.numel, device=device)
            for s in b.slots:
                flat[s.offset: s.offset + s.numel].copy_(self._initial(b, s))
            lo, hi = b.slice_of(self.layout.rank)
            if self.master is not None:
                self.master[b.shard_offset: b.shard_offset + b.shard_numel].copy_(flat[lo:hi])
            flat = flat.to(self.dtype)
            self.param_flat.append(flat)
            for s in b.slots:
                s.param.data = flat[s.offset: s.offset + s.numel].view(s.shape)
        # fp32 gradients: full buckets at stage 0/1, this rank's shard at stage 2/3.
        if self.stage <= 1:
            self.grad_flat = [torch.zeros(b.numel, device=device) for b in self.layout.buckets]
        else:
            self.grad_shard = torch.zeros(n, device=device)

    def _fill_shard(self, b: Bucket) -> None:
        """Stage 3: this rank's slice of bucket b, written parameter by parameter (never the
        whole bucket): model values in the compute dtype and fp32 master weights."""
        lo, hi = b.slice_of(self.layout.rank)
        for s in b.slots:
            start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start >= end:
                continue
            piece = self._initial(b, s)[start - s.offset: end - s.offset]
            where = slice(b.shard_offset + start - lo, b.shard_offset + end - lo)
            self.param_shard[where].copy_(piece)
            if self.master is not None:
                self.master[where].copy_(piece)

    # ------------------------------------------------------------------ views of one range

    def _param(self, r: Range) -> torch.Tensor:
        if self.stage == 3:
            return self.param_shard[r.shard_offset: r.shard_offset + r.length]
        return self.param_flat[r.bucket][r.start: r.start + r.length]

    def _master(self, r: Range) -> torch.Tensor:
        return self._param(r) if self.master is None else self.master[r.shard_offset: r.shard_offset + r.length]

    def _grad(self, r: Range) -> torch.Tensor:
        if self.stage >= 2:
            return self.grad_shard[r.shard_offset: r.shard_offset + r.length]
        return self.grad_flat[r.bucket][r.start: r.start + r.length]

    def _grad_slice(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced gradient of bucket b."""
        if self.stage >= 2:
            return self.grad_shard[b.shard_offset: b.shard_offset + b.shard_numel]
        lo, hi = b.slice_of(self.layout.rank)
        return self.grad_flat[b.index][lo:hi]

    # ------------------------------------------------------------------ gradients

    def zero_grad(self) -> None:
        self._ready.clear()
        self._reduced.clear()
        if self.stage <= 1:
            for g in self.grad_flat:
                g.zero_()
            # fp32 model: gradients are views into the buckets, so autograd accumulates in place
            # and a bucket is ready to send without a copy. 16-bit: the hook adds each
            # micro-batch's gradient into the fp32 bucket.
            for b, s in self.layout.slots():
                s.param.grad = self._bucket_view(b, s) if self.dtype == torch.float32 else None
        else:
            self.grad_shard.zero_()
            for _, s in self.layout.slots():
                s.param.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication.
        Stages 2/3 reduce every micro-batch into the shard anyway, so for them it changes nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _bucket_view(self, b: Bucket, s: Slot) -> torch.Tensor:
        """Stages 0/1: parameter s's place in the fp32 gradient bucket b."""
        return self.grad_flat[b.index][s.offset: s.offset + s.numel].view(s.shape)

    def _grad_ready(self, b: Bucket, s: Slot, p: nn.Parameter) -> None:
        """Called by autograd once p's gradient of this backward pass is accumulated."""
        if self.stage <= 1:
            if p.grad is not None and p.grad.dtype != torch.float32:
                self._bucket_view(b, s).add_(p.grad)  # fp32 accumulation of a 16-bit gradient
                p.grad = None
            if not self._sync:
                return
            if b.index in self._reduced:
                raise RuntimeError(f"zero stage {self.stage} reduces gradients once per iteration, but bucket "
                                   f"{b.index} ({s.name}) got a second synchronised backward; wrap every backward "
                                   f"but the last of each model chunk in optimizer.no_sync()")
        else:
            buf = self._pending.get(b.index)
            if buf is None:
                buf = self._pending[b.index] = torch.zeros(b.numel, device=self.grid.device)
            buf[s.offset: s.offset + s.numel].view(s.shape).add_(p.grad)
            p.grad = None  # the full gradient lives on only in the bucket until it is reduced
        ready = self._ready.setdefault(b.index, set())
        ready.add(s.name)
        if len(ready) == len(b.slots):
            self._reduce(b)

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        """An fp32 gradient as it is communicated (zero.reduce_dtype)."""
        return t if self.reduce_dtype == torch.float32 else t.to(self.reduce_dtype)

    def _reduce(self, b: Bucket) -> None:
        self._ready.pop(b.index, None)
        if self.stage == 0:
            full = self.grad_flat[b.index]
            wire = self._on_wire(full)
            self._works.append((comm.all_reduce(wire, self.dp, async_op=True), wire, full))
        elif self.stage == 1:
            self._reduce_scatter(b, self.grad_flat[b.index], add=False)
        else:
            self._reduce_scatter(b, self._pending.pop(b.index), add=True)
            if self.gatherer is not None:
                self.gatherer.release(b.index)
        self._reduced.add(b.index)

    def _reduce_scatter(self, b: Bucket, full: torch.Tensor, add: bool) -> None:
        """Sum fp32 bucket `full` over DP in the reduce dtype; write (stage 1) or add (stages
        2/3, once per micro-batch) this rank's slice into its fp32 gradient slice."""
        into, wire = self._grad_slice(b), self._on_wire(full)
        if wire is full and not add:  # stage 1 in fp32: reduced in place, into full's own slice
            comm.reduce_scatter_into(into, full, self.dp)
            return
        out = torch.empty(b.shard_numel, dtype=wire.dtype, device=wire.device)
        comm.reduce_scatter_into(out, wire, self.dp)
        into.add_(out) if add else into.copy_(out)

    def finish_grad_sync(self) -> None:
        """Complete the DP reduction (buckets some parameter of which got no gradient are sent
        now, in bucket order on every rank), then sum the tied embedding over its group."""
        if self.stage <= 1:
            for b in self.layout.buckets:
                if b.index not in self._reduced:
                    self._reduce(b)
        else:
            for index in sorted(self._pending):
                self._reduce(self.layout.buckets[index])
        for work, wire, full in self._works:
            if work is not None:
                work.wait()
            if wire is not full:
                full.copy_(wire)
        self._works.clear()
        if self.gatherer is not None:
            self.gatherer.release_all()
        for index in self.tied_buckets:
            comm.all_reduce(self._grad_slice(self.layout.buckets[index]), self.grid.embed_group)

    # ------------------------------------------------------------------ step

    def grad_norm_and_overflow(self, loss: Optional[torch.Tensor] = None) -> tuple[float, bool]:
        """Global L2 norm of the (unscaled) gradients over TP, PP and DP, each element once;
        and whether any rank saw inf/NaN in a gradient or in its `loss` share. One all-reduce
        over the world: [counted sum of squares, the rest (replicas, the tied head, a
        non-finite loss as inf)]. At stage 0 DP replicas hold the same reduced gradients, so
        only DP rank 0 adds them."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.grid.device)
        for r in self.ranges if self.stage > 0 or self.grid.dp_rank == 0 else ():
            sums[0 if r.counted else 1] += torch.linalg.vector_norm(self._grad(r), dtype=torch.float64).square()
        if loss is not None:
            sums[1] += torch.where(torch.isfinite(loss.detach()), 0.0, float("inf")).double().to(sums.device)
        comm.all_reduce(sums, self.grid["world"])
        overflow = not bool(torch.isfinite(sums).all())
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        return float(sums[0].sqrt()) * inv_scale, overflow

    @torch.no_grad()
    def step(self, lr: float, loss: Optional[torch.Tensor] = None) -> StepResult:
        """One AdamW step of this rank's shard, or none anywhere when a gradient (or a rank's
        `loss` share) is inf/NaN: in every precision such a step would poison the master
        weights and Adam moments, so it is skipped whole (fp16 also backs off its loss scale)."""
        norm, overflow = self.grad_norm_and_overflow(loss)
        scale = self.scaler.scale if self.scaler is not None else None
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:  # every rank saw the same sums, so every rank skips
            return StepResult(grad_norm=norm, skipped=True, loss_scale=scale)
        o = self.cfg.optim
        coef = 1.0 / scale if scale is not None else 1.0
        if o.clip_grad > 0 and norm > o.clip_grad:
            coef *= o.clip_grad / (norm + 1e-6)
        self.step_count += 1
        for group in self.groups:
            grads = [self._grad(r) for r in group]  # fp32; scaled in place (zeroed before the next use)
            if coef != 1.0:
                torch._foreach_mul_(grads, coef)
            masters = [self._master(r) for r in group]
            adamw_(masters, grads,
                   [self.exp_avg[r.shard_offset: r.shard_offset + r.length] for r in group],
                   [self.exp_avg_sq[r.shard_offset: r.shard_offset + r.length] for r in group],
                   [m for m, r in zip(masters, group) if r.decay],
                   lr=lr, weight_decay=o.weight_decay, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                   step=self.step_count)
            if self.master is not None:
                torch._foreach_copy_([self._param(r) for r in group], masters)
        self._gather_updated_params()
        return StepResult(grad_norm=norm, skipped=False, loss_scale=scale)

    def all_finite(self) -> bool:
        """Whether every rank's master weights are finite (collective over the world)."""
        bad = torch.zeros(1, device=self.grid.device)
        for values in self._shard_values():
            bad += (~torch.isfinite(values)).sum()
        comm.all_reduce(bad, self.grid["world"])
        return not bool(bad)

    def _gather_updated_params(self) -> None:
        """Stages 1/2: every rank stepped its slice; put the full parameters everywhere."""
        if self.stage not in (1, 2):
            return
        for b in self.layout.buckets:
            lo, hi = b.slice_of(self.layout.rank)
            comm.all_gather_into(self.param_flat[b.index], self.param_flat[b.index][lo:hi], self.dp)

    # ------------------------------------------------------------------ state

    def _shard_values(self) -> list[torch.Tensor]:
        """This rank's fp32 master shard (padding included), as pieces laid end to end."""
        if self.master is not None:
            return [self.master]
        if self.stage == 3:
            return [self.param_shard]
        return [self._param_slice(b) for b in self.layout.buckets]

    def _param_slice(self, b: Bucket) -> torch.Tensor:
        """Stages 0-2: this rank's slice of bucket b's parameters."""
        lo, hi = b.slice_of(self.layout.rank)
        return self.param_flat[b.index][lo:hi]

    def state_dict(self) -> dict:
        """Only this rank's shard (fp32 master, Adam moments, step, loss scaler) and the
        partition map that says where each element belongs, in host memory: copied out one
        tensor at a time through a pinned buffer, never cloned on the device."""
        host = HostStaging()
        return {"stage": self.stage, "dp_rank": self.layout.rank, "dp_size": self.layout.shards,
                "precision": self.cfg.train.precision, "step": self.step_count,
                "master": host.concat(self._shard_values()), "exp_avg": host.concat([self.exp_avg]),
                "exp_avg_sq": host.concat([self.exp_avg_sq]),
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "partition": self.layout.param_map()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict of the same layout; the model's parameters are set from the
        master weights exactly as a step would have set them (bitwise resume)."""
        mine = self.layout.param_map()
        if state["partition"] != mine or state["stage"] != self.stage:
            raise ValueError(f"optimizer state has a different layout (stage {state['stage']}, "
                             f"{state['partition']['shards']} shards) than this run (stage {self.stage}, "
                             f"{mine['shards']} shards); reshard it first")
        self.step_count = int(state["step"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        master = state["master"]
        for b in self.layout.buckets:
            values = master[b.shard_offset: b.shard_offset + b.shard_numel]
            if self.master is not None:
                self.master[b.shard_offset: b.shard_offset + b.shard_numel].copy_(values)
            if self.stage == 3:
                self.param_shard[b.shard_offset: b.shard_offset + b.shard_numel].copy_(values)
            else:
                self._param_slice(b).copy_(values)
        self._gather_updated_params()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters as this rank holds them: full (per model-parallel rank) at
        stages 0-2; at stage 3 each parameter's piece of this rank's shard, flattened (the
        partition map in state_dict() says where each piece goes)."""
        host = HostStaging()  # one pinned buffer for every tensor
        if self.stage < 3:
            return {s.name: host.copy(s.param.detach()) for _, s in self.layout.slots()}
        return {name: host.copy(piece) for name, piece in self._stage3_pieces()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of model_state_dict(); the master weights follow the loaded values."""
        if self.stage < 3:
            for _, s in self.layout.slots():
                s.param.copy_(state[s.name])
        else:
            for name, piece in self._stage3_pieces():
                piece.copy_(state[name])
        if self.master is not None:
            for b in self.layout.buckets:
                own = self.param_shard[b.shard_offset: b.shard_offset + b.shard_numel] if self.stage == 3 \
                    else self._param_slice(b)
                self.master[b.shard_offset: b.shard_offset + b.shard_numel].copy_(own)

    def _stage3_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """(name, the view of param_shard holding this rank's piece of it) per parameter;
        a piece is empty when the parameter lies wholly in other ranks' slices."""
        out = []
        for b, s in self.layout.slots():
            lo, hi = b.slice_of(self.layout.rank)
            start = max(lo, s.offset)
            length = max(0, min(hi, s.offset + s.numel) - start)
            base = b.shard_offset + min(start, hi) - lo
            out.append((s.name, self.param_shard[base: base + length]))
        return out

    # ------------------------------------------------------------------ stage 3: full parameters on request

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Inside, every parameter holds its full value (read-only: changes are not kept).
        At stages 0-2 parameters are always full, so this does nothing."""
        if self.gatherer is None:
            yield
            return
        newly = self.gatherer.fetch_all()
        try:
            yield
        finally:
            for b in newly:
                self.gatherer.release(b)

    def full_parameters(self) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, full value) for this model-parallel rank, one gather unit at a
        time: at stage 3 a bucket is gathered, handed out and released before the next, so
        at most one unit is materialized beyond the shards. Collective over DP at stage 3."""
        for index, bucket in enumerate(self.layout.buckets):
            fetched = self.gatherer is not None and index not in self.gatherer.gathered
            if fetched:
                self.gatherer.fetch(index)
            for slot in bucket.slots:
                yield slot.name, slot.param, slot.param.detach()
            if fetched:
                self.gatherer.release(index)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of this model-parallel rank in full, as copies (any stage; at
        stage 3 gathered one unit at a time)."""
        host = HostStaging()
        return {name: host.copy(value) for name, _, value in self.full_parameters()}

    def _refuse_sharded_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.gatherer.gathered != set(range(len(self.layout.buckets))):
            raise RuntimeError("zero stage 3 keeps parameters sharded, so module.state_dict() would hold empty "
                               "placeholders; use optimizer.model_state_dict() (shards), "
                               "optimizer.full_state_dict(), or call it inside optimizer.gathered_parameters()")

    # ------------------------------------------------------------------ accounting

    @property
    def materialized_numel(self) -> int:
        """Stage 3: full parameter elements gathered right now (0 at other stages: not tracked)."""
        return self.gatherer.materialized_numel if self.gatherer else 0

    @property
    def peak_materialized_numel(self) -> int:
        return self.gatherer.peak_materialized_numel if self.gatherer else 0

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds persistently: parameters, gradients and
        optimizer states (master weights when separate, Adam moments)."""
        def nbytes(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts)
        params = nbytes([self.param_shard] if self.stage == 3 else self.param_flat)
        grads = nbytes([self.grad_shard] if self.stage >= 2 else self.grad_flat)
        optim = nbytes([self.exp_avg, self.exp_avg_sq] + ([self.master] if self.master is not None else []))
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
