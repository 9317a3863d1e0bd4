"""Silent faults (issue 48), each injected with train.inject_fault on 4 gloo ranks, at a layout with
replicas (tp 2 x dp 2, ZeRO-1) and at ZeRO-3 (tp 2 x dp 2: only the TP replicas of each DP slice):
a flipped bit is caught by the replica check within one interval and no checkpoint of that state is
written; a transient NaN is rerun and leaves the losses equal, bit for bit, to a clean run's; a
persistent NaN skips exactly one batch, named; a slow rank is named, its waiting peers are not."""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from helpers import make_trainer, read_jsonl, run_distributed

LAYOUTS = {"zero1": ["--parallel.tp", "2", "--zero.stage", "1"], "zero3": ["--parallel.tp", "2", "--zero.stage", "3"]}
BASE = ["--train.iters", "4", "--train.log_interval", "1", "--train.straggler_interval", "0"]


def _train(args: list[str]) -> tuple[list, str]:
    """Run a tiny training job in this rank: (the JSONL records on the logging rank, its stdout)."""
    tr = make_trainer(args)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tr.run()
    path = tr.cfg.logging.jsonl
    return (read_jsonl(path) if tr.is_logger and path else []), out.getvalue()


def _faults(layout: list[str], tmp: str) -> tuple:
    """In the same 4 ranks, one after the other: a clean run, a transient NaN, a persistent NaN
    (each on rank 1 at iteration 2), and a bit flip on rank 3 after iteration 3."""
    import torch.distributed as dist
    rank = dist.get_rank()
    runs = {kind: _train([*layout, *BASE, "--logging.jsonl", os.path.join(tmp, f"{kind}{rank}.jsonl"),
                          *(["--train.inject_fault", f"{kind}:1:2"] if kind != "clean" else [])])
            for kind in ("clean", "transient_nan", "persistent_nan")}
    return runs, _bitflip(layout, os.path.join(tmp, "ckpt"))


def _bitflip(layout: list[str], save: str) -> tuple:
    from megazero.train.replicas import ReplicaMismatch
    tr = make_trainer([*layout, *BASE, "--train.iters", "6", "--train.replica_check_interval", "2",
                       "--checkpoint.save", save, "--checkpoint.interval", "2", "--train.inject_fault", "bitflip:3:3"])
    line = None
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            tr.run()
        except ReplicaMismatch as e:
            line = str(e)
    return line, tr.iteration, tr.replicas.coverage(tr.cfg)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_injected_faults_are_caught(layout, tmp_path):
    results = run_distributed(_faults, 4, LAYOUTS[layout], str(tmp_path))
    runs = next(r[0] for r in results if r[0]["clean"][0])  # the logging rank's records and lines
    clean = [r["loss"] for r in runs["clean"][0]]

    # a transient NaN: rerun, rank 1 named, the losses those of the clean run bit for bit
    transient, printed = runs["transient_nan"]
    assert [r["loss"] for r in transient if "loss" in r] == clean
    assert [r for r in transient if r.get("event")] == [
        {"iteration": 2, "event": "transient_fault", "why": transient[2]["why"], "ranks": [1]}]
    assert "iteration 2:" in printed and "a transient fault on rank(s) 1 (their loss differed)" in printed
    assert not any(r.get("skipped_iters") for r in transient)

    # a persistent NaN: exactly one batch skipped (iteration 2's samples 16..31), named
    persistent, printed = runs["persistent_nan"]
    records = [r for r in persistent if "loss" in r]
    assert [r["skipped_iters"] for r in records] == [0, 1, 1, 1] and records[0]["loss"] == clean[0]
    event = next(r for r in persistent if r.get("event"))
    assert event["event"] == "skipped_batch" and event["iteration"] == 2
    assert [s["sample"] for s in event["samples"]] == list(range(16, 32))
    assert "the data is the cause; batch skipped: samples 16-31 of mock" in printed

    # a flipped bit after iteration 3: every rank stops at the check of iteration 4 with the same line
    lines = {r[1][0] for r in results}
    assert len(lines) == 1 and None not in lines
    line = lines.pop()
    # (a step has passed since the flip: its computation carried the damage to other values too)
    assert line.startswith("replica mismatch at iteration 4: ") and "differs between ranks" in line
    assert {r[1][1] for r in results} == {4}
    # the checkpoint due at iteration 4 was never written: the last one is the verified iteration 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.yaml", "iter_0000002", "latest",
                                                   "latest_checkpointed_iteration.txt", "wandb_run_id"]
    coverage = results[0][1][2]
    assert "TP-replicated parameters" in coverage
    assert ("every parameter over its 2 data-parallel replicas" in coverage) == (layout == "zero1")


def _coverage(args: list[str]) -> tuple:
    tr = make_trainer([*BASE, *args])
    counts = tr.grid.bytes_moved()
    tr.replicas.check(1)  # nothing to compare: no collective either
    return tr.replicas.coverage(tr.cfg), tr.replicas.enabled, counts == tr.grid.bytes_moved()


def test_zero3_without_tp_says_nothing_is_compared():
    coverage, enabled, silent = run_distributed(_coverage, 2, ["--zero.stage", "3"])[0]
    assert not enabled and silent
    assert coverage.startswith("replica check: nothing to compare at ZeRO 3 with tp 1")


def _slow(layout: list[str]) -> str:
    return _train([*layout, "--train.iters", "6", "--train.log_interval", "3", "--train.inject_fault", "slow:2:1"])[1]


