"""What one rank of a layout holds, read off the real model rather than re-derived.

The rank's model chunks are built on the meta device exactly as training builds them
(pipeline split, then the TP split), and grouped into buckets by ZeRO's own grouping
(`bucket_groups` at stages 0-2, stage 3's fetch units); so the planner's Ψ is the
optimizer's to the element, alignment padding included, with no second description of
GPT-2's parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from megazero.config.schema import ModelConfig
from megazero.model.gpt import GPT, apply_tensor_parallel, moe_layers
from megazero.parallel.comm import Group, solo_group
from megazero.parallel.dispatch import LocalDispatch
from megazero.parallel.placement import placement
from megazero.pipeline.stages import stage_layers
from megazero.plan.formulas import ChunkShape, muon_shard_numels
from megazero.zero.muon import is_muon_matrix, split_matrices
from megazero.zero.partition import bucket_groups, bucket_numel
from megazero.zero.stage3 import fetch_units


@dataclass(frozen=True)
class RankParams:
    """One pipeline rank's parameters as the optimizer lays them out (any TP rank alike)."""

    chunks: tuple[ChunkShape, ...]
    buckets: tuple[tuple[int, ...], ...]
    """Per bucket, the element counts of its parameters in layout order."""
    tied: tuple[int, ...]
    """Buckets that hold the tied embedding (summed over the embedding group)."""
    param_numel: int
    replicated_numel: int = 0
    """Elements of the TP-replicated parameters (partial gradients under sequence parallelism)."""
    muon: tuple[tuple[bool, ...], ...] = ()
    """Per bucket, whether each parameter is a weight matrix Muon steps under optim.name muon."""
    muon_shapes: tuple[tuple[int, int], ...] = ()
    """The (out, in) shapes of the matrices Muon orthogonalises on this pipeline rank, whole over TP."""
    expert: tuple[tuple[bool, ...], ...] = ()
    """Per bucket, whether each parameter is a routed experts' weight (this rank's E / ep experts)."""

    @property
    def expert_numel(self) -> int:
        """Elements of this rank's routed experts (the expert memory: E / ep experts per MoE layer)."""
        return sum(n for b, e in zip(self.buckets, self.expert) for n, is_expert in zip(b, e) if is_expert)

    def split_experts(self) -> tuple[list[tuple[int, ...]], tuple[int, ...], list[tuple[int, ...]]]:
        """The buckets cut into their dense parameters and their experts' (a bucket is reduced over
        one group: ZeRO's dp x cp, or the experts' expert-dp), each part in layout order, empty
        parts dropped: (dense buckets, which of them hold the tied embedding, expert buckets)."""
        dense: list[tuple[int, ...]] = []
        experts: list[tuple[int, ...]] = []
        tied = []
        for i, (b, e) in enumerate(zip(self.buckets, self.expert or [()] * len(self.buckets))):
            flags = e or (False,) * len(b)
            part = tuple(n for n, is_expert in zip(b, flags) if not is_expert)
            if part:
                tied += [len(dense)] if i in self.tied else []
                dense.append(part)
            if any(flags):
                experts.append(tuple(n for n, is_expert in zip(b, flags) if is_expert))
        return dense, tuple(tied), experts

    def padded(self, shards: int) -> list[int]:
        """Each bucket's padded size when partitioned over `shards` ranks."""
        return [bucket_numel(list(b), shards) for b in self.buckets]

    def muon_shard_numel(self, shards: int) -> int:
        """Muon's elements in the shard of the DP rank holding fewest of them (the most optimizer state)."""
        per_rank = [muon_shard_numels(list(b), list(m), shards) for b, m in zip(self.buckets, self.muon)]
        return min((sum(counts) for counts in zip(*per_rank)), default=0)


def rank_params(m: ModelConfig, tp: int, pp: int, vpp: int, pp_rank: int, stage3: bool, bucket_size: int,
                pp_layers: Optional[list[int]] = None, ep: int = 1, etp: int = 1) -> RankParams:
    """The parameters of pipeline rank `pp_rank` of a tp x pp (x vpp) layout, its MoE layers
    keeping E / ep experts (GPT.apply_expert_parallel), each 1 / etp of its width (cached)."""
    model = tuple(tuple(v) if isinstance(v, list) else v for v in (getattr(m, f.name) for f in dataclasses.fields(m)))
    return _rank_params(model, tp, pp, vpp, pp_rank, stage3, bucket_size, tuple(pp_layers) if pp_layers else None,
                        ep, etp)


@functools.lru_cache(maxsize=2048)
def _rank_params(model: tuple, tp: int, pp: int, vpp: int, pp_rank: int, stage3: bool, bucket_size: int,
                 pp_layers: Optional[tuple[int, ...]], ep: int = 1, etp: int = 1) -> RankParams:
    values: tuple = tuple(list(v) if isinstance(v, tuple) else v for v in model)  # lists back (moe_layer_freq)
    cfg = ModelConfig(*values)
    layer_sets = stage_layers(cfg.num_layers, pp, vpp, pp_rank, list(pp_layers) if pp_layers else None)
    group = Group("tp", None, list(range(tp)), 0)  # shapes only: no collective runs on meta tensors
    with torch.device("meta"):
        chunks = [GPT(cfg, None, layers=layers, pre_process=pp_rank == 0 and v == 0,
                      post_process=pp_rank == pp - 1 and v == len(layer_sets) - 1)
                  for v, layers in enumerate(layer_sets)]
    for chunk in chunks:
        apply_tensor_parallel(chunk, group)
        # Rank 0 of the EP and expert_tp groups: every rank keeps as many experts, each slice as
        # wide. (Shapes only, as above.)
        chunk.apply_expert_parallel(Group("ep", None, list(range(ep)), 0), LocalDispatch(), solo_group(),
                                    expert_tp=Group("etp", None, list(range(etp)), 0))
    groups = fetch_units(chunks)[1] if stage3 else bucket_groups(chunks, bucket_size)
    tied_params = {id(c.tied_weight()): c for c in chunks if c.tied_weight() is not None}
    tied = tuple(i for i, (_, named) in enumerate(groups) if any(id(p) in tied_params for _, p in named))
    return RankParams(chunks=tuple(ChunkShape(len(c.layers), c.pre_process, c.post_process, len(moe_layers(c)))
                                   for c in chunks),
                      buckets=tuple(tuple(p.numel() for _, p in named) for _, named in groups),
                      expert=tuple(tuple(bool(placement(p).experts) for _, p in named) for _, named in groups),
                      muon=tuple(tuple(is_muon_matrix(n) for n, _ in named) for _, named in groups),
                      # Every matrix of the stage, each expert's too (Muon's exchange lists all experts).
                      muon_shapes=tuple(m.shape for c in chunks for n, p in c.named_parameters() if is_muon_matrix(n)
                                        for m in split_matrices(n, placement(p), tuple(p.shape), 0,
                                                                etp if placement(p).experts else tp)),
                      tied=tied,
                      param_numel=sum(p.numel() for c in chunks for p in c.parameters()),
                      replicated_numel=sum(p.numel() for c in chunks for p in c.parameters()
                                           if not placement(p).sharded))
