"""ZeRO's optimizer on a ShardedParameters (shard.py): AdamW on fp32 master weights of this
rank's shard, sub-group by sub-group, with global-norm clipping and fp16 loss scaling; a step
whose gradient norm or any rank's loss is inf/NaN is skipped on every rank, in any precision.

    state.py       master weights and Adam moments on the device, in host memory
                   (zero.offload_optimizer cpu) or in NVMe swap files (nvme), one interface
    clip.py        global grad norm and inf/NaN agreement; adamw.py: the update rule
    host_grads.py  ZeRO-Offload on an accelerator: gradient slices copied to the host
                   during backward, as their buckets are reduced

The trainer calls zero_grad() before an iteration's first micro-batch, finish_grad_sync()
after its last backward and step(lr, loss, extra) -> StepResult (skipped everywhere on
inf/NaN; with the global loss and the summed `extra` values: one device->host read per step); the
schedules scale the loss before each backward (scale_loss: fp16 loss scaling) and run every
backward but the last of each model chunk inside no_sync(). all_finite() guards saving;
state_dict() / load_state_dict() hold this rank's shard and the partition map.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from megazero.config.schema import Config
from megazero.config.sharding import DENSE, ParameterGroups, parameter_groups
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.host import HostSnapshot, HostStaging
from megazero.parallel.placement import placement
from megazero.parallel.weight_grad import WeightGradSink
from megazero.zero.adamw import adamw_
from megazero.zero.clip import clip_coefficient, reduce_step_sums
from megazero.zero.muon import MuonExchange, is_muon_matrix, momentum_, ns_dtype
from megazero.zero.partition import Range, sub_groups, with_trainable_flags
from megazero.zero.precision import DynamicLossScaler
from megazero.zero.sgd import sgd_
from megazero.zero.shard import ShardedParameters
from megazero.zero.state import Holes, MemoryOptimizerStore, NvmeOptimizerStore


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: Optional[float] = None
    loss: float = 0.0
    """The global loss: every rank's share summed over the world (each loss replica once)."""
    extra: tuple[float, ...] = ()
    """The element-wise sums over the world of the `extra` values given to step()."""


EMBEDDING_OR_OUTPUT = ("transformer.wte.weight", "lm_head.weight")
"""The parameters Megatron's --decoupled-lr steps at their own LR (the input embedding, the output layer)."""


