"""checkpoint.init_from_hf: a run starts from Hugging Face GPT-2 weights at any layout, each
rank reading only its slices; its first loss is transformers' loss on the same batch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, make_config, make_trainer, run_distributed, save_random_hf
from megazero.checkpoint.sharded import CheckpointError
from megazero.config import ConfigError

transformers = pytest.importorskip("transformers")

HF = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=48)  # 300: padding rows at any tp
ARGS = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.seq_length",
        "32", "--model.vocab_size", "auto", "--model.dropout", "0", "--data.mock", "true",
        "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--zero.sub_group_size", "5000"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random GPT-2 with non-trivial LayerNorms and biases, saved as safetensors."""
    return save_random_hf(tmp_path_factory.mktemp("hf"), **HF)


def _transformers_loss(hf_dir: str) -> float:
    """transformers' mean next-token loss on megazero's first global batch (mock data)."""
    from megazero.data.mock import MockGPTDataset
    cfg = make_config(ARGS, world=1)
    ds = MockGPTDataset(8, 32, HF["vocab_size"], cfg.train.seed)
    rows = torch.stack([torch.as_tensor(ds[i]) for i in range(8)])
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return float(model(input_ids=rows, labels=rows).loss)


def _first_losses(hf_dir: str, layouts: list[list[str]]) -> list[float]:
    out = []
    for layout in layouts:
        out.append(make_trainer(ARGS + layout + ["--checkpoint.init_from_hf", hf_dir]).train_step()["loss"])
    return out


