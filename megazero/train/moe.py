"""The trainer's side of mixture-of-experts layers: how much their losses weigh, and what the
logs say of them.

The load-balancing and z-losses are computed per MoE layer and micro-batch and join the
backward through the layer's output (model/moe.py). They count like the LM loss: averaged
over the micro-batches and data ranks of the global batch (each rank's gradients are summed
over data ranks), and multiplied by the fp16 loss scale when there is one, as the LM loss is
before its backward. `scale_losses` sets that weight before each step; `step_figures` then
sums what the layers recorded over the whole grid, once per step (one all-reduce over the
world, the same on every rank):
- `moe_aux_loss`, `moe_z_loss`: summed over the MoE layers, averaged over micro-batches and
  data ranks (each rank holding part of a micro-batch's tokens adds its share);
- `moe_imbalance`: tokens of the busiest expert over the mean, the worst layer's;
- `moe_dropped`: (token, expert) pairs dropped by a capacity factor in the global batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megazero.config.schema import ModelConfig
from megazero.model.gpt import GPT, is_moe_layer, moe_layers
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid


def scale_losses(chunks: Sequence[GPT], microbatches: int, grid: ProcessGrid, fp16_scale: Optional[float]) -> None:
    """Weigh each micro-batch's MoE losses 1 / (micro-batches x data ranks), times the fp16 loss scale."""
    for chunk in chunks:
        for layer in moe_layers(chunk):
            layer.loss_scale = (fp16_scale or 1.0) / (microbatches * grid.dp)


def step_figures(chunks: Sequence[GPT], microbatches: int, grid: ProcessGrid, model: ModelConfig,
                 sequence_parallel: bool) -> dict:
    """The step's MoE figures (see above), the same on every rank ({} for a dense model)."""
    indices = [i for i in range(model.num_layers) if is_moe_layer(model, i)]
    if not indices:
        return {}
    mine = {int(i): layer for chunk in chunks for i, block in chunk.transformer.h.items()
            for layer in moe_layers(block)}
    table = torch.zeros(len(indices), 3 + model.num_experts, device=grid.device)  # aux, z, dropped, counts
    for row, index in enumerate(indices):
        if index in mine:
            table[row] = mine[index].take_totals().to(table.device)
    # Tensor-parallel ranks without sequence parallelism routed the same tokens: count one of them.
    if not (sequence_parallel or grid.tp_rank == 0):
        table.zero_()
    comm.all_reduce(table, grid["world"])
    losses = table[:, :2] / (microbatches * grid.dp)
    counts = table[:, 3:]
    imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)).max()
    return {"moe_aux_loss": float(losses[:, 0].sum()), "moe_z_loss": float(losses[:, 1].sum()),
            "moe_imbalance": float(imbalance), "moe_dropped": int(table[:, 2].sum())}
