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


def _bitflip(layout: list[str], save: str, at: int = 3) -> tuple:
    from megazero.train.replicas import ReplicaMismatch
    tr = make_trainer([*layout, *BASE, "--train.iters", "6", "--train.replica_check_interval", "2",
                       "--checkpoint.save", save, "--checkpoint.interval", "2", "--train.inject_fault", f"bitflip:3:{at}"])
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


def _slow(layout: list[str], jsonl: str) -> tuple:
    return _train([*layout, "--train.iters", "6", "--train.log_interval", "3", "--train.inject_fault", "slow:2:1",
                   "--logging.jsonl", jsonl])


@pytest.mark.parametrize("layout", [pytest.param("zero1"), pytest.param("zero3", marks=pytest.mark.slow)])
def test_slow_rank_is_named_and_its_waiting_peers_are_not(layout, tmp_path):
    results = run_distributed(_slow, 4, LAYOUTS[layout], str(tmp_path / "metrics.jsonl"))
    printed = "".join(out for _, out in results)
    # the JSONL records of both checks hold every rank's compute time per phase: rank 2's the largest
    records = [r for records, _ in results for r in records]
    assert [r["iteration"] for r in records] == [3, 6]
    for r in records:
        times = r["rank_compute_s"]
        assert set(times) == {"forward_backward", "optimizer"} and all(len(t) == 4 for t in times.values())
        assert max(range(4), key=times["forward_backward"].__getitem__) == 2
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


OFF = ["--train.replica_check_interval", "0", "--train.rerun_on", "none", "--train.straggler_interval", "0"]


def _losses_and_weights(args: list[str]) -> tuple:
    """(loss and gradient norm per iteration, this rank's parameters' bytes) after 4 iterations."""
    tr = make_trainer(["--train.iters", "4", "--train.log_interval", "1", "--model.dropout", "0.1", *args])
    with contextlib.redirect_stdout(io.StringIO()):
        records = tr.run()
    tr.optimizer.params.wait_all()
    weights = b"".join(p.detach().cpu().numpy().tobytes() for c in tr.chunks for p in c.parameters())
    checks = (tr.replicas.enabled and tr.replicas.verified == 4, tr.rerun.enabled, tr.stragglers.enabled)
    return [(r["loss"], r["grad_norm"]) for r in records], weights, checks


def _with_and_without_checks(layout: list[str]) -> tuple:
    return _losses_and_weights(layout), _losses_and_weights([*layout, *OFF])


@pytest.mark.parametrize("ranks, layout", [pytest.param(2, ["--zero.stage", "1"], id="dp2-zero1"),
                                           pytest.param(4, LAYOUTS["zero1"], id="tp2-dp2-zero1",
                                                        marks=pytest.mark.slow)])
def test_the_checks_change_nothing_bit_for_bit(ranks, layout):
    """The default run (replica digests, the rerun guard's saves and the straggler gather every
    iteration, dropout on) and one with all three off: the same losses, gradient norms and weights,
    bit for bit, on every rank."""
    for on, off in run_distributed(_with_and_without_checks, ranks, layout):
        assert on[2] == (True, True, True) and off[2] == (False, False, False)
        assert on[:2] == off[:2]
        assert len(on[0]) == 4 and on[1]


