"""The planner's expert-parallel bytes against the comm counters (issue 45, requirement 9): one
MoE layer, its experts split over 2 ranks, runs forward and backward through each dispatcher,
and the bytes its EP group counted equal formulas.expert_dispatch_bytes. The routing is made
even (every expert gets the same number of each rank's pairs), where the all-to-all's expected
bytes are its exact bytes; the all-gather's do not depend on the routing."""

from helpers import make_grid, run_ranks

HIDDEN, EXPERTS, TOPK, BATCH, SEQ = 16, 4, 2, 2, 8


def _evenly_routed_layer():
    """A layer whose router sends token t to experts t mod 4 and t + 1 mod 4 (its logits are
    10 x the token's first 4 features: 1 and 0.9 there)."""
    import torch

    from megazero.model.moe import MoE, MoESpec
    from megazero.model.router import RouterSpec
    layer = MoE(HIDDEN, "swiglu", MoESpec(RouterSpec(EXPERTS, TOPK), 24, aux_loss_coeff=0.01))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.router.weight.zero_()
        layer.router.weight[:, :EXPERTS] = 10 * torch.eye(EXPERTS)
    return layer


def _tokens(rank):
    import torch
    x = torch.randn(BATCH * SEQ, HIDDEN, generator=torch.Generator().manual_seed(rank)) * 0.01
    t = torch.arange(BATCH * SEQ)
    x[t, t % EXPERTS] = 1.0
    x[t, (t + 1) % EXPERTS] = 0.9
    return x.view(BATCH, SEQ, HIDDEN).requires_grad_()


def _measure():
    """Per (dispatcher, recomputed): the bytes counted on the EP group, and this rank's tokens per expert."""
    from torch.utils.checkpoint import checkpoint

    from megazero.parallel.dispatch import AllGatherDispatch, AllToAllDispatch
    ep = make_grid(1).dp_group
    out = {}
    for kind, dispatcher in (("alltoall", AllToAllDispatch), ("allgather", AllGatherDispatch)):
        for replayed in (False, True):
            layer = _evenly_routed_layer()
            layer.apply_ep(ep, dispatcher(ep))
            x = _tokens(ep.rank)
            ep.counter.clear()
            y = checkpoint(layer, x, use_reentrant=False) if replayed else layer(x)
            y.square().sum().backward()
            sent = sum(v for op, v in ep.counter.items() if not op.endswith("_calls"))
            out[(kind, replayed)] = (sent, layer.stats.tokens_per_expert.tolist())
    return out


def test_expert_parallel_bytes_equal_the_planner_formula():
    from megazero.plan.formulas import expert_dispatch_bytes
    for rank in run_ranks(_measure, 2, timeout=180):
        for (kind, replayed), (sent, per_expert) in rank.items():
            assert per_expert == [BATCH * SEQ * TOPK // EXPERTS] * EXPERTS  # even routing
            predicted = expert_dispatch_bytes(BATCH * SEQ, TOPK, HIDDEN, 4, EXPERTS, 2, kind, replayed)
            assert sent == predicted > 0, (kind, replayed, sent, predicted)


def _measure_expert_tp():
    """Per (sequence parallel, recomputed): the bytes one MoE layer at tp 2 = etp 2 (each expert split
    over the TP group, ep 1) counted on its TP group in a forward and backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from megazero.parallel.dispatch import LocalDispatch
    grid = make_grid(2)
    tp = grid.tp_group
    out = {}
    for sp in (False, True):
        for replayed in (False, True):
            layer = _evenly_routed_layer()
            layer.apply_ep(grid.ep_group, LocalDispatch(), tp)
            if sp:
                layer.sequence_parallel, layer.split_groups = True, [tp]
            x = _tokens(0)  # the same tokens on both ranks; under SP each keeps its half of the sequence
            x = x.detach()[:, tp.rank * SEQ // 2:(tp.rank + 1) * SEQ // 2].requires_grad_() if sp else x
            tp.counter.clear()
            y = checkpoint(layer, x, use_reentrant=False) if replayed else layer(x)
            y.square().sum().backward()
            out[(sp, replayed)] = sum(v for op, v in tp.counter.items() if not op.endswith("_calls"))
            assert torch.isfinite(x.grad).all()
    return out


def test_expert_tensor_parallel_bytes_equal_the_planner_formula():
    """At etp = tp the experts are a TP region: the bytes its collectives put on the TP group equal
    formulas.moe_tp_bytes, with and without sequence parallelism, with and without a replay."""
    from megazero.plan.formulas import ActivationShape, moe_tp_bytes
    for rank in run_ranks(_measure_expert_tp, 2, timeout=180):
        for (sp, replayed), sent in rank.items():
            shape = ActivationShape(micro_batch=BATCH, seq=SEQ, hidden=HIDDEN, heads=4, ffn=0, vocab=0, tp=2,
                                    sequence_parallel=sp, recompute="none", act_bytes=4, experts=EXPERTS, topk=TOPK,
                                    expert_ffn=24, etp=2)
            assert sent == moe_tp_bytes(shape, replayed) > 0, (sp, replayed, sent)
