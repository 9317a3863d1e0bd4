"""Experts split by expert tensor parallelism (issue 45, 4: "ep with tp, etp = tp"): each expert's
MLP cut over the TP group as the dense MLP is (c_fc's gate and up rows, c_proj's columns), the
router replicated (or on each rank's positions under sequence parallelism), the experts' partial
outputs summed over the group. A Mixtral-style mixture of experts (configs/mixtral-tiny.yaml, 4
experts, top-2) at tp 2 with etp 2 equals the single process: fp32, dropless, same seed and global
batch; per iteration the LM loss, the gradient norm (each expert element counted once: every etp
rank its slice) and the logged aux and z-losses within 1e-5."""

from __future__ import annotations

import pytest

from helpers import (
    MOE_ITERS,
    MOE_SHORT,
    assert_moe_resumes,
    assert_parity,
    check_moe_buckets,
    logged_by_layout,
    moe_records,
    moe_save_then_resume,
    run_ranks,
    zero,
)

ITERS, SHORT = MOE_ITERS, MOE_SHORT
# configs/mixtral-tiny.yaml keeps whole experts (parallel.etp 1); etp 0 is the default, etp = tp.
ETP = ["--parallel.tp", "2", "--parallel.etp", "0"]
EP2, SP = ["--parallel.ep", "2"], ["--parallel.sequence_parallel", "true"]


