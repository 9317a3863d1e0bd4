"""The planner's counts for mixtures of experts (issue 45, requirement 9): total and active
parameters against the built model, per-rank parameters and expert memory at ep = 1 layouts
(tp with etp 1, pp, dp at every ZeRO stage) and, at ep > 1, against the model's own expert
placement (GPT.apply_expert_parallel on the meta device); active FLOPs against torch's FLOP
counter and the trainer's MFU. The all-to-all bytes are measured in
tests/parallel/test_moe_plan_bytes.py, the published shapes against transformers in
tests/e2e/test_plan.py."""

from __future__ import annotations

import pytest

from helpers import REPO, run_distributed
from megazero.config import build_config
from megazero.config.parse import load_yaml
from megazero.model.layers import padded_vocab_size
from megazero.plan import formulas as F

SHARED = ["--model.moe_shared_expert_ffn_hidden_size", "32", "--model.moe_shared_expert_gate", "true",
          "--model.bias", "true", "--model.moe_layer_freq", "[0, 1, 0, 1]"]
SHAPES = {"mixtral-tiny": [], "shared-gated-bias-every-other": SHARED}


def moe_config(overrides: list[str]):
    return build_config(load_yaml(str(REPO / "configs/mixtral-tiny.yaml")), overrides)


def hand_count(m, tp: int, layers: list[int], pre: bool, post: bool, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """One rank's (parameters, routed experts' parameters), written out: attention and a dense or
    shared-expert MLP split over tp (their biases on the column side too, the row side's whole),
    norms, the router and the gate whole, E / ep experts, each 1 / etp of its width."""
    h, kv, a = m.hidden_size, m.query_groups * m.head_dim, m.hidden_size
    norm = h if m.normalization == "rmsnorm" else 2 * h
    attention = (a + 2 * kv) * h // tp + a * h // tp + (((a + 2 * kv) // tp + h) if m.bias else 0)
    total = experts = 0
    for i in layers:
        moe = m.moe_layer_freq[i] if isinstance(m.moe_layer_freq, list) else i % m.moe_layer_freq == 0
        width = m.moe_shared_expert_ffn_hidden_size if moe else m.ffn_size
        mlp = 3 * width * h // tp + ((2 * width // tp + h) if m.bias and width else 0)
        routed = m.num_experts // ep * 3 * m.moe_ffn_size // etp * h if moe else 0
        extra = m.num_experts * h + (h if m.moe_shared_expert_gate else 0) if moe else 0
        total += attention + mlp + 2 * norm + routed + extra
        experts += routed
    vocab = padded_vocab_size(m.vocab_size, tp)
    total += (vocab // tp * h if pre else 0) + ((norm + vocab // tp * h) if post else 0)  # untied head
    return total, experts


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_moe_parameters_equal_the_built_model(shape):
    """Total parameters equal the built model's; active ones count the k experts a token reaches."""
    import torch

    from megazero.model.gpt import GPT
    m = moe_config(SHAPES[shape]).model
    with torch.device("meta"):
        built = sum(p.numel() for p in GPT(m).parameters())
    assert F.model_parameters(m, padded_vocab_size(m.vocab_size, 1)) == built
    per_expert = 3 * m.moe_ffn_size * m.hidden_size
    moe_layers = len(F.moe_layer_indices(m))
    assert F.model_parameters(m) - F.model_parameters(m, active=True) == \
        moe_layers * (m.num_experts - m.moe_router_topk) * per_expert


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tp, pp, dp, ep", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 4, 1, 1), (2, 2, 2, 1),
                                            (1, 1, 2, 2), (1, 1, 4, 4), (2, 2, 2, 4), (1, 2, 4, 2)])
def test_moe_parameters_per_rank_equal_a_hand_count(shape, tp, pp, dp, ep):
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    cfg = moe_config(SHAPES[shape])
    m = cfg.model
    layout = ParallelLayout(tp, pp, dp, ep=ep, etp=1)
    pred = predict(cfg, layout, Cluster(tp * pp * dp, 8, 80.0, None), ranks=list(range(pp)))
    per_stage = m.num_layers // pp
    for r in range(pp):
        layers = list(range(r * per_stage, (r + 1) * per_stage))
        assert (pred.rank(r).params, pred.rank(r).expert_params) == \
            hand_count(m, tp, layers, r == 0, r == pp - 1, ep), (shape, tp, pp, dp, ep, r)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tp, pp, dp, ep", [(2, 1, 1, 1), (2, 2, 2, 2), (2, 1, 4, 4)])
def test_moe_parameters_per_rank_at_etp_equal_tp_equal_a_hand_count(shape, tp, pp, dp, ep):
    """Each expert split over the TP group (etp = tp, GPT.apply_expert_parallel's expert_tp): the
    planner's count holds 1 / etp of every expert's width, as the hand count says."""
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    cfg = moe_config(SHAPES[shape])
    pred = predict(cfg, ParallelLayout(tp, pp, dp, ep=ep, etp=tp), Cluster(tp * pp * dp, 8, 80.0, None),
                   ranks=list(range(pp)))
    per_stage = cfg.model.num_layers // pp
    for r in range(pp):
        layers = list(range(r * per_stage, (r + 1) * per_stage))
        assert (pred.rank(r).params, pred.rank(r).expert_params) == \
            hand_count(cfg.model, tp, layers, r == 0, r == pp - 1, ep, tp), (shape, tp, pp, dp, ep, r)


