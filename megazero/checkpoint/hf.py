"""Hugging Face GPT-2 interchange: config.json and tensor mapping, both directions.

megazero's parameter names are GPT2LMHeadModel's; only storage differs: the four
projections (c_attn, attn.c_proj, c_fc, mlp.c_proj) are nn.Linear-shaped [out, in] here
and Conv1D-shaped [in, out] in HF, and megazero's token embedding has zero rows padding
the vocabulary (to a multiple of 128 x tp) that HF does not have.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from megazero.config import ModelConfig

if TYPE_CHECKING:
    from megazero.data.tokenizer import Tokenizer

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
TIED_HEAD = "lm_head.weight"


def hf_config(m: ModelConfig, eos_token_id: int | None = None) -> dict:
    """GPT2Config fields for a megazero model."""
    eos = m.vocab_size - 1 if eos_token_id is None else eos_token_id
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": m.vocab_size, "n_positions": m.seq_length, "n_ctx": m.seq_length,
        "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_heads,
        "n_inner": m.ffn_size, "activation_function": "gelu_new",
        "layer_norm_epsilon": m.layernorm_eps, "initializer_range": m.init_std,
        "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
        "tie_word_embeddings": True, "bos_token_id": eos, "eos_token_id": eos,
    }


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The megazero model section equivalent to a GPT2Config dict."""
    inner = hf.get("n_inner") or 0
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"model_type '{hf.get('model_type')}' is not gpt2; only GPT-2 checkpoints can be imported")
    return ModelConfig(num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_heads=hf["n_head"],
                       seq_length=hf["n_positions"], vocab_size=hf["vocab_size"],
                       ffn_hidden_size=0 if inner == 4 * hf["n_embd"] else inner, layernorm_eps=hf.get("layer_norm_epsilon", 1e-5),
                       init_std=hf.get("initializer_range", 0.02), dropout=0.0)


def to_hf(name: str, full: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """A full (unsharded) megazero tensor as HF stores it."""
    if name.endswith(CONV1D_SUFFIXES):
        return full.t().contiguous()
    if name == "transformer.wte.weight":
        return full[: m.vocab_size].contiguous()
    return full


def from_hf(name: str, hf_tensor: torch.Tensor) -> torch.Tensor:
    """An HF tensor in megazero's storage layout (Conv1D weights transposed); the vocab
    padding rows are added by `fit_vocab` for the target tp."""
    return hf_tensor.t().contiguous() if name.endswith(CONV1D_SUFFIXES) else hf_tensor


def write_hf(output_dir: str, tensors: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]],
             m: ModelConfig, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None) -> None:
    """config.json + model.safetensors into `output_dir`, streamed one tensor at a time
    (`shapes`: megazero's full shapes, in the order `tensors` yields them)."""
    from megazero.checkpoint.export import save_safetensors_streaming

    os.makedirs(output_dir, exist_ok=True)
    hf_shapes = {name: hf_shape(name, shape, m) for name, shape in shapes.items() if name != TIED_HEAD}
    converted = ((name, to_hf(name, t, m)) for name, t in tensors if name != TIED_HEAD)
    save_safetensors_streaming(os.path.join(output_dir, "model.safetensors"), hf_shapes, dtype, converted,
                               metadata={"format": "pt"})
    tmp = os.path.join(output_dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(hf_config(m, eos_token_id), f, indent=2)
    os.replace(tmp, os.path.join(output_dir, "config.json"))


def hf_shape(name: str, shape: tuple[int, ...], m: ModelConfig) -> tuple[int, ...]:
    if name.endswith(CONV1D_SUFFIXES):
        return tuple(reversed(shape))
    if name == "transformer.wte.weight":
        return (m.vocab_size, shape[1])
    return tuple(shape)


def read_hf(hf_dir: str) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The model config of an HF GPT-2 directory and a lazy iterator over its tensors,
    with names normalised to GPT2LMHeadModel's (a bare GPT2Model has no 'transformer.')."""
    from safetensors import safe_open

    cfg_path, st_path = os.path.join(hf_dir, "config.json"), os.path.join(hf_dir, "model.safetensors")
    for path in (cfg_path, st_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"'{path}' not found: an HF GPT-2 directory needs config.json and model.safetensors")
    with open(cfg_path) as f:
        m = model_config_from_hf(json.load(f))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(st_path, framework="pt") as f:
            for key in f.keys():
                name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
                if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
                    continue  # old HF files store the causal mask as a buffer
                yield name, f.get_tensor(key)

    return m, tensors()


def write_hf_tokenizer(tokenizer: "Tokenizer", output_dir: str, model_max_length: int) -> None:
    """A megazero tokenizer, into an HF directory: megazero's own files (so megazero
    reads the directory back with the same tokenizer) and tokenizer.json +
    tokenizer_config.json (so `AutoTokenizer.from_pretrained` encodes the same ids)."""
    from megazero.atomic import write_bytes, write_text
    from megazero.data.hf_tokenizer import hf_tokenizer_files
    from megazero.data.tokenizer import SPM_MODEL_NAME

    names = ("vocab.json", "merges.txt") if tokenizer.kind == "gpt2bpe" else (SPM_MODEL_NAME,)
    for source, name in zip(tokenizer.files, names):
        with open(source, "rb") as f:
            write_bytes(os.path.join(output_dir, name), f.read())
    for name, text in hf_tokenizer_files(tokenizer, model_max_length).items():
        write_text(os.path.join(output_dir, name), text)
