"""The MoE layer in one process: grouped GEMM, routing variants, losses, capacity, and the
layer against transformers' Mixtral block."""

import math

import pytest
import torch

from megazero.model.moe import MoE, MoESpec, expert_loop_mm, grouped_mm
from megazero.model.router import (
    RouterSpec,
    aux_loss,
    expert_bias_update,
    route,
    seq_aux_loss,
    tokens_per_expert,
    z_loss,
)


def _moe(hidden=16, experts=4, topk=2, ffn=24, activation="swiglu", seed=0, **kw) -> MoE:
    spec_kw = {k: kw.pop(k) for k in list(kw) if k in RouterSpec.__dataclass_fields__}
    layer = MoE(hidden, activation, MoESpec(RouterSpec(experts, topk, **spec_kw), ffn, **kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def test_grouped_mm_equals_the_loop_over_experts_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(5, 24, 16, generator=g, requires_grad=True)
    counts = torch.tensor([9, 0, 20, 0, 8])  # idle experts too
    y, ref = grouped_mm(x, w, counts), expert_loop_mm(x, w, counts)
    assert torch.equal(y, ref)
    grad = torch.randn(y.shape, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(y, (x, w), grad),
                                                  torch.autograd.grad(ref, (x, w), grad)))


def test_layer_equals_transformers_mixtral_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4,
                                     num_experts_per_tok=2, router_jitter_noise=0.0)
    ours = _moe()
    theirs = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.c_fc.weight)
        theirs.experts.down_proj.copy_(ours.experts.c_proj.weight)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2))
    mine, ref = ours(x), theirs(x)
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-6)
    mine.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(ours.experts.c_fc.weight.grad, theirs.experts.gate_up_proj.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.router.weight.grad, theirs.gate.weight.grad, rtol=1e-5, atol=1e-5)


def test_softmax_orders_top_k_then_softmax_equals_normalised_softmax():
    logits = torch.randn(11, 6, generator=torch.Generator().manual_seed(3))
    after = route(logits, RouterSpec(6, 2))
    before = route(logits, RouterSpec(6, 2, pre_softmax=True))
    assert torch.equal(after.experts, before.experts)
    torch.testing.assert_close(after.probs, before.probs / before.probs.sum(-1, keepdim=True))
    torch.testing.assert_close(before.probs, torch.softmax(logits, -1).gather(1, before.experts))


def test_sigmoid_bias_moves_the_choice_not_the_weights():
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(4))
    bias = torch.tensor([10.0, 0.0, 0.0, 10.0])  # experts 0 and 3 win everywhere
    routing = route(logits, RouterSpec(4, 2, score_function="sigmoid", enable_expert_bias=True), bias)
    assert torch.equal(routing.experts.sort(-1).values, torch.tensor([[0, 3]] * 9))
    chosen = torch.sigmoid(logits)[:, [0, 3]]
    torch.testing.assert_close(routing.probs.sort(-1).values, (chosen / chosen.sum(-1, keepdim=True)).sort(-1).values)


def test_group_limited_routing_picks_only_from_the_best_groups():
    logits = torch.randn(20, 8, generator=torch.Generator().manual_seed(5))
    spec = RouterSpec(8, 2, score_function="sigmoid", num_groups=4, group_topk=1)
    routing = route(logits, spec)
    scores = torch.sigmoid(logits).view(20, 4, 2)
    best_group = scores.topk(2, dim=-1).values.sum(-1).argmax(-1)  # topk / group_topk = 2 per group
    assert torch.equal(routing.experts.sort(-1).values, torch.stack([best_group * 2, best_group * 2 + 1], -1))


def test_scaling_factor_scales_the_weights():
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(6))
    plain, scaled = route(logits, RouterSpec(4, 2)), route(logits, RouterSpec(4, 2, topk_scaling_factor=2.5))
    torch.testing.assert_close(scaled.probs, plain.probs * 2.5)


def test_aux_loss_is_megatrons_formula_and_even_load_gives_coeff():
    scores = torch.softmax(torch.randn(12, 4, generator=torch.Generator().manual_seed(7)), -1)
    experts = scores.topk(2, -1).indices
    counts = tokens_per_expert(experts, 4)
    expected = 0.01 * 4 / (2 * 12 * 12) * sum(scores[:, i].sum() * counts[i] for i in range(4))
    torch.testing.assert_close(aux_loss(scores, counts, 12, 2, 0.01), expected)
    even = torch.full((8, 4), 0.25)
    torch.testing.assert_close(aux_loss(even, torch.full((4,), 4.0), 8, 2, 0.01), torch.tensor(0.01))