@pytest.mark.parametrize("layout", [pytest.param("zero1"), pytest.param("zero3", marks=pytest.mark.slow)])
def test_slow_rank_is_named_and_its_waiting_peers_are_not(layout):
    printed = "".join(run_distributed(_slow, 4, LAYOUTS[layout]))
    named = [line for line in printed.splitlines() if "straggler: rank" in line]
    # both checks (iterations 3 and 6) name rank 2's forward and backward
    assert [line.split(":")[0] for line in named if "rank 2 computes forward backward" in line] == \
        ["iteration 3", "iteration 6"]
    assert not [line for line in named if "rank 2" not in line]  # rank 3 (its TP peer) waited on it: not named


def _spikes(tmp: str) -> tuple:
    """train.rerun_on spike on 2 ranks: a transient NaN caught before the step (the spike check's
    all-reduce) leaves the clean losses; a loss far above the recent maximum fires on both
    executions (the data: skipped)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    spike = [*BASE, "--train.rerun_on", "spike"]
    clean = _train([*spike, "--logging.jsonl", os.path.join(tmp, f"clean{rank}.jsonl")])
    transient = _train([*spike, "--logging.jsonl", os.path.join(tmp, f"t{rank}.jsonl"),
                        "--train.inject_fault", "transient_nan:0:3"])
    tr = make_trainer([*spike, "--train.spike_factor", "2"])
    tr.train_step()
    tr.rerun.recent.clear()
    tr.rerun.recent.extend([0.1] * 3)  # a loss of ~6 after losses of 0.1: a spike, on both executions
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        out = tr.train_step()
    return clean[0], transient, (tr.skipped_iters, out["loss"], printed.getvalue(), tr.fault_records)


def test_spike_mode_reruns_before_the_step(tmp_path):
    clean, (transient, printed), (skipped, loss, spiked, records) = run_distributed(_spikes, 2, str(tmp_path))[0]
    assert [r["loss"] for r in transient if "loss" in r] == [r["loss"] for r in clean]
    assert "iteration 3: loss nan on the first execution" in printed and "rank(s) 0" in printed
    assert skipped == 1 and loss > 2 * 0.1
    assert "above 2 x the recent maximum 0.1" in spiked and "the data is the cause; batch skipped: samples" in spiked
    assert records[0]["event"] == "skipped_batch" and records[0]["iteration"] == 2


MOE = ["--train.iters", "2", "--model.seq_length", "32", "--train.global_batch_size", "8",
       "--train.micro_batch_size", "2", "--train.log_interval", "1", "--train.straggler_interval", "0"]


def _moe_replicas(layouts: dict[str, list[str]]) -> dict:
    """Each layout of a Mixtral-style model with the replica check every iteration (losses on the
    logging rank, the values compared); then at ep 1 x dp 2, ZeRO 0, a flipped bit in rank 1's copy
    of an expert weight and the check's line."""
    import torch

    from megazero.train.replicas import ReplicaMismatch
    out = {}
    for name, extra in layouts.items():
        tr = make_trainer(MOE + extra, base="configs/mixtral-tiny.yaml")
        with contextlib.redirect_stdout(io.StringIO()):
            records = tr.run()
        out[name] = ([r["loss"] for r in records] if tr.is_logger else None, tr.replicas.compared)
    tr = make_trainer(MOE + ["--zero.stage", "0", "--train.iters", "1"], base="configs/mixtral-tiny.yaml")
    with contextlib.redirect_stdout(io.StringIO()):
        tr.run()
    expert = next(p for n, p in tr.chunks[0].named_parameters() if n.endswith("experts.c_fc.weight"))
    if tr.grid.rank == 1:
        with torch.no_grad():
            expert.view(-1)[7:8].view(torch.int32).bitwise_xor_(1 << 27)
    tr.replicas.verified = None
    try:
        tr.replicas.check(2)
        out["flip"] = None
    except ReplicaMismatch as e:
        out["flip"] = str(e)
    return out


def test_moe_replicas_compare_each_expert_shard_with_its_own_replicas():
    """Expert weights split over ep (and their ZeRO-0 optimizer state) are compared only between
    ranks holding the same experts: ep 2 at ZeRO 0 and tp 2 x etp 1 at ZeRO 3 run clean with the
    check every iteration, their losses those of the check turned off; a bit flipped in an expert
    weight's replica is named."""
    layouts = {"ep2-zero0": ["--parallel.ep", "2", "--zero.stage", "0"],
               "tp2-etp1-ep2-zero0": ["--parallel.tp", "2", "--parallel.etp", "1", "--parallel.ep", "2",
                                      "--zero.stage", "0"],
               "tp2-etp1-zero3": ["--parallel.tp", "2", "--parallel.etp", "1", "--zero.stage", "3"],
               "ep2-zero0-off": ["--parallel.ep", "2", "--zero.stage", "0", "--train.replica_check_interval", "0"]}
    out = run_distributed(_moe_replicas, 2, layouts)[0]
    assert out["ep2-zero0"][0] == out["ep2-zero0-off"][0]
    assert all(out[k][1] > 0 for k in ("ep2-zero0", "tp2-etp1-ep2-zero0", "tp2-etp1-zero3"))
    assert out["flip"] is not None and "experts.c_fc.weight" in out["flip"] and "iteration 2" in out["flip"], out
