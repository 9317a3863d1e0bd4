"""Deferrable weight gradients (megazero/parallel/weight_grad.py): B gives the input and bias
gradients at once and no weight gradient; W later lands the weight gradient through the
parameter's AccumulateGrad, so post-accumulate-grad hooks (ZeRO's) fire then, not before."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.config import build_config
from megazero.model.gpt import GPT
from megazero.parallel.weight_grad import WeightGradStore, attach_weight_grad_store, linear


def _case():
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 4, generator=g))
    b = torch.nn.Parameter(torch.randn(5, generator=g))
    x = torch.randn(2, 3, 4, generator=g).requires_grad_()
    return x, w, b


def test_b_then_w_equals_one_backward_and_hooks_fire_in_w():
    x, w, b = _case()
    want = torch.autograd.grad(F.linear(x, w, b).square().sum(), [x, w, b])
    landed = []
    w.register_post_accumulate_grad_hook(lambda p: landed.append(p.grad.clone()))
    w.grad = torch.zeros_like(w)  # accumulated in place, as into a ZeRO bucket view
    bucket = w.grad
    store = WeightGradStore()
    with store.defer():
        linear(x, w, b, store).square().sum().backward()
    assert landed == [] and store.pending() == 1 and not w.grad.any()
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(b.grad, want[2], rtol=0, atol=1e-6)
    store.run_next()
    assert store.pending() == 0 and len(landed) == 1 and w.grad is bucket
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=1e-6)


def test_outside_defer_the_weight_gradient_lands_at_once():
    x, w, b = _case()
    want = torch.autograd.grad(F.linear(x, w, b).square().sum(), [w])[0]
    store = WeightGradStore()
    linear(x, w, b, store).square().sum().backward()
    assert store.pending() == 0
    torch.testing.assert_close(w.grad, want, rtol=0, atol=1e-6)


def test_attach_reaches_every_matmul_and_the_head():
    model = GPT(build_config({"model": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 8,
                                        "vocab_size": 64}, "data": {"mock": True}}).model)
    store = attach_weight_grad_store(model)
    users = [m for m in model.modules() if hasattr(m, "weight_grads")]
    assert len(users) == 2 * 4 + 1 and all(m.weight_grads is store for m in users)