class ZeroOptimizer:
    """ZeRO stages 0-3: AdamW on this rank's shard of `sharded` (see the module docstring)."""

    def __init__(self, sharded: ShardedParameters, cfg: Config, grid: ProcessGrid):
        """Also materializes `sharded`: its starting values become the master weights too."""
        self.sharded, self.cfg, self.grid = sharded, cfg, grid
        # What the step reads and writes: the buckets' layout, the parameters and their gradients.
        self.layout, self.params, self.grads = sharded.layout, sharded.params, sharded.grads
        self.sharding, self.compute_dtype = sharded.sharding, sharded.compute_dtype
        # ZeRO-Offload on an accelerator: gradient slices leave for the host during backward.
        self.host_grads = sharded.host_grads
        z = cfg.zero
        slots = self.layout.slots()
        no_decay = [c.no_weight_decay() for c in sharded.chunks]
        decays = {s.name: s.name not in no_decay[b.chunk] for b, s in slots}
        # Each gradient element counted once: parameters replicated over their TP group (tp, or
        # expert_tp for experts) on its rank 0 only, and the tied embedding (one summed gradient in
        # every copy after finish_grad_sync) on the first stage.
        counted = {s.name: (placement(s.param).sharded or grid[parameter_groups(placement(s.param)).tensor].rank == 0)
                   and (b.index not in sharded.tied_buckets or grid.pp_rank == 0) for b, s in slots}
        # Megatron's --decoupled-lr: the input embedding and the output layer get their own LR.
        decoupled = frozenset(EMBEDDING_OR_OUTPUT) if cfg.optim.decoupled_lr is not None else frozenset()
        # optim.name muon: the blocks' trainable weight matrices are Muon's, in ranges of their own.
        muon = frozenset(s.name for b, s in slots if cfg.optim.name == "muon" and b.trainable and is_muon_matrix(s.name))
        self.ranges = self.layout.ranges(decays, counted, z.sub_group_size, decoupled, muon)
        self.groups = sub_groups(self.ranges, z.sub_group_size)
        # What this rank's share of the norm reads: at stage 0 a bucket's replicas over its ZeRO
        # group hold the same reduced gradients, so the group's rank 0 stands for them all.
        owned = [not self.sharding.replicated or sharded.zero_groups[b.group].rank == 0 for b in self.layout.buckets]
        self.norm_ranges = [r for r in self.ranges if owned[r.bucket]]
        self.scaler = (DynamicLossScaler(z.initial_loss_scale, z.loss_scale_window, z.hysteresis, z.min_loss_scale)
                       if cfg.train.precision == "fp16" else None)
        self.step_count = 0
        o = cfg.optim
        self.muon = self._muon_exchanges(muon) if o.name == "muon" else []
        self.state = self._state_store()
        sharded.materialize(self._write_master)
        self.state.flush()

    def _state_store(self) -> MemoryOptimizerStore | NvmeOptimizerStore:
        """Master weights and moments (of the trainable buckets) where zero.offload_optimizer puts them."""
        z, n = self.cfg.zero, self.layout.trainable_numel
        # In fp32 with the parameters in device memory, the parameters are the master weights.
        separate = self.compute_dtype != torch.float32 or z.offload_param != "none"
        # Muon's ranges, and SGD's all, keep one buffer (exp_avg, their momentum): no second moment.
        holes = Holes([(0, n)] if self.cfg.optim.name == "sgd" else
                      [(r.shard_offset, r.length) for r in self.ranges if r.muon])

        def build() -> MemoryOptimizerStore | NvmeOptimizerStore:
            if z.offload_optimizer == "none":
                return MemoryOptimizerStore(n, self.grid.device, separate_master=separate, holes=holes)
            if z.offload_optimizer == "cpu":
                return MemoryOptimizerStore(n, torch.device("cpu"), separate_master=True, pin=z.pin_memory, holes=holes)
            return NvmeOptimizerStore(n, self.groups, z.nvme_path, z.buffer_count, z.pin_memory, holes)
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
        """After the last backward: see ShardedParameters.finish_grad_sync."""
        self.sharded.finish_grad_sync()

    @property
    def weight_grad_sink(self) -> Optional[WeightGradSink]:
        """Where zbh1's deferred weight gradients go instead of autograd (the schedule's W passes hand
        them to it): at stage 3 straight into the gradient sync (their parameters are released by the
        time W runs); else None."""
        return self.grads.add_grad if self.sharded.gatherer is not None else None

    def _muon_exchanges(self, muon: frozenset[str]) -> list[MuonExchange]:
        """Muon's exchanges over the pipeline stage, one per kind of parameter that has matrices:
        the dense ones (their TP parts and ZeRO shards), then the experts (every expert of a layer
        listed on every rank; each rank holds its experts' expert-TP parts and ZeRO shards). At
        stage 0 each kind's ZeRO-group rank 0 alone contributes the replicated updates."""
        o, grid, out = self.cfg.optim, self.grid, []
        kinds: dict[ParameterGroups, set[str]] = {parameter_groups(placement(s.param)): set() for _, s in self.layout.slots()}
        for _, s in self.layout.slots():
            if s.name in muon:
                kinds[parameter_groups(placement(s.param))].add(s.name)
        for groups, names in kinds.items():
            if not names:
                continue
            zero, tensor = self.sharded.zero_groups[groups.zero], grid[groups.tensor]
            ep = (0, 1) if groups == DENSE else (grid.ep_rank, grid.ep)
            out.append(MuonExchange(self.layout, frozenset(names), grid.stage_group, tensor.rank, tensor.size,
                                    not self.sharding.replicated or zero.rank == 0, grid.device, o.muon_ns_steps,
                                    o.muon_adjust_lr, ns_dtype(self.cfg.train.precision), ep))
        return out

    @property
    def owns_state(self) -> bool:
        """Whether this rank's optimizer state is its own to save: at stage 0 every rank of a
        ZeRO group holds the same, so its rank 0 stands for them all (dp x cp's for the dense
        parameters; expert-dp's rank 0 also saves its experts, beside a copy of the dense state)."""
        return not self.sharding.replicated or any(g.rank == 0 for g in self.sharded.zero_groups.values())

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, lr: float, loss: Optional[torch.Tensor] = None, extra: Sequence[float] = (),
             decoupled_lr: Optional[float] = None) -> StepResult:
        """One AdamW step of this rank's shard, or none anywhere when a gradient (or a rank's
        `loss` share) is inf/NaN: in every precision such a step would poison the master
        weights and Adam moments, so it is skipped whole (fp16 also backs off its loss scale).
        The decision, the clip coefficient, the global loss and the summed `extra` values
        (the trainer's step signals, summed here unread) come from one all-reduce and one
        device->host read. `decoupled_lr`: the LR of the embedding and output layer's ranges
        (optim.decoupled_lr's schedule), else `lr` for them too."""
        self.params.wait_all()  # the step writes the slices the last gathers read
        # The world's sums: the gradients' global norm, each element once (at stage 0 ZeRO-group
        # replicas hold the same reduced gradients: rank 0 of each adds them); the loss, one TP rank
        # per replica.
        pieces = ((self.grads.buffers.view(r), r.counted) for r in self.norm_ranges)
        sums = reduce_step_sums(pieces, loss, loss is not None and self.grid.tp_rank == 0, extra, self.grid["world"],
                                self.grid.device)
        scale = self.scaler.scale if self.scaler is not None else None
        norm = sums.grad_norm * (1.0 / scale) if scale is not None else sums.grad_norm
        result = StepResult(grad_norm=norm, skipped=sums.overflow, loss_scale=scale, loss=sums.loss,
                            extra=tuple(sums.extra))
        if self.scaler is not None:
            self.scaler.update(sums.overflow)
        if sums.overflow:  # every rank saw the same sums, so every rank skips
            return result
        o = self.cfg.optim
        coef = (1.0 / scale if scale is not None else 1.0) * clip_coefficient(norm, o.clip_grad)
        self.step_count += 1
        if self.host_grads is not None:  # their copies of what the TP sum of sequence parallelism changed are stale
            self.host_grads.wait()
            for r in self.sharded.sp_grads.ranges if self.sharded.sp_grads is not None else ():
                self.host_grads.view(r).copy_(self.grads.buffers.view(r))
        for group, st in self.state.iterate(self.groups):
            # fp32 gradients where the step runs; scaled in place (zeroed before the next use)
            grads = [self._grad(r) for r in group]
            if coef != 1.0:
                torch._foreach_mul_(grads, coef)
            masters = st.master if st.master is not None else [self.params.view(r) for r in group]
            muon = [i for i, r in enumerate(group) if r.muon]  # none under optim.name adamw
            if muon:  # Muon's elementwise first half: the gradients become its updates
                momentum_([grads[i] for i in muon], [st.exp_avg[i] for i in muon], o.muon_momentum, o.muon_nesterov)
            # The update rule (AdamW: Megatron's --optimizer adam), once per weight decay and LR the
            # group's ranges take: the embedding and output layer at optim.decoupled_lr when that is set.
            for decoupled, decay in itertools.product((False, True), (True, False)):
                part = [i for i, r in enumerate(group) if not r.muon and (r.decoupled, r.decay) == (decoupled, decay)]
                part_lr = decoupled_lr if decoupled and decoupled_lr is not None else lr
                wd = o.weight_decay if decay else 0.0
                if o.name == "sgd":  # torch.optim.SGD's rule, its momentum buffer in Adam's first-moment slot
                    sgd_([masters[i] for i in part], [grads[i] for i in part], [st.exp_avg[i] for i in part],
                         lr=part_lr, weight_decay=wd, momentum=o.sgd_momentum)
                else:
                    adamw_([masters[i] for i in part], [grads[i] for i in part], [st.exp_avg[i] for i in part],
                           [st.exp_avg_sq[i] for i in part], lr=part_lr, weight_decay=wd, beta1=o.beta1,
                           beta2=o.beta2, eps=o.eps, step=self.step_count)
            if st.master is not None:
                adam = [i for i, r in enumerate(group) if not r.muon]
                self.params.set_ranges([group[i] for i in adam], [masters[i] for i in adam])
        if self.muon:
            self._muon_step(lr)
        self.params.flush()
        if self.sharding.gathers_after_step:  # stage 0 stepped everything, stage 3 keeps shards
            # In forward order (buckets are laid out in reverse), so the first unit's arrive first.
            self.params.all_gather(self.sharded.zero_groups, reversed(self.layout.trainable_buckets()))
        return result

    def _grad(self, r: Range) -> torch.Tensor:
        """The fp32 gradient of range r where the step runs (host memory under ZeRO-Offload)."""
        return self.host_grads.view(r) if self.host_grads is not None else self.grads.buffers.view(r)

    def _muon_step(self, lr: float) -> None:
        """Muon's second half: each matrix's update orthogonalised by its owner (MuonExchange),
        then decoupled weight decay and the step, at muon_lr scaled as the schedule scales optim.lr."""
        o = self.cfg.optim
        for exchange in self.muon:  # the same order on every rank: dense, then experts
            exchange.step(self._grad)
        muon_lr = o.muon_lr * (lr / o.lr if o.lr > 0 else 1.0)
        for group, st in self.state.iterate(self.groups):
            mine = [r for r in group if r.muon]
            if not mine:
                continue
            masters = st.master if st.master is not None else [self.params.view(r) for r in group]
            masters = [m for m, r in zip(masters, group) if r.muon]
            for m, r in zip(masters, mine):
                if r.decay:
                    m.mul_(1 - muon_lr * o.weight_decay)
                m.sub_(self._grad(r), alpha=muon_lr)
            if st.master is not None:
                self.params.set_ranges(mine, masters)

    def all_finite(self) -> bool:
        """Whether every rank's master weights are finite (collective over the world)."""
        self.params.wait_all()
        bad = torch.zeros(1, device=self.grid.device)
        values: Iterable[torch.Tensor]
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

    def state_dict(self, snapshot: Optional[HostSnapshot] = None) -> dict:
        """Only this rank's shard (fp32 master, Adam moments, step, loss scaler) and the
        partition map that says where each element belongs, in host memory: copied out one
        tensor at a time through a pinned buffer, never cloned on the device (state swapped
        to NVMe comes back in scratch-file-backed host tensors, never wholly in memory).
        With `snapshot` the tensors are copied into its reused host tensors instead
        (asynchronous saves: they stay unchanged while training goes on)."""
        self.params.wait_all()
        host = HostStaging()

        def on_host(kind: str, pieces: list[torch.Tensor]) -> torch.Tensor:
            # An NVMe store's reads are already private host copies (file-backed): no second one.
            if len(pieces) == 1 and self.state.reads_are_copies:
                return pieces[0]
            return snapshot.concat(kind, pieces) if snapshot is not None else host.concat(pieces)
        return {"stage": self.sharding.stage, "dp_rank": self.layout.rank, "dp_size": self.layout.shards,
                "zero_ranks": {b.group: b.rank for b in self.layout.buckets},  # each ZeRO group's shard index
                "precision": self.cfg.train.precision, "step": self.step_count,
                "master": on_host("master", self._shard_values()),
                "exp_avg": on_host("exp_avg", [self.state.read("exp_avg")]),
                "exp_avg_sq": on_host("exp_avg_sq", self.state.read_pieces("exp_avg_sq")),  # Muon's as zeros
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "partition": self.layout.param_map()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict of the same layout; the model's parameters are set from the
        master weights exactly as a step would have set them (bitwise resume)."""
        self.params.wait_all()
        mine = self.layout.param_map()
        if with_trainable_flags(state["partition"]) != mine or state["stage"] != self.sharding.stage:
            raise ValueError(f"optimizer state has a different layout (stage {state['stage']}, "
                             f"{state['partition']['shards']} shards) than this run (stage {self.sharding.stage}, "
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
        if self.sharding.gathers_after_step:
            self.params.all_gather(self.sharded.zero_groups, self.layout.buckets)
            self.params.wait_all()

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The sharded parameters' load_model_state_dict(); the master weights follow the loaded values."""
        self.sharded.load_model_state_dict(state)
        for b in self.layout.buckets:
            self._write_master(b.shard_offset, self.params.own_slice(b))
        self.state.flush()

    # ------------------------------------------------------------------ accounting

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds persistently on its compute device:
        parameters, gradients and optimizer states (master weights when separate, Adam
        moments); what zero.offload_param / offload_optimizer moved off the device is
        counted apart, by where it lives (`offloaded_host`: host memory, `offloaded_nvme`:
        swap files)."""
        z = self.cfg.zero
        grads = sum(t.nbytes for t in self.grads.buffers.tensors())
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
