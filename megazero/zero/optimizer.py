"""ZeRO-sharded data parallelism: gradient reduction over DP replicas, global-norm clipping,
fp16 loss scaling and AdamW on fp32 master weights, at stages 0 to 3.

    stage 0  every rank keeps everything; gradient buckets are all-reduced (async) as they
             become ready during the last backward of the iteration
    stage 1  optimizer state (fp32 master, Adam moments) partitioned over DP: buckets are
             reduce-scattered (async) in that last backward, each rank steps its shard,
             updated parameters are all-gathered per bucket (async), each waited by a
             forward pre-hook of the first unit using it, so the next forward overlaps them
    stage 2  gradients partitioned as well: every backward reduce-scatters each bucket as it
             fills and a rank accumulates only its shard across micro-batches
    stage 3  parameters partitioned as well (see stage3.py): gathered per module on demand,
             never all-gathered after the step

The work is divided by responsibility; this class wires the pieces together and steps:
    grads.py    GradientSync: fp32 gradient buffers, hooks, no_sync, bucketed DP reduction
    params.py   ParamStore: the model's parameters in flat buckets (stage 3: shards)
    state.py    where master weights and Adam moments live: the device, host memory
                (zero.offload_optimizer cpu) or NVMe swap files (nvme), one interface
    clip.py     global grad norm and inf/NaN agreement; adamw.py: the update rule
    stage3.py   ParamGatherer: gather/release of stage-3 parameters around each module
    host_grads.py  ZeRO-Offload on an accelerator: gradient slices copied to the host
                during backward, as their buckets are reduced

Frozen parameters (requires_grad False: the base model under LoRA) sit in buckets of their
own at the end of the shard: they are stored, sharded and gathered like the others, but
have no gradient buffer, no DP gradient traffic and no optimizer state (partition.py).

Gradients accumulate in fp32 buffers at every stage and precision (zero.reduce_dtype sets
only the DP wire dtype). A step whose gradient norm or any rank's loss is inf/NaN is
skipped on every rank, in every precision. A model built on the meta device is
materialized here: each rank writes only the elements it owns (see materialize.py).

Interface used by the trainer and the pipeline schedules:
    zero_grad()           before the first micro-batch of an iteration
    scale_loss(loss)      loss multiplier before backward (fp16 loss scaling)
    no_sync()             context for every backward but the last of each model chunk
    finish_grad_sync()    after the last backward: complete DP reduction, sum tied embeddings
                          and the partial gradients of sequence parallelism over TP
    step(lr, loss, votes) -> StepResult          skipped everywhere on inf/NaN; carries the global
                          loss and the summed votes (one device->host read per step)
    all_finite()          whether every rank's master weights are finite (before saving)
    state_dict() / load_state_dict()           this rank's shard plus the partition map
    model_state_dict() / load_model_state_dict()  the model's parameters (shards at stage 3)
    gathered_parameters() / full_state_dict()  full parameters on request at stage 3
    wait_params()         stages 1-2: complete the post-step all-gathers (every method here
                          that reads parameters calls it; forward waits bucket by bucket)
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch
from torch import nn

from megazero.config import Config
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.host import HostStaging
from megazero.zero.adamw import adamw_
from megazero.zero.clip import StepSums, clip_coefficient, reduce_step_sums
from megazero.zero.grads import GradientSync
from megazero.zero.host_grads import HostGradients
from megazero.zero.materialize import replace_meta_parameters
from megazero.zero.params import ParamStore
from megazero.zero.partition import (
    Bucket,
    FlatLayout,
    FlatSlot,
    bucket_groups,
    build_layout,
    split_frozen,
    sub_groups,
    with_trainable_flags,
)
from megazero.zero.precision import COMPUTE_DTYPE, DynamicLossScaler
from megazero.zero.sequence_parallel import SequenceParallelGrads
from megazero.zero.shard_home import MemoryShard, NvmeShard, ShardHome
from megazero.zero.stage3 import ParamGatherer, fetch_units
from megazero.zero.state import MemoryOptimizerStore, NvmeOptimizerStore


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: Optional[float] = None
    loss: float = 0.0
    """The global loss: every rank's share summed over the world (each loss replica once)."""
    votes: tuple[int, ...] = ()
    """The element-wise sums over the world of the `votes` given to step()."""


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


