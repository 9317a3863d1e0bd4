"""A Hugging Face GPT-2 config.json read as megazero's model section: torch-free, so
checkpoint.init_from_hf is checked before torch loads (hf.py reads the weights)."""

from __future__ import annotations

import json
import os

from megazero.config.resolve import tokenizer_size
from megazero.config.schema import Config, ConfigError, ModelConfig


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The megazero model section equivalent to a GPT2Config dict."""
    inner = hf.get("n_inner") or 0
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"model_type '{hf.get('model_type')}' is not gpt2; only GPT-2 checkpoints can be imported")
    return ModelConfig(num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_heads=hf["n_head"],
                       seq_length=hf["n_positions"], vocab_size=hf["vocab_size"],
                       ffn_hidden_size=0 if inner == 4 * hf["n_embd"] else inner, layernorm_eps=hf.get("layer_norm_epsilon", 1e-5),
                       init_std=hf.get("initializer_range", 0.02), dropout=0.0)


def resolve_init_from_hf(cfg: Config) -> None:
    """Resolve against checkpoint.init_from_hf: a GPT-2 directory whose config.json the model section
    matches (refused otherwise); model.vocab_size auto becomes its vocabulary size."""
    d, m = cfg.checkpoint.init_from_hf, cfg.model
    assert d is not None
    path = os.path.join(d, "config.json")
    if not os.path.isfile(path) or not any(os.path.isfile(os.path.join(d, n))
                                           for n in ("model.safetensors", "pytorch_model.bin")):
        raise ConfigError(f"checkpoint.init_from_hf {d} is not a Hugging Face model directory (config.json with "
                          f"model.safetensors or pytorch_model.bin); save one with save_pretrained() or "
                          f"python -m megazero.convert --to hf")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint.init_from_hf: cannot read {path} ({e})") from e
    if hf.get("model_type") != "gpt2":
        raise ConfigError(f"checkpoint.init_from_hf {d} holds a '{hf.get('model_type')}' model; only GPT-2 "
                          f"(model_type gpt2) weights can start a megazero run")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"checkpoint.init_from_hf {d} uses activation {hf['activation_function']}; megazero's "
                          f"GPT-2 uses the tanh GELU (gelu_new)")
    theirs = model_config_from_hf(hf)
    assert isinstance(theirs.vocab_size, int)
    if cfg.data.tokenizer and tokenizer_size(cfg.data.tokenizer) > theirs.vocab_size:
        raise ConfigError(f"data.tokenizer {cfg.data.tokenizer!r} has {tokenizer_size(cfg.data.tokenizer)} tokens but "
                          f"the GPT-2 in {d} only {theirs.vocab_size}; use the tokenizer that model was trained with")
    if m.vocab_size == "auto":
        m.vocab_size = theirs.vocab_size
    for key, hf_key in [("num_layers", "n_layer"), ("hidden_size", "n_embd"), ("num_heads", "n_head"),
                        ("vocab_size", "vocab_size"), ("layernorm_eps", "layer_norm_epsilon")]:
        if getattr(m, key) != getattr(theirs, key):
            raise ConfigError(f"model.{key} ({getattr(m, key)}) differs from {hf_key} ({getattr(theirs, key)}) in "
                              f"{path}; set --model.{key} {getattr(theirs, key)}")
    if m.ffn_size != theirs.ffn_size:
        raise ConfigError(f"the MLP width ({m.ffn_size}) differs from n_inner ({theirs.ffn_size}) in {path}; "
                          f"set --model.ffn_hidden_size {theirs.ffn_size}")
    if m.seq_length > theirs.seq_length:
        raise ConfigError(f"model.seq_length ({m.seq_length}) exceeds n_positions ({theirs.seq_length}) in {path}; "
                          f"set --model.seq_length {theirs.seq_length} or less")
