"""The trainer's side of mixture-of-experts layers: how much their losses weigh, what the logs
say of them, and the expert bias of aux-loss-free balancing.

The load-balancing and z-losses are computed per MoE layer and micro-batch and join the
backward through the layer's output (model/moe.py). They count like the LM loss: averaged
over the micro-batches and data ranks of the global batch (each rank's gradients are summed
over data ranks), and multiplied by the fp16 loss scale when there is one, as the LM loss is
before its backward. `scale_losses` sets that weight before each step; `MoESteps.figures`
then sums what the layers recorded over the whole grid, once per step (one all-reduce over
the world, the same on every rank):
- `moe_aux_loss`, `moe_z_loss`: summed over the MoE layers, averaged over micro-batches and
  data ranks (each rank holding part of a micro-batch's tokens adds its share);
- `moe_imbalance`: tokens of the busiest expert over the mean, the worst layer's;
- `moe_dropped`: (token, expert) pairs dropped by a capacity factor in the global batch;
- with `logging.moe_per_layer`, `moe_aux_loss_layers` and `moe_z_loss_layers`: each MoE
  layer's share, by layer index (Megatron's --moe-per-layer-logging).

With `model.moe_router_enable_expert_bias` the same sums drive the aux-loss-free balancing:
every rank keeps the bias of every MoE layer ([MoE layers, E], equal everywhere: the counts
were summed over the whole grid), adds rate · sign(mean(c) − c) after each global batch and
hands each of its own layers its row. The table is saved with the trainer's state, so a resume
at any layout continues with it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megazero.config.schema import ModelConfig
from megazero.model.gpt import GPT, is_moe_layer, moe_layers
from megazero.model.moe import MoE
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid


def scale_losses(chunks: Sequence[GPT], microbatches: int, grid: ProcessGrid, fp16_scale: Optional[float]) -> None:
    """Weigh each micro-batch's MoE losses 1 / (micro-batches x data ranks), times the fp16 loss scale."""
    for chunk in chunks:
        for layer in moe_layers(chunk):
            layer.loss_scale = (fp16_scale or 1.0) / (microbatches * grid.dp)


class MoESteps:
    """The MoE figures of each step and the expert-bias table (see above); nothing for a dense model."""

    def __init__(self, model: ModelConfig, chunks: Sequence[GPT], grid: ProcessGrid, sequence_parallel: bool,
                 per_layer: bool = False):
        self.model, self.grid, self.sequence_parallel, self.per_layer = model, grid, sequence_parallel, per_layer
        self.indices = [i for i in range(model.num_layers) if is_moe_layer(model, i)]
        self.mine: dict[int, MoE] = {int(i): layer for chunk in chunks for i, block in chunk.transformer.h.items()
                                     for layer in moe_layers(block)}
        self.bias = torch.zeros(len(self.indices), model.num_experts, device=grid.device) \
            if model.num_experts and model.moe_router_enable_expert_bias else None
        self._hand_out_bias()

    def figures(self, microbatches: int) -> dict:
        """The step's figures, the same on every rank (collective: every rank calls it each step)."""
        if not self.indices:
            return {}
        table = torch.zeros(len(self.indices), 3 + self.model.num_experts, device=self.grid.device)  # aux, z, dropped, counts
        for row, index in enumerate(self.indices):
            if index in self.mine:
                table[row] = self.mine[index].take_totals().to(table.device)
        # Tensor-parallel ranks without sequence parallelism routed the same tokens: count one of them.
        if not (self.sequence_parallel or self.grid.tp_rank == 0):
            table.zero_()
        comm.all_reduce(table, self.grid["world"])
        losses, counts = table[:, :2] / (microbatches * self.grid.dp), table[:, 3:]
        if self.bias is not None:  # aux-loss-free balancing: b += rate · sign(mean(c) − c)
            self.bias += self.model.moe_router_bias_update_rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
            self._hand_out_bias()
        imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)).max()
        out: dict = {"moe_aux_loss": float(losses[:, 0].sum()), "moe_z_loss": float(losses[:, 1].sum()),
               "moe_imbalance": float(imbalance), "moe_dropped": int(table[:, 2].sum())}
        if self.per_layer:
            rows = losses.tolist()
            out["moe_aux_loss_layers"] = {str(i): row[0] for i, row in zip(self.indices, rows)}
            out["moe_z_loss_layers"] = {str(i): row[1] for i, row in zip(self.indices, rows)}
        return out

    def discard(self) -> None:
        """Drop the routing totals gathered so far (a rerun iteration's first execution: the rerun counts anew)."""
        for layer in self.mine.values():
            layer.take_totals()

    def state_dict(self) -> Optional[list]:
        """The expert-bias table for the checkpoint (None without one)."""
        return None if self.bias is None else self.bias.tolist()

    def load_state_dict(self, saved: Optional[list]) -> None:
        """A checkpoint's table; one without (saved before it had one) leaves the bias at zero."""
        if self.bias is not None and saved is not None:
            self.bias.copy_(torch.tensor(saved, dtype=self.bias.dtype))
            self._hand_out_bias()

    def _hand_out_bias(self) -> None:
        if self.bias is None:
            return
        for row, index in enumerate(self.indices):
            if index in self.mine:
                self.mine[index].router.expert_bias = self.bias[row].clone()
