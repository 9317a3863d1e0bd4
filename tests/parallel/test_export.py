"""Checkpoint interoperability: consolidation equals the live model, HF export, resharded
resume at other layouts, greedy generation across layouts, bounded conversion memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, make_trainer, read_jsonl, run_distributed, torchrun
from megazero.config import ModelConfig
from megazero.convert import main as convert_main
from megazero.model.gpt import GPT
from megazero.parallel.comm import Group

ROOT = str(REPO)
SOLO = Group("solo", None, [0], 0)
SHORT = ["--data.mock", "true", "--train.iters", "3"]  # gpt2-tiny on mock data, 3 steps
TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(11))


def _train_then_logits(save_dir: str, overrides: list[str]) -> torch.Tensor:
    """Train a few steps at a layout, save, and return the live model's full logits."""
    from megazero.parallel.comm import gather_from_tp
    trainer = make_trainer(SHORT + ["--checkpoint.save", save_dir] + overrides)
    trainer.run()
    chunk = trainer.chunks[0].eval()
    with torch.no_grad():
        logits = gather_from_tp(chunk(TOKENS), trainer.grid.tp_group)
    return logits[..., :512].float()


def _plain_model(path: str) -> GPT:
    with open(path + ".config.json") as f:
        m = ModelConfig(**json.load(f)["model"])
    model = GPT(m)
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return model.eval()


@pytest.mark.parametrize("layout", [["--parallel.tp", "2", "--zero.stage", "1"],
                                    pytest.param(["--zero.stage", "3"], marks=pytest.mark.slow)],  # suite budget
                         ids=["tp2_dp2_zero1", "dp4_zero3"])
def test_consolidated_and_hf_exports_equal_live_model(tmp_path, layout):
    save = str(tmp_path / "ckpt")
    live = run_distributed(_train_then_logits, 4, save, layout)[0]
    out = str(tmp_path / "model.pt")
    convert_main(["--load", save, "--to", "torch", "--output", out])
    with torch.no_grad():
        plain = _plain_model(out)(TOKENS)[..., :512]
    assert (plain - live).abs().max() <= 1e-5
    transformers = pytest.importorskip("transformers")
    convert_main(["--load", save, "--to", "hf", "--output", str(tmp_path / "hf")])
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        assert (hf(TOKENS).logits - live).abs().max() <= 1e-4


def test_gathered_16bit_save_at_zero3_with_pipeline(tmp_path):
    """tp2 x pp2 x dp2 ZeRO-3: the 16-bit model is gathered from shards, written by rank 0."""
    from safetensors.torch import load_file
    save = str(tmp_path / "ckpt")
    _losses(tmp_path, "z3", 8, ["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "3", "--train.iters", "2",
                                "--checkpoint.save", save, "--checkpoint.save_model_16bit", "true"])
    gathered = load_file(os.path.join(save, "iter_0000002", "model_16bit.safetensors"))
    convert_main(["--load", save, "--to", "torch", "--output", str(tmp_path / "m.pt"), "--dtype", "bf16"])
    consolidated = torch.load(str(tmp_path / "m.pt"), weights_only=True)
    assert gathered.keys() == consolidated.keys()
    for name, t in gathered.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, consolidated[name]), name
    assert all(t.abs().sum() > 0 for n, t in gathered.items() if n.endswith("weight"))  # no empty placeholders
    from megazero.checkpoint.load import open_checkpoint
    from megazero.generate import build_model
    ckpt = open_checkpoint(os.path.join(save, "iter_0000002", "model_16bit.safetensors"))
    assert ckpt.iteration == 2  # read from the metadata.json beside it
    build_model(ckpt, SOLO)


def _losses(tmp_path, name: str, nproc: int, extra: list[str]) -> list[float]:
    out = str(tmp_path / f"{name}.jsonl")
    proc = torchrun(nproc, ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--model.num_layers", "8",
                            "--logging.jsonl", out, *extra], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["loss"] for r in read_jsonl(out)]