def _check_split(tr) -> None:
    """Each expert weight is placed along the dense MLP's dims and (outside ZeRO-3, whose
    parameters are placeholders) holds its experts' etp slice; the buckets are the planner's."""
    from megazero.parallel.placement import placement
    check_moe_buckets(tr)
    grid, m, whole = tr.grid, tr.cfg.model, tr.optimizer.sharded.sharding.parameters
    if grid.etp == 1:  # whole experts (a layout to compare with)
        return
    assert grid.etp == grid.tp == 2 and grid.expert_tp_group.ranks == grid.tp_group.ranks
    f, h = m.moe_ffn_size, m.hidden_size
    for chunk in tr.chunks:
        for name, p in chunk.named_parameters():
            for kind, dim, shape in (("c_fc", 1, (f, h)), ("c_proj", 2, (h, f // 2))):  # gate | up: 2 x f / 2 rows
                if f".experts.{kind}." in name:
                    assert placement(p).dim == dim and (whole or tuple(p.shape[1:]) == shape), name


def _records(extra: list[str]) -> list[tuple[float, ...]]:
    return moe_records(SHORT + extra, _check_split)


def _layouts(layouts: dict[str, list[str]]) -> dict[str, list]:
    return logged_by_layout(_records, layouts)


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, ...]]:
    return run_ranks(moe_records, 1, SHORT)[0]


def test_expert_tensor_parallel_on_2_ranks(reference):
    """tp 2 = etp 2 at dp 1: without sequence parallelism at ZeRO-1 (replicated tokens, the
    partial outputs all-reduced), with it at ZeRO-3 (tokens gathered, outputs reduce-scattered)."""
    layouts = {"etp2-zero1": ETP + zero(1), "etp2-sp-zero3": ETP + SP + zero(3)}
    assert_parity(run_ranks(_layouts, 2, layouts)[0], reference, ITERS)


def test_expert_tensor_parallel_with_expert_parallel_on_4_ranks(reference):
    """tp 2 = etp 2 x ep 2 (ep over the data ranks) at ZeRO-3: the tokens' all-to-all between the
    ranks of the same etp slice, expert slices sharded over their expert-dp group of one."""
    assert_parity(run_ranks(_layouts, 4, {"etp2-ep2-zero3": ETP + EP2 + zero(3)})[0], reference, ITERS)


@pytest.mark.slow
def test_expert_tensor_parallel_layouts_on_4_ranks(reference):
    """tp 2 = etp 2 x ep 2 with sequence parallelism at ZeRO 1 and 3; without it at ZeRO-1 with the
    all-gather dispatcher; tp 2 = etp 2 x dp 2 (ep 1: expert slices over expert-dp 2) at ZeRO-2."""
    layouts = {"etp2-sp-ep2-zero1": ETP + SP + EP2 + zero(1), "etp2-sp-ep2-zero3": ETP + SP + EP2 + zero(3),
               "etp2-ep2-zero1-allgather": ETP + EP2 + zero(1) + ["--parallel.moe_dispatcher", "allgather"],
               "etp2-edp2-zero2": ETP + zero(2)}
    assert_parity(run_ranks(_layouts, 4, layouts)[0], reference, ITERS)


@pytest.mark.slow
def test_expert_tensor_parallel_with_recompute_compile_pipeline_and_context_parallel(reference):
    """tp 2 = etp 2 with full recomputation under sequence parallelism (the region's collectives
    replayed) and with train.compile on 2 ranks; with pp 2 under ZB-H1 (deferred weight
    gradients) and with cp 2 x ep 2 under sequence parallelism at ZeRO-3 on 4."""
    two = {"etp2-sp-full-zero2": ETP + SP + ["--train.recompute", "full"] + zero(2),
           "etp2-compile": ETP + ["--train.compile", "true"]}
    four = {"etp2-pp2-zbh1": ETP + ["--parallel.pp", "2", "--parallel.schedule", "zbh1"],
            "etp2-cp2-sp-ep2-zero3": ETP + SP + ["--parallel.cp", "2"] + EP2 + zero(3)}
    assert_parity(run_ranks(_layouts, 2, two)[0], reference, ITERS)
    assert_parity(run_ranks(_layouts, 4, four)[0], reference, ITERS)


SHARED = ["--model.moe_shared_expert_ffn_hidden_size", "64", "--model.moe_shared_expert_gate", "true"]


@pytest.mark.parametrize("etp", [pytest.param("1", marks=pytest.mark.slow), "2"])
def test_gated_shared_expert_beside_split_experts(etp):
    """Qwen2-MoE's gated shared expert, a dense MLP over tp beside the routed experts: at tp 2 with
    sequence parallelism (its TP layers gather the [b, s/tp, h] stream along the sequence), with
    the experts split (etp 2) or whole (etp 1, under slow), equals its own single process."""
    own = run_ranks(moe_records, 1, SHORT + SHARED)[0]
    layout = {f"etp{etp}-sp-shared": ["--parallel.tp", "2", "--parallel.etp", etp] + SP + SHARED}
    assert_parity(run_ranks(_layouts, 2, layout)[0], own, ITERS)


# ----------------------------------------------------------------------------- checkpoints
# The partition map records an expert slice's tp_dim / tp_stride as a dense TP shard's, so the
# rank files and the universal export join the etp slices and any layout cuts them again.
TP2_ETP1 = ["--parallel.tp", "2", "--parallel.etp", "1"]


def test_checkpoint_at_etp2_resumes_bitwise_and_reshards(tmp_path, reference):
    """Saved at tp 2 = etp 2 (ZeRO-1): the same layout resumes bit for bit; tp 1 x dp 2 (from the
    rank files, ZeRO-2) and tp 2 with whole experts (etp 1, from the universal export, ZeRO-3)
    continue within 1e-5; convert --to torch and the 16-bit model join every expert's slices."""
    resumes = {"same": ETP + zero(1), "tp1-zero2": zero(2), "universal-tp2-etp1-zero3": TP2_ETP1 + zero(3)}
    out = run_ranks(moe_save_then_resume, 2, str(tmp_path), SHORT, ETP + zero(1), resumes, ITERS)[0]
    assert_moe_resumes(out, reference, "same", ["tp1-zero2", "universal-tp2-etp1-zero3"])


@pytest.mark.slow
def test_checkpoint_at_etp2_with_expert_parallel_resumes_and_reshards(tmp_path, reference):
    """Saved at tp 2 = etp 2 x ep 2 with sequence parallelism (ZeRO-3): bitwise at the same layout;
    resharded to tp 1 x dp 4 (ZeRO-1), to tp 2 with whole experts x ep 2 (ZeRO-2) and, from the
    universal export, to tp 2 = etp 2 at ep 1 (expert-dp 2, ZeRO-0)."""
    layout = ETP + SP + EP2 + zero(3)
    resumes = {"same": layout, "tp1-zero1": zero(1), "tp2-etp1-ep2-zero2": TP2_ETP1 + EP2 + zero(2),
               "universal-etp2-edp2": ETP}
    out = run_ranks(moe_save_then_resume, 4, str(tmp_path), SHORT, layout, resumes, ITERS)[0]
    assert_moe_resumes(out, reference, "same", ["tp1-zero1", "tp2-etp1-ep2-zero2", "universal-etp2-edp2"])
