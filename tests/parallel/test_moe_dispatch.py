"""Expert parallelism of one MoE layer: the all-to-all and all-gather dispatchers give each
rank the outputs and gradients of the single-process layer (experts split over 2 ranks)."""

from helpers import make_grid, run_ranks


def _layer(seed=0, experts=4):
    import torch

    from megazero.model.moe import MoE, MoESpec
    from megazero.model.router import RouterSpec
    layer = MoE(16, "swiglu", MoESpec(RouterSpec(experts, 2), 24, aux_loss_coeff=0.01, z_loss_coeff=1e-3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _inputs(rank, skew):
    import torch
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(100 + rank))
    return x + skew * rank  # skew: rank 1's tokens crowd a few experts, some get none


def _ep_rank():
    """Every dispatcher and routing skew in one world (spawning is the slow part); returns, per
    case, the tokens counted per expert and the collectives this rank issued, in order."""
    from megazero.parallel.comm import record_calls
    ep = make_grid(1).dp_group
    results = []
    for kind in ("alltoall", "allgather"):
        for skew in (0.0, 3.0):
            calls = record_calls([ep])
            counts = _check_case(ep, kind, skew)
            results.append((counts, [(c.group, c.op) for c in calls]))
    return results


def _check_case(ep, kind, skew):
    import torch

    from megazero.parallel.dispatch import AllGatherDispatch, AllToAllDispatch
    reference = [_layer() for _ in range(ep.size)]  # the single-process layer on each rank's tokens
    ref_out = []
    for r, layer in enumerate(reference):
        out = layer(_inputs(r, skew))
        out.square().sum().backward()
        ref_out.append(out.detach())
    layer = _layer()
    layer.apply_ep(ep, (AllToAllDispatch if kind == "alltoall" else AllGatherDispatch)(ep))
    out = layer(_inputs(ep.rank, skew))
    out.square().sum().backward()
    torch.testing.assert_close(out, ref_out[ep.rank], rtol=1e-6, atol=1e-6)
    mine = slice(2 * ep.rank, 2 * ep.rank + 2)  # this rank's 2 of the 4 experts
    for name in ("c_fc", "c_proj"):
        expected = sum(getattr(ref.experts, name).weight.grad[mine] for ref in reference)
        torch.testing.assert_close(getattr(layer.experts, name).weight.grad, expected, rtol=1e-4, atol=1e-5)  # summed in another order
    torch.testing.assert_close(layer.router.weight.grad, reference[ep.rank].router.weight.grad, rtol=1e-4, atol=1e-5)
    return layer.stats.tokens_per_expert.tolist()


def test_expert_parallel_layer_equals_one_process_and_ranks_issue_the_same_collectives():
    per_rank = run_ranks(_ep_rank, 2, timeout=180)
    for case in range(4):
        (counts0, calls0), (counts1, calls1) = per_rank[0][case], per_rank[1][case]
        assert sum(counts0) == sum(counts1) == 2 * 6 * 2  # each rank's own (token, expert) pairs
        assert calls0 == calls1 and calls0  # the same collectives in the same order, however skewed