def test_expert_parallel_count_equals_the_model_placement_on_every_ep_rank():
    """At ep > 1 each EP rank keeps E / ep experts (GPT.apply_expert_parallel with a group of that
    size and rank, on the meta device): the planner's count, from rank 0, holds for every rank."""
    import torch

    from megazero.model.gpt import GPT
    from megazero.parallel.comm import Group, solo_group
    from megazero.parallel.dispatch import LocalDispatch
    from megazero.parallel.placement import placement
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    cfg = moe_config(SHARED)
    for ep in (2, 4):
        pred = predict(cfg, ParallelLayout(1, 1, ep, ep=ep, etp=1), Cluster(ep, 8, 80.0, None), ranks=[0])
        for rank in range(ep):
            with torch.device("meta"):
                model = GPT(cfg.model)
                model.apply_expert_parallel(Group("ep", None, list(range(ep)), rank), LocalDispatch(), solo_group())
            params = list(model.parameters())
            assert pred.rank(0).params == sum(p.numel() for p in params), (ep, rank)
            assert pred.rank(0).expert_params == sum(p.numel() for p in params if placement(p).experts), (ep, rank)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_states_shard_over_expert_dp(stage):
    """ZeRO shards the dense parameters' states over dp x cp and the experts' over expert-dp
    (tp x cp x dp / (ep x etp)), each group's buckets padded for its own group."""
    from megazero.config.sharding import sharding
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    from megazero.plan.ranks import rank_params
    from megazero.zero.partition import bucket_numel
    cfg = moe_config(["--train.precision", "bf16"])
    layout = ParallelLayout(1, 1, 4, zero_stage=stage, ep=2, etp=1)  # dp 4, ep 2: expert-dp 2
    pred = predict(cfg, layout, Cluster(4, 8, 80.0, None), ranks=[0])
    rp = rank_params(cfg.model, 1, 1, 1, 0, stage == 3, cfg.zero.bucket_size, None, 2, 1)
    dense, _, experts = rp.split_experts()
    zs = sharding(stage)
    shards = (4, 2) if zs.optimizer else (1, 1)
    psi = (sum(bucket_numel(list(b), shards[0]) for b in dense), sum(bucket_numel(list(b), shards[1]) for b in experts))
    expected = {k: a + b for (k, a), b in zip(zs.model_state_bytes(psi[0], 4, (2, 4, 12)).items(),
                                              zs.model_state_bytes(psi[1], 2, (2, 4, 12)).values())}
    assert pred.rank(0).states == expected
    assert sum(sum(b) for b in experts) == rp.expert_numel == 4 * 2 * 3 * 96 * 64  # 4 layers x E/ep x 3 F h
    assert pred.rank(0).bytes["expert_dp"] > 0 and pred.rank(0).bytes["ep"] > 0


def test_ep_is_among_the_candidates_and_refused_when_it_cannot_divide():
    from megazero.plan.planner import Cluster, PlanError, candidates, check_fixed
    cfg = moe_config([])
    layouts = candidates(cfg, Cluster(8, 8, 80.0, None), {"pp": 1, "cp": 1, "tp": 1})
    assert {lay.ep for lay in layouts} == {1, 2, 4} and all(lay.etp == 1 for lay in layouts)  # 4 experts
    with pytest.raises(PlanError, match=r"--ep 3 must divide model.num_experts \(4\).*closest that fits: ep 2"):
        check_fixed(cfg, Cluster(8, 8, 80.0, None), {"ep": 3})
    with pytest.raises(PlanError, match=r"--etp 4 must be 1 or --tp \(2\).*closest that fits: etp 2"):
        check_fixed(cfg, Cluster(8, 8, 80.0, None), {"tp": 2, "etp": 4})
    at_tp2 = candidates(cfg, Cluster(8, 8, 80.0, None), {"pp": 1, "cp": 1, "tp": 2, "etp": 2})
    assert at_tp2 and {lay.etp for lay in at_tp2} == {2}  # each expert split over the TP group
    dense = build_config({"model": {"vocab_size": 256}, "data": {"mock": True}})
    assert {(lay.ep, lay.etp) for lay in candidates(dense, Cluster(4, 8, 80.0, None), {})} == {(1, 1)}


def test_moe_flops_count_the_active_experts(monkeypatch):
    """6 x active matmul parameters (router, k experts, shared expert and gate) + 12 L h s equal
    what torch's FLOP counter counts on a forward and backward, the experts computed by their
    loop reference (the counter has no formula for the grouped GEMM; the two are bitwise equal)."""
    from test_plan_family import counted_flops_per_token

    import megazero.model.moe as moe
    monkeypatch.setattr(moe, "grouped_mm", moe.expert_loop_mm)
    for shape in SHAPES.values():
        m = moe_config(shape).model
        assert F.model_flops_per_token(m) == counted_flops_per_token(m)
    m = moe_config([]).model
    h, f, e = 64, 96, 4
    dense_active = F.model_flops_per_token(m) - 6 * 4 * (e * h + 2 * 3 * h * f)  # router + 2 experts per layer
    assert dense_active == 6 * (4 * (2 * h * h + 2 * h * 32) + 512 * h) + 12 * 4 * h * 64


def _trainer_flops():
    from helpers import make_trainer
    tr = make_trainer(["--train.iters", "1"], str(REPO / "configs/mixtral-tiny.yaml"))
    return tr.flops_per_token, tr.cfg.model


def test_logged_mfu_counts_active_flops():
    """The trainer's TFLOP/s (and so the logged MFU) multiplies tokens/s by the active FLOPs."""
    logged, m = run_distributed(_trainer_flops, 1)[0]
    assert m.num_experts == 4 and logged == F.model_flops_per_token(m)
    assert F.matmul_parameters(m) < F.matmul_parameters(m, active=False)
