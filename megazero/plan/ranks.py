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
from megazero.model.gpt import GPT, apply_tensor_parallel
from megazero.parallel.comm import Group
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

    def padded(self, shards: int) -> list[int]:
        """Each bucket's padded size when partitioned over `shards` ranks."""
        return [bucket_numel(list(b), shards) for b in self.buckets]

    def muon_shard_numel(self, shards: int) -> int:
        """Muon's elements in the shard of the DP rank holding fewest of them (the most optimizer state)."""
        per_rank = [muon_shard_numels(list(b), list(m), shards) for b, m in zip(self.buckets, self.muon)]
        return min((sum(counts) for counts in zip(*per_rank)), default=0)


def rank_params(m: ModelConfig, tp: int, pp: int, vpp: int, pp_rank: int, stage3: bool, bucket_size: int,
                pp_layers: Optional[list[int]] = None) -> RankParams:
    """The parameters of pipeline rank `pp_rank` of a tp x pp (x vpp) layout (cached)."""
    # The cache needs hashable keys: a list value (model.moe_layer_freq's 0/1 form) goes in as a tuple.
    model = tuple(tuple(v) if isinstance(v, list) else v for v in dataclasses.astuple(m))
    return _rank_params(model, tp, pp, vpp, pp_rank, stage3, bucket_size, tuple(pp_layers) if pp_layers else None)


@functools.lru_cache(maxsize=256)
def _rank_params(model: tuple, tp: int, pp: int, vpp: int, pp_rank: int, stage3: bool, bucket_size: int,
                 pp_layers: Optional[tuple[int, ...]]) -> RankParams:
    values: list = [list(v) if isinstance(v, tuple) else v for v in model]
    cfg = ModelConfig(*values)
    layer_sets = stage_layers(cfg.num_layers, pp, vpp, pp_rank, list(pp_layers) if pp_layers else None)
    group = Group("tp", None, list(range(tp)), 0)  # shapes only: no collective runs on meta tensors
    with torch.device("meta"):
        chunks = [GPT(cfg, None, layers=layers, pre_process=pp_rank == 0 and v == 0,
                      post_process=pp_rank == pp - 1 and v == len(layer_sets) - 1)
                  for v, layers in enumerate(layer_sets)]
    for chunk in chunks:
        apply_tensor_parallel(chunk, group)
    groups = fetch_units(chunks)[1] if stage3 else bucket_groups(chunks, bucket_size)
    tied_params = {id(c.tied_weight()): c for c in chunks if c.tied_weight() is not None}
    tied = tuple(i for i, (_, named) in enumerate(groups) if any(id(p) in tied_params for _, p in named))
    return RankParams(chunks=tuple(ChunkShape(len(c.layers), c.pre_process, c.post_process) for c in chunks),
                      buckets=tuple(tuple(p.numel() for _, p in named) for _, named in groups),
                      muon=tuple(tuple(is_muon_matrix(n) for n, _ in named) for _, named in groups),
                      muon_shapes=tuple(m.shape for c in chunks for n, p in c.named_parameters() if is_muon_matrix(n)
                                        for m in split_matrices(n, placement(p), tuple(p.shape), 0, tp)),
                      tied=tied,
                      param_numel=sum(p.numel() for c in chunks for p in c.parameters()),
                      replicated_numel=sum(p.numel() for c in chunks for p in c.parameters()
                                           if not placement(p).sharded))
