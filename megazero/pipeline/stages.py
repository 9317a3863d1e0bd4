"""Which layers each pipeline rank owns, and building its model chunks.

With vpp model chunks per rank (interleaved schedule), the model is cut into pp x vpp
equal chunks and rank r owns chunks r, r + pp, r + 2 pp, ... (Megatron's layout), so a
micro-batch visits every rank vpp times.
"""

from __future__ import annotations

from typing import Optional

import torch

from megazero.config.schema import Config
from megazero.model.gpt import GPT
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.random import RNGTracker
from megazero.parallel.weight_grad import attach_weight_grad_store


def stage_layers(num_layers: int, pp: int, vpp: int, pp_rank: int,
                 pp_layers: Optional[list[int]] = None) -> list[list[int]]:
    """Global layer indices of each of `pp_rank`'s model chunks, in execution order."""
    if pp_layers is not None:  # uneven split, one chunk per rank
        start = sum(pp_layers[:pp_rank])
        return [list(range(start, start + pp_layers[pp_rank]))]
    per_chunk = num_layers // (pp * vpp)
    return [list(range((v * pp + pp_rank) * per_chunk, (v * pp + pp_rank + 1) * per_chunk)) for v in range(vpp)]


def build_model_chunks(cfg: Config, grid: ProcessGrid, tracker: RNGTracker) -> list[GPT]:
    """This rank's model chunks, built whole (tp = 1) on the meta device: shapes and names,
    no memory. megazero.train.parallelize splits them over TP and ZeRO materializes only
    what this rank owns from the layout-independent init."""
    p = cfg.parallel
    layer_sets = stage_layers(cfg.model.num_layers, grid.pp, p.vpp, grid.pp_rank, p.pp_layers)
    with torch.device("meta"):
        chunks = [GPT(cfg.model, tracker, layers=layers,
                      pre_process=grid.is_first_stage and v == 0,
                      post_process=grid.is_last_stage and v == len(layer_sets) - 1)
                  for v, layers in enumerate(layer_sets)]
    if grid.pp > 1 and p.schedule == "zbh1":  # its backward defers the matmuls' weight gradients
        for chunk in chunks:
            attach_weight_grad_store(chunk)
    return chunks
