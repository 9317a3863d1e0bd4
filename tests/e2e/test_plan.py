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

from helpers import REPO, make_config, run_distributed, warm_trainer_and_plan
from megazero.config.sharding import sharding
from megazero.plan import formulas as F

ROOT = str(REPO)

TINY = {"model": {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "seq_length": 64, "vocab_size": 256},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "iters": 2},
        "zero": {"bucket_size": 20000}, "data": {"mock": True}}

LLAMA = ["--model.normalization", "rmsnorm", "--model.position_embedding", "rope", "--model.activation", "swiglu",
         "--model.num_query_groups", "2", "--model.ffn_hidden_size", "96", "--model.bias", "false",
         "--model.tie_embeddings", "false"]
LLAMA_LAYOUTS = [
    LLAMA + ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    LLAMA + ["--parallel.pp", "2", "--train.precision", "bf16", "--zero.stage", "1"],
    LLAMA + ["--parallel.cp", "2", "--zero.stage", "2"],
    LLAMA + ["--parallel.cp", "2", "--parallel.cp_impl", "ulysses", "--train.recompute", "selective"],
]
# On 2 ranks: tp, pp (interleaved), dp at each ZeRO stage, recompute none/selective/full, fp32 and bf16.
LAYOUTS = [
    ["--parallel.tp", "2"],
    ["--parallel.pp", "2", "--parallel.vpp", "2", "--train.recompute", "selective", "--train.precision", "bf16",
     "--model.dropout", "0.1"],
    ["--zero.stage", "0", "--train.recompute", "full"],
    ["--zero.stage", "1"],
    ["--zero.stage", "2", "--train.recompute", "selective", "--zero.reduce_dtype", "bf16", "--train.precision", "bf16"],
    ["--zero.stage", "3", "--train.precision", "bf16"],
    ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--model.dropout", "0.1", "--train.recompute", "selective"],
    # The Llama family: rotary, RMSNorm, SwiGLU, 2 K/V groups, no biases, the output layer untied.
    *LLAMA_LAYOUTS,
]
# On 4 ranks: TP and PP composed, GPipe over 4 stages, TP 4 with ZeRO-3.
SLOW_LAYOUTS = [
    ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.vpp", "2", "--train.recompute", "full"],
    ["--parallel.pp", "4", "--parallel.schedule", "gpipe", "--zero.stage", "1", "--train.global_batch_size", "16"],
    ["--parallel.tp", "2", "--zero.stage", "3", "--train.recompute", "selective", "--model.dropout", "0.1"],
    ["--parallel.tp", "2", "--parallel.pp", "2", "--train.recompute", "full", "--parallel.sequence_parallel", "true"],
]


def _measure(layouts: list[list[str]]) -> list[dict]:
    """Per layout, this rank's planner prediction beside what one training step measured."""
    import torch
    import torch.distributed as dist

    from megazero.plan.measure import ActivationMeter
    out = []
    for overrides in layouts:
        tr, pred = warm_trainer_and_plan(overrides, TINY)
        meter = ActivationMeter(lambda tr=tr: weight_storages(tr))
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            tr.train_step()
        moved, p = tr.grid.bytes_moved(), tr.cfg.parallel
        out.append({"case": " ".join(overrides), "rank": dist.get_rank(),
                    "states": (_on_device(tr.optimizer.model_state_bytes()), pred.states),
                    "bytes": ({k: sum(v for group in groups for op, v in moved.get(group, {}).items()
                                      if not op.endswith("_calls"))
                               for k, groups in (("dp", ("dp", "dp_cp") if p.cp > 1 else ("dp",)), ("tp", ("tp",)), ("cp", ("cp",)),
                                                 ("pp", ("pp",)), ("embed", ("embed",)))}, pred.bytes),
                    "activations": (meter.peak, pred.activations)})
    return out


def weight_storages(tr) -> set[int]:
    """Where the weights live now: parameters, and at ZeRO-3 the gathered buffers."""
    out = {p.untyped_storage().data_ptr() for c in tr.chunks for p in c.parameters()}
    gatherer = tr.optimizer.sharded.gatherer
    return out | {f.untyped_storage().data_ptr() for f in gatherer.full} if gatherer else out


