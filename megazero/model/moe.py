"""The mixture-of-experts layer: a Block's MLP when its layer is an MoE layer.

Each token goes to k of E experts chosen by the router (router.py); each expert is an MLP of
its own (`moe_ffn_hidden_size` wide, the run's activation); the token's output is the sum of
its experts' outputs weighted by the router's probabilities, plus, when the model has one, a
shared expert that every token passes through (Qwen2-MoE: scaled by a sigmoid gate).

Parameter names (layer i; E experts, F = moe_ffn_hidden_size, h = hidden_size):

    transformer.h.{i}.mlp.router.weight              [E, h]
    transformer.h.{i}.mlp.experts.c_fc.weight        [E, 2F, h] (gate | up under swiglu), else [E, F, h]
    transformer.h.{i}.mlp.experts.c_proj.weight      [E, h, F]
    transformer.h.{i}.mlp.shared_expert.c_fc/c_proj  a dense MLP (gpt.MLP) of the shared width
    transformer.h.{i}.mlp.shared_expert_gate.weight  [1, h]

The experts' weights are 3-D, one slice per expert, so that all experts compute as one
grouped GEMM over the tokens sorted by expert (`grouped_mm`). How the sorted tokens reach the
rank that holds their expert is the dispatcher's business (parallel/dispatch.py), set from
outside; the layer knows only the interface.

The load-balancing and z-losses of a training forward are attached to the layer's output
(`_AttachLoss`): their gradient, scaled by `loss_scale` (what the trainer sets so that they
count like the LM loss, averaged over micro-batches and data ranks), joins the backward
wherever that output's gradient comes from, a later layer or another pipeline stage. Their
values, the tokens per expert and the tokens dropped are kept in `stats` for the logs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from megazero.config.schema import ModelConfig
from megazero.model.layers import activate, split_parameter_
from megazero.model.router import (
    RouterSpec,
    Routing,
    TopKRouter,
    aux_loss,
    seq_aux_loss,
    sequence_counts,
    tokens_per_expert,
    z_loss,
)
from megazero.parallel.comm import Group, all_reduce, solo_group
from megazero.parallel.dispatch import (
    LocalDispatch,
    TokenDispatcher,
    enter_expert_tp,
    gather_expert_tp,
    gather_token_shares,
    leave_expert_tp,
    share_rows,
    token_share,
)
from megazero.parallel.placement import Placement, place, placement


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by expert, weight [E, out, in], counts [E] -> [N, out]: row block j of x
    times expert j's weight transposed, as one grouped GEMM (torch._grouped_mm) where this
    torch has it, else a loop over the experts (equal to it bit for bit on the CPU)."""
    if hasattr(torch, "_grouped_mm") and _grouped_mm_fits(x, weight):
        offsets = counts.cumsum(0).to(device=x.device, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return expert_loop_mm(x, weight, counts)


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The grouped GEMM takes rows 16 bytes aligned (a LoRA adapter's rank r may not be); on CUDA
    bf16 only, and so under torch.compile (its fake-tensor rule is CUDA's); eager on the CPU any
    float."""
    align = 16 // x.element_size()
    if x.shape[1] % align or weight.shape[1] % align:
        return False
    bf16 = x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    return bf16 or (x.device.type != "cuda" and not torch.compiler.is_compiling())


def expert_loop_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The reference of grouped_mm: one matmul per expert over its rows."""
    return torch.cat([piece @ weight[j].t() for j, piece in enumerate(x.split(counts.tolist()))])


class _ExpertWeight(nn.Module):
    """One 3-D weight [E, out, in]: a module of its own so that its name ends in `.weight` and
    that its product is a module's forward (which LoRA's hook extends, as a dense projection's).
    `stride`: equal fused blocks of each expert's rows (gate | up), as a dense MLP's c_fc."""

    def __init__(self, shape: tuple[int, int, int], experts: int = 0, stride: int = 1):
        super().__init__()
        self.weight = place(nn.Parameter(torch.empty(shape)), Placement(shape, stride=stride, experts=experts))
        self.etp: Group = solo_group()  # the ranks each expert is split over (split())

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, in] sorted by expert, `counts` [E] rows each -> [N, out]."""
        return grouped_mm(x, self.weight, counts)

    def keep_experts(self, ep: Group) -> None:
        """Keep this expert-parallel rank's whole experts (the placement keeps the full shape)."""
        where = placement(self.weight)
        self.weight = place(nn.Parameter(where.expert_shard(self.weight.detach(), ep.rank, ep.size).clone()), where)

    def split(self, dim: int, etp: Group) -> None:
        """Keep this expert-tensor-parallel rank's slice of every expert along `dim` (1: output
        rows, each of `stride`'s blocks cut on its own; 2: input columns). The placement records
        the dim only now: whole experts (etp 1) stay replicated over their expert_tp group of one,
        as checkpoints of whole experts record them."""
        self.weight = place(self.weight, dataclasses.replace(placement(self.weight), dim=dim))
        split_parameter_(self, "weight", etp)
        self.etp = etp


class GroupedExperts(nn.Module):
    """E expert MLPs whose weights are stacked: c_fc [E, (2)F, h], c_proj [E, h, F]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, activation: str):
        super().__init__()
        self.activation = activation
        gated = activation == "swiglu"
        self.c_fc = _ExpertWeight((num_experts, (2 if gated else 1) * ffn, hidden), num_experts, 2 if gated else 1)
        self.c_proj = _ExpertWeight((num_experts, hidden, ffn), num_experts)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.c_proj(activate(self.c_fc(x, counts), self.activation), counts)

    def apply_etp(self, etp: Group) -> None:
        """Expert tensor parallelism: each expert's MLP split as a dense MLP over TP, c_fc by output
        rows (gate and up each on its own), c_proj by input columns; the output is then partial."""
        width = self.c_proj.weight.shape[2]
        if width % etp.size:
            raise ValueError(f"the experts' width ({width}) must be divisible by etp ({etp.size})")
        self.c_fc.split(1, etp)
        self.c_proj.split(2, etp)


@dataclass(frozen=True)
class MoESpec:
    """The MoE layer's settings from the model keys (Megatron's names, without the moe_ prefix)."""

    router: RouterSpec
    ffn_hidden_size: int
    load_balancing: str = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None  # None: dropless
    token_drop_policy: str = "probs"  # probs | position
    pad_to_capacity: bool = False
    shared_expert_gate: bool = False


def moe_spec(cfg: ModelConfig) -> MoESpec:
    """The MoE layer's settings from a ModelConfig's moe_* keys."""
    router = RouterSpec(cfg.num_experts, cfg.moe_router_topk, cfg.moe_router_score_function,
                        cfg.moe_router_pre_softmax, cfg.moe_router_topk_scaling_factor, cfg.moe_router_num_groups,
                        cfg.moe_router_group_topk, cfg.moe_router_enable_expert_bias)
    return MoESpec(router, cfg.moe_ffn_size, cfg.moe_load_balancing, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff,
                   cfg.moe_capacity_factor, cfg.moe_token_drop_policy, cfg.moe_pad_to_capacity,
                   cfg.moe_shared_expert_gate)


@dataclass
class MoEStats:
    """One forward's figures for the logs (detached)."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor  # [E] over the ranks that split the micro-batch
    dropped: torch.Tensor  # (token, expert) pairs dropped by the capacity


class MoE(nn.Module):
    """Router, experts and (optionally) a shared expert; `dispatcher` says how tokens travel."""

    def __init__(self, hidden: int, activation: str, spec: MoESpec, shared_expert: Optional[nn.Module] = None):
        super().__init__()
        self.spec = spec
        self.router = TopKRouter(hidden, spec.router)
        self.experts = GroupedExperts(spec.router.num_experts, hidden, spec.ffn_hidden_size, activation)
        self.shared_expert = shared_expert
        if shared_expert is not None and spec.shared_expert_gate:
            self.shared_expert_gate = _ExpertWeight((1, 1, hidden))  # a [1, h] linear, stored [1, 1, h]
        self.dispatcher: TokenDispatcher = LocalDispatch()
        self.ep_size = 1  # ranks whose tokens reach this rank's experts (each sends at most a capacity's worth)
        # Groups whose ranks hold parts of the same micro-batch's tokens (tp under sequence
        # parallelism, cp): the load-balancing counts are summed over them. The data-parallel
        # group too for global_aux_loss. Set from outside, like the dispatcher.
        self.split_groups: list[Group] = []
        self.data_group: Group = solo_group()
        # Ranks holding the same tokens whose experts' places differ (tp without sequence
        # parallelism, at etp 1): each sends only its share of the tokens (dispatch.token_share).
        self.token_replicas: Group = solo_group()
        # Ranks that split each expert's MLP (etp = tp; set by apply_ep), and whether the tokens
        # arrive split along the sequence over them (set by GPT.apply_sequence_parallel).
        self.expert_tp: Group = solo_group()
        self.sequence_parallel = False
        self.loss_scale = 1.0
        self.stats: Optional[MoEStats] = None
        # Sums over the training forwards since `take_totals` (recomputations not counted): aux, z,
        # dropped, then the tokens of each expert.
        self.totals: Optional[torch.Tensor] = None  # (not a tensor made here: the model may be built on meta)

    def apply_ep(self, ep: Group, dispatcher: TokenDispatcher, expert_tp: Optional[Group] = None) -> None:
        """Expert parallelism (from outside, like tensor parallelism): keep this rank's E/ep
        experts, each its slice of the `expert_tp` group (None: whole), and let `dispatcher` carry
        the tokens to the ranks of theirs."""
        if expert_tp is not None and expert_tp.size > 1:
            self.experts.apply_etp(expert_tp)
            self.expert_tp = expert_tp
        if ep.size > 1:
            self.experts.c_fc.keep_experts(ep)
            self.experts.c_proj.keep_experts(ep)
        self.dispatcher, self.ep_size = dispatcher, ep.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        keep = self._within_capacity(routing, flat.shape[0])
        out = self._experts(flat, routing, keep)
        if self.shared_expert is not None:
            # Given [b, s, h]: under sequence parallelism its TP layers gather along the sequence (dim 1).
            shared = self.shared_expert(x).reshape(flat.shape)
            if hasattr(self, "shared_expert_gate"):
                shared = shared * torch.sigmoid(flat @ self.shared_expert_gate.weight[0].t())
            out = out + shared
        out = out.view(shape)
        if torch.is_grad_enabled():
            out = self._losses(out, routing, keep, shape[0])
        return out

    def _experts(self, flat: torch.Tensor, routing: Routing, keep: Optional[torch.Tensor]) -> torch.Tensor:
        """The routed experts' output for every token: where other ranks hold the same tokens
        (`token_replicas`), this rank computes its share of them and the shares are gathered;
        where the experts are split over `expert_tp`, a TP region around the dispatch."""
        group = self.token_replicas
        rows = flat.shape[0]
        if self.expert_tp.size > 1:
            return self._split_experts(flat, routing, keep)
        if group.size == 1:
            return self._routed(flat, routing.experts, routing.probs, keep, self._pad_rows(rows))
        own = share_rows(rows, group)
        mine = self._routed(token_share(flat, group), routing.experts[own], token_share(routing.probs, group),
                            None if keep is None else keep[own], self._pad_rows(rows))
        return gather_token_shares(mine, group, flat.shape[0])

    def _split_experts(self, flat: torch.Tensor, routing: Routing, keep: Optional[torch.Tensor]) -> torch.Tensor:
        """Experts split over expert_tp (etp = tp): every rank of the group runs its slice of the
        experts on the same tokens (replicated, or gathered from each rank's positions under
        sequence parallelism), and the weighted outputs, partial sums, are summed over the group:
        the sum commutes with the weighted combine, so it is one reduction, as a row-parallel
        linear's. The tokens' and the probabilities' gradients are partial likewise, summed on
        the way back (enter_expert_tp); the router's own stay whole."""
        g, sp = self.expert_tp, self.sequence_parallel
        # Under sequence parallelism each rank's capacity was counted over its own positions: an
        # expert gets at most that many from each of the group's ranks.
        pad = self._pad_rows(flat.shape[0], g.size if sp else 1)
        out = self._routed(enter_expert_tp(flat, g, sp), gather_expert_tp(routing.experts, g, sp),
                           enter_expert_tp(routing.probs, g, sp),
                           None if keep is None else gather_expert_tp(keep, g, sp), pad)
        return leave_expert_tp(out, g, sp)

    def _pad_rows(self, routed: int, sources: int = 1) -> Optional[int]:
        """Rows each local expert computes under model.moe_pad_to_capacity (None: its tokens alone):
        a capacity counted over `routed` tokens from each of the ep group's ranks, times `sources`."""
        if not (self.spec.pad_to_capacity and self.spec.capacity_factor is not None):
            return None
        return self.ep_size * sources * self._capacity(routed)

    def _routed(self, flat: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor,
                keep: Optional[torch.Tensor], pad_rows: Optional[int]) -> torch.Tensor:
        """Sort the kept (token, expert) pairs by expert, run the experts, and sum each token's
        outputs weighted by its probabilities (a dropped pair adds nothing). `pad_rows`: the rows
        each local expert computes when padded to capacity (`_pad_rows`)."""
        tokens, k = experts.shape
        pairs = experts.reshape(-1)
        kept = torch.arange(pairs.numel(), device=pairs.device) if keep is None else keep.reshape(-1).nonzero()[:, 0]
        order = kept[torch.argsort(pairs[kept], stable=True)]  # pair indices, grouped by expert
        counts = torch.bincount(pairs[order], minlength=self.spec.router.num_experts).cpu()
        local, local_counts, sent = self.dispatcher.dispatch(flat[order // k], counts)
        if pad_rows is not None:
            computed = self._padded_experts(local, local_counts, pad_rows)
        else:
            computed = self.experts(local, local_counts)
        outputs = self.dispatcher.combine(computed, sent)
        per_pair = outputs.new_zeros(tokens * k, flat.shape[-1]).index_copy(0, order, outputs)
        weights = probs.to(outputs.dtype).unsqueeze(-1)
        return (per_pair.view(tokens, k, -1) * weights).sum(dim=1)

    def _padded_experts(self, local: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
        """model.moe_pad_to_capacity: every expert computes `rows` rows (its tokens, then zeros), so
        the grouped GEMM's shapes do not depend on the routing; the padding's outputs are dropped."""
        blocks = local.split(counts.tolist())
        padded = torch.cat([torch.cat([b, b.new_zeros(rows - b.shape[0], b.shape[1])]) for b in blocks])
        out = self.experts(padded, torch.full_like(counts, rows)).split(rows)
        return torch.cat([o[:n] for o, n in zip(out, counts.tolist(), strict=True)])

    def _capacity(self, tokens: int) -> int:
        """Pairs an expert takes from `tokens` tokens: ceil(T·k/E · moe_capacity_factor)."""
        assert self.spec.capacity_factor is not None
        return math.ceil(tokens * self.spec.router.topk / self.spec.router.num_experts * self.spec.capacity_factor)

    def _within_capacity(self, routing: Routing, tokens: int) -> Optional[torch.Tensor]:
        """[T, k] which pairs an expert takes under the capacity factor (None: dropless, all).
        Each expert takes at most ceil(T·k/E · factor) of its pairs: those of the highest
        probability (policy probs) or the first tokens (policy position)."""
        if self.spec.capacity_factor is None:
            return None
        num_experts, capacity = self.spec.router.num_experts, self._capacity(tokens)
        pairs = routing.experts.reshape(-1)
        # Rank each pair among its expert's by the policy's key: sort by key, then stably by expert.
        key = -routing.probs.reshape(-1) if self.spec.token_drop_policy == "probs" else \
            torch.arange(pairs.numel(), device=pairs.device, dtype=torch.float)
        by_key = torch.argsort(key, stable=True)
        by_expert = by_key[torch.argsort(pairs[by_key], stable=True)]
        per_expert = torch.bincount(pairs, minlength=num_experts)
        starts = per_expert.cumsum(0) - per_expert
        rank_in_expert = torch.empty_like(pairs)
        rank_in_expert[by_expert] = torch.arange(pairs.numel(), device=pairs.device) - starts[pairs[by_expert]]
        return (rank_in_expert < capacity).view_as(routing.experts)

    def _losses(self, out: torch.Tensor, routing: Routing, keep: Optional[torch.Tensor], batch: int) -> torch.Tensor:
        """Compute this micro-batch's load-balancing and z-losses, keep them for the logs, and
        attach them (scaled by loss_scale) to the output's backward."""
        spec, num_experts = self.spec, self.spec.router.num_experts
        tokens = routing.experts.shape[0]
        all_counts = self._over_split(tokens_per_expert(routing.experts, num_experts))  # the micro-batch's
        split = math.prod(g.size for g in self.split_groups)
        total = tokens * split
        zero = routing.logits.new_zeros(())
        balance = zero
        if spec.load_balancing == "aux_loss":
            balance = aux_loss(routing.scores, all_counts, total, spec.router.topk, spec.aux_loss_coeff)
        elif spec.load_balancing == "global_aux_loss":
            global_counts = all_counts.clone()
            all_reduce(global_counts, self.data_group)
            balance = aux_loss(routing.scores, global_counts, total * self.data_group.size, spec.router.topk,
                               spec.aux_loss_coeff) * self.data_group.size
        elif spec.load_balancing == "seq_aux_loss":
            seq_counts = self._over_split(sequence_counts(routing.experts, batch, num_experts))
            balance = seq_aux_loss(routing.scores, routing.experts, batch, total // batch, spec.router.topk,
                                   spec.aux_loss_coeff, seq_counts)
        # This rank's share of the mean over the micro-batch's tokens (the shares sum to it).
        z = z_loss(routing.logits, spec.z_loss_coeff) / split if spec.z_loss_coeff else zero
        dropped = zero if keep is None else (~keep).sum().float()
        self.stats = MoEStats(balance.detach(), z.detach(), all_counts, dropped)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            figures = torch.cat([torch.stack([balance.detach(), z.detach(), dropped]), all_counts])
            self.totals = figures if self.totals is None else self.totals + figures
        total_loss = balance + z
        if not total_loss.requires_grad:
            return out
        return _AttachLoss.apply(out, total_loss * self.loss_scale)


    def _over_split(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` summed over the ranks that split the micro-batch's tokens."""
        for group in self.split_groups:
            all_reduce(counts, group)
        return counts

    def take_totals(self) -> torch.Tensor:
        """[aux, z, dropped, tokens of expert 0, 1, ...] summed over the training forwards since
        the last call, and reset."""
        totals, self.totals = self.totals, None
        return torch.zeros(3 + self.spec.router.num_experts) if totals is None else totals


class _AttachLoss(torch.autograd.Function):
    """Returns `out` unchanged; its backward also starts `loss`'s backward (gradient 1), so an
    auxiliary loss joins the model's gradient wherever `out`'s gradient comes from."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)
