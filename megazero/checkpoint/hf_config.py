"""checkpoint.init_from_hf: a Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE or
OLMoE config.json resolved into the run's model section (hf_names.py reads it), torch-free, so it is
checked before torch loads (hf.py reads the weights)."""

from __future__ import annotations

import json
import os

from megazero.checkpoint.hf_names import hf_key, model_config_from_hf, set_by_hf, suggested_by_hf
from megazero.config.resolve import tokenizer_size
from megazero.config.schema import Config, ConfigError, ModelConfig
from megazero.data.tokenizer import spec_of_directory


def resolve_init_from_hf(cfg: Config) -> None:
    """Resolve against checkpoint.init_from_hf: a GPT-2, Llama, Qwen or mixture-of-experts directory
    whose config.json gives the model keys the run leaves unset and agrees with those it sets
    (refused otherwise, naming both values); model.vocab_size auto becomes its vocabulary size."""
    d, m = cfg.checkpoint.init_from_hf, cfg.model
    assert d is not None
    path = os.path.join(d, "config.json")
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    if not os.path.isfile(path) or not any(os.path.isfile(os.path.join(d, n)) for n in weights):
        raise ConfigError(f"checkpoint.init_from_hf {d} is not a Hugging Face model directory (config.json with "
                          f"model.safetensors, its index or pytorch_model.bin); save one with save_pretrained() or "
                          f"python -m megazero.convert --to hf")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint.init_from_hf: cannot read {path} ({e})") from e
    try:
        theirs = model_config_from_hf(hf)
    except KeyError as e:
        raise ConfigError(f"checkpoint.init_from_hf {d}: its config.json lacks {e} for its model_type "
                          f"{hf.get('model_type')!r}; save the model with save_pretrained()") from None
    except ValueError as e:
        raise ConfigError(f"checkpoint.init_from_hf {d}: {e}; only GPT-2, Llama, Qwen2, Qwen3, Mixtral, "
                          f"Qwen2-MoE, Qwen3-MoE and OLMoE weights of these shapes can start a megazero run") from None
    if hf.get("model_type") == "gpt2" and hf.get("activation_function", "gelu_new") not in ("gelu_new",
                                                                                          "gelu_pytorch_tanh"):
        raise ConfigError(f"checkpoint.init_from_hf {d} uses activation {hf['activation_function']}; megazero's "
                          f"GPT-2 uses the tanh GELU (gelu_new)")
    assert isinstance(theirs.vocab_size, int)
    if cfg.data.tokenizer and tokenizer_size(cfg.data.tokenizer) > theirs.vocab_size:
        own = spec_of_directory(d)  # the tokenizer files beside the weights, when the directory has them
        fix = f": --data.tokenizer {own}" if own else " (its tokenizer files, e.g. --data.tokenizer hf:DIR)"
        raise ConfigError(f"data.tokenizer {cfg.data.tokenizer!r} has {tokenizer_size(cfg.data.tokenizer)} tokens but "
                          f"the model in {d} only {theirs.vocab_size}; use the tokenizer that model was trained "
                          f"with{fix}")
    _take_model_keys(cfg, theirs, path, hf.get("model_type", ""))
    if m.position_embedding == "learned" and m.seq_length > theirs.seq_length:
        raise ConfigError(f"model.seq_length ({m.seq_length}) exceeds n_positions ({theirs.seq_length}) in {path}; "
                          f"set --model.seq_length {theirs.seq_length} or less")


def _take_model_keys(cfg: Config, theirs: ModelConfig, path: str, model_type: str) -> None:
    """Model keys the run did not set come from config.json; the ones it set must agree, but for
    those it may choose (suggested_by_hf)."""
    m = cfg.model
    for key in suggested_by_hf(theirs):
        if f"model.{key}" not in cfg.set_keys:
            setattr(m, key, getattr(theirs, key))
    for key in set_by_hf(theirs):
        # 0 stands for a value derived from the other keys: compare the values themselves
        resolved = {"ffn_hidden_size": "ffn_size", "num_query_groups": "query_groups", "kv_channels": "head_dim",
                    "moe_ffn_hidden_size": "moe_ffn_size"}.get(key, key)
        mine, hf_value = getattr(m, resolved), getattr(theirs, resolved)
        if mine == hf_value:
            continue
        if f"model.{key}" not in cfg.set_keys or mine == "auto":
            setattr(m, key, getattr(theirs, key))
            continue
        raise ConfigError(f"model.{key} ({mine}) differs from {hf_key(key, model_type)} ({hf_value}) in {path}; "
                          f"set --model.{key} {getattr(theirs, key)} or leave it out to take the checkpoint's")