def _train_and_capture(prefix: str, jsonl: str) -> dict:
    """pp 2 with logging.timers on mock data (records), then indexed data whose split leaves
    validation empty (start-up lines); what each rank printed."""
    import contextlib
    import io

    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    out = {}
    runs = {"mock": ({"data": {"mock": True}, "logging": {"timers": True, "jsonl": jsonl}}, 3),
            "indexed": ({"data": {"mock": False, "prefix": [0.7, prefix + "a", 0.3, prefix + "b"], "split": "100,0,0"},
                         "train": {"eval_interval": 2}}, 1)}
    for name, (extra, iters) in runs.items():
        cfg = make_config(["--parallel.pp", "2", "--train.iters", str(iters)], base={**TINY, **extra},
                          world=dist.get_world_size())
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            Trainer(cfg, ProcessGrid.create(1, 2)).run()
        out[name] = printed.getvalue()
    return out


def _world(layouts: list[list[str]], prefix: str, jsonl: str) -> dict:
    return {"measured": _measure(layouts), "printed": _train_and_capture(prefix, jsonl)}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """One spawned world of 2 ranks for every measured layout and the trainer's output."""
    import numpy as np

    from megazero.data.indexed import IndexedDatasetWriter
    tmp = tmp_path_factory.mktemp("plan")
    rng = np.random.default_rng(0)
    for name, docs in (("a", 40), ("b", 20)):
        with IndexedDatasetWriter(tmp / name, np.int32) as writer:
            lengths = rng.integers(20, 100, docs)
            writer.add_documents(rng.integers(0, 256, int(lengths.sum())), lengths)
            writer.finalize()
    ranks = run_distributed(_world, 2, LAYOUTS, str(tmp) + "/", str(tmp / "m.jsonl"))
    return {"measured": [r["measured"] for r in ranks], "printed": [r["printed"] for r in ranks], "tmp": tmp}


def _on_device(state_bytes: dict) -> dict:
    """The optimizer's model-state bytes on the compute device (these runs offload nothing)."""
    assert state_bytes["offloaded_host"] == state_bytes["offloaded_nvme"] == 0
    return {k: v for k, v in state_bytes.items() if not k.startswith("offloaded")}


def _check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            measured, predicted = r["states"]
            assert measured == predicted, (r["case"], r["rank"], measured, predicted)
            measured, predicted = r["bytes"]
            assert measured == predicted, (r["case"], r["rank"], measured, predicted)
            measured, predicted = r["activations"]
            assert abs(predicted - measured) <= 0.1 * measured, (r["case"], r["rank"], measured, predicted)


def test_planner_equals_measured_bytes_and_memory(world):
    _check(world["measured"])


@pytest.mark.slow
def test_planner_equals_measured_on_more_layouts():
    _check(run_distributed(_measure, 4, SLOW_LAYOUTS))


def test_bubble_equals_simulated_orders():
    for schedule, vpps in [("gpipe", [1]), ("1f1b", [1]), ("zbh1", [1]), ("interleaved", [2, 3, 4])]:
        for pp in (2, 3, 4, 8):
            for vpp in vpps:
                for m in range(pp if vpp > 1 else 1, 4 * pp + 1, pp if vpp > 1 else 1):
                    simulated = F.simulated_bubble(pp, vpp, m, schedule)
                    assert F.pipeline_bubble(pp, vpp, m, schedule) == pytest.approx(simulated, abs=1e-12), \
                        (schedule, pp, vpp, m)


# ---------------------------------------------------------------------------- anchors


