"""The optimizer side of training: gradient reduction over data-parallel replicas, global
gradient-norm clipping, and AdamW on fp32 master weights.

Interface used by the trainer and the pipeline schedules:
    zero_grad()           before the first micro-batch of an iteration
    scale_loss(loss)      loss multiplier before backward (fp16 loss scaling)
    finish_grad_sync()    after the last backward: reduce gradients over DP, sum tied embeddings
    step(lr) -> StepResult
    state_dict() / load_state_dict()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megazero.config import Config
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: Optional[float] = None


def no_weight_decay(name: str, p: nn.Parameter) -> bool:
    """Biases, LayerNorms and position embeddings are not decayed (GPT-2 / Megatron practice)."""
    return p.dim() < 2 or ".ln_" in name or "ln_f" in name


class ZeroOptimizer:
    """ZeRO stage 0: every DP rank holds all optimizer state; gradients are all-reduced."""

    def __init__(self, chunks: list[nn.Module], cfg: Config, grid: ProcessGrid):
        self.cfg, self.grid = cfg, grid
        self.named = [(n, p) for c in chunks for n, p in c.named_parameters()]
        self.tied = [c.tied_weight() for c in chunks if c.tied_weight() is not None]
        fp32 = cfg.train.precision == "fp32"
        # fp32 master weights: the parameters themselves in fp32 runs, copies otherwise.
        self.master = [p if fp32 else p.detach().float().clone().requires_grad_() for _, p in self.named]
        groups = [
            {"params": [m for (n, p), m in zip(self.named, self.master) if not no_weight_decay(n, p)],
             "weight_decay": cfg.optim.weight_decay},
            {"params": [m for (n, p), m in zip(self.named, self.master) if no_weight_decay(n, p)],
             "weight_decay": 0.0},
        ]
        self.adam = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                      eps=cfg.optim.eps, foreach=False)

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def finish_grad_sync(self) -> None:
        for _, p in self.named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # The first stage's embedding and the last stage's head are one weight: sum their grads.
        for w in self.tied:
            comm.all_reduce(w.grad, self.grid.embed_group)
        grads = [p.grad for _, p in self.named]
        flat = torch._utils._flatten_dense_tensors(grads)
        comm.all_reduce(flat, self.grid.dp_group)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def grad_norm(self) -> float:
        """Global L2 norm over TP, PP and DP, each gradient element counted once."""
        sq = torch.zeros(1, dtype=torch.float64)
        for (name, p), m in zip(self.named, self.master):
            replicated_over_tp = p.tp_dim is None
            if replicated_over_tp and self.grid.tp_rank != 0:
                continue
            if name == "lm_head.weight":  # tied copy of wte, counted on the first stage
                continue
            sq += p.grad.double().pow(2).sum()
        comm.all_reduce(sq, self.grid.mp_group)
        return float(sq.sqrt())

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        for (_, p), m in zip(self.named, self.master):
            m.grad = p.grad if m is p else p.grad.float()
        norm = self.grad_norm()
        clip = self.cfg.optim.clip_grad
        if clip > 0 and norm > clip:
            for m in self.master:
                m.grad.mul_(clip / (norm + 1e-6))
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        for (_, p), m in zip(self.named, self.master):
            if m is not p:
                p.copy_(m)
        return StepResult(grad_norm=norm, skipped=False)

    def state_dict(self) -> dict:
        return {"adam": self.adam.state_dict(), "master": [m.detach() for m in self.master]}

    def load_state_dict(self, state: dict) -> None:
        self.adam.load_state_dict(state["adam"])
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
