"""The layout planner against measurement and against the published anchors.

Measured on gloo with real training steps (one spawned world runs every layout; dropout
only with recomputed attention, as torch's CPU attention falls back to an unfused kernel
with dropout that GPUs do not use): the
planner's model-state bytes equal what the optimizer allocates and its DP/TP/PP bytes equal
the comm counters, exactly; its saved-activation memory is within 10% of the peak measured
with saved_tensors_hooks; its bubble equals the executor's orders replayed in simulated time.
Anchors: the ZeRO paper's 7.5B model on 64 GPUs and Korthikanti et al.'s activation formulas.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distributed import run_distributed
from megazero.plan import formulas as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = {"model": {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "seq_length": 64, "vocab_size": 256},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "iters": 2},
        "zero": {"bucket_size": 20000}, "data": {"mock": True}}

# tp, pp, dp, each ZeRO stage, recompute none/selective/full, fp32 and bf16, every schedule.
LAYOUTS = [
    ["--parallel.tp", "2", "--zero.stage", "1"],
    ["--parallel.pp", "2", "--zero.stage", "2", "--train.recompute", "selective", "--train.precision", "bf16",
     "--model.dropout", "0.1"],
    ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.vpp", "2", "--train.recompute", "full"],
    ["--zero.stage", "3", "--train.precision", "bf16", "--zero.reduce_dtype", "bf16"],
]
SLOW_LAYOUTS = [
    ["--parallel.pp", "4", "--parallel.schedule", "gpipe", "--zero.stage", "1", "--train.global_batch_size", "16"],
    ["--parallel.tp", "4", "--zero.stage", "3", "--train.recompute", "selective"],
    ["--parallel.pp", "2", "--zero.stage", "0", "--train.precision", "bf16", "--model.dropout", "0.1",
     "--train.recompute", "full"],
]


def _measure(layouts: list[list[str]]) -> list[dict]:
    """Per layout, this rank's planner prediction beside what one training step measured."""
    import contextlib
    import io

    import torch
    import torch.distributed as dist

    from megazero.config import build_config, validate
    from megazero.parallel.grid import ProcessGrid
    from megazero.plan.measure import ActivationMeter
    from megazero.plan.planner import Cluster, Layout, predict
    from megazero.train.trainer import Trainer
    out = []
    for overrides in layouts:
        cfg = build_config(TINY, overrides)
        dp = validate(cfg, dist.get_world_size())
        with contextlib.redirect_stdout(io.StringIO()):
            tr = Trainer(cfg, ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp))
        tr.train_step()  # warm-up: the counters and the meter see a steady iteration
        tr.grid.reset_counters()
        meter = ActivationMeter(lambda: weight_storages(tr))
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            tr.train_step()
        moved = tr.grid.bytes_moved()
        p, z, t = cfg.parallel, cfg.zero, cfg.train
        layout = Layout(p.tp, p.pp, dp, p.vpp, z.stage, t.micro_batch_size, t.recompute)
        pred = predict(cfg, layout, Cluster(dist.get_world_size(), 8, 1.0, None), ranks=[tr.grid.pp_rank],
                       device="cpu").rank(tr.grid.pp_rank)
        out.append({"case": " ".join(overrides), "rank": dist.get_rank(),
                    "states": (tr.optimizer.model_state_bytes(), pred.states),
                    "bytes": ({k: sum(v for op, v in moved[k].items() if not op.endswith("_calls"))
                               for k in ("dp", "tp", "pp", "embed")}, pred.bytes),
                    "activations": (meter.peak, pred.activations)})
    return out


def weight_storages(tr) -> set[int]:
    """Where the weights live now: parameters, and at ZeRO-3 the gathered buffers."""
    out = {p.untyped_storage().data_ptr() for c in tr.chunks for p in c.parameters()}
    gatherer = tr.optimizer.gatherer
    return out | {f.untyped_storage().data_ptr() for f in gatherer.full} if gatherer else out


def _check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            measured, predicted = r["states"]
            assert measured == predicted, (r["case"], r["rank"], measured, predicted)
            measured, predicted = r["bytes"]
            assert measured == predicted, (r["case"], r["rank"], measured, predicted)
            measured, predicted = r["activations"]
            assert abs(predicted - measured) <= 0.1 * measured, (r["case"], r["rank"], measured, predicted)


