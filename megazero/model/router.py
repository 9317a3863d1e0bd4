"""The MoE router: which k experts each token goes to, with what weight, and the losses that
keep the experts evenly loaded.

Everything here is in fp32 whatever the run's precision: the router's logits decide discrete
choices, and a bf16 rounding of a near tie would send a token elsewhere from one layout to
the next. The choice follows Megatron-Core's router (megatron/core/transformer/moe/router.py),
written from its description:

- softmax scores: top-k over the logits, then softmax over the k chosen (Mixtral, Qwen3 with
  norm_topk_prob), or with `pre_softmax` softmax over every expert first and the chosen
  probabilities kept as they are (OLMoE, Qwen2-MoE);
- sigmoid scores (DeepSeek-V3): sigmoid per expert, the k chosen renormalised to sum to 1;
- group-limited routing: the experts fall into `num_groups` groups, each group is scored by
  the sum of its best top-k / group_topk experts, and only the best `group_topk` groups'
  experts are candidates;
- an expert bias (aux-loss-free balancing) shifts the scores the top-k compares, never the
  probabilities the outputs are weighted by;
- the chosen probabilities are multiplied by `topk_scaling_factor`.

The losses are plain functions, each a scalar per layer and micro-batch; the MoE layer
attaches them to its output (moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megazero.parallel.placement import Placement, place


@dataclass(frozen=True)
class RouterSpec:
    """What routing does, taken from the model keys (ModelConfig.moe_* by Megatron's names)."""

    num_experts: int
    topk: int
    score_function: str = "softmax"  # softmax | sigmoid
    pre_softmax: bool = False
    topk_scaling_factor: Optional[float] = None
    num_groups: int = 0  # 0: no group-limited routing
    group_topk: int = 0
    enable_expert_bias: bool = False


@dataclass
class Routing:
    """One micro-batch's routing of T tokens (fp32)."""

    probs: torch.Tensor
    """[T, k] the weights of the chosen experts' outputs."""
    experts: torch.Tensor
    """[T, k] the chosen experts (int64), in descending score order."""
    logits: torch.Tensor
    """[T, E] the router's logits (for the z-loss)."""
    scores: torch.Tensor
    """[T, E] the scores of every expert, as the load-balancing loss weighs them: softmax over all
    experts, or the sigmoids normalised per token."""


class TopKRouter(nn.Module):
    """The router's linear layer [E, h], replicated over tensor-parallel ranks, and the choice."""

    def __init__(self, hidden_size: int, spec: RouterSpec):
        super().__init__()
        self.spec = spec
        shape = (spec.num_experts, hidden_size)
        self.weight = place(nn.Parameter(torch.empty(shape)), Placement(shape))
        # The aux-loss-free balancing bias [E]: no parameter (no gradient, no optimizer state),
        # no buffer (the model may be built on the meta device): the trainer owns every layer's
        # bias, updates it after each global batch and sets it here (train/moe.py).
        self.expert_bias: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, h] (any dtype) -> the routing of its T tokens."""
        logits = x.float() @ self.weight.float().t()
        return route(logits, self.spec, self.expert_bias)


def route(logits: torch.Tensor, spec: RouterSpec, bias: Optional[torch.Tensor] = None) -> Routing:
    """The top-k choice and its weights from fp32 logits [T, E]."""
    if spec.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        experts = _topk(scores if bias is None else scores + bias, spec)
        probs = scores.gather(1, experts)
        if spec.topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        aux_scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        aux_scores = torch.softmax(logits, dim=-1)
        if spec.pre_softmax:
            experts = _topk(aux_scores if bias is None else aux_scores + bias, spec)
            probs = aux_scores.gather(1, experts)
        else:
            experts = _topk(logits if bias is None else logits + bias, spec)
            probs = torch.softmax(logits.gather(1, experts), dim=-1)
    if spec.topk_scaling_factor is not None:
        probs = probs * spec.topk_scaling_factor
    return Routing(probs, experts, logits, aux_scores)


def _topk(scores: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The k best experts per token, among the best groups' experts under group-limited routing."""
    if spec.num_groups > 1:
        t, e = scores.shape
        grouped = scores.view(t, spec.num_groups, e // spec.num_groups)
        group_score = grouped.topk(spec.topk // spec.group_topk, dim=-1).values.sum(dim=-1)  # [T, groups]
        best = group_score.topk(spec.group_topk, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        scores = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(t, e)
    return scores.topk(spec.topk, dim=-1).indices


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the [T, k] choices went to each expert, as fp32 [E]."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts).float()


def aux_loss(scores: torch.Tensor, counts: torch.Tensor, total_tokens: int, topk: int, coeff: float) -> torch.Tensor:
    """Megatron's (Switch Transformer's) load-balancing loss of one layer and micro-batch:
    coeff · E / (k · T²) · Σᵢ Pᵢ · cᵢ, with Pᵢ the sum of expert i's scores over this rank's
    tokens and cᵢ its tokens over every rank that holds part of the micro-batch (`counts`,
    already summed over them, as T is). Its minimum, coeff, is an even load."""
    num_experts = scores.shape[-1]
    return (scores.sum(dim=0) * counts).sum() * (coeff * num_experts / (topk * total_tokens * total_tokens))


def seq_aux_loss(scores: torch.Tensor, experts: torch.Tensor, batch: int, seq_total: int, topk: int,
                 coeff: float, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The load-balancing loss per sequence, averaged over the micro-batch's `batch` sequences
    (DeepSeek-V3's sequence-wise loss): each sequence is balanced on its own. `scores` [b·s, E]
    and `experts` [b·s, k] hold this rank's s positions of each sequence, `seq_total` of them in
    all; `counts` [b, E], when given, are the per-sequence counts summed over the ranks that split
    the sequence (else counted here)."""
    num_experts = scores.shape[-1]
    per_seq_scores = scores.view(batch, -1, num_experts).sum(dim=1)  # [b, E]
    if counts is None:
        counts = sequence_counts(experts, batch, num_experts)
    per_seq = (per_seq_scores * counts).sum(dim=-1) * (coeff * num_experts / (topk * seq_total * seq_total))
    return per_seq.mean()


def sequence_counts(experts: torch.Tensor, batch: int, num_experts: int) -> torch.Tensor:
    """Tokens per expert of each sequence, fp32 [b, E], from this rank's [b·s, k] choices."""
    one_hot = torch.zeros(experts.shape[0], num_experts, device=experts.device).scatter_(1, experts, 1.0)
    return one_hot.view(batch, -1, num_experts).sum(dim=1)


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff · mean over tokens of logsumexp(logits)², which keeps the
    logits small (fp32 softmax stays exact)."""
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


def expert_bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing after a global batch: b += rate · sign(mean(c) − c), with `counts`
    the tokens each expert got over the whole batch (every micro-batch and data rank): an
    overloaded expert's bias falls, an idle one's rises."""
    return bias + rate * torch.sign(counts.mean() - counts)
