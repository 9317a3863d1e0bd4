"""LoRA fine-tuning: adapters sharded like their base layers, a frozen base that costs no
gradient, optimizer state or DP gradient traffic at any ZeRO stage, parity with the
single-process run, PEFT-compatible adapter files, --merge-lora, resume and reshard."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import full_logits, make_config, make_trainer, run_distributed
from megazero.config import ConfigError

ARGS = ["--model.num_layers", "2", "--model.seq_length", "32", "--model.dropout", "0", "--data.mock", "true", "--train.global_batch_size", "8",
        "--train.micro_batch_size", "2", "--zero.sub_group_size", "5000", "--zero.bucket_size", "20000",
        "--optim.lr", "1e-2", "--optim.warmup_iters", "0", "--optim.decay_iters", "10", "--finetune.lora_rank", "4", "--finetune.lora_alpha", "8",
        "--finetune.lora_targets", "c_attn", "c_proj", "c_fc"]
TP2_DP2_Z3 = ["--parallel.tp", "2", "--zero.stage", "3"]
# Adapter dropout on column-parallel inputs only: replicated over TP, the same mask on every
# TP rank, drawn from the default stream exactly as at tp 1.
COLUMN_DROPOUT = ["--finetune.lora_dropout", "0.3", "--finetune.lora_targets", "c_attn", "c_fc"]


def _losses(args: list[str], iters: int) -> list[float]:
    t = make_trainer(ARGS + args + ["--train.iters", str(iters)])
    return [t.train_step()["loss"] for _ in range(iters)]


def _held(per_rank: list[list]) -> list[list[float]]:
    """The loss sequences of the ranks that hold the loss."""
    held = [losses for losses in per_rank if losses[0] is not None]
    assert held
    return held


def test_config_is_validated():
    for args, message in [(["--finetune.lora_rank", "-1"], r"finetune.lora_rank \(-1\) must not be negative"),
                          (["--finetune.lora_targets", "c_atn"], r"names 'c_atn', which matches no GPT-2 module"),
                          (["--finetune.lora_alpha", "0"], r"finetune.lora_alpha \(0\) must be positive"),
                          (["--finetune.lora_dropout", "1"], r"finetune.lora_dropout \(1\) must be in \[0, 1\)")]:
        with pytest.raises(ConfigError, match=message):
            make_config(ARGS + args, world=1)


def test_targets_match_like_peft():
    from megazero.model.lora_targets import adapted_modules
    assert adapted_modules(["c_proj"]) == ["attn.c_proj", "mlp.c_proj"]
    assert adapted_modules(["mlp.c_proj"]) == ["mlp.c_proj"]
    assert adapted_modules(["c_attn", "c_fc"]) == ["attn.c_attn", "mlp.c_fc"]


# ----------------------------------------------------------------------------- frozen base: what moves over DP


def _traffic(stages: list[int]) -> list[dict]:
    """Per ZeRO stage, one iteration: gradient bytes on the DP group (measured, and
    predicted from the trainable buckets alone), parameter all-gather bytes, sizes."""
    from megazero.parallel.comm import all_gather_volume, all_reduce_volume, reduce_scatter_volume
    out = []
    for stage in stages:
        t = make_trainer(ARGS + ["--zero.stage", str(stage)])
        opt, dp = t.optimizer, t.grid.dp_group
        trainable = opt.layout.trainable_buckets()
        dp.counter.clear()
        t.train_step()
        n, micro = dp.size, t.num_microbatches
        if stage == 0:
            predicted = sum(all_reduce_volume(4 * b.numel, n) for b in trainable)
        else:
            per_pass = sum(reduce_scatter_volume(4 * b.shard_numel, n) for b in trainable)
            predicted = per_pass * (micro if stage >= 2 else 1)
        gathered_after_step = sum(all_gather_volume(4 * b.shard_numel, n) for b in trainable) if stage in (1, 2) else 0
        frozen_grads = [s.param.grad for b in opt.layout.buckets if not b.trainable for s in b.slots]
        out.append({"stage": stage, "grad_bytes": dp.counter["all_reduce"] + dp.counter["reduce_scatter"],
                    "predicted_grad_bytes": predicted, "all_gather_bytes": dp.counter["all_gather"],
                    "predicted_step_gather": gathered_after_step,
                    "trainable_numel": sum(b.numel for b in trainable),
                    "frozen_numel": opt.layout.numel - sum(b.numel for b in trainable),
                    "reduced_numel": opt.grads.reduced_numel, "frozen_grads": sum(g is not None for g in frozen_grads),
                    "bytes": opt.model_state_bytes(), "peak_gathered": opt.sharded.peak_materialized_numel,
                    "model_numel": opt.layout.numel, "largest_unit": max(b.numel for b in opt.layout.buckets)})
    return out


def _traffic_and_dropout(stages: list[int]) -> tuple[list[dict], list[float], list[float]]:
    tp2 = ["--parallel.tp", "2", "--train.global_batch_size", "4"]
    return _traffic(stages), _losses(tp2 + COLUMN_DROPOUT, 4), _losses(tp2 + COLUMN_DROPOUT[2:], 4)


def test_only_adapter_gradients_move_over_dp_at_every_stage(reference):
    per_rank = run_distributed(_traffic_and_dropout, 2, [0, 1, 2, 3])
    traffic, dropped, undropped = per_rank[0]
    # the adapters' dropout at tp 2 draws tp 1's masks (and matters)
    assert max(abs(a - b) for a, b in zip(dropped, reference["dropout"], strict=True)) <= 1e-5, \
        (dropped, reference["dropout"])
    assert abs(dropped[-1] - undropped[-1]) > 1e-4
    for r in traffic:
        print(f"zero {r['stage']}: DP gradient bytes {r['grad_bytes']} (trainable-only prediction "
              f"{r['predicted_grad_bytes']}), DP all-gather bytes {r['all_gather_bytes']}, trainable elements "
              f"{r['trainable_numel']}, frozen {r['frozen_numel']}, state bytes {r['bytes']}, peak gathered "
              f"{r['peak_gathered']} of {r['model_numel']}")
        assert r["frozen_numel"] > 10 * r["trainable_numel"]
        # what the DP group carried beyond the adapters' gradients: the loss' own all-reduce (one scalar)
        assert 0 <= r["grad_bytes"] - r["predicted_grad_bytes"] <= 16 and r["predicted_grad_bytes"] > 0
        assert r["frozen_grads"] == 0
        micro = 2 if r["stage"] >= 2 else 1  # 8 samples / (2 per micro-batch x dp 2)
        assert r["reduced_numel"] == r["trainable_numel"] * micro
        if r["stage"] in (1, 2):  # only the updated (trainable) buckets are re-gathered
            assert r["all_gather_bytes"] == r["predicted_step_gather"]
        if r["stage"] == 3:  # the frozen base is still sharded and gathered for forward and backward ...
            assert r["all_gather_bytes"] >= 4 * r["frozen_numel"] // 2
            # ... and released after its unit's backward, though no gradient of it is awaited
            assert r["peak_gathered"] < r["model_numel"], (r["peak_gathered"], r["model_numel"])
        # no gradient buffer and no optimizer state for the frozen base
        assert r["bytes"]["grads"] <= 4 * r["trainable_numel"]
        assert r["bytes"]["optimizer"] <= 8 * r["trainable_numel"]


# ----------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """The base model: a random GPT-2 in Hugging Face's format that the runs start from
    (checkpoint.init_from_hf) and PEFT applies the adapters to."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=32,
                                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    path = str(tmp_path_factory.mktemp("hf"))
    transformers.GPT2LMHeadModel(config).save_pretrained(path, safe_serialization=True)
    return path


