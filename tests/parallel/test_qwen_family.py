"""Qwen's dense attention on the Llama family: QK-norm with a head size other than h / heads (Qwen3)
and biases on q, k, v alone (Qwen2). Every layout equals the single process (fp32, losses and
gradient norms within 1e-5); one process equals transformers' Qwen3ForCausalLM / Qwen2ForCausalLM
on the same weights, read by checkpoint.init_from_hf (each TP rank its rows of q | k | v), and
`convert --to hf` writes a directory transformers loads as the same class with the same logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import (
    assert_parity,
    full_logits,
    logged_by_layout,
    logged_losses,
    make_trainer,
    run_distributed,
    save_random_hf,
)

LLAMA = "configs/llama-tiny.yaml"  # 4 layers, h 64, 4 heads, 2 K/V groups, untied
ITERS = 4  # at 3 a q/k norm gradient left partial over TP already shows (1.3e-5 in the grad norm)
SHORT = ["--train.iters", str(ITERS), "--model.seq_length", "32", "--train.global_batch_size", "8",
         "--train.micro_batch_size", "2"]
# Qwen3: QK-norm, heads of 24 (q 96 wide beside h 64); Qwen2: q/k/v biases with model.bias false.
MODELS = {"qwen3": ["--model.qk_layernorm", "true", "--model.kv_channels", "24"],
          "qwen2": ["--model.qkv_bias", "true"]}
TP2, CP2 = ["--parallel.tp", "2"], ["--parallel.cp", "2"]
LAYOUTS = {
    "tp2": TP2,  # the q/k norm weights' gradients are partial over TP even without sequence parallelism
    "tp2-sp": TP2 + ["--parallel.sequence_parallel", "true"],
    "cp2-ring": CP2,
    "cp2-ulysses": CP2 + ["--parallel.cp_impl", "ulysses"],
    "pp2-1f1b": ["--parallel.pp", "2"],
}


def _records(extra: list[str]) -> list[tuple[float, float]]:
    return logged_losses(lambda: make_trainer(SHORT + extra, base=LLAMA))


def _layouts(layouts: dict[str, list[str]]) -> dict[str, list[tuple[float, float]]]:
    return logged_by_layout(_records, layouts)


# Suite budget: the default run keeps the layouts where the new pieces shard (tp, where the q/k
# norms' gradients are partial, and Ulysses, which moves heads of the new size); all under slow.
DEFAULT_LAYOUTS = ("tp2", "cp2-ulysses")


@pytest.mark.slow  # suite budget: test_qwen_from_and_to_hugging_face trains the family by default
@pytest.mark.parametrize("which", ["default", "all"])
def test_qwen_layouts_equal_the_single_process(which):
    """Qwen3 and Qwen2 style models at tp 2 (with and without sequence parallelism), cp 2 ring and
    Ulysses, pp 2: one 2-rank world runs them all."""
    layouts = {k: v for k, v in LAYOUTS.items() if which == "all" or k in DEFAULT_LAYOUTS}
    reference = run_distributed(_layouts, 1, MODELS)[0]
    runs = run_distributed(_layouts, 2, {f"{family}-{name}": flags + layout for family, flags in MODELS.items()
                                         for name, layout in layouts.items()})[0]
    for family in MODELS:
        assert_parity({k: v for k, v in runs.items() if k.startswith(family)}, reference[family], ITERS)
        assert reference[family][-1][0] < reference[family][0][0], reference[family]  # it trains


def test_a_resume_without_the_qwen_keys_is_refused_naming_the_key():
    """A Qwen3-style checkpoint does not resume as a model without QK-norm: one line naming the key."""
    import dataclasses

    from megazero.checkpoint.meta import model_mismatch
    from megazero.config import build_config
    saved = build_config({"data": {"mock": True}}, MODELS["qwen3"])
    why = model_mismatch({"model": dataclasses.asdict(saved.model)}, build_config({}), "CK")
    assert why is not None and why.startswith("checkpoint 'CK' holds a model with model.qk_layernorm = True, but "
                                              "this run has False"), why


# ----------------------------------------------------------------------------- Hugging Face in and out

transformers = pytest.importorskip("transformers")

HF = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
          tie_word_embeddings=False)
FAMILIES = {"qwen3": ("Qwen3ForCausalLM", dict(head_dim=24)), "qwen2": ("Qwen2ForCausalLM", {})}
ARGS = ["--model.seq_length", "32", "--data.mock", "true", "--train.global_batch_size", "4",
        "--train.micro_batch_size", "2", "--train.iters", "1"]
ROWS = torch.randint(0, HF["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


def _imported_logits(hf_dirs: dict[str, str], layout: list[str], save: str) -> dict[str, torch.Tensor]:
    """For each family: the logits of ROWS of a run started from its directory at `layout`, saved
    (iteration 0) under `save`/family."""
    out = {}
    for family, hf_dir in hf_dirs.items():
        t = make_trainer(ARGS + layout + ["--checkpoint.init_from_hf", hf_dir, "--checkpoint.save",
                                          os.path.join(save, family)], base={"data": {"mock": True}})
        t.checkpoints.save(t.iteration, last=False)
        out[family] = full_logits(t, ROWS)
    return out


def test_qwen_from_and_to_hugging_face(tmp_path):
    """Random Qwen3 (QK-norm, head_dim 24 beside h / heads 16, grouped K/V) and Qwen2 (q/k/v biases)
    directories: init_from_hf at one process and at tp 2 gives transformers' logits (1e-5); the tp 2
    save exported with convert --to hf loads as the same class with the same logits."""
    from megazero.convert import main as convert
    hf_dirs = {family: save_random_hf(tmp_path / family, family, **HF, **extra)
               for family, (_, extra) in FAMILIES.items()}
    one = run_distributed(_imported_logits, 1, hf_dirs, [], str(tmp_path / "one"))[0]
    tp2 = run_distributed(_imported_logits, 2, hf_dirs, TP2, str(tmp_path / "tp2"))[0]
    for family, (name, extra) in FAMILIES.items():
        with torch.no_grad():
            hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[family], dtype=torch.float32).eval()
            expected = hf(ROWS).logits
        assert (one[family] - expected).abs().max() <= 1e-5, family
        assert (tp2[family] - expected).abs().max() <= 1e-5, family
        export = str(tmp_path / f"{family}-export")
        convert(["--load", str(tmp_path / "tp2" / family / "iter_0000000"), "--to", "hf", "--output", export])
        config = json.load(open(os.path.join(export, "config.json")))
        assert (config["architectures"], config["model_type"], config["head_dim"]) == (
            [name], family, extra.get("head_dim", 16))
        with torch.no_grad():
            back = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
            assert type(back).__name__ == name
            assert (back(ROWS).logits - expected).abs().max() <= 1e-5, family
