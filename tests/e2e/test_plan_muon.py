"""The layout planner under optim.name muon against what training allocates, moves and computes:
Muon's matrices keep one fp32 buffer (4 B per element instead of Adam's 8; SGD's every element), and the planner's
optimizer-state bytes equal the optimizer's allocation on the DP rank holding the most; its
exchange bytes equal the stage group's counters; its Newton-Schulz FLOPs equal torch's count
of the iteration and a hand count; the start-up summary shows them."""

from __future__ import annotations

import pytest

from helpers import run_distributed, warm_trainer_and_plan

TINY = {"model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 32, "vocab_size": 256},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "iters": 2},
        "zero": {"bucket_size": 20000}, "data": {"mock": True}, "optim": {"name": "muon"}}
# On 2 ranks: dp at ZeRO 1 (fp32) and 3 (bf16), tp 2, and the optimizer in host memory; last, SGD,
# which keeps its momentum alone (4 B per element, no exchange).
LAYOUTS = [["--zero.stage", "1"], ["--zero.stage", "3", "--train.precision", "bf16"], ["--parallel.tp", "2"],
           ["--zero.stage", "2", "--zero.offload_optimizer", "cpu"], ["--zero.stage", "2", "--optim.name", "sgd"]]


def _measure(layouts: list[list[str]]) -> list[dict]:
    out = []
    for overrides in layouts:
        tr, pred = warm_trainer_and_plan(overrides, TINY)
        tr.train_step()
        exchange = tr.grid.bytes_moved().get("stage", {})
        state = tr.optimizer.model_state_bytes()
        out.append({"case": " ".join(overrides), "optimizer": state["optimizer"] + state["offloaded_host"],
                    "predicted": pred.states["optimizer"], "host": pred.host_items["optimizer_states"],
                    "exchange": (sum(v for k, v in exchange.items() if not k.endswith("_calls")), pred.bytes.get("muon", 0))})
    return out


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    return run_distributed(_measure, 2, LAYOUTS)


def test_planner_optimizer_state_equals_the_allocation_under_muon_and_sgd(measured):
    for case in zip(*measured, strict=True):
        allocated = [r["optimizer"] for r in case]
        offloaded = "offload_optimizer" in case[0]["case"]  # in host memory: fp32 master weights too
        predicted = case[0]["host"] if offloaded else case[0]["predicted"]
        assert max(allocated) == predicted, case


def test_planner_exchange_bytes_equal_the_counters(measured):
    for rank in measured:
        for r in rank:
            sgd = "sgd" in r["case"]
            assert r["exchange"][0] == r["exchange"][1] and (r["exchange"][0] == 0) == sgd, r


def test_newton_schulz_flops_equal_a_count_of_the_iteration():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megazero.zero.muon import ns_flops, orthogonalize
    # A tall 6 x 4 matrix runs on its wide orientation X (m = 4, n = 6); per step X X^T is
    # 2 m^2 n = 192 FLOPs, A A 2 m^3 = 128, (bA + cA A) X 2 m^2 n = 192: 512 x 5 steps.
    assert ns_flops((6, 4), 5) == 2560
    for shape in ((6, 4), (64, 192), (96, 32)):
        with FlopCounterMode(display=False) as counter:
            orthogonalize(torch.randn(shape), 5)
        assert counter.get_total_flops() == ns_flops(shape, 5), shape


def test_startup_summary_shows_muon_costs():
    from helpers import make_config
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    from megazero.train.summary import muon_line
    cfg = make_config(["--optim.name", "muon", "--zero.stage", "1"], base=TINY, world=2)
    plan = predict(cfg, ParallelLayout(1, 1, 2, zero_stage=1, micro_batch=2), Cluster(2, 8, 80.0, 1e15))
    r = plan.rank(0)
    assert r.muon_flops > 0 and r.times is not None and r.times["muon"] > 0
    line = muon_line(plan, 5)
    assert line.startswith("muon: Newton-Schulz (5 steps)") and "GFLOP per step" in line and "exchange" in line
