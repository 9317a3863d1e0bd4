"""optim.name muon on a Mixtral-style mixture of experts (configs/mixtral-tiny.yaml): each expert's
gate, up and down matrices are orthogonalised on their own, once per step over all the ranks, and
dp 2 at ZeRO 1, tp 2 with whole experts (etp 1) or with each expert cut over the TP group (etp 2),
and ep 2 equal the single process: losses and every parameter within 1e-5 after 3 steps."""

from __future__ import annotations

import pytest
import torch

from helpers import loaded, muon_steps, run_distributed

MIXTRAL = "configs/mixtral-tiny.yaml"
ITERS = 3
ARGS = ["--model.seq_length", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
        "--model.moe_aux_loss_coeff", "0.1", "--model.moe_z_loss_coeff", "0.01", "--optim.name", "muon",
        "--optim.muon_lr", "0.02", "--optim.clip_grad", "0.5", "--zero.sub_group_size", "5000"]


def _run(extra: list[str]) -> bytes:
    return muon_steps(ARGS + extra, MIXTRAL, ITERS)


def _outs(world: int, extra: list[str]) -> list[dict]:
    return loaded(run_distributed(_run, world, extra))


@pytest.fixture(scope="module")
def reference() -> dict:
    return _outs(1, [])[0]


def _expected_calls(cfg) -> list[tuple[int, int]]:
    """One step's matrices: per layer q, k, v and the output projection, and per expert its gate,
    up (each F x h) and down (h x F)."""
    h, f, e = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts
    q, kv = cfg.num_heads * cfg.head_dim, cfg.query_groups * cfg.head_dim
    per_layer = [(q, h), (kv, h), (kv, h), (h, q)] + [(f, h)] * (2 * e) + [(h, f)] * e
    return sorted(per_layer * cfg.num_layers)


def test_each_experts_matrices_are_muons_once_per_step(reference):
    assert sorted(reference["calls"]) == sorted(_expected_calls(reference["model"]) * ITERS)


@pytest.mark.parametrize("layout", [["--zero.stage", "1"],
                                    pytest.param(["--parallel.tp", "2", "--parallel.etp", "1"], marks=pytest.mark.slow),
                                    pytest.param(["--parallel.ep", "2", "--zero.stage", "0"], marks=pytest.mark.slow),
                                    ["--parallel.ep", "2", "--zero.stage", "3"],
                                    ["--parallel.tp", "2", "--parallel.etp", "2", "--zero.stage", "1"]],
                         ids=["dp2-zero1", "tp2-etp1", "ep2-zero0", "ep2-zero3", "tp2-etp2-zero1"])
def test_moe_muon_layouts_equal_the_single_process(reference, layout):
    """Every expert's matrices are listed on every rank of the stage, each gathered whole (its
    expert-TP parts, its ZeRO shards) to one owner, whatever splits the experts (ep, or etp = tp)."""
    _assert_equal(_outs(2, layout), reference)


@pytest.mark.slow
def test_moe_muon_with_expert_data_parallelism_on_4_ranks(reference):
    """ep 2 x expert-dp 2 at ZeRO 0 (each group's rank 0 contributes the replicated updates) and 2;
    tp 2 = etp 2 x ep 2 with sequence parallelism at ZeRO 3."""
    for stage in ("0", "2"):
        _assert_equal(_outs(4, ["--parallel.ep", "2", "--zero.stage", stage]), reference)
    _assert_equal(_outs(4, ["--parallel.tp", "2", "--parallel.etp", "2", "--parallel.ep", "2",
                            "--parallel.sequence_parallel", "true",
                            "--zero.stage", "3"]), reference)


def _assert_equal(outs: list[dict], reference: dict) -> None:
    """Each rank's losses and its shard of every parameter within 1e-5 of the single process, and
    each matrix orthogonalised once per step over the ranks."""
    for out in outs:
        assert max(abs(a - b) for a, b in zip(out["losses"], reference["losses"], strict=True)) <= 1e-5
        for name, p in out["params"].items():
            where = out["where"][name]
            full = reference["params"][name]
            if where.experts and p.shape[0] != full.shape[0]:  # this rank's experts
                full = where.expert_shard(full, out["ep_rank"], out["ep"])
            mine = where.shard(full, out["tp_rank"], out["tp"])
            torch.testing.assert_close(p, mine, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # each matrix orthogonalised once per step over the ranks, by one owner
    assert sorted(c for out in outs for c in out["calls"]) == sorted(reference["calls"])
