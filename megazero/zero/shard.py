"""ZeRO's sharded parameters, applied from outside the model like FSDP2's `fully_shard`
(train/parallelize.py): flat buckets take over the model's parameters, hooks reduce their
gradients over DP and, at stage 3, gather and release them; ZeroOptimizer (optimizer.py)
steps the shard. "DP" here is the grid's dp x cp group: context-parallel ranks hold the same
parameters, so ZeRO shards and reduces over them too (at cp 1 it is the DP group). Expert
weights live in buckets of their own, sharded, reduced and gathered over the expert-data-parallel
group instead (`zero_groups`, each bucket's `group`: config/sharding.parameter_groups decides).

    stage 0  every rank keeps everything; gradient buckets are all-reduced (async) as they
             become ready during the last backward of the iteration
    stage 1  optimizer state partitioned over DP: buckets are reduce-scattered (async) in
             that last backward, each rank steps its shard, updated parameters are
             all-gathered per bucket (async), each waited by a forward pre-hook of the first
             unit using it, so the next forward overlaps them
    stage 2  gradients partitioned as well: every backward reduce-scatters each bucket as it
             fills and a rank accumulates only its shard across micro-batches
    stage 3  parameters partitioned as well (see stage3.py): gathered per module on demand,
             never all-gathered after the step

What the stage partitions is a Sharding (config/sharding.py), chosen once from zero.stage.

    partition.py  FlatLayout: the parameters in flat, aligned buckets, partitioned over DP
    params.py     ParamStore: their values in those buckets (stage 3: this rank's shard)
    stage3.py     ParamGatherer: stage-3 gather/release around each unit, with prefetch
    grads.py      GradientSync: fp32 gradient buffers (at every precision: zero.reduce_dtype
                  is only the wire dtype), hooks, no_sync, bucketed DP reduction

Frozen parameters (LoRA's base model) are stored and gathered like the others, with no
gradients and no optimizer state (partition.py). Values are written by `materialize` (each
rank only the elements it owns: materialize.py), which the optimizer calls so that its fp32
master weights get the same starting values. Whatever here reads parameters first completes
the post-step all-gathers of stages 1-2 (`params.wait_all`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from megazero.config.schema import Config
from megazero.config.sharding import DENSE, sharding
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.host import HostStaging
from megazero.parallel.placement import placement
from megazero.zero.grads import GradientSync
from megazero.zero.host_grads import HostGradients
from megazero.zero.materialize import replace_meta_parameters
from megazero.zero.params import ParamStore
from megazero.zero.partition import (
    Bucket,
    FlatLayout,
    FlatSlot,
    ShardableModel,
    bucket_groups,
    build_layout,
    split_frozen,
    zero_group,
)
from megazero.zero.precision import COMPUTE_DTYPE
from megazero.zero.sequence_parallel import SequenceParallelGrads
from megazero.zero.shard_home import MemoryShard, NvmeShard, ShardHome
from megazero.zero.stage3 import ParamGatherer, fetch_units


class ShardedParameters:
    """One model-parallel rank's model chunks, their parameters held in flat buckets (see above)."""

    def __init__(self, chunks: Sequence[ShardableModel], cfg: Config, grid: ProcessGrid,
                 initial: Optional[Callable[[int, str, nn.Parameter], torch.Tensor]] = None):
        """`initial(chunk index, name, parameter)`, when given, supplies starting values
        (this TP rank's shard, e.g. read from pretrained weights) instead of the model's init."""
        self.cfg, self.grid, self.chunks, self.initial = cfg, grid, chunks, initial
        # A model built on the meta device gets its values from its init, drawn in materialize().
        self.sharded_init = replace_meta_parameters(chunks, grid.device, hollow=True)
        z = cfg.zero
        self.sharding, self.compute_dtype = sharding(z.stage), COMPUTE_DTYPE[cfg.train.precision]
        units, groups = (fetch_units(chunks) if self.sharding.parameters
                         else (None, split_frozen(bucket_groups(chunks, z.bucket_size))))
        # ZeRO's groups by kind: context-parallel ranks hold the same parameters, so dense ones are
        # sharded and reduced over dp x cp; expert weights over expert-dp (config/sharding.py).
        kinds = dict.fromkeys([DENSE.zero] + [zero_group(p) for _, named in groups for _, p in named])
        self.zero_groups: dict[str, comm.Group] = {kind: grid[kind] for kind in kinds}
        self.layout: FlatLayout = build_layout(groups, {kind: self.sharding.shards(g)
                                                        for kind, g in self.zero_groups.items()})
        slots = self.layout.slots()
        tied = {id(c.tied_weight()) for c in chunks if c.tied_weight() is not None}
        self.tied_buckets = [b.index for b, s in slots if id(s.param) in tied and b.trainable]
        self.params = ParamStore(self.layout, home=self._shard_home() if self.sharding.parameters else None,
                                 dtype=self.compute_dtype, device=grid.device)
        # Built in this order, each object handed the ones it calls, so that nothing is wired
        # afterwards and every hook has its collaborators from the moment it is registered:
        # 1. stage 3: the gatherer; its forward pre-hooks gather a unit's buckets before it runs,
        #    its forward and output-gradient hooks free them after and gather them for backward;
        # 2. ZeRO-Offload on an accelerator: the host copy of the gradient shard;
        # 3. the gradient sync; its post-accumulate-grad hooks reduce each complete bucket, then
        #    hand it to 1 (release its parameters) and 2 (copy its final slice to the host);
        # 4. stages 1-2: forward pre-hooks waiting for the post-step all-gathers (what 1 does at 3).
        self.gatherer = (ParamGatherer(self.layout, self.params.home, units, self.zero_groups, z.prefetch,  # type: ignore[arg-type]  # stage 3: home and units set
                                       self.compute_dtype, grid.device, [getattr(c, "weight_grads", None) for c in chunks])
                         if self.sharding.parameters else None)
        self.host_grads = (HostGradients(self.layout.trainable_numel, grid.device, z.pin_memory)
                           if self._offloads_gradients() else None)
        self.grads = GradientSync(self.layout, sharding=self.sharding, model_dtype=self.compute_dtype,
                                  reduce_dtype=COMPUTE_DTYPE[z.reduce_dtype], groups=self.zero_groups,
                                  embed=grid.embed_group if self.tied_buckets else None, tied_buckets=self.tied_buckets,
                                  device=grid.device, on_reduced=self.gatherer.reduced if self.gatherer else None,
                                  on_final=self.host_grads.copy if self.host_grads else None)
        if self.sharding.gathers_after_step:
            self._wait_in_forward(chunks)
        for c in chunks if self.gatherer is not None else ():
            c.register_state_dict_pre_hook(self._refuse_sharded_state_dict)
        partial_over_tp = any(placement(s.param).sequence_parallel for _, s in slots)
        self.sp_grads = SequenceParallelGrads(self.layout, self.grads, grid.tp_group) if partial_over_tp else None

    def _offloads_gradients(self) -> bool:
        """Whether the optimizer steps in host memory apart from the device's gradients."""
        return self.cfg.zero.offload_optimizer != "none" and self.grid.device.type != "cpu"

    def materialize(self, master: Callable[[int, torch.Tensor], None] = lambda offset, values: None) -> None:
        """Write the starting values (ParamStore.fill; `master` gets the fp32 pieces); zero the gradients."""
        self.params.fill(self._initial, master)
        if self.gatherer is not None:  # the values are in the shard home now: gathered on use
            self.gatherer.release_storage()
        self.grads.zero_grad()

    def _wait_in_forward(self, chunks: Sequence[ShardableModel]) -> None:
        """Stages 1-2: a bucket's post-step all-gather is waited by the forward pre-hook of the
        first unit using it (later ones find it done), so the next forward starts while later
        buckets are in flight; module.state_dict() waits for all through a hook."""
        bucket_of = {id(s.param): b.index for b, s in self.layout.slots()}
        for c in chunks:
            tied = c.tied_weight()
            for unit in c.units():
                used = [p for _, p in unit.named] + ([tied] if unit.uses_tied and tied is not None else [])
                buckets = tuple(sorted({bucket_of[id(p)] for p in used}))
                unit.start.register_forward_pre_hook(lambda m, a, bs=buckets: self.params.wait(bs))
            c.register_state_dict_pre_hook(lambda *_: self.params.wait_all())

    def _initial(self, b: Bucket, s: FlatSlot) -> torch.Tensor:
        """Parameter s's starting value, flat: drawn from its chunk's init when the model was
        built on the meta device, else the values it holds."""
        if self.initial is not None:
            return self.initial(b.chunk, s.name, s.param).reshape(-1)
        if self.sharded_init:
            return self.chunks[b.chunk].initial_value(s.name, self.cfg.train.seed).reshape(-1)
        return s.param.detach().reshape(-1)

    def _shard_home(self) -> ShardHome:
        """Where the stage-3 parameter shard lives: zero.offload_param."""
        z, n = self.cfg.zero, self.layout.shard_numel

        def build() -> ShardHome:
            if z.offload_param == "none":
                return MemoryShard(n, self.compute_dtype, self.grid.device)
            if z.offload_param == "cpu":
                return MemoryShard(n, self.compute_dtype, torch.device("cpu"), pin=z.pin_memory)
            return NvmeShard(self.layout, self.compute_dtype, z.nvme_path, z.pin_memory)
        return comm.agreed(build, self.grid["world"])  # a full disk on one node stops every rank

    def finish_grad_sync(self) -> None:
        """Complete the DP reduction and sum the tied embedding over its group (see GradientSync.finish),
        then complete the gradients sequence parallelism leaves partial over TP."""
        self.grads.finish()
        if self.sp_grads is not None:
            self.sp_grads.all_reduce()
        if self.gatherer is not None:
            self.gatherer.release_all()

    # ------------------------------------------------------------------ state

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters as this rank holds them: full at stages 0-2; at stage 3 each one's
        piece of this rank's shard, flattened (the optimizer's partition map says where it goes)."""
        self.params.wait_all()
        host = HostStaging()  # one pinned buffer for every tensor
        if not self.sharding.parameters:
            return {s.name: host.copy(s.param.detach()) for _, s in self.layout.slots()}
        assert self.params.home is not None  # stage 3
        return {name: host.copy(self.params.home.read(offset, length)) for name, offset, length in self.params.pieces()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of model_state_dict()."""
        self.params.wait_all()
        if not self.sharding.parameters:
            for _, s in self.layout.slots():
                s.param.copy_(state[s.name])
        else:
            for name, offset, length in self.params.pieces():
                if length:
                    assert self.params.home is not None  # stage 3
                    self.params.home.write(offset, state[name])
        self.params.flush()

    # ------------------------------------------------------------------ stage 3: full parameters on request

    @contextlib.contextmanager
    def gathered_parameters(self, buckets: Optional[Iterable[int]] = None) -> Iterator[None]:
        """Inside, every parameter (or those of `buckets`) holds its full value (read-only: changes
        are not kept). At stages 0-2 parameters are always full (once the post-step gathers are waited)."""
        self.params.wait_all()
        newly = self.gatherer.fetch_all(buckets) if self.gatherer is not None else []
        try:
            yield
        finally:
            for b in newly:
                assert self.gatherer is not None
                self.gatherer.release(b)

    def full_parameters(self, trainable_only: bool = False) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, full value) for this model-parallel rank (or its trainable parameters
        only, e.g. LoRA's adapters); at stage 3 (collective over DP) a bucket is gathered, handed
        out and released before the next, so at most one unit is materialized beyond the shards."""
        for bucket in self.layout.buckets:
            if trainable_only and not bucket.trainable:
                continue
            with self.gathered_parameters([bucket.index]):
                for slot in bucket.slots:
                    yield slot.name, slot.param, slot.param.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of this model-parallel rank in full, as copies (any stage; at
        stage 3 gathered one unit at a time)."""
        host = HostStaging()
        return {name: host.copy(value) for name, _, value in self.full_parameters()}

    def _refuse_sharded_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        assert self.gatherer is not None  # registered at stage 3 only
        if self.gatherer.gathered != set(range(len(self.layout.buckets))):
            raise RuntimeError("zero stage 3 keeps parameters sharded, so module.state_dict() would hold empty "
                               "placeholders; use the ShardedParameters' model_state_dict() (shards) or "
                               "full_state_dict(), or call it inside their gathered_parameters()")

    # ------------------------------------------------------------------ accounting

    @property
    def materialized_numel(self) -> int:
        """Stage 3: full parameter elements gathered right now (0 at other stages: not tracked)."""
        return self.gatherer.materialized_numel if self.gatherer else 0

    @property
    def peak_materialized_numel(self) -> int:
        return self.gatherer.peak_materialized_numel if self.gatherer else 0