def _reference_runs(hf_dir: str) -> dict:
    return {"plain": _losses(["--checkpoint.init_from_hf", hf_dir], 10),
            "dropout": _losses(COLUMN_DROPOUT + ["--train.global_batch_size", "4"], 4)}


@pytest.fixture(scope="module")
def reference(hf_dir) -> dict:
    """Single-process runs: from hf_dir (10 iterations), and with adapter dropout."""
    [runs] = run_distributed(_reference_runs, 1, hf_dir)
    return runs


ROWS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def _parallel_then_resume(hf_dir: str, save: str, iters: int, half: int) -> dict:
    """tp 2 x dp 2 at ZeRO-3: train `iters` saving after `half` (with the logits of the saved
    model); resume that checkpoint in the same layout and in another (dp 4, ZeRO-1)."""
    t = make_trainer(ARGS + TP2_DP2_Z3 + ["--train.iters", str(iters), "--checkpoint.save", save,
                                          "--checkpoint.init_from_hf", hf_dir,
                                          "--checkpoint.save_model_16bit", "true"])
    out = {"straight": []}
    for i in range(iters):
        out["straight"].append(t.train_step()["loss"])
        if i + 1 == half:
            t.checkpoints.save(t.iteration, last=False)
            out["logits"] = full_logits(t, ROWS)
    for name, layout in [("resumed", TP2_DP2_Z3), ("resharded", ["--zero.stage", "1"])]:
        t = make_trainer(ARGS + layout + ["--train.iters", str(iters), "--checkpoint.load", save])
        out[name] = [t.train_step()["loss"] for _ in range(iters - half)]
    return out