def test_first_loss_equals_transformers_at_tp2_pp2_zero3(hf_dir):
    expected = _transformers_loss(hf_dir)
    layout = ["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "3"]  # dp 2 as well: the slow test
    empty = os.path.join(hf_dir, "empty-save-dir")
    os.makedirs(empty, exist_ok=True)
    # A checkpoint.load without a checkpoint in it yet is a fresh start: from the HF weights.
    layouts = [layout, layout + ["--checkpoint.load", empty]]
    per_layout = list(zip(*run_distributed(_first_losses, 4, hf_dir, layouts), strict=True))
    for losses in per_layout:  # None on ranks that do not hold the loss (earlier pipeline stages)
        held = [loss for loss in losses if loss is not None]
        assert held and all(abs(loss - expected) <= 1e-4 for loss in held), (losses, expected)


@pytest.mark.slow
def test_first_loss_equals_transformers_at_tp2_pp2_dp2_zero3(hf_dir):
    expected = _transformers_loss(hf_dir)
    layout = ["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "3"]
    held = [losses[0] for losses in run_distributed(_first_losses, 8, hf_dir, [layout]) if losses[0] is not None]
    assert held and all(abs(loss - expected) <= 1e-4 for loss in held), (held, expected)


def test_single_process_reads_pytorch_model_bin_too(hf_dir, tmp_path):
    """weights_only loading of pytorch_model.bin, the older HF format."""
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(open(os.path.join(hf_dir, "config.json")).read())
    expected = _transformers_loss(hf_dir)
    [losses] = run_distributed(_first_losses, 1, str(tmp_path), [[]])
    assert abs(losses[0] - expected) <= 1e-4


def test_the_start_up_says_the_run_starts_from_the_hf_weights(hf_dir):
    """Issue 46, 6: a run from checkpoint.init_from_hf says so, with the architecture and the
    number of tensors read from (it said nothing of where its weights came from)."""
    from safetensors import safe_open
    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
        tensors = [k for k in f.keys() if not k.endswith((".attn.bias", ".attn.masked_bias"))]  # buffers
    proc = subprocess.run([sys.executable, "-m", "megazero.train", *ARGS, "--train.iters", "1",
                           "--checkpoint.init_from_hf", hf_dir], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"initialized from Hugging Face {hf_dir} (GPT2LMHeadModel, {len(tensors)} tensors)\n" in proc.stdout


def _edited(hf_dir: str, tmp_path, **changes) -> str:
    """A copy of hf_dir whose config.json has `changes` (the weights stay as they are)."""
    hf = json.load(open(os.path.join(hf_dir, "config.json")))
    hf.update(changes)
    tmp_path.mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    os.symlink(os.path.join(hf_dir, "model.safetensors"), tmp_path / "model.safetensors")
    return str(tmp_path)


def test_bad_input_is_one_clear_line(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"model_type 'mistral' is none of gpt2, llama, qwen2, qwen3, mixtral, qwen2_moe"):
        make_config(ARGS + ["--checkpoint.init_from_hf", _edited(hf_dir, tmp_path / "a", model_type="mistral")],
                    world=1)
    with pytest.raises(ConfigError, match=r"config.json lacks 'num_attention_heads'"):  # llama keys missing
        make_config(ARGS + ["--checkpoint.init_from_hf", _edited(hf_dir, tmp_path / "a2", model_type="llama")], world=1)
    with pytest.raises(ConfigError, match=r"model.hidden_size \(64\) differs from n_embd \(128\) .* set "
                                          r"--model.hidden_size 128"):
        make_config(ARGS + ["--checkpoint.init_from_hf", _edited(hf_dir, tmp_path / "b", n_embd=128)], world=1)
    with pytest.raises(ConfigError, match=r"is not a Hugging Face model directory"):
        make_config(ARGS + ["--checkpoint.init_from_hf", str(tmp_path)], world=1)
    with pytest.raises(ConfigError, match=r"model.vocab_size \(500\) differs from vocab_size \(300\)"):
        make_config(ARGS + ["--checkpoint.init_from_hf", hf_dir, "--model.vocab_size", "500"], world=1)
    # config.json agrees with the model section but the weights do not: refused when read
    from megazero.checkpoint.hf import HFInitialValues
    from megazero.model.gpt import GPT
    cfg = make_config(ARGS + ["--checkpoint.init_from_hf", _edited(hf_dir, tmp_path / "c", n_inner=512),
                              "--model.ffn_hidden_size", "512"], world=1)
    model = GPT(cfg.model)
    fc = model.get_parameter("transformer.h.0.mlp.c_fc.weight")
    with pytest.raises(CheckpointError, match=r"'transformer.h.0.mlp.c_fc.weight' has shape \[64, 256\], but the model "
                                              r"config needs \[64, 512\]"):
        HFInitialValues(cfg.checkpoint.init_from_hf, cfg.model).value("transformer.h.0.mlp.c_fc.weight", fc, 0, 1)


def test_a_tokenizer_larger_than_the_checkpoint_vocabulary_is_refused(hf_dir, tmp_path):
    from megazero.data.tokenizer import build_tokenizer, train_gpt2bpe
    spec = train_gpt2bpe(["the list of words and the words of the list"] * 20, 300, tmp_path / "tok")
    tokens = build_tokenizer(spec).vocab_size
    small = _edited(hf_dir, tmp_path / "hf", vocab_size=tokens - 1)
    with pytest.raises(ConfigError, match=rf"has {tokens} tokens but the model in .* only {tokens - 1}; use the "
                                          rf"tokenizer that model was trained with \(its tokenizer files"):
        make_config(ARGS + ["--checkpoint.init_from_hf", small, "--data.tokenizer", spec], world=1)


def _one_step(args: list[str]) -> float:
    return make_trainer(args).train_step()["loss"]


def test_a_directory_with_its_tokenizer_names_it_and_that_fix_starts(hf_dir, tmp_path, bpe_spec):
    """The refusal of a tokenizer larger than the model names the directory's own tokenizer;
    the run given that --data.tokenizer starts (issue 46, 3)."""
    import re
    import shutil

    from megazero.data.tokenizer import train_gpt2bpe
    with_tokenizer = _edited(hf_dir, tmp_path / "hf")
    own = train_gpt2bpe(["the list of words and the words of the list"] * 20, 280, tmp_path / "own")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(os.path.join(own.partition(":")[2], name), with_tokenizer)
    big = bpe_spec  # 400 ids, over the model's 300
    args = ARGS + ["--checkpoint.init_from_hf", with_tokenizer, "--train.iters", "1"]
    with pytest.raises(ConfigError) as refused:
        make_config(args + ["--data.tokenizer", big], world=1)
    fix = re.search(r"(--data\.tokenizer) (\S+)$", str(refused.value))
    assert fix and fix.groups() == ("--data.tokenizer", f"gpt2bpe:{with_tokenizer}"), str(refused.value)
    loss = run_distributed(_one_step, 1, args + ["--data.tokenizer", big, *fix.groups()])[0]
    assert math.isfinite(loss)  # the run started and took its first step
