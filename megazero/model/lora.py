"""LoRA (Hu et al., 2021): low-rank adapters beside frozen GPT-2 projections.

An adapted projection computes y = base(x) + B(A(dropout(x))) * alpha / r. The adapter is
a separate path whose output is added to the base layer's by a forward hook, so the base
layer's own forward (and whatever a pipeline schedule does inside it) is untouched. Its
two weights hang under the base module as `lora_A.weight` [r, in] and `lora_B.weight`
[out, r], so their names are PEFT's for GPT-2 (`transformer.h.0.attn.c_attn.lora_A.weight`)
and ZeRO-3 gathers them with their block like any other parameter.

Adapters follow the base layer's tensor-parallel sharding (torchtitan's rule):

    column-parallel base (c_attn, c_fc)  input replicated: A replicated; B split on its
        output rows with the base's stride (c_attn: q | k | v each split), so a rank's
        adapter output lines up with its slice of the base output. The r-wide
        intermediate enters the TP region through copy_to_tp: its gradient, partial per
        rank, is summed before it reaches A.
    row-parallel base (attn/mlp c_proj)  input split over TP: A split on its input columns,
        B replicated; the partial r-wide products are summed (reduce_from_tp) before B.

Dropout on a replicated input uses the default stream (the same mask on every TP rank);
on a row-parallel input each rank holds distinct features and uses the tracker's
per-rank stream, as attention dropout does.

An MoE layer's experts (model/moe.py: 3-D weights [E, out, in], experts whole on each rank)
get one adapter per expert, stacked as their weights are: `lora_A.weight` [E, r, in] and
`lora_B.weight` [E, out, r] under the expert weight (or, for gate and up of a SwiGLU c_fc,
under its part: mlp.experts.c_fc.gate_proj.lora_A.weight); the tokens sorted by expert pass
through A and B as one grouped GEMM each, so expert j's tokens see exactly W_j + B_j A_j.
Each expert's slice is the adapter PEFT puts on that expert's own Linear
(block_sparse_moe.experts.{j}.w1, mlp.experts.{j}.gate_proj, ...): the export splits them.

Initial values are layout-independent (seeded by name, like GPT._full_init): A as PEFT's
default (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B zeros, so training
starts from the base model exactly.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config.schema import FinetuneConfig, ModelConfig
from megazero.model.gpt import GPT
from megazero.model.layers import ColumnParallelLinear, RowParallelLinear
from megazero.model.lora_targets import Target, adapted, part_rows
from megazero.model.moe import MoE, grouped_mm
from megazero.parallel.comm import copy_to_tp, reduce_from_tp
from megazero.parallel.placement import Placement, place, placement
from megazero.parallel.random import RNGTracker, in_stream


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter weight."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


class LoRA:
    """The adapter path of one base projection; its forward hook adds the adapter's output."""

    def __init__(self, base: Any, rank: int, alpha: float, dropout: float, tracker: Optional[RNGTracker],
                 part: Optional[tuple[str, int, int]] = None):
        """`part`: (name, lo, hi) when the adapter covers rows [lo, hi) of a fused column-parallel
        projection (the Llama family's q_proj of c_attn, ...); its weights then hang under
        base.NAME and its output lands on this rank's share of those rows."""
        self.row = isinstance(base, RowParallelLinear)
        if not (self.row or isinstance(base, ColumnParallelLinear)):
            raise TypeError(f"LoRA adapts column/row-parallel linears, not {type(base).__name__}")
        self.scale, self.dropout, self.tracker = alpha / rank, dropout, tracker
        out_full, in_full = placement(base.weight).full_shape
        tp = self.tp_size = base.tp.size
        self.at: Optional[tuple[int, int]] = None  # (first local output column, local width) of a part
        holder, where = base, placement(base.weight)
        split = Placement((out_full, rank), 0, where.stride, parts=where.parts)
        if part is not None:
            name, lo, hi = part
            holder = nn.Module()
            setattr(base, name, holder)
            out_full = hi - lo
            split = Placement((out_full, rank), 0)
            self.at = (lo // tp, out_full // tp)  # every fused part is split over the ranks on its own
        make = dict(dtype=base.weight.dtype, device=base.weight.device)
        holder.lora_A, holder.lora_B = nn.Module(), nn.Module()
        self.holder = holder
        if self.row:  # A split on the input like the base weight, B replicated
            holder.lora_A.weight = place(nn.Parameter(torch.empty(rank, in_full // tp, **make)),
                                         Placement((rank, in_full), 1))
            holder.lora_B.weight = place(nn.Parameter(torch.empty(out_full, rank, **make)),
                                         Placement((out_full, rank)))
        else:  # A replicated, B split on the output rows as the base's (or, for a part, as one block)
            holder.lora_A.weight = place(nn.Parameter(torch.empty(rank, in_full, **make)), Placement((rank, in_full)))
            holder.lora_B.weight = place(nn.Parameter(torch.empty(out_full // tp, rank, **make)), split)
        base.register_forward_hook(self._add_adapter)

    def _dropped(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        if not training or self.dropout == 0:
            return x
        if self.row and self.tracker is not None and self.tp_size > 1:  # distinct features per rank
            return in_stream(self.tracker, "tp", functools.partial(F.dropout, x, self.dropout, training=True))
        return F.dropout(x, self.dropout, training=True)

    def _add_adapter(self, base: Any, args: tuple, y: torch.Tensor) -> torch.Tensor:
        x, h = self._dropped(args[0], base.training), self.holder
        a = F.linear(x, h.lora_A.weight)  # [..., r]
        if self.row:  # each rank's A slice saw its slice of the input: sum the partial products before B
            return y + F.linear(reduce_from_tp(a, base.tp), h.lora_B.weight) * self.scale
        # a is the same on every rank, but each B slice sends back only part of its gradient:
        # copy_to_tp sums those in backward, so A (replicated) gets the full gradient everywhere.
        delta = F.linear(copy_to_tp(a, base.tp), h.lora_B.weight) * self.scale
        if self.at is not None:  # onto this rank's columns of the part
            start, width = self.at
            delta = F.pad(delta, (start, y.shape[-1] - start - width))
        return y + delta


class ExpertLoRA:
    """The adapters of every expert of one expert weight [E, out, in] (or of its rows [lo, hi)
    of each expert: gate or up); its forward hook adds expert j's B_j A_j x to its tokens' rows.

    Experts split over expert-TP ranks (etp = tp) are adapted as a dense projection under TP is:
    c_fc's B by output rows (A replicated, its gradient summed over the group), c_proj's A by input
    columns (the partial products A x summed before B, which is replicated). Inside the experts'
    TP region the tokens' gradient is partial on each rank (summed where the region begins), so
    c_fc's adapter sums A's gradient on A itself, not on A x; and the experts' output is partial
    (summed after the combine), so c_proj's adapter adds its share, 1 / etp of B A x, while B's
    gradient stays whole on every rank (`_share`)."""

    def __init__(self, base: Any, rank: int, alpha: float, dropout: float,
                 part: Optional[tuple[str, int, int]] = None):
        self.scale, self.dropout = alpha / rank, dropout
        where = placement(base.weight)
        experts, out_full, in_full = where.full_shape
        self.etp = base.etp
        etp = self.etp.size  # apply_lora runs after expert parallelism: the experts' split is known
        self.row = where.dim == 2  # c_proj split by input columns (else c_fc by output rows, or whole)
        local = base.weight.shape[0]  # this rank's experts (all of them at ep 1)
        self.at: Optional[tuple[int, int]] = None  # (first local output column, local width) of a part
        holder: Any = base
        b_split = Placement((experts, out_full, rank), 1, where.stride, experts=experts)
        if part is not None:
            name, lo, hi = part
            holder = nn.Module()
            setattr(base, name, holder)
            out_full, self.at = hi - lo, (lo // etp, (hi - lo) // etp)  # gate and up each split on its own
            b_split = Placement((experts, out_full, rank), 1, experts=experts)
        make = dict(dtype=base.weight.dtype, device=base.weight.device)
        whole_a, whole_b = Placement((experts, rank, in_full), experts=experts), \
            Placement((experts, out_full, rank), experts=experts)
        if etp == 1:  # whole experts: nothing split (the maps of checkpoints record no dim)
            a_where, b_where = whole_a, whole_b
        elif self.row:
            a_where, b_where = Placement((experts, rank, in_full), 2, experts=experts), whole_b
        else:
            a_where, b_where = whole_a, b_split
        holder.lora_A, holder.lora_B = nn.Module(), nn.Module()
        holder.lora_A.weight = place(nn.Parameter(torch.empty(
            local, rank, in_full // etp if a_where.sharded else in_full, **make)), a_where)
        holder.lora_B.weight = place(nn.Parameter(torch.empty(
            local, out_full // etp if b_where.sharded else out_full, rank, **make)), b_where)
        self.holder = holder
        base.register_forward_hook(self._add_adapter)

    def _add_adapter(self, base: Any, args: tuple, y: torch.Tensor) -> torch.Tensor:
        x, counts = args
        if base.training and self.dropout:  # the experts' inputs are the same on every TP rank: one mask
            x = F.dropout(x, self.dropout, training=True)
        h, g = self.holder, self.etp
        weight_a = h.lora_A.weight
        if g.size > 1 and not self.row:  # A's gradient summed over the group; x's stays this rank's part
            weight_a = copy_to_tp(weight_a, g)
        a = grouped_mm(x, weight_a, counts)
        if g.size > 1 and self.row:  # the partial products A x summed before B
            a = reduce_from_tp(a, g)
        delta = grouped_mm(a, h.lora_B.weight, counts) * self.scale
        if g.size > 1 and self.row:
            delta = _share(delta, g.size)
        if self.at is not None:  # onto the part's columns
            start, width = self.at
            delta = F.pad(delta, (start, y.shape[-1] - start - width))
        return y + delta


def _share(delta: torch.Tensor, parts: int) -> torch.Tensor:
    """delta / parts forward (each of `parts` ranks adds its share to an output summed over them),
    delta's own gradient backward: the sum of the shares is delta, and each rank's B, replicated
    over the group, gets the whole gradient rather than 1 / parts of it."""
    return delta - delta.detach() * (1 - 1 / parts)


def apply_lora(model: GPT, f: FinetuneConfig, tracker: Optional[RNGTracker] = None) -> None:
    """Freeze every parameter of `model` (a GPT chunk, after tensor parallelism) and give the
    projections finetune.lora_targets selects trainable adapters: in an MoE layer, the MLP's
    targets are its experts' projections. A no-op at lora_rank 0."""
    if f.lora_rank == 0:
        return
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h.values():
        for t in adapted(f.lora_targets, model.cfg):
            if isinstance(block.mlp, MoE) and t.module.startswith("mlp."):
                ExpertLoRA(block.mlp.experts.get_submodule(t.module.removeprefix("mlp.")), f.lora_rank, f.lora_alpha,
                           f.lora_dropout, _expert_part(model.cfg, t))
                continue
            part = None if t.part is None or t.position is None else (t.part, *part_rows(model.cfg, t.module, t.position))
            LoRA(block.get_submodule(t.module), f.lora_rank, f.lora_alpha, f.lora_dropout, tracker, part)


def _expert_part(m: ModelConfig, t: Target) -> Optional[tuple[str, int, int]]:
    """(name, lo, hi) of the rows of each expert's fused gate | up that target `t` adapts; None: all."""
    if t.part is None or t.position is None:
        return None
    width = m.moe_ffn_size
    return t.part, t.position * width, (t.position + 1) * width


def adapter_shapes(m: ModelConfig, f: FinetuneConfig) -> dict[str, tuple[int, ...]]:
    """Names and full shapes of every adapter of the non-parallel model, in its order."""
    with torch.device("meta"):
        model = GPT(m)
    apply_lora(model, f)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if is_adapter(n)}


def initial_adapter(name: str, p: nn.Parameter, seed: int, tp_rank: int, tp_size: int,
                    ep: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """An adapter's starting value on this TP rank (of an expert adapter: its experts of the
    expert-parallel group, `ep` = (rank, size)), the same whatever the layout: A drawn whole from
    a generator seeded by (seed, name), B zeros."""
    where = placement(p)
    if name.endswith(".lora_B.weight"):
        full = torch.zeros(where.full_shape, device="cpu")
    else:
        bound = 1.0 / math.sqrt(where.full_shape[-1])  # A [r, in], or an expert weight's [E, r, in]
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(where.full_shape, device="cpu").uniform_(-bound, bound, generator=g)
    return where.shard(where.expert_shard(full, *ep), tp_rank, tp_size)


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """A base weight [out, in] with its adapter folded in: W + scale * B A (full tensors); an
    expert weight [E, out, in] expert by expert."""
    return weight + scale * (lora_b.double() @ lora_a.double()).to(weight.dtype)