def test_planner_equals_measured_bytes_and_memory():
    _check(run_distributed(_measure, 4, LAYOUTS))


@pytest.mark.slow
def test_planner_equals_measured_on_more_layouts():
    _check(run_distributed(_measure, 4, SLOW_LAYOUTS))


def test_bubble_equals_simulated_orders():
    for schedule, vpps in [("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3, 4])]:
        for pp in (2, 3, 4, 8):
            for vpp in vpps:
                for m in range(pp if vpp > 1 else 1, 4 * pp + 1, pp if vpp > 1 else 1):
                    assert F.pipeline_bubble(pp, vpp, m) == pytest.approx(F.simulated_bubble(pp, vpp, m, schedule),
                                                                          abs=1e-12), (schedule, pp, vpp, m)


# ---------------------------------------------------------------------------- anchors


def test_zero_paper_model_states_for_7_5b_on_64_gpus():
    """Rajbhandari et al. 2020, Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB per device."""
    psi, published = 7_500_000_000, [120, 31.4, 16.6, 1.88]
    for stage, gb in enumerate(published):
        got = F.model_state_bytes(psi, 64, stage, F.ZERO_PAPER_BYTES)["total"] / 1e9
        assert abs(got - gb) / gb < 0.005, (stage, got, gb)


def test_korthikanti_activation_formulas():
    """Korthikanti et al. 2022, eqs. 1-5 (16-bit, dropout, unfused attention): per layer
    sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP + SP: sbh/t (34 + 5as/h); selective
    with SP: 34 sbh/t; full: 2 sbh. Ours adds LayerNorm's fp32 mean and rstd (16 bs bytes)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B on 8-way TP
    sbh, stats = s * b * h, 16 * b * s

    def ours(**kw) -> int:
        shape = F.ActivationShape(micro_batch=b, seq=s, hidden=h, heads=a, ffn=4 * h, vocab=51200,
                                  attention="math", **kw)
        return F.layer_activation_bytes(shape)
    assert ours() == sbh * (34 + 5 * a * s / h) + stats
    assert ours(tp=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t)) + stats
    assert ours(tp=t, sequence_parallel=True) == sbh / t * (34 + 5 * a * s / h) + stats / t
    assert ours(tp=t, sequence_parallel=True, recompute="selective") == sbh * 34 / t + stats / t
    assert ours(tp=t, recompute="selective") == sbh * (10 + 24 / t) + stats
    assert ours(tp=t, recompute="full") == 2 * sbh
    # 1F1B keeps p micro-batches on the first stage: L layers' worth, however the model is split.
    from megazero.pipeline.schedules import ORDERS
    pp, layers = 8, 96
    order = [(x.forward, x.chunk) for x in ORDERS["1f1b"](pp, 1, 0, 64)]
    assert F.peak_in_flight_bytes(order, [layers // pp * ours(tp=t)]) == layers * ours(tp=t)


# ---------------------------------------------------------------------------- the command


def _plan(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "megazero.plan", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def test_plan_command_ranks_layouts_and_prints_json():
    import json
    proc = _plan("--config", "configs/gpt2-355m.yaml", "--gpus", "16", "--gpu", "a100", "--top", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["layouts"]) == 3 and all(lay["fits"] for lay in out["layouts"])
    steps = [lay["step_seconds"] for lay in out["layouts"]]
    assert steps == sorted(steps) and out["explanation"].startswith("winner " + out["layouts"][0]["label"])
    proc = _plan("--config", "configs/gpt2-355m.yaml", "--gpus", "16", "--tp", "2", "--pp", "2", "--zero-stage", "1",
                 "--micro-batch", "2", "--recompute", "selective", "--vpp", "1")
    assert proc.returncode == 0, proc.stderr
    assert "tp2 pp2 dp4 z1 mb2 selective" in proc.stdout and "pp rank 1:" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8", "--tp", "3"], "--tp 3 must divide model.num_heads (16)"),
    (["--gpus", "8", "--pp", "5"], "--pp 5 (x vpp 1) must divide model.num_layers (24)"),
    (["--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "3"], "closest that fits: dp 2"),
    (["--gpus", "2", "--gpu-memory", "2"], "no layout fits 2 x 2 GiB: the smallest"),
])
def test_plan_command_refuses_bad_input_in_one_line(args, message):
    proc = _plan("--config", "configs/gpt2-355m.yaml", *args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
