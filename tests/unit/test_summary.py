"""The start-up lines that say what runs (issue 46, 6): the banner names the model family from
its keys (it said GPT-2 for every model), and one line names the optimizer and its LRs."""

from __future__ import annotations

import torch

from helpers import make_config
from megazero.model.gpt import GPT
from megazero.train.summary import architecture, family, optim_line
from megazero.zero.muon import is_muon_matrix

LLAMA = ["--model.normalization", "rmsnorm", "--model.position_embedding", "rope", "--model.activation", "swiglu",
         "--model.num_query_groups", "2", "--model.tie_embeddings", "false", "--model.bias", "false"]


def test_the_banner_names_the_family_from_the_model_keys():
    gpt2, llama = make_config([]).model, make_config(LLAMA).model
    assert (family(gpt2), architecture(gpt2)) == ("GPT-2", "layernorm, learned positions, gelu, 4 heads, tied")
    assert (family(llama), architecture(llama)) == (
        "Llama-style GPT", "rmsnorm, rope, swiglu, 4 heads / 2 KV groups, untied, no biases")
    mixed = make_config(["--model.position_embedding", "rope", "--model.num_query_groups", "1"]).model
    assert (family(mixed), architecture(mixed)) == ("GPT", "layernorm, rope, gelu, 4 heads / 1 KV group, tied")


def test_one_line_names_the_optimizer_and_its_lrs():
    assert optim_line(make_config(["--optim.lr", "3e-3"])).startswith(
        "optim: adamw lr 0.003 (betas 0.9, 0.95, eps 1e-08, weight decay 0.1); warm-up")
    assert optim_line(make_config(["--optim.name", "sgd", "--optim.lr", "0.01", "--optim.clip_grad", "0"])) == (
        "optim: sgd lr 0.01 momentum 0.9, weight decay 0.1 (L2); warm-up 5 iterations, cosine decay to 0.0001, "
        "no clipping")
    cfg = make_config(["--optim.name", "muon", "--optim.lr", "3e-3", "--data.mock", "true", *LLAMA], world=1)
    with torch.device("meta"):
        matrices = sum(is_muon_matrix(name) for name, _ in GPT(cfg.model, None).named_parameters())
    assert matrices == 4 * cfg.model.num_layers
    assert optim_line(cfg).startswith(f"optim: muon 0.02 on {matrices} matrices + adamw 0.003 on the rest (betas")