def test_zero_paper_model_states_for_7_5b_on_64_gpus():
    """Rajbhandari et al. 2020, Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB per device."""
    psi, published = 7_500_000_000, [120, 31.4, 16.6, 1.88]
    for stage, gb in enumerate(published):
        got = sharding(stage).model_state_bytes(psi, 64, F.ZERO_PAPER_BYTES)["total"] / 1e9
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


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    """`python -m megazero.plan ARGS` in this process: (exit code, stdout, stderr)."""
    from megazero.plan.__main__ import main
    code = 0
    try:
        main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_command_ranks_layouts_and_prints_json(capsys):
    import json
    code, out, err = _plan(capsys, "--config", "configs/gpt2-124m.yaml", "--gpus", "16", "--gpu", "a100", "--top", "3",
                           "--json")
    assert code == 0, err
    out = json.loads(out)
    assert len(out["layouts"]) == 3 and all(lay["fits"] for lay in out["layouts"])
    steps = [lay["step_seconds"] for lay in out["layouts"]]
    assert steps == sorted(steps) and out["explanation"].startswith("winner " + out["layouts"][0]["label"])
    code, out, err = _plan(capsys, "--config", "configs/gpt2-124m.yaml", "--gpus", "16", "--tp", "2", "--pp", "2",
                           "--cp", "1", "--zero-stage", "1", "--micro-batch", "2", "--recompute", "selective",
                           "--vpp", "1")
    assert code == 0, err
    assert "tp2 pp2 dp4 z1 mb2 selective" in out and "pp rank 1:" in out


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8", "--tp", "5"], "--tp 5 must divide model.num_heads (12), the MLP width (3072) and --gpus (8); "
                                   "closest that fits: tp 4"),
    (["--gpus", "8", "--pp", "5"], "--pp 5 (x vpp 1) must divide model.num_layers (12)"),
    (["--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "3"], "closest that fits: dp 2"),
    (["--gpus", "2", "--gpu-memory", "1"], "no layout fits 2 x 1 GiB: the smallest"),
])
def test_plan_command_refuses_bad_input_in_one_line(capsys, args, message):
    code, _, err = _plan(capsys, "--config", "configs/gpt2-124m.yaml", *args)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ") and message in err, err


def test_plan_command_honours_training_layout_overrides(capsys):
    """--parallel.tp/cp/pp/dp/vpp and --zero.stage, as training spells them, fix the layout like --tp/--pp/..."""
    import json
    base = ["--config", "configs/gpt2-124m.yaml", "--gpus", "16", "--json", "--top", "0"]
    code, out, err = _plan(capsys, *base, "--parallel.tp", "2", "--parallel.pp=2", "--parallel.cp", "1", "--zero.stage", "1")
    assert code == 0, err
    labels = [lay["label"] for lay in json.loads(out)["layouts"]]
    assert labels and all(label.startswith("tp2 pp2 ") and " dp4 z1 " in label for label in labels), labels
    code, _, err = _plan(capsys, *base, "--parallel.dp", "4", "--dp", "2")
    assert code == 2 and "error: --parallel.dp 4 and --dp 2 disagree; pass one of them" in err


def test_plan_module_exits_2_on_bad_input():
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "megazero.plan", "--config", "configs/gpt2-1.5b.yaml", "--gpus", "8",
                           "--tp", "2"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --tp 2 must divide model.num_heads (25)")


# ---------------------------------------------------------------------------- the trainer


def test_trainer_summary_timers_and_plan_check(world):
    from helpers import read_jsonl
    first, last = world["printed"]
    tmp_path = world["tmp"]
    head = first["mock"].split("--- config ---")[0]
    assert "parameters" in head and "tp 1 x pp 2 x dp 1" in head and "micro-batch 2 x accumulation 4" in head
    # On CPUs the plan says where the model states live, and predicts nothing for GPUs it does not have.
    assert "plan: model states" in head and "peak memory per GPU" not in head and "--- config ---" not in head
    indexed = first["indexed"].split("--- config ---")[0]
    assert f"data train: {tmp_path}/a: 40 documents" in indexed and f"{tmp_path}/b: 20 documents" in indexed
    assert "warning: data.split '100,0,0' leaves the valid split without documents" in indexed
    # The logging rank (last stage): no planner check on CPUs (RSS is no GPU memory), the timed records.
    assert "plan check" not in last["mock"]
    records = read_jsonl(str(tmp_path / "m.jsonl"))
    assert len(records) == 3
    for rec in records:
        assert all(rec[k] >= 0 for k in ("time_forward_s", "time_backward_s", "time_optimizer_s", "time_comm_wait_s"))
        # pp 2, 4 micro-batches of [2, 64, 64] fp32 activations: one send per micro-batch each way from the
        # last stage, plus the tied embedding's fp32 gradient summed over the two stages.
        assert rec["bytes_dp"] == 0 and rec["bytes_tp"] == 0 and rec["bytes_pp"] >= 4 * 2 * 64 * 64 * 4


