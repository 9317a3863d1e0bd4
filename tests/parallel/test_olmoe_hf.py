"""OLMoE from and to Hugging Face (issue 45, 7): OlmoeForCausalLM's q_norm and k_norm normalise the
whole q and k projections (model.qk_layernorm_scope projection), not each head. A tiny random
OlmoeForCausalLM saved by transformers starts a run (checkpoint.init_from_hf) at dp 2 with
transformers' logits (1e-5); convert --to hf of one step loads as OlmoeForCausalLM with the
stepped model's logits (1e-5); tp > 1 (which would split the norm's width) is refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import full_logits, make_config, make_trainer, run_distributed, save_random_hf

transformers = pytest.importorskip("transformers")

OLMOE = dict(vocab_size=300, hidden_size=64, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=False, tie_word_embeddings=False, eos_token_id=299)
BASE: dict = {"data": {"mock": True}}  # no model keys: the run takes them from config.json
ARGS = ["--model.seq_length", "32", "--data.mock", "true", "--train.global_batch_size", "8",
        "--train.micro_batch_size", "2", "--train.iters", "1", "--optim.lr", "1e-2", "--model.moe_aux_loss_coeff",
        "0.1", "--model.moe_z_loss_coeff", "0.01", "--parallel.etp", "1"]
ROWS = torch.randint(0, OLMOE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory) -> str:
    return save_random_hf(tmp_path_factory.mktemp("hf-olmoe"), "olmoe", **OLMOE)


def _hf_logits(directory: str) -> torch.Tensor:
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        assert type(model).__name__ == "OlmoeForCausalLM"
        return model(ROWS).logits


def _start_step_save(hf_dir: str, save: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ROWS from hf_dir, and after one step (saved)."""
    t = make_trainer(ARGS + ["--checkpoint.init_from_hf", hf_dir, "--checkpoint.save", save, "--zero.stage", "1"],
                     base=BASE)
    start = full_logits(t, ROWS)
    t.train_step()
    t.checkpoints.save(t.iteration, last=False)
    return start, full_logits(t, ROWS)


def test_olmoe_keys_come_from_its_config(olmoe_dir):
    """Whole-projection q/k norms, softmax over every expert before the top k, experts of
    intermediate_size, every layer MoE; tp 2 refused in one line naming the fix."""
    from megazero.config import ConfigError
    hf_dir = olmoe_dir
    m = make_config(ARGS + ["--checkpoint.init_from_hf", hf_dir], base=BASE, world=1).model
    assert (m.qk_layernorm, m.qk_layernorm_scope, m.moe_router_pre_softmax, m.num_experts, m.moe_ffn_size,
            m.moe_router_topk, m.moe_layer_freq, m.query_groups) == (True, "projection", True, 4, 24, 2, 1, 2)
    with pytest.raises(ConfigError, match=r"model.qk_layernorm_scope projection normalises q and k over all heads, "
                                          r"which parallel.tp \(2\) splits; use --parallel.tp 1") as refused:
        make_config(ARGS + ["--checkpoint.init_from_hf", hf_dir, "--parallel.tp", "2"], base=BASE, world=2)
    assert "\n" not in str(refused.value)


def test_olmoe_comes_in_and_goes_out(olmoe_dir, tmp_path):
    from megazero.convert import main as convert
    save, export = str(tmp_path / "save"), str(tmp_path / "export")
    start, stepped = run_distributed(_start_step_save, 2, olmoe_dir, save)[0]
    assert (start - _hf_logits(olmoe_dir)).abs().max() <= 1e-5
    convert(["--load", save, "--to", "hf", "--output", export])
    config = json.load(open(os.path.join(export, "config.json")))
    assert (config["model_type"], config["intermediate_size"], config["num_experts"], config["norm_topk_prob"]) == (
        "olmoe", 24, 4, False)
    got = _hf_logits(export)
    assert (got - stepped).abs().max() <= 1e-5 and (stepped - start).abs().max() > 1e-3  # the step moved it
