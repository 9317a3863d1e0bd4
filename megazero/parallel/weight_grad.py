"""Deferrable weight gradients: a linear layer's backward split into B and W.

The backward of y = x W^T + b is two matmuls of equal cost: the input gradient
dx = dy W, which the previous pipeline stage is waiting for (B), and the weight gradient
dW = dy^T x, which nobody waits for until the optimizer step (W). Zero-bubble schedules
(Qi et al., 2023, "Zero Bubble Pipeline Parallelism") run B at once and W later, in what
would otherwise be pipeline bubbles.

How: layers built with a `WeightGradStore` (the `weight_grads` attribute of the column-
and row-parallel linears and of the GPT head; None by default) run their matmul through
one autograd Function. Its backward returns dx (and the cheap bias gradient) at once; while
the store is `deferring`, it files the saved input x and the incoming dy instead of
computing dW. `run_next` later computes one B pass's dW's and hands each to
autograd as the gradient of the leaf parameter itself (`torch.autograd.backward(param,
dW)`), which runs the parameter's AccumulateGrad: the gradient lands exactly where a plain
backward would put it (accumulated in place into a bucket view, or stored), and the
post-accumulate-grad hooks that ZeRO's gradient sync hangs on the parameters fire as they
would have. LayerNorm, bias and embedding gradients stay in B: they are cheap.
Under ZeRO-3 the parameter is released (an empty placeholder) by the time W runs, which
needs only x and dy, not the weight; the schedule then hands `run_next` ZeRO's `sink`, which
takes each dW straight into the gradient sync instead of through autograd.

Layers without a store (weight_grads None: every schedule but zbh1, generation, tests of
the plain model) call F.linear, unchanged to the bit.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megazero.parallel.comm import Group, gather_sequence, reduce_scatter_sequence

WeightGradWork = tuple[nn.Parameter, torch.Tensor, torch.Tensor]
"""(parameter, output gradient dy, input x): dW = dy^T x, to accumulate into the parameter."""
WeightGradSink = Callable[[nn.Parameter, torch.Tensor], None]
"""Takes (parameter, dW) in place of autograd's accumulation (ZeRO-3's gradient sync)."""


class WeightGradStore:
    """One model chunk's deferred weight-gradient work, one entry per B pass, first in
    first out (a schedule runs W passes in the order of their B passes)."""

    def __init__(self) -> None:
        self.deferring = False
        self._filling: list[WeightGradWork] = []
        self._passes: deque[list[WeightGradWork]] = deque()

    @contextlib.contextmanager
    def defer(self) -> Iterator[None]:
        """A B pass: backwards inside file their weight-gradient work as one W pass."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
            self._passes.append(self._filling)
            self._filling = []

    def put(self, param: nn.Parameter, grad_out: torch.Tensor, x: torch.Tensor) -> None:
        """The weight gradient of a boxed parameter: filed while deferring, else accumulated as
        the parameter's own backward would, inside the backward that calls this."""
        if not param.requires_grad:
            return
        if self.deferring:
            self._filling.append((param, grad_out, x))
        else:
            torch.autograd.backward(param, _weight_grad(grad_out, x))

    def pending(self) -> int:
        """W passes filed and not yet run."""
        return len(self._passes)

    def held_bytes(self) -> int:
        """Bytes the pending W passes keep alive (each storage once): activation memory that
        the B passes no longer hold in autograd's graph."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for work in self._passes for _, grad_out, x in work for t in (grad_out, x)}
        return sum(storages.values())

    def run_next(self, sink: Optional[WeightGradSink] = None) -> None:
        """The W pass of the oldest B pass still pending: each weight gradient is computed
        and accumulated into its parameter by autograd (hooks fire), or handed to `sink`
        (ZeRO-3), one at a time, in the order backward produced them, so only one extra
        gradient is alive at once."""
        work = deque(self._passes.popleft())
        while work:
            param, grad_out, x = work.popleft()
            if sink is not None:
                with torch.no_grad():  # x is part of the graph: dW must not be
                    sink(param, _weight_grad(grad_out, x))
            else:
                torch.autograd.backward(param, _weight_grad(grad_out, x))


def attach_weight_grad_store(module: nn.Module) -> WeightGradStore:
    """Give every deferrable matmul of `module` (modules with a `weight_grads` attribute)
    one shared store; returns it."""
    store = WeightGradStore()
    for m in module.modules():
        if hasattr(m, "weight_grads"):
            m.weight_grads = store  # type: ignore[assignment]  # torch types Module attributes Tensor | Module
    return store


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           store: Optional[WeightGradStore]) -> torch.Tensor:
    """F.linear whose weight gradient `store` may defer (plain F.linear without a store)."""
    if store is None:
        return F.linear(x, weight, bias)
    # The weight goes in detached, its parameter boxed where autograd does not look: an
    # autograd edge to it would run its AccumulateGrad in B even with no gradient (a
    # Function returning None still fires the post-accumulate-grad hooks), and ZeRO would
    # count that as the gradient having arrived.
    return _DeferrableLinear.apply(x, weight.detach(), bias, store, (weight,))


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    store: Optional[WeightGradStore], group: Group) -> torch.Tensor:
    """linear(x all-gathered along the sequence over `group`, ...), the column-parallel matmul
    under sequence parallelism, keeping only x's shard [b, s/n, h] for backward, which
    gathers it again (Korthikanti et al., 2022, Sec. 4.2.2): the gathered [b, s, h] input is
    not held between forward and backward, one extra all-gather per matmul in backward."""
    if group.size == 1:
        return linear(x, weight, bias, store)
    return _eager_gathered_linear()(x, weight, bias, store, group)


@functools.cache
def _eager_gathered_linear() -> Callable:
    """Dynamo cannot trace the collectives inside: a compiled block (train.compile) calls the
    matmul eagerly between its graphs, instead of recompiling its frame for every parameter.
    Wrapped on first use: torch.compiler.disable imports dynamo (~2 s per process), which
    only runs with sequence parallelism need."""
    def apply(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              store: Optional[WeightGradStore], group: Group) -> torch.Tensor:
        # With a store the weight goes in detached, its parameter boxed: see `linear`.
        return _GatheredLinear.apply(x, weight if store is None else weight.detach(), bias, group, store, (weight,))
    return torch.compiler.disable(apply)


def _weight_grad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dy^T x over every leading (batch, sequence) position."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _DeferrableLinear(torch.autograd.Function):
    """y = x W^T + b; backward returns dx and db, and accumulates dW now or files it (see above)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, boxed_param):
        # Saved through save_for_backward, so recomputation (checkpoint) and saved-tensor
        # hooks see them.
        ctx.save_for_backward(x, weight)
        (ctx.param,), ctx.store, ctx.has_bias = boxed_param, store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.store.put(ctx.param, grad_out, x)
        return grad_x, None, _bias_grad(ctx, grad_out), None, None


def _bias_grad(ctx, grad_out: torch.Tensor) -> Optional[torch.Tensor]:
    if ctx.has_bias and ctx.needs_input_grad[2]:
        return grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
    return None


class _GatheredLinear(torch.autograd.Function):
    """y = gather(x) W^T + b saving x's shard (see `gathered_linear`); with a store the weight
    comes in detached and boxed, as in _DeferrableLinear."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, store, boxed_param):
        ctx.save_for_backward(x, weight)
        (ctx.param,), ctx.store, ctx.group, ctx.has_bias = boxed_param, store, group, bias is not None
        return F.linear(gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        full = gather_sequence(x, ctx.group)
        # Each rank's input gradient is partial (its weight rows): summed, this rank's positions kept.
        grad_x = reduce_scatter_sequence(grad_out.matmul(weight), ctx.group) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.store is not None:
            ctx.store.put(ctx.param, grad_out, full)
        elif ctx.needs_input_grad[1]:
            grad_weight = _weight_grad(grad_out, full)
        return grad_x, grad_weight, _bias_grad(ctx, grad_out), None, None, None