def test_log_line_keeps_tflops_digits_on_tiny_models():
    from megazero.train.metrics import format_line
    rec = {"iteration": 1, "loss": 6.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 4000.0,
           "tflops_per_device": 0.000138, "peak_mem_gib": 0.2, "time_forward_s": 0.0123, "time_backward_s": 0.02,
           "time_optimizer_s": 0.001, "time_comm_wait_s": 0.0, "bytes_dp": 2 ** 20, "bytes_tp": 0, "bytes_pp": 0}
    line = format_line(rec, 10)
    assert "0.000138 TFLOP/s" in line and "fwd 12.3 ms" in line and "sent dp 1.00 MiB tp 0.00 MiB" in line


def test_zbh1_plans_its_own_bubble():
    """zbh1's pipelined layouts (ZeRO-3 included) get ZB-H1's bubble, and memory counts each
    micro-batch until its W (rank 0 as in 1F1B, the last rank up to pp micro-batches instead
    of one)."""
    from megazero.config import build_config
    from megazero.plan.planner import Cluster, candidates, predict
    preds = {}
    for schedule in ("1f1b", "zbh1"):
        cfg = build_config({"model": {"num_layers": 8, "hidden_size": 64, "num_heads": 4, "seq_length": 32,
                                      "vocab_size": 256}, "parallel": {"schedule": schedule},
                            "train": {"global_batch_size": 32}, "data": {"mock": True}})
        cluster = Cluster(8, 8, 80.0, None)
        layouts = candidates(cfg, cluster, {})
        assert any(lay.pp > 1 and lay.zero_stage == 2 for lay in layouts)
        assert any(lay.pp > 1 and lay.vpp == 1 and lay.zero_stage == 3 for lay in layouts)
        layout = next(lay for lay in layouts if lay.pp == 4 and lay.vpp == 1 and lay.micro_batch == 2)
        preds[schedule] = predict(cfg, layout, cluster, ranks=[0, 3], device="cpu")
    m = 32 // (2 * layout.dp)
    zb, one_f = preds["zbh1"], preds["1f1b"]
    assert zb.schedule == "zbh1" and zb.bubble == pytest.approx(F.pipeline_bubble(4, 1, m, "zbh1"))
    assert zb.bubble < one_f.bubble
    assert zb.rank(0).activations == one_f.rank(0).activations
    assert zb.rank(3).activations > one_f.rank(3).activations


@pytest.mark.parametrize("optimizer, param, expected", [
    ("none", "none", "model states 3.62 MiB = params 925.50 KiB + grads 925.50 KiB + optimizer 1.81 MiB per rank"),
    ("cpu", "none", "model states 1.81 MiB on the device = params 925.50 KiB + grads 925.50 KiB, 1.81 MiB in host "
                    "memory = optimizer 1.81 MiB (zero.offload_optimizer cpu); host memory for offloading 2.71 MiB per rank"),
    ("nvme", "cpu", "model states 925.50 KiB on the device = grads 925.50 KiB, 925.50 KiB in host memory = params "
                    "925.50 KiB, 1.81 MiB on NVMe = optimizer 1.81 MiB (zero.offload_optimizer nvme, "
                    "zero.offload_param cpu: the device holds only the gathered units in flight); host memory for "
                    "offloading 11.75 MiB per rank"),
])
def test_startup_plan_line_says_where_each_kind_of_state_lives(optimizer, param, expected):
    """Under offload the start-up line groups params, grads and optimizer states by where they
    are (device / host memory / NVMe), instead of one sum that mixes them (issue 25)."""
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    from megazero.train.summary import plan_line
    cfg = make_config(["--zero.stage", "3", "--zero.offload_optimizer", optimizer, "--zero.offload_param", param,
                       "--zero.nvme_path", "/tmp"], world=1)
    layout = ParallelLayout(1, 1, 1, 1, 3, cfg.train.micro_batch_size, "none", False, optimizer != "none")
    plan = predict(cfg, layout, Cluster(1, 1, 0.0, None, 1.0, 1.0), ranks=[0], device="cpu")
    assert plan_line(plan, "cpu", False, optimizer, param).startswith(f"plan: {expected} (pp rank 0)")


