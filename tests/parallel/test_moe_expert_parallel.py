"""Experts split over ranks (expert parallelism, issue 45): a Mixtral-style mixture of experts
(configs/mixtral-tiny.yaml, 4 experts, top-2) with ep > 1 equals the single process: fp32,
dropless, same seed and global batch; per iteration the LM loss, the gradient norm (each expert
element counted once over the world) and the logged aux and z-losses within 1e-5.

Expert weights are sharded and reduced over the expert-data-parallel group, dense ones over
dp x cp (config/sharding.parameter_groups), at every ZeRO stage; the tokens reach their experts
by all-to-all or all-gather over the ep group; at tp without sequence parallelism (etp 1) each
TP rank sends its share of the replicated tokens."""

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
    run_distributed,
    zero,
)

ITERS, SHORT = MOE_ITERS, MOE_SHORT


def _records(extra: list[str]) -> list[tuple[float, ...]]:
    """(loss, grad norm, aux loss, z-loss) of each iteration on the logging rank (empty elsewhere),
    after checking that the expert buckets are partitioned over expert-dp and the dense over dp x cp."""
    return moe_records(SHORT + extra, check_moe_buckets)


def _layouts(layouts: dict[str, list[str]]) -> dict[str, list]:
    return logged_by_layout(_records, layouts)


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, ...]]:
    return run_distributed(_records, 1, [])[0]


EP2, EP4, TP2 = ["--parallel.ep", "2"], ["--parallel.ep", "4"], ["--parallel.tp", "2", "--parallel.etp", "1"]
ALLGATHER, SP = ["--parallel.moe_dispatcher", "allgather"], ["--parallel.sequence_parallel", "true"]


def test_expert_parallel_on_2_ranks(reference):
    """ep 2 over the data ranks with ZeRO-3 and the all-gather dispatcher (experts alone on their
    expert-dp group of one), and ep 2 over the TP ranks under sequence parallelism with ZeRO-1."""
    layouts = {"ep2-zero3-allgather": EP2 + zero(3) + ALLGATHER, "tp2-sp-ep2-zero1": TP2 + SP + EP2 + zero(1)}
    assert_parity(run_distributed(_layouts, 2, layouts)[0], reference, ITERS)


def test_expert_parallel_with_expert_data_parallelism_on_4_ranks(reference):
    """ep 2 x expert-dp 2 (dp 4): expert gradients reduce-scattered and their shards gathered over
    expert-dp, dense ones over dp, at ZeRO-2 with the all-to-all dispatcher."""
    assert_parity(run_distributed(_layouts, 4, {"ep2-edp2-zero2": EP2 + zero(2)})[0], reference, ITERS)


@pytest.mark.slow
def test_expert_parallel_every_stage_and_dispatcher_on_2_ranks(reference):
    """ZeRO 0-2 and both dispatchers at ep 2; tp 2 (etp 1) without sequence parallelism, where the
    TP ranks hold the same tokens and each sends its share; cp 2 folded into ep."""
    layouts = {"ep2-zero0": EP2, "ep2-zero1-allgather": EP2 + zero(1) + ALLGATHER, "ep2-zero2": EP2 + zero(2),
               "tp2-ep2": TP2 + EP2, "tp2-ep1": TP2, "cp2-ep2-zero3": ["--parallel.cp", "2"] + EP2 + zero(3)}
    assert_parity(run_distributed(_layouts, 2, layouts)[0], reference, ITERS)


@pytest.mark.slow
def test_expert_parallel_layouts_on_4_ranks(reference):
    """ep 4 at ZeRO-3; ep 2 x expert-dp 2 at ZeRO 0, 1 and 3 (all-gather); pp 2 x ep 2; tp 2 x ep 2 x dp 2."""
    layouts = {"ep4-zero3": EP4 + zero(3), "ep2-edp2-zero0": EP2, "ep2-edp2-zero1": EP2 + zero(1),
               "ep2-edp2-zero3-allgather": EP2 + zero(3) + ALLGATHER,
               "pp2-ep2-zero1": ["--parallel.pp", "2"] + EP2 + zero(1), "tp2-ep2-dp2-zero3": TP2 + EP2 + zero(3)}
    assert_parity(run_distributed(_layouts, 4, layouts)[0], reference, ITERS)


@pytest.mark.slow
def test_expert_parallel_with_pipeline_schedules_and_tp_cp_on_4_ranks(reference):
    """pp 2 x ep 2 under ZB-H1 (ZeRO-3: deferred weight gradients into expert buckets) and the
    interleaved schedule; tp 2 x pp 2 x ep 2; tp 2 x cp 2 with sequence parallelism and ep 4 (the
    ep group spans the tp and cp ranks) at ZeRO-2."""
    pp2, cp2 = ["--parallel.pp", "2"], ["--parallel.cp", "2"]
    layouts = {"pp2-zbh1-ep2-zero3": pp2 + ["--parallel.schedule", "zbh1"] + EP2 + zero(3),
               "pp2-vpp2-ep2-zero1": pp2 + ["--parallel.vpp", "2"] + EP2 + zero(1),
               "tp2-pp2-ep2": TP2 + pp2 + EP2, "tp2-cp2-sp-ep4-zero2": TP2 + cp2 + SP + EP4 + zero(2)}
    assert_parity(run_distributed(_layouts, 4, layouts)[0], reference, ITERS)


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_at_ep2_resumes_bitwise_and_reshards_to_ep1(tmp_path, reference):
    """Saved at ep 2 (dp 2, ZeRO-1: experts alone on their expert-dp ranks): the same layout
    resumes bit for bit; ep 1 at ZeRO-2 (resharded from the rank files) and ep 1 at ZeRO-3 from
    the universal export continue within 1e-5; convert --to torch and the 16-bit model gather every expert."""
    resumes = {"same": EP2 + zero(1), "ep1-zero2": zero(2), "universal-ep1-zero3": zero(3)}
    out = run_distributed(moe_save_then_resume, 2, str(tmp_path), SHORT, EP2 + zero(1), resumes, ITERS)[0]
    assert_moe_resumes(out, reference, "same", ["ep1-zero2", "universal-ep1-zero3"])


@pytest.mark.slow
def test_checkpoint_at_ep2_with_expert_data_parallelism_resumes_and_reshards(tmp_path, reference):
    """Saved at ep 2 x expert-dp 2 at ZeRO-0 (each bucket's state saved by its ZeRO group's rank 0
    alone): bitwise at the same layout; resharded to ep 1 x dp 4 at ZeRO-1, to ep 4 at ZeRO-3, to
    tp 2 = etp 2 x ep 2 (each expert cut over the TP ranks) at ZeRO-1 and, from the universal
    export, to ep 2 x tp 2 at ZeRO-2."""
    resumes = {"same": EP2, "ep1-zero1": zero(1), "ep4-zero3": EP4 + zero(3),
               "tp2-etp2-ep2-zero1": ["--parallel.tp", "2", "--parallel.etp", "2"] + EP2 + zero(1),
               "universal-tp2-ep2-zero2": TP2 + EP2 + zero(2)}
    out = run_distributed(moe_save_then_resume, 4, str(tmp_path), SHORT, EP2, resumes, ITERS)[0]
    assert_moe_resumes(out, reference, "same", ["ep1-zero1", "ep4-zero3", "tp2-etp2-ep2-zero1",
                                                 "universal-tp2-ep2-zero2"])
