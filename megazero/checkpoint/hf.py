"""Reading Hugging Face GPT-2 directories: whole (convert, generate), or each rank's TP shard
of one parameter at a time (checkpoint.init_from_hf). export.write_hf writes them.

megazero's parameter names are GPT2LMHeadModel's; only storage differs: the four
projections (c_attn, attn.c_proj, c_fc, mlp.c_proj) are nn.Linear-shaped [out, in] here
and Conv1D-shaped [in, out] in HF, and megazero's token embedding has zero rows padding
the vocabulary (to a multiple of 128 x tp) that HF does not have.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Optional

import torch
from safetensors import safe_open

from megazero.checkpoint.base import Checkpoint, CheckpointError, safetensors_metadata
from megazero.checkpoint.hf_config import model_config_from_hf
from megazero.checkpoint.tensors import plain_shapes, stream_safetensors
from megazero.config.schema import ModelConfig
from megazero.parallel.placement import Placement, placement

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
TIED_HEAD = "lm_head.weight"


def from_hf(name: str, hf_tensor: torch.Tensor) -> torch.Tensor:
    """An HF tensor in megazero's storage layout (Conv1D weights transposed); the vocab
    padding rows are added by `fit_vocab` for the target tp."""
    return hf_tensor.t().contiguous() if name.endswith(CONV1D_SUFFIXES) else hf_tensor


def read_hf(hf_dir: str) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The model config of an HF GPT-2 directory and a lazy iterator over its tensors,
    with names normalised to GPT2LMHeadModel's (a bare GPT2Model has no 'transformer.')."""
    cfg_path, st_path = os.path.join(hf_dir, "config.json"), os.path.join(hf_dir, "model.safetensors")
    for path in (cfg_path, st_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"'{path}' not found: an HF GPT-2 directory needs config.json and model.safetensors")
    with open(cfg_path) as f:
        m = model_config_from_hf(json.load(f))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, t in stream_safetensors(st_path):
            name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
            if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
                continue  # old HF files store the causal mask as a buffer
            yield name, t

    return m, tensors()


def open_hf(path: str) -> Checkpoint:
    """A Hugging Face GPT-2 directory as a Checkpoint (weights only)."""
    try:
        m, _ = read_hf(path)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"Hugging Face directory '{path}' cannot be read: {e}") from None
    safetensors_metadata(os.path.join(path, "model.safetensors"))

    def stream(kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, from_hf(n, t)) for n, t in read_hf(path)[1])

    return Checkpoint(path, "Hugging Face directory", m, hf_tokenizer_spec(path), None, plain_shapes(m), stream)


def hf_tokenizer_spec(hf_dir: str) -> Optional[str]:
    """The megazero spec of the tokenizer files in an HF directory (GPT-2 BPE or SentencePiece)."""
    if all(os.path.isfile(os.path.join(hf_dir, n)) for n in ("vocab.json", "merges.txt")):
        return f"gpt2bpe:{hf_dir}"
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        return f"sentencepiece:{hf_dir}"
    return None


# ----------------------------------------------------------------------------- init_from_hf

def hf_weights_file(hf_dir: str) -> str:
    """model.safetensors, else pytorch_model.bin, of an HF directory."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            return path
    raise CheckpointError(f"checkpoint.init_from_hf {hf_dir} has neither model.safetensors nor pytorch_model.bin")


class HFInitialValues:
    """A run's starting parameters read from an HF GPT-2 directory, one parameter's TP shard
    at a time: safetensors slices (or a memory-mapped weights_only pytorch_model.bin) read
    only the rows or columns this rank keeps, never the whole model.

    `value(name, param, tp_rank, tp_size)` returns the shard in megazero's layout (Linear
    [out, in] weights, the vocabulary padded with zero rows), fp32, on the CPU."""

    def __init__(self, hf_dir: str, m: ModelConfig) -> None:
        self.path, self.m = hf_weights_file(hf_dir), m
        self._file: Any  # a safetensors safe_open, or a state_dict
        if self.path.endswith(".safetensors"):
            self._file = safe_open(self.path, framework="pt")
            keys = list(self._file.keys())
        else:
            self._file = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            keys = list(self._file)
        # GPT2LMHeadModel names; a bare GPT2Model's keys lack the 'transformer.' prefix
        self.keys = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: k for k in keys}

    def _slice(self, key: str):
        return self._file.get_slice(key) if self.path.endswith(".safetensors") else self._file[key]

    def _shape(self, key: str) -> tuple[int, ...]:
        s = self._slice(key)
        return tuple(s.get_shape() if hasattr(s, "get_shape") else s.shape)

    def value(self, name: str, p: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
        hf_name = "transformer.wte.weight" if name == TIED_HEAD else name
        if hf_name not in self.keys:
            raise CheckpointError(f"{self.path} has no tensor '{hf_name}': not a GPT-2 checkpoint of this model's shape")
        key, conv = self.keys[hf_name], hf_name.endswith(CONV1D_SUFFIXES)
        full = placement(p).full_shape
        expected: tuple[object, ...] = tuple(reversed(full)) if conv else full
        rows = None
        if hf_name == "transformer.wte.weight":
            expected = (self.m.vocab_size, full[1])  # megazero's padding rows are not stored
        elif hf_name == "transformer.wpe.weight":
            rows = full[0]  # the first seq_length of the checkpoint's n_positions
        got = self._shape(key)
        if got != expected and not (rows and got[1:] == expected[1:] and got[0] >= rows):
            raise CheckpointError(f"{self.path}: '{key}' has shape {list(got)}, but the model config needs "
                             f"{list(expected)}; the model section does not match this checkpoint")
        where = placement(p) if tp_size > 1 else Placement(full)
        if hf_name == "transformer.wte.weight":
            where = dataclasses.replace(where, dim=0)  # read by rows at any tp, so the padding rows come out as zeros
        if where.dim is None:
            t = self._slice(key)[:rows] if rows else self._slice(key)[:]
            return (t.t() if conv else t).float().contiguous()
        dim = where.dim
        pieces = [self._read(key, conv, dim, lo, hi, full) for lo, hi in where.ranges(tp_rank, tp_size)]
        return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]

    def _read(self, key: str, conv: bool, dim: int, lo: int, hi: int, full: tuple[int, ...]) -> torch.Tensor:
        """Elements [lo, hi) along megazero dimension `dim`, in megazero's layout, fp32;
        indices past what the file stores (vocabulary padding) are zeros."""
        hf_dim = 1 - dim if conv else dim
        real_hi = min(hi, self._shape(key)[hf_dim])
        shape = list(full)
        shape[dim] = hi - lo
        out = torch.zeros(shape)
        if lo < real_hi:
            s = self._slice(key)
            t = s[lo:real_hi] if hf_dim == 0 else s[:, lo:real_hi]
            out.narrow(dim, 0, real_hi - lo).copy_(t.t() if conv else t)
        return out