# ---------------------------------------------------------------------------- published shapes


@pytest.mark.parametrize("config, published", [("configs/llama-3.2-1b.yaml", 1_235_814_400),
                                               ("configs/llama-3-8b.yaml", 8_030_261_248)])
def test_llama_configs_plan_with_their_published_parameter_counts(capsys, config, published):
    """The Llama 3.2 1B and Llama 3 8B shapes: megazero's model built on the meta device, and
    transformers' LlamaForCausalLM of the same shape, hold the published count; the planner
    plans a layout of each and says so."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megazero.config import build_config
    from megazero.config.parse import load_yaml
    from megazero.model.gpt import GPT
    m = build_config(load_yaml(os.path.join(ROOT, config))).model
    with torch.device("meta"):
        built = sum(p.numel() for p in GPT(m).parameters())
        hf = LlamaForCausalLM(LlamaConfig(
            hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_query_groups, vocab_size=m.vocab_size,
            tie_word_embeddings=m.tie_embeddings))
    assert built == F.model_parameters(m) == published == sum(p.numel() for p in hf.parameters())
    code, out, err = _plan(capsys, "--config", config, "--gpus", "8", "--tp", "2", "--pp", "2", "--cp", "1",
                           "--vpp", "1", "--zero-stage", "1", "--micro-batch", "1", "--recompute", "selective")
    assert code == 0, err
    assert f"{published / 1e9:.2f}B parameters" in out and "rope, rmsnorm, swiglu, 8 query groups, no bias" in out
    assert "tp2 pp2 dp2 z1 mb1 selective" in out and "pp rank 1:" in out


def test_the_zero3_pipeline_note_follows_the_candidate_layout():
    """The planner ranks layouts of every ZeRO stage from one config: the note is the layout's."""
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    note = "ZeRO-3 with pp > 1 gathers every stage's parameters per micro-batch"
    for config_stage in ("0", "3"):
        cfg = make_config(["--zero.stage", config_stage], base=TINY)
        for stage in range(4):
            pred = predict(cfg, ParallelLayout(1, 2, 1, zero_stage=stage, micro_batch=2), Cluster(2, 8, 80.0, None))
            assert (note in pred.notes) == (stage == 3), (config_stage, stage, pred.notes)


def _hf_moe(config: str):
    """transformers' model of the published shape `config` names."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )
    if "mixtral" in config:
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False))
    if "qwen3" in config:
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False))
    return OlmoeForCausalLM(OlmoeConfig(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, tie_word_embeddings=False))


@pytest.mark.parametrize("config, total, active", [("configs/mixtral-8x7b.yaml", "46.70B", "12.88B"),
                                                   ("configs/qwen3-30b-a3b.yaml", "30.53B", "3.35B"),
                                                   ("configs/olmoe-1b-7b.yaml", "6.92B", "1.28B")])
def test_moe_configs_plan_with_transformers_parameter_counts(capsys, config, total, active):
    """The published MoE shapes: the planner's count from the config equals transformers' model of
    the same shape on the meta device (OLMoE's q/k norms over the whole projections included), and
    the planner plans them with ep and says both counts."""
    import torch

    from megazero.config import build_config
    from megazero.config.parse import load_yaml
    m = build_config(load_yaml(os.path.join(ROOT, config))).model
    with torch.device("meta"):
        hf = _hf_moe(config)
    assert F.model_parameters(m) == sum(p.numel() for p in hf.parameters())
    code, out, err = _plan(capsys, "--config", config, "--gpus", "16", "--tp", "1", "--pp", "2", "--cp", "1",
                           "--vpp", "1", "--zero-stage", "1", "--micro-batch", "1", "--recompute", "full", "--ep", "8")
    assert code == 0, err
    assert f"{total} parameters ({active} active: {m.num_experts} experts, top-{m.moe_router_topk}" in out
    assert "tp1 pp2 dp8 ep8 z1 mb1 full" in out and "| experts/GPU |" in out and "sends EP" in out