@pytest.fixture(scope="module")
def trained(hf_dir, tmp_path_factory) -> tuple[str, list[dict]]:
    save = str(tmp_path_factory.mktemp("lora") / "save")
    return save, run_distributed(_parallel_then_resume, 4, hf_dir, save, 5, 3)


def test_tp2_dp2_zero3_equals_single_process_and_resumes(reference, trained):
    _, per_rank = trained
    for r in per_rank:
        if r["straight"][0] is None:
            continue
        first_5 = reference["plain"][:5]  # the 5 iterations of these runs, of the reference's 10
        assert max(abs(a - b) for a, b in zip(r["straight"], first_5, strict=True)) <= 1e-5, (r["straight"], reference)
        assert r["resumed"] == r["straight"][3:]  # bitwise
    resharded = [r["resharded"] for r in per_rank if r["resharded"][0] is not None]
    assert resharded and max(abs(a - b) for a, b in zip(resharded[0], reference["plain"][3:5], strict=True)) <= 1e-5


@pytest.mark.slow
def test_tp2_pp2_dp2_zero3_equals_single_process_over_10_iterations(hf_dir, reference):
    args = TP2_DP2_Z3 + ["--parallel.pp", "2", "--checkpoint.init_from_hf", hf_dir]
    for losses in _held(run_distributed(_losses, 8, args, 10)):
        assert max(abs(a - b) for a, b in zip(losses, reference["plain"], strict=True)) <= 1e-5, (losses, reference)


# ----------------------------------------------------------------------------- PEFT and --merge-lora


def _adapter_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    """The saved adapter files, checked: PEFT's config, names and shapes, and every tensor
    whole and changed by training (the DeepSpeed + PEFT empty-adapter bug must not happen)."""
    from safetensors.torch import load_file
    adapter = os.path.join(ckpt, "adapter")
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["fan_in_fan_out"] is True
    assert config["target_modules"] == ["c_attn", "c_proj", "c_fc"] and config["task_type"] == "CAUSAL_LM"
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert len(tensors) == 2 * 4 * 2  # 2 layers x (c_attn, attn.c_proj, c_fc, mlp.c_proj) x (A, B)
    for name, t in tensors.items():
        assert name.startswith("base_model.model.transformer.h.") and t.numel() > 0, name
        assert t.abs().sum() > 0, f"{name} is all zeros after training"
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (192, 4)
    assert tensors["base_model.model.transformer.h.0.mlp.c_proj.lora_A.weight"].shape == (4, 256)
    return tensors