class ZeroOptimizer:
    """ZeRO stages 0-3 over one model-parallel rank's model chunks (see the module docstring)."""

    def __init__(self, chunks: list[ShardableModel], cfg: Config, grid: ProcessGrid,
                 initial: Optional[Callable[[int, str, nn.Parameter], torch.Tensor]] = None):
        """`initial(chunk index, name, parameter)`, when given, supplies starting values
        (this TP rank's shard, e.g. read from pretrained weights) instead of the model's init."""
        self.cfg, self.grid, self.chunks, self.initial = cfg, grid, chunks, initial
        # A model built on the meta device gets its values from its init, drawn here: each
        # rank writes only the elements it owns.
        self.sharded_init = replace_meta_parameters(chunks, grid.device, hollow=True)
        z = cfg.zero
        self.stage = z.stage
        self.dtype = COMPUTE_DTYPE[cfg.train.precision]
        # Stage 0 is the same machinery with a single shard: every rank owns everything.
        shards, rank = (1, 0) if self.stage == 0 else (grid.dp, grid.dp_rank)
        units = None
        if self.stage == 3:
            units, groups = fetch_units(chunks)
        else:
            groups = split_frozen(bucket_groups(chunks, z.bucket_size))
        self.layout: FlatLayout = build_layout(groups, shards, rank)
        slots = self.layout.slots()
        tied = {id(c.tied_weight()) for c in chunks if c.tied_weight() is not None}
        self.tied_buckets = [b.index for b, s in slots if id(s.param) in tied and b.trainable]
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

        # In fp32 the model's own values are the master weights; a copy would be waste.
        self.state = self._state_store()
        self.params = ParamStore(self.layout, home=self._shard_home() if self.stage == 3 else None, dtype=self.dtype,
                                 device=grid.device, initial=self._initial, write_master=self._write_master)
        self.state.flush()
        stores = [getattr(c, "weight_grads", None) for c in chunks]  # zbh1's deferred weight gradients
        self.gatherer = (ParamGatherer(self.layout, self.params.home, units, grid.dp_group, z.prefetch,
                                       self.dtype, grid.device, stores)
                         if self.stage == 3 else None)
        if self.gatherer is not None:
            for c in chunks:
                c.register_state_dict_pre_hook(self._refuse_sharded_state_dict)
        # ZeRO-Offload on an accelerator: gradient slices leave for the host during backward.
        self.host_grads = (HostGradients(self.layout.trainable_numel, grid.device, z.pin_memory)
                           if self._offloads_gradients() else None)
        self.grads = GradientSync(self.layout, stage=self.stage, model_dtype=self.dtype,
                                  reduce_dtype=COMPUTE_DTYPE[z.reduce_dtype], dp=grid.dp_group,
                                  embed=grid.embed_group if self.tied_buckets else None, tied_buckets=self.tied_buckets, device=grid.device,
                                  on_reduced=self.gatherer.reduced if self.gatherer is not None else None,
                                  on_final=self.host_grads.copy if self.host_grads is not None else None)
        if self.stage in (1, 2):
            self._wait_in_forward(chunks)
        if self.gatherer is not None:  # W lands its weight gradients with the parameters released
            for store in filter(None, stores):
                store.sink = self.grads.add_grad
        partial_over_tp = any(getattr(s.param, "sequence_parallel", False) for _, s in slots)
        self.sp_grads = SequenceParallelGrads(self.layout, self.grads, grid.tp_group) if partial_over_tp else None
        self.zero_grad()

    def _wait_in_forward(self, chunks: list[ShardableModel]) -> None:
        """Stages 1-2: the post-step all-gather of a bucket is waited by the forward pre-hook
        of the first unit using it (a hook on every unit: later ones find it done), so the
        next forward starts while later buckets are in flight. Anything reading parameters
        outside forward calls wait_params(); module.state_dict() does through a hook."""
        bucket_of = {id(s.param): b.index for b, s in self.layout.slots()}
        for c in chunks:
            tied = c.tied_weight()
            for unit in c.units():
                used = [p for _, p in unit.named] + ([tied] if unit.uses_tied and tied is not None else [])
                buckets = tuple(sorted({bucket_of[id(p)] for p in used}))
                unit.start.register_forward_pre_hook(lambda m, a, bs=buckets: self.params.wait(bs))
            c.register_state_dict_pre_hook(lambda *_: self.wait_params())

    def wait_params(self) -> None:
        """Complete the post-step all-gathers (stages 1-2): every parameter holds its value after."""
        self.params.wait_all()

    def _offloads_gradients(self) -> bool:
        """Whether the step runs in host memory apart from the device's gradients."""
        return self.cfg.zero.offload_optimizer != "none" and self.grid.device.type != "cpu"

    def _initial(self, b: Bucket, s: FlatSlot) -> torch.Tensor:
        """Parameter s's starting value, flat: drawn from its chunk's init when the model was
        built on the meta device, else the values it holds."""
        if self.initial is not None:
            return self.initial(b.chunk, s.name, s.param).reshape(-1)
        if self.sharded_init:
            return self.chunks[b.chunk].initial_value(s.name, self.cfg.train.seed).reshape(-1)
        return s.param.detach().reshape(-1)

    def _state_store(self) -> MemoryOptimizerStore | NvmeOptimizerStore:
        """Master weights and moments (of the trainable buckets) where zero.offload_optimizer puts them."""
        z, n = self.cfg.zero, self.layout.trainable_numel
        # In fp32 with the parameters in device memory, the parameters are the master weights.
        separate = self.dtype != torch.float32 or z.offload_param != "none"

        def build() -> MemoryOptimizerStore | NvmeOptimizerStore:
            if z.offload_optimizer == "none":
                return MemoryOptimizerStore(n, self.grid.device, separate_master=separate)
            if z.offload_optimizer == "cpu":
                return MemoryOptimizerStore(n, torch.device("cpu"), separate_master=True, pin=z.pin_memory)
            return NvmeOptimizerStore(n, self.groups, z.nvme_path, z.buffer_count, z.pin_memory)
        return comm.agreed(build, self.grid["world"])  # a full disk on one node stops every rank

    def _shard_home(self) -> ShardHome:
        """Where the stage-3 parameter shard lives: zero.offload_param."""
        z, n = self.cfg.zero, self.layout.shard_numel

        def build() -> ShardHome:
            if z.offload_param == "none":
                return MemoryShard(n, self.dtype, self.grid.device)
            if z.offload_param == "cpu":
                return MemoryShard(n, self.dtype, torch.device("cpu"), pin=z.pin_memory)
            return NvmeShard(self.layout, self.dtype, z.nvme_path, z.pin_memory)
        return comm.agreed(build, self.grid["world"])  # a full disk on one node stops every rank

    def _write_master(self, offset: int, values: torch.Tensor) -> None:
        if offset < self.layout.trainable_numel:  # frozen buckets have no master weights
            self.state.write("master", offset, values)

    # ------------------------------------------------------------------ gradients

    def zero_grad(self) -> None:
        self.grads.zero_grad()
        if self.host_grads is not None:
            self.host_grads.reset()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside accumulate gradients locally, without communication."""
        return self.grads.no_sync()

    def finish_grad_sync(self) -> None:
        """Complete the DP reduction and sum the tied embedding over its group (see GradientSync.finish),
        then complete the gradients sequence parallelism leaves partial over TP."""
        self.grads.finish()
        if self.sp_grads is not None:
            self.sp_grads.all_reduce()
            if self.host_grads is not None:  # their host copies left before the TP sum: replace them
                self.host_grads.wait()
                for r in self.sp_grads.ranges:
                    self.host_grads.view(r).copy_(self.grads.view(r))
        if self.gatherer is not None:
            self.gatherer.release_all()

    # ------------------------------------------------------------------ step

    def step_sums(self, loss: Optional[torch.Tensor] = None, votes: tuple[int, ...] = ()) -> StepSums:
        """The world's sums behind a step, read once: the global L2 norm of the gradients
        over TP, PP and DP, each element once (still scaled by any fp16 loss scale); whether
        any rank saw inf/NaN in a gradient or in its `loss` share; the global loss (one TP
        rank per loss replica adds its share); the summed `votes`. At stage 0 DP replicas
        hold the same reduced gradients, so only DP rank 0 adds them."""
        mine = self.stage > 0 or self.grid.dp_rank == 0
        pieces = ((self.grads.view(r), r.counted) for r in (self.ranges if mine else ()))
        count_loss = loss is not None and self.grid.tp_rank == 0
        return reduce_step_sums(pieces, loss, count_loss, votes, self.grid["world"], self.grid.device)

    @torch.no_grad()
    def step(self, lr: float, loss: Optional[torch.Tensor] = None, votes: tuple[int, ...] = ()) -> StepResult:
        """One AdamW step of this rank's shard, or none anywhere when a gradient (or a rank's
        `loss` share) is inf/NaN: in every precision such a step would poison the master
        weights and Adam moments, so it is skipped whole (fp16 also backs off its loss scale).
        The decision, the clip coefficient, the global loss and the summed `votes` (e.g. the
        trainer's stop requests) come from one all-reduce and one device->host read."""
        self.wait_params()  # the step writes the slices the last gathers read
        sums = self.step_sums(loss, votes)
        scale = self.scaler.scale if self.scaler is not None else None
        norm = sums.grad_norm * (1.0 / scale) if scale is not None else sums.grad_norm
        result = StepResult(grad_norm=norm, skipped=sums.overflow, loss_scale=scale, loss=sums.loss,
                            votes=tuple(sums.votes))
        if self.scaler is not None:
            self.scaler.update(sums.overflow)
        if sums.overflow:  # every rank saw the same sums, so every rank skips
            return result
        o = self.cfg.optim
        coef = (1.0 / scale if scale is not None else 1.0) * clip_coefficient(norm, o.clip_grad)
        self.step_count += 1
        if self.host_grads is not None:
            self.host_grads.wait()
        for group, st in self.state.iterate(self.groups):
            # fp32 gradients where the step runs; scaled in place (zeroed before the next use)
            grads = [self.host_grads.view(r) if self.host_grads is not None else self.grads.view(r) for r in group]
            if coef != 1.0:
                torch._foreach_mul_(grads, coef)
            masters = st.master if st.master is not None else [self.params.view(r) for r in group]
            adamw_(masters, grads, st.exp_avg, st.exp_avg_sq, [m for m, r in zip(masters, group) if r.decay],
                   lr=lr, weight_decay=o.weight_decay, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                   step=self.step_count)
            if st.master is not None:
                self.params.set_ranges(group, masters)
        self.params.flush()
        if self.stage in (1, 2):  # stage 0 stepped everything, stage 3 keeps shards
            # In forward order (buckets are laid out in reverse), so the first unit's arrive first.
            self.params.all_gather(self.grid.dp_group, reversed(self.layout.trainable_buckets()))
        return result

    def all_finite(self) -> bool:
        """Whether every rank's master weights are finite (collective over the world)."""
        self.wait_params()
        bad = torch.zeros(1, device=self.grid.device)
        if self.state.separate_master:  # piece by piece: swapped state never whole in memory
            masters = (values for _, values in self.state.pieces("master"))
            values = itertools.chain(masters, self.params.own_slices(frozen_only=True))
        else:
            values = self.params.own_slices()
        for piece in values:
            bad += (~torch.isfinite(piece)).sum().to(bad.device)
        comm.all_reduce(bad, self.grid["world"])
        return not bool(bad)

    # ------------------------------------------------------------------ state

    def _shard_values(self) -> list[torch.Tensor]:
        """This rank's fp32 master shard (padding included), as pieces laid end to end; the
        frozen part, which has no master weights, from the parameters themselves."""
        if not self.state.separate_master:
            return self.params.own_slices()
        return [self.state.read("master"), *self.params.own_slices(frozen_only=True)]

    def state_dict(self) -> dict:
        """Only this rank's shard (fp32 master, Adam moments, step, loss scaler) and the
        partition map that says where each element belongs, in host memory: copied out one
        tensor at a time through a pinned buffer, never cloned on the device (state swapped
        to NVMe comes back in scratch-file-backed host tensors, never wholly in memory)."""
        self.wait_params()
        host = HostStaging()

        def on_host(pieces: list[torch.Tensor]) -> torch.Tensor:
            # An NVMe store's reads are already private host copies (file-backed): no second one.
            return pieces[0] if len(pieces) == 1 and self.state.reads_are_copies else host.concat(pieces)
        return {"stage": self.stage, "dp_rank": self.layout.rank, "dp_size": self.layout.shards,
                "precision": self.cfg.train.precision, "step": self.step_count,
                "master": on_host(self._shard_values()), "exp_avg": on_host([self.state.read("exp_avg")]),
                "exp_avg_sq": on_host([self.state.read("exp_avg_sq")]),
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "partition": self.layout.param_map()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict of the same layout; the model's parameters are set from the
        master weights exactly as a step would have set them (bitwise resume)."""
        self.wait_params()
        mine = self.layout.param_map()
        if with_trainable_flags(state["partition"]) != mine or state["stage"] != self.stage:
            raise ValueError(f"optimizer state has a different layout (stage {state['stage']}, "
                             f"{state['partition']['shards']} shards) than this run (stage {self.stage}, "
                             f"{mine['shards']} shards); reshard it first")
        self.step_count = int(state["step"])
        for kind in ("exp_avg", "exp_avg_sq"):
            self.state.write(kind, 0, state[kind])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        master = state["master"]
        for b in self.layout.buckets:
            values = master[b.shard_offset: b.shard_offset + b.shard_numel]
            self._write_master(b.shard_offset, values)
            self.params.set_own_slice(b, values)
        self.state.flush()
        self.params.flush()
        if self.stage in (1, 2):
            self.params.all_gather(self.grid.dp_group, self.layout.buckets)
            self.wait_params()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters as this rank holds them: full (per model-parallel rank) at
        stages 0-2; at stage 3 each parameter's piece of this rank's shard, flattened (the
        partition map in state_dict() says where each piece goes)."""
        self.wait_params()
        host = HostStaging()  # one pinned buffer for every tensor
        if self.stage < 3:
            return {s.name: host.copy(s.param.detach()) for _, s in self.layout.slots()}
        return {name: host.copy(self.params.home.read(offset, length)) for name, offset, length in self.params.pieces()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of model_state_dict(); the master weights follow the loaded values."""
        self.wait_params()
        if self.stage < 3:
            for _, s in self.layout.slots():
                s.param.copy_(state[s.name])
        else:
            for name, offset, length in self.params.pieces():
                if length:
                    self.params.home.write(offset, state[name])
        self.params.flush()
        for b in self.layout.buckets:
            self._write_master(b.shard_offset, self.params.own_slice(b))
        self.state.flush()

    # ------------------------------------------------------------------ stage 3: full parameters on request

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Inside, every parameter holds its full value (read-only: changes are not kept).
        At stages 0-2 parameters are always full (once the post-step gathers are waited)."""
        if self.gatherer is None:
            self.wait_params()
            yield
            return
        newly = self.gatherer.fetch_all()
        try:
            yield
        finally:
            for b in newly:
                self.gatherer.release(b)

    def full_parameters(self, trainable_only: bool = False) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, full value) for this model-parallel rank (or its trainable
        parameters only, e.g. LoRA's adapters), one gather unit at a time: at stage 3 a
        bucket is gathered, handed out and released before the next, so at most one unit is
        materialized beyond the shards. Collective over DP at stage 3."""
        self.wait_params()
        for index, bucket in enumerate(self.layout.buckets):
            if trainable_only and not bucket.trainable:
                continue
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
        """Bytes of model state this rank holds persistently on its compute device:
        parameters, gradients and optimizer states (master weights when separate, Adam
        moments); what zero.offload_param / offload_optimizer moved off the device is
        counted apart, by where it lives (`offloaded_host`: host memory, `offloaded_nvme`:
        swap files)."""
        z = self.cfg.zero
        grads = sum(t.numel() * t.element_size() for t in self.grads.tensors())
        kept = {"params": (self.params.nbytes(), z.offload_param != "none"),
                "optimizer": (self.state.nbytes(), z.offload_optimizer != "none")}
        out = {"grads": grads, "offloaded_host": 0, "offloaded_nvme": 0}
        for what, (where, offloaded) in kept.items():
            out[what] = 0 if offloaded else sum(where.values())
            if offloaded:
                out["offloaded_host"] += where.get("cpu", 0)
                out["offloaded_nvme"] += where.get("nvme", 0)
        out["total"] = out["params"] + grads + out["optimizer"]
        return out