SOURCE = ["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "1"]  # x dp 2: 8 ranks
TARGETS = {  # name: (processes, layout)
    "tp1_pp1_dp4_zero3": (4, ["--zero.stage", "3"]),
    "pp4_vpp2_zero0": (4, ["--parallel.pp", "4", "--parallel.vpp", "2"]),
    "tp2_pp1_dp2_zero2": (4, ["--parallel.tp", "2", "--zero.stage", "2"]),
    "tp4_pp2_dp1_zero0": (8, ["--parallel.tp", "4", "--parallel.pp", "2"]),
}


@pytest.fixture(scope="module")
def source_checkpoint(tmp_path_factory):
    """tp2 x pp2 x dp2 ZeRO-1 trained 4 steps and saved; a same-layout resume gives the reference."""
    tmp = tmp_path_factory.mktemp("src")
    save = str(tmp / "ckpt")
    _losses(tmp, "first", 8, SOURCE + ["--train.iters", "4", "--checkpoint.save", save])
    reference = _losses(tmp, "same", 8, SOURCE + ["--train.iters", "6", "--checkpoint.load", save])
    return save, reference


# Slow (suite budget): by default the universal export below resumes at another layout, and
# test_llama_family and test_checkpoint reshard at load.
@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_at_another_layout(tmp_path, source_checkpoint, target):
    save, reference = source_checkpoint
    nproc, layout = TARGETS[target]
    losses = _losses(tmp_path, target, nproc, layout + ["--train.iters", "6", "--checkpoint.load", save])
    assert len(losses) == 2 and max(abs(a - b) for a, b in zip(losses, reference, strict=True)) <= 1e-4


def test_resume_from_universal_export(tmp_path, source_checkpoint):
    save, reference = source_checkpoint
    universal = str(tmp_path / "universal")
    convert_main(["--load", save, "--to", "universal", "--output", universal])
    assert sorted(os.listdir(universal)) == ["exp_avg.safetensors", "exp_avg_sq.safetensors", "master.safetensors",
                                             "universal.json"]
    losses = _losses(tmp_path, "uni", 2, ["--zero.stage", "2", "--train.iters", "6", "--checkpoint.load", universal])
    assert len(losses) == 2
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) <= 1e-4


def test_reshard_to_impossible_layout_is_refused(tmp_path, source_checkpoint):
    save, _ = source_checkpoint
    proc = torchrun(3, ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--model.num_layers", "8",
                        "--parallel.tp", "3", "--checkpoint.load", save], cwd=ROOT)
    assert proc.returncode != 0 and proc.stderr.count("model.num_heads (4) must be divisible by parallel.tp (3)") == 1


def _greedy(path: str) -> list[int]:
    from megazero.checkpoint.load import open_checkpoint
    from megazero.generate import build_model, generate_batch
    from megazero.parallel.grid import ProcessGrid
    grid = ProcessGrid.create(tp=int(os.environ["WORLD_SIZE"]), pp=1)
    model = build_model(open_checkpoint(path), grid.tp_group)
    return generate_batch(model, [[5, 17, 33, 2]], max_new_tokens=12, temperature=0.0)[0]


@pytest.mark.slow  # suite budget: generation is checked against transformers by default (test_generate_*)
def test_greedy_generation_equal_across_layouts(tmp_path, source_checkpoint):
    save, _ = source_checkpoint
    out = str(tmp_path / "model.pt")
    convert_main(["--load", save, "--to", "torch", "--output", out])
    single = run_distributed(_greedy, 1, out)[0]
    tp4_from_checkpoint = run_distributed(_greedy, 4, save)  # saved at tp2 x pp2 x dp2
    assert len(single) == 16
    assert all(ids == single for ids in tp4_from_checkpoint)


@pytest.mark.slow  # suite budget
def test_sampling_is_deterministic_for_a_seed(tmp_path, source_checkpoint):
    from megazero.checkpoint.load import open_checkpoint
    from megazero.generate import build_model, generate_batch
    save, _ = source_checkpoint
    model = build_model(open_checkpoint(save), SOLO)
    runs = [generate_batch(model, [[1, 2, 3]], 20, temperature=1.0, top_k=50, top_p=0.9, seed=s)[0] for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


MEASURE = """
import resource, sys
from megazero.convert import main
if sys.argv[1] != "baseline":
    main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _save_big_checkpoint(save_dir: str) -> None:
    make_trainer(SHORT + ["--checkpoint.save", save_dir, "--model.hidden_size", "512", "--model.num_layers", "8",
                          "--model.vocab_size", "8192", "--model.num_heads", "8", "--train.global_batch_size", "2",
                          "--train.micro_batch_size", "1", "--train.iters", "1", "--zero.stage", "1"]).run()


@pytest.mark.slow  # a 117 MB checkpoint and three interpreters (suite budget)
def test_conversion_memory_stays_near_one_parameter(tmp_path):
    save = str(tmp_path / "big")
    run_distributed(_save_big_checkpoint, 2, save)

    def peak(args: list[str]) -> int:
        proc = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.strip().splitlines()[-1])

    baseline = peak(["baseline"])
    model_bytes = 4 * (8 * 12 * 512 * 512 + 8192 * 512)  # fp32 weights, about 117 MB
    for to, out in [("torch", "m.pt"), ("universal", "uni")]:
        extra = peak(["--load", save, "--to", to, "--output", str(tmp_path / out)]) - baseline
        assert extra < model_bytes / 3, f"--to {to} used {extra / 2**20:.0f} MiB over baseline"