def test_seq_aux_loss_is_the_mean_of_each_sequences_aux_loss():
    g = torch.Generator().manual_seed(8)
    scores = torch.softmax(torch.randn(3 * 5, 4, generator=g), -1)
    experts = scores.topk(2, -1).indices
    per_seq = [aux_loss(scores[5 * b:5 * b + 5], tokens_per_expert(experts[5 * b:5 * b + 5], 4), 5, 2, 0.1)
               for b in range(3)]
    torch.testing.assert_close(seq_aux_loss(scores, experts, 3, 5, 2, 0.1), torch.stack(per_seq).mean())


def test_z_loss_and_bias_update():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(z_loss(logits, 1e-3), 1e-3 * (torch.logsumexp(logits, -1) ** 2).mean())
    bias = expert_bias_update(torch.zeros(4), torch.tensor([1.0, 5.0, 3.0, 3.0]), 0.1)
    torch.testing.assert_close(bias, torch.tensor([0.1, -0.1, 0.0, 0.0]))


def test_losses_join_the_backward_through_the_output():
    layer = _moe(load_balancing="aux_loss", aux_loss_coeff=0.5, z_loss_coeff=0.1)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(10))
    layer(x).sum().backward()
    attached = layer.router.weight.grad.clone()
    assert layer.stats is not None and layer.stats.aux_loss > 0 and layer.stats.z_loss > 0
    layer.zero_grad()
    layer.loss_scale = 0.0  # the same forward without the losses' gradient...
    out = layer(x)
    routing = layer.router(x.reshape(-1, 16))  # ...plus the losses computed here by hand
    by_hand = aux_loss(routing.scores, tokens_per_expert(routing.experts, 4), 10, 2, 0.5) + z_loss(routing.logits, 0.1)
    (out.sum() + by_hand).backward()
    torch.testing.assert_close(attached, layer.router.weight.grad)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_past_each_experts_capacity(policy):
    layer = _moe(experts=4, topk=2, capacity_factor=0.5, token_drop_policy=policy)
    x = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(11))
    routing = layer.router(x.reshape(-1, 16))
    keep = layer._within_capacity(routing, 16)
    capacity = math.ceil(16 * 2 / 4 * 0.5)
    kept = torch.bincount(routing.experts[keep], minlength=4)
    assert (kept == torch.minimum(tokens_per_expert(routing.experts, 4).long(), torch.tensor(capacity))).all()
    for e in range(4):  # the kept pairs of each expert are the best by the policy
        mask = routing.experts == e
        key = routing.probs[mask] if policy == "probs" else -torch.arange(32).view(16, 2)[mask].float()
        if keep[mask].any() and (~keep[mask]).any():
            assert key[keep[mask]].min() >= key[~keep[mask]].max()
    layer(x)
    assert layer.stats.dropped == (~keep).sum()


def test_padding_to_capacity_computes_fixed_shapes_and_changes_no_output():
    """moe_pad_to_capacity: every expert's grouped-GEMM block is the capacity's rows whatever the
    routing, and the outputs and gradients are those of the unpadded layer, bit for bit."""
    x = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(12))
    plain, padded = _moe(capacity_factor=1.0), _moe(capacity_factor=1.0, pad_to_capacity=True)
    seen = []
    original = padded.experts.forward
    padded.experts.forward = lambda rows, counts: seen.append(counts.tolist()) or original(rows, counts)
    out_plain, out_padded = plain(x), padded(x)
    assert seen == [[8, 8, 8, 8]]  # ceil(16 tokens x 2 / 4 experts x 1.0) rows each
    routing = plain.router(x.reshape(-1, 16))
    kept = torch.bincount(routing.experts[plain._within_capacity(routing, 16)], minlength=4)
    assert kept.min() < 8  # some expert's block was padded
    assert torch.equal(out_plain, out_padded)
    out_plain.square().sum().backward()
    out_padded.square().sum().backward()
    for a, b in zip(plain.parameters(), padded.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
