"""Tensor-parallel building blocks: vocab-parallel embedding, column/row-parallel linear (the
vocab-parallel cross-entropy is cross_entropy.py), and the bookkeeping that maps a TP shard to
its full tensor.

Layers are built whole (tp = 1), where each is exactly its torch twin (the f/g functions
are identities); `apply_tp(tp)` then splits one over a TP group, in place: it keeps this
rank's shard of every parameter (on the meta device only the shapes change) and routes the
forward through the group. The parallelize step calls it from outside the model.
Each parameter is made with its `Placement` (megazero.parallel.placement: the split
dimension, None when replicated, its stride, e.g. 3 for a fused q|k|v projection, and the
full shape), so initialization, checkpoint resharding and export never special-case a layer.

Sequence parallelism (`sequence_parallel` set on a layer, see GPT.apply_sequence_parallel):
the activations between TP regions are split along the sequence instead of replicated, so
a TP region is entered by an all-gather and left by a reduce-scatter along the sequence
(column_parallel_linear, comm.leave_tp) instead of an identity and an all-reduce.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megazero.parallel.comm import Group, copy_to_tp, leave_tp, solo_group
from megazero.parallel.placement import Placement, place, placement
from megazero.parallel.random import RNGTracker
from megazero.parallel.weight_grad import WeightGradStore, gathered_linear, linear


def placed_parameter(shape: tuple[int, ...], dim: Optional[int] = None, stride: int = 1,
                     parts: tuple[int, ...] = ()) -> nn.Parameter:
    """A whole (uninitialized) parameter that `apply_tp` splits along `dim` (None: replicated)."""
    return place(nn.Parameter(torch.empty(shape)), Placement(shape, dim, stride, parts=parts))


def split_parameter_(module: nn.Module, name: str, tp: Group, full_rows: Optional[int] = None) -> None:
    """Replace module.NAME (a whole parameter) by this TP rank's shard as its placement says,
    first padding dim 0 with zero rows up to `full_rows` (vocabulary padding). On the meta
    device only the shape changes (computed here: meta kernels for cat/chunk import
    torch._dynamo, seconds per process)."""
    param = getattr(module, name)
    where, whole = placement(param), param.detach()
    full_shape = list(whole.shape)
    if full_rows is not None:
        full_shape[0] = max(full_rows, full_shape[0])
    where = dataclasses.replace(where, full_shape=tuple(full_shape))
    if whole.is_meta:
        shape = list(full_shape)
        if where.dim is not None:
            shape[where.dim] //= tp.size
        shard = torch.empty(shape, dtype=whole.dtype, device="meta")
    else:
        if full_shape[0] > whole.shape[0]:
            whole = torch.cat([whole, whole.new_zeros(full_shape[0] - whole.shape[0], *whole.shape[1:])])
        shard = where.shard(whole, tp.rank, tp.size).clone()
    setattr(module, name, place(nn.Parameter(shard), where))


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           store: Optional[WeightGradStore], tp: Group, sequence_parallel: bool) -> torch.Tensor:
    """x times this rank's output rows. x is replicated, and its gradient the sum of every
    rank's partial one; or, under sequence parallelism, split along the sequence: gathered
    for the matmul, its gradient reduce-scattered back."""
    if sequence_parallel:
        return gathered_linear(x, weight, bias, store, tp)
    return linear(copy_to_tp(x, tp), weight, bias, store)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by output rows; the output stays split over TP ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, stride: int = 1,
                 parts: tuple[int, ...] = ()):
        """`stride` equal fused blocks of the output rows, or `parts`: their unequal sizes (q|k|v
        with grouped K/V heads); each is split over the TP ranks on its own."""
        super().__init__()
        self.tp, self.stride, self.parts = solo_group(), stride, parts
        self.sequence_parallel = False  # the input arrives split along the sequence
        self.weight = placed_parameter((out_features, in_features), 0, stride, parts)
        self.bias = placed_parameter((out_features,), 0, stride, parts) if bias else None
        self.weight_grads: Optional[WeightGradStore] = None  # set: the weight gradient may be deferred

    def apply_tp(self, tp: Group) -> None:
        out_features = self.weight.shape[0]
        parts = list(self.parts) or [out_features // self.stride] * self.stride
        if sum(parts) != out_features or any(part % tp.size for part in parts):
            raise ValueError(f"each fused part of out_features ({out_features}: {parts}) must be divisible by tp "
                             f"({tp.size})")
        self.tp = tp
        split_parameter_(self, "weight", tp)
        if self.bias is not None:
            split_parameter_(self, "bias", tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.weight_grads, self.tp, self.sequence_parallel)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by input columns; partial outputs are summed over TP."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.tp = solo_group()
        self.sequence_parallel = False  # the output leaves split along the sequence
        self.weight = placed_parameter((out_features, in_features), 1)
        self.bias = placed_parameter((out_features,)) if bias else None
        self.weight_grads: Optional[WeightGradStore] = None  # set: the weight gradient may be deferred

    def apply_tp(self, tp: Group) -> None:
        in_features = self.weight.shape[1]
        if in_features % tp.size:
            raise ValueError(f"in_features ({in_features}) must be divisible by tp ({tp.size})")
        self.tp = tp
        split_parameter_(self, "weight", tp)  # the bias is replicated: added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # nothing to sum: the bias rides in the matmul's epilogue, no pass of its own
            return linear(x, self.weight, self.bias, self.weight_grads)
        y = leave_tp(linear(x, self.weight, None, self.weight_grads), self.tp, self.sequence_parallel)
        # The bias is added once, after the sum, not once per rank (under sequence parallelism
        # to this rank's positions only: its gradient is partial).
        return y + self.bias if self.bias is not None else y


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocab rounded up to a multiple of 128 x tp so every TP shard has equal, aligned rows."""
    return -(-vocab_size // (128 * tp)) * 128 * tp


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose (padded) vocabulary rows are split over TP ranks."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.tp = solo_group()
        self.sequence_parallel = False  # the output leaves split along the sequence
        # The weight's gradient as the rows looked up (a sparse tensor) instead of a dense
        # V x h one that is almost all zeros: see apply_sparse_embedding_grad below.
        self.sparse_grad = False
        self.per_rank, self.start = num_embeddings, 0
        self.weight = placed_parameter((num_embeddings, dim), 0)

    def apply_tp(self, tp: Group) -> None:
        """Pad the rows to a multiple of 128 x tp (zero rows, never looked up) and keep this
        rank's equal slice of them."""
        rows = padded_vocab_size(self.weight.shape[0], tp.size)
        self.tp, self.per_rank, self.start = tp, rows // tp.size, tp.rank * (rows // tp.size)
        split_parameter_(self, "weight", tp, full_rows=rows)

    def forward(self, ids: torch.Tensor, tied: Optional["TiedRows"] = None) -> torch.Tensor:
        """`tied`: this forward's TiedRows, when the head uses the weight too (GPT.forward gives
        one when the gradient is rows: sparse_grad)."""
        if self.tp.size == 1:
            return self._rows(ids, tied)
        outside = (ids < self.start) | (ids >= self.start + self.per_rank)
        local = (ids - self.start).masked_fill(outside, 0)
        out = self._rows(local, tied).masked_fill(outside.unsqueeze(-1), 0.0)
        # Each id's row lives on exactly one rank; the sum puts it everywhere (or, under
        # sequence parallelism, each rank's positions on that rank).
        return leave_tp(out, self.tp, self.sequence_parallel)

    def _rows(self, ids: torch.Tensor, tied: Optional["TiedRows"]) -> torch.Tensor:
        if tied is not None:
            return _RowsIntoHeadGrad.apply(ids, self.weight, tied)
        return F.embedding(ids, self.weight, sparse=self.sparse_grad)


def apply_sparse_embedding_grad(model: nn.Module) -> None:
    """Every vocab-parallel embedding of `model` hands its weight's gradient on as the rows
    looked up (`sparse_grad`), for a gradient sink that adds rows in place (ZeRO's buckets,
    which train/parallelize.py applies next); GPT.forward then joins a tied head's gradient too."""
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.sparse_grad = True


class TiedRows:
    """One forward's link between the two uses of a tied embedding weight, when the embedding's
    gradient is its rows (sparse_grad): the head's dense gradient is kept for the embedding's
    backward, which adds its rows into it in place and sends none of its own.

    autograd sums the two gradients of a weight used twice before accumulating them, and it
    adds a sparse gradient to a dense one out of place: a second V x h tensor at the end of
    backward (the embedding's rows arrive last), the largest transient of a sharded run. The
    head's gradient, with the rows added, still reaches the weight through autograd. Should
    the embedding's backward run first, its rows travel as F.embedding's would."""

    def __init__(self) -> None:
        self.dense: Optional[torch.Tensor] = None

    def head(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the head uses it: its gradient is kept here on its way to the weight."""
        return _KeepHeadGrad.apply(weight, self)


class _KeepHeadGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, tied: TiedRows) -> torch.Tensor:
        ctx.tied = tied
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.tied.dense = grad
        return grad, None


class _RowsIntoHeadGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, tied: TiedRows) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.tied, ctx.shape = tied, weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        # Dropped here, so that autograd holds the last reference and accumulates it without a copy.
        dense, ctx.tied.dense = ctx.tied.dense, None
        rows, flat_ids = grad.reshape(-1, grad.shape[-1]), ids.reshape(-1)
        if dense is None:
            return None, torch.sparse_coo_tensor(flat_ids.unsqueeze(0), rows, ctx.shape, check_invariants=False), None
        dense.index_put_((flat_ids,), rows.to(dense.dtype), accumulate=True)  # deterministic on CUDA too
        return None, None, None


class Dropout(nn.Dropout):
    """nn.Dropout on activations outside TP regions. Replicated there, they take the same
    mask on every TP rank from the default generator; split along the sequence (sequence
    parallelism), each rank's positions are distinct and take their own masks from the
    tracker's per-TP-rank stream."""

    def __init__(self, p: float, tracker: Optional[RNGTracker]):
        super().__init__(p)
        self.tracker = tracker
        self.sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.training and self.p > 0 and self.tracker is not None:
            with self.tracker.fork("tp"):
                return super().forward(x)
        return super().forward(x)


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """An MLP's activation (dense or expert): gelu (tanh), squared_relu, or swiglu on gate | up halves."""
    if activation == "swiglu":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "squared_relu":
        return F.relu(x).square()
    return F.gelu(x, approximate="tanh")