def _peft_logits(base: str, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(base model's logits, with PEFT's adapters) of ROWS."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    with torch.no_grad():
        plain = transformers.GPT2LMHeadModel.from_pretrained(base).eval()
        unadapted = plain(ROWS).logits
        return unadapted, peft.PeftModel.from_pretrained(plain, adapter).eval()(ROWS).logits


def test_adapters_load_in_peft_and_merge(hf_dir, trained, tmp_path, capsys):
    """Saved at ZeRO-3 over tp 2 x dp 2: PEFT on the base model gives megazero's logits, and so
    does the --merge-lora export."""
    transformers = pytest.importorskip("transformers")
    from megazero.convert import main as convert
    save, per_rank = trained
    ckpt = os.path.join(save, "iter_0000003")
    _adapter_tensors(ckpt)
    expected = per_rank[0]["logits"]  # megazero's own, at tp 2 x dp 2, ZeRO-3
    unadapted, got = _peft_logits(hf_dir, os.path.join(ckpt, "adapter"))  # the frozen base is hf_dir itself
    assert (unadapted - expected).abs().max() > 1e-3  # the adapters matter
    assert (got - expected).abs().max() <= 1e-4
    merged = str(tmp_path / "merged")
    capsys.readouterr()
    convert(["--load", ckpt, "--to", "hf", "--output", merged, "--merge-lora"])
    assert capsys.readouterr().out.strip().endswith(  # the merge says what it folded in
        f"to {merged}, LoRA adapters merged in (rank 4, alpha 8 (W + 2 B A) on 8 weights: attn.c_attn, "
        f"attn.c_proj, mlp.c_fc, mlp.c_proj of 2 blocks)")
    with torch.no_grad():
        folded = transformers.GPT2LMHeadModel.from_pretrained(merged).eval()(ROWS).logits
    assert (folded - expected).abs().max() <= 1e-4


@pytest.mark.slow
def test_peft_on_the_base_export(trained, tmp_path):
    """convert --to hf of a LoRA checkpoint exports the base model the adapters apply to."""
    from megazero.convert import main as convert
    save, per_rank = trained
    ckpt = os.path.join(save, "iter_0000003")
    base = str(tmp_path / "base")
    convert(["--load", ckpt, "--to", "hf", "--output", base])
    _, got = _peft_logits(base, os.path.join(ckpt, "adapter"))
    assert (got - per_rank[0]["logits"]).abs().max() <= 1e-4


def test_merge_lora_refusals_are_one_line(hf_dir, trained, capsys):
    from megazero.convert import main as convert
    save, _ = trained
    for args, message in [(["--load", hf_dir, "--to", "hf", "--merge-lora"], "holds no LoRA adapters; drop --merge-lora"),
                          (["--load", save, "--to", "universal", "--merge-lora"],
                           "--merge-lora applies to --to torch or hf")]:
        with pytest.raises(SystemExit):
            convert(args + ["--output", os.path.join(save, "never")])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not os.path.exists(os.path.join(save, "never"))


def _resume_from(uni: str) -> list[float]:
    t = make_trainer(ARGS + ["--zero.stage", "2", "--train.iters", "5", "--checkpoint.load", uni])
    return [t.train_step()["loss"] for _ in range(2)]


@pytest.mark.slow
def test_universal_conversion_resumes_at_another_layout(trained, tmp_path):
    from megazero.convert import main as convert
    save, per_rank = trained
    uni = str(tmp_path / "uni")
    convert(["--load", os.path.join(save, "iter_0000003"), "--to", "universal", "--output", uni])
    straight = next(r["straight"] for r in per_rank if r["straight"][0] is not None)
    for losses in _held(run_distributed(_resume_from, 2, uni)):
        assert max(abs(a - b) for a, b in zip(losses, straight[3:], strict=True)) <= 1e-5, (losses, straight)


def test_a_resume_keeps_the_adapters(trained):
    """A LoRA checkpoint resumes only into a run with the same adapters (one line naming both)."""
    from megazero.checkpoint.sharded import CheckpointError, check_model, read_metadata
    save, _ = trained
    ckpt = os.path.join(save, "iter_0000003")
    meta = read_metadata(ckpt)
    check_model(meta, make_config(ARGS), ckpt)
    with pytest.raises(CheckpointError, match=r"saved with LoRA \{'lora_rank': 4, 'lora_targets': \['c_attn', "
                                              r"'c_proj', 'c_fc'\]\} but this run has \{'lora_rank': 0\}"):
        check_model(meta, make_config(ARGS + ["--finetune.lora_rank", "0"]), ckpt)


def test_partition_maps_saved_before_frozen_parameters_still_match():
    from megazero.config.sharding import DENSE
    from megazero.zero.partition import build_layout, with_trainable_flags
    named = [("a", torch.nn.Parameter(torch.zeros(100))), ("b", torch.nn.Parameter(torch.zeros(7, 3)))]
    today = build_layout([(0, named)], {DENSE.zero: (2, 0)}).param_map()
    old = {k: v for k, v in today.items() if k != "trainable_numel"}
    old["params"] = {n: {k: v for k, v in e.items() if k != "trainable"} for n, e in today["params"].items()}
    assert with_trainable_flags(old) == today


def _train_and_save(args: list[str], save: str, iters: int) -> None:
    t = make_trainer(ARGS + args + ["--train.iters", str(iters), "--checkpoint.save", save])
    for _ in range(iters):
        t.train_step()
    t.checkpoints.save(t.iteration, last=False)


@pytest.mark.slow
def test_adapters_saved_over_pipeline_stages_are_whole(hf_dir, trained, tmp_path):
    """tp 2 x pp 2 at ZeRO-3: each stage's adapters reach the one file, equal to the tp 2 x dp 2 run's."""
    save, _ = trained
    other = str(tmp_path / "save")
    run_distributed(_train_and_save, 4, TP2_DP2_Z3 + ["--parallel.pp", "2", "--checkpoint.init_from_hf", hf_dir],
                    other, 3)
    mine, theirs = (_adapter_tensors(os.path.join(s, "iter_0000003")) for s in (other, save))
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.allclose(mine[name], theirs[name], atol=1e-5, rtol=1e-4), name


def test_the_16bit_model_of_a_lora_run_folds_its_adapters_in(trained):
    """model_16bit.safetensors carries the adapters; generate and convert fold them in."""
    from megazero.checkpoint.adapter import adapters_folded
    from megazero.checkpoint.load import open_checkpoint
    save, _ = trained
    ckpt = os.path.join(save, "iter_0000003")
    whole, sixteen = (dict(adapters_folded(open_checkpoint(p)).tensors())
                      for p in (ckpt, os.path.join(ckpt, "model_16bit.safetensors")))
    assert whole.keys() == sixteen.keys() and not any(".lora_" in n for n in whole)
    name = "transformer.h.1.mlp.c_fc.weight"
    assert torch.allclose(sixteen[name].float(), whole[name], atol=2e-3)
    base = dict(open_checkpoint(os.path.join(save, "iter_0000003")).tensors())[name]
    assert (whole[name] - base).abs().max() > 1e-3  # folded: not the base weight


@pytest.mark.slow  # suite budget
def test_lora_on_a_plain_checkpoint_names_a_fix_that_starts(tmp_path):
    """A LoRA run resuming a checkpoint saved without adapters is refused; the export and the
    start the line names, followed as written (HF_DIR filled in), start the LoRA run."""
    import math
    import re

    from megazero.checkpoint.sharded import CheckpointError, check_model, read_metadata
    from megazero.convert import main as convert
    plain, hf = str(tmp_path / "plain"), str(tmp_path / "hf")
    run_distributed(_train_and_save, 1, ["--finetune.lora_rank", "0"], plain, 1)
    ckpt = os.path.join(plain, "iter_0000001")
    with pytest.raises(CheckpointError) as refused:
        check_model(read_metadata(ckpt), make_config(ARGS + ["--checkpoint.load", plain]), ckpt)
    line = str(refused.value).replace("HF_DIR", hf)
    export = re.search(r"\(python -m megazero\.convert (.*?)\)", line)
    start = re.search(r"start from that: (.*)$", line)
    assert export and start, line
    convert(export.group(1).split())
    args = ARGS + ["--checkpoint.load", plain, "--train.iters", "1", "--model.vocab_size", "auto", *start.group(1).split()]
    assert math.isfinite(run_distributed(_first_loss, 1, args)[0])


def _first_loss(args: list[str]) -> float:
    return make_trainer(args).train_step()["loss"]