def _corrupt_optimizer_state(args: list[str]) -> tuple:
    """After a step, one element of rank 1's first moment changes (its weights do not): at ZeRO 0
    any element (the whole state is replicated over dp), at tp > 1 one of a TP-replicated
    parameter's; the replica check of that iteration stops every rank, naming the optimizer state."""
    import tempfile

    import torch
    import torch.distributed as dist

    from megazero.parallel.placement import placement
    from megazero.train.replicas import ReplicaMismatch
    swap = ["--zero.nvme_path", tempfile.mkdtemp(prefix="swap")] if "nvme" in args else []
    tr = make_trainer([*BASE, *args, *swap])
    with contextlib.redirect_stdout(io.StringIO()):
        tr.train_step()
    tr.iteration = 1
    tr.replicas.check(1)  # clean: it passes
    layout, state = tr.optimizer.layout, tr.optimizer.state
    _, slot, start, end, offset = next(piece for piece in layout.slot_pieces(layout.trainable_buckets())
                                       if not placement(piece[1].param).sharded)
    if tr.grid.tp > 1:  # written back through the store: on NVMe a range is a copy
        values = state.view("exp_avg", offset, end - start).clone()
        values[values.numel() // 2] += torch.tensor(1e-3 if dist.get_rank() == 1 else 0.0, dtype=values.dtype)
        state.write("exp_avg", offset, values)
        state.flush()
    elif dist.get_rank() == 1:
        values = next(state.pieces("exp_avg"))[1]
        values[values.numel() // 2] += torch.tensor(1e-3, dtype=values.dtype)
    try:
        tr.replicas.check(2)
    except ReplicaMismatch as e:
        return tr.replicas.coverage(tr.cfg), str(e), slot.name
    return tr.replicas.coverage(tr.cfg), None, slot.name


STATE_CASES = {
    "zero0 dp3": (3, ["--zero.stage", "0", "--train.micro_batch_size", "2", "--train.global_batch_size", "12"],
                  "the replicated optimizer state", "optimizer state exp_avg",
                  "ranks 0, 2 (the majority) agree, rank(s) 1 hold another value"),
    "zero1 tp2": (2, ["--zero.stage", "1", "--parallel.tp", "2"], "the TP-replicated parameters' optimizer state",
                  "optimizer state exp_avg of {slot} (DP slice 0)", "no majority: ranks 0 vs ranks 1"),
    "zero1 tp2 nvme": (2, ["--zero.stage", "1", "--parallel.tp", "2", "--zero.offload_optimizer", "nvme",
                           "--zero.sub_group_size", "3000"], "the TP-replicated parameters' optimizer state",
                       "optimizer state exp_avg of {slot} (DP slice 0)", "no majority: ranks 0 vs ranks 1"),
}


@pytest.mark.parametrize("case", STATE_CASES)
def test_replicated_optimizer_state_is_compared(case):
    ranks, args, covered, named, side = STATE_CASES[case]
    results = run_distributed(_corrupt_optimizer_state, ranks, args)
    assert len({line for _, line, _ in results}) == 1
    coverage, line, slot = results[0]
    assert covered in coverage
    assert line is not None and line.startswith(f"replica mismatch at iteration 2: {named.format(slot=slot)}"), line
    assert side in line


def _gradient_nan(tmp: str) -> tuple:
    """dp 2, ZeRO 1: on rank 1 one gradient is NaN in the first execution of iteration 2 only (its
    loss stays finite): the rerun is clean, and the losses are the clean run's."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    clean = _train(["--zero.stage", "1", *BASE, "--logging.jsonl", os.path.join(tmp, f"clean{rank}.jsonl")])[0]
    tr = make_trainer(["--zero.stage", "1", *BASE, "--logging.jsonl", os.path.join(tmp, f"grad{rank}.jsonl")])
    calls = []

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls.append(tr.iteration)
        return grad * float("nan") if rank == 1 and calls.count(1) == 1 and tr.iteration == 1 else grad
    next(p for c in tr.chunks for p in c.parameters() if p.requires_grad).register_hook(poison)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tr.run()
    return clean, read_jsonl(tr.cfg.logging.jsonl) if tr.is_logger else [], out.getvalue(), calls.count(1)


def test_a_non_finite_gradient_alone_is_rerun(tmp_path):
    results = run_distributed(_gradient_nan, 2, str(tmp_path))
    clean, records, printed, calls = next(r for r in results if r[1])
    assert calls == 4  # 2 micro-batches per rank, twice: iteration 2 ran again
    assert [r["loss"] for r in records if "loss" in r] == [r["loss"] for r in clean]
    event = next(r for r in records if r.get("event"))
    assert event["event"] == "transient_fault" and event["iteration"] == 2 and event["ranks"] == []
    assert event["why"].startswith("gradient norm nan")
    assert "iteration 2: gradient norm nan" in printed and "a transient fault on a rank whose loss agreed" in printed
    assert not any(r.get("skipped_iters") for r in records)


def _bitflip_on_stage(save: str) -> tuple:
    import torch.distributed as dist
    line, iteration, coverage = _bitflip(["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "1"], save, 4)
    return line, iteration, coverage, dist.get_rank()


@pytest.mark.slow
def test_tp_replicas_are_compared_on_every_pipeline_stage(tmp_path):
    """tp 2 x pp 2: a bit flipped on rank 3 (the last stage) after iteration 4's step is caught by
    that iteration's check, before its save, naming that stage's parameter and TP peers (a step
    later the damage would have spread to the first stage's replicas too, through the gradients
    the two TP peers send back)."""
    results = run_distributed(_bitflip_on_stage, 4, str(tmp_path / "ckpt"))
    lines = {r[0] for r in results}
    assert len(lines) == 1 and {r[1] for r in results} == {4}
    line = lines.pop()
    assert line is not None and line.startswith("replica mismatch at iteration 4: ")
    assert "no majority: ranks 2 vs ranks 3" in line or "no majority: ranks 3 vs ranks 2" in line
    layer = line.split(": ")[1].split(" ")[0]
    assert layer.startswith(("transformer.h.2.", "transformer.h.3.", "transformer.ln_f.")), layer  # stage 1's layers
    assert "the TP-replicated parameters (norms, biases, routers) over the 2 TP ranks" in results[0][2]
    assert sorted(os.listdir(tmp_path / "ckpt"))[:2] == ["config.yaml", "iter_0000002"]
    assert not (tmp_path / "ckpt" / "iter_0000004").exists()


def _startup(args: list[str]) -> tuple[str, str]:
    """What building the trainer prints on this rank: (stdout, stderr)."""
    import torch.distributed as dist

    from helpers import make_config
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    cfg = make_config([*BASE, *args], world=dist.get_world_size())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        Trainer(cfg, ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp))
    return out.getvalue(), err.getvalue()


def test_startup_says_what_is_checked_and_the_injected_fault_loudly():
    (out, err), (out1, _) = run_distributed(_startup, 2, ["--zero.stage", "1", "--train.inject_fault", "slow:1:3"])
    line = next(line for line in out.splitlines() if line.startswith("replica check: "))
    assert line.startswith("replica check: every parameter over its 2 data-parallel replicas; every 1 iterations and "
                           "before every checkpoint save (") and line.endswith(" values compared)")
    assert "WARNING: FAULT INJECTION (train.inject_fault slow:1:3, for testing): slow on rank 1 at iteration 3; " \
           "this run is corrupted on purpose" in err
    assert "replica check" not in out1  # said once, by rank 0
    off, _ = run_distributed(_startup, 1, ["--train.replica_check_interval", "0"])[0]
    assert "replica check: off (train.replica_check_interval 0)" in off


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
