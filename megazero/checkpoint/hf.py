"""Reading Hugging Face GPT-2, Llama, Qwen and mixture-of-experts directories (one
model.safetensors, a sharded model.safetensors.index.json, or pytorch_model.bin): whole (convert, generate), or each
rank's TP shard of one parameter at a time (checkpoint.init_from_hf). export.write_hf
writes them; hf_names.py says where each megazero tensor lives in them.

For GPT-2 megazero's parameter names are GPT2LMHeadModel's; only storage differs: the four
projections are nn.Linear-shaped [out, in] here and Conv1D-shaped [in, out] in HF. For
Llama the fused projections stack several HF tensors. megazero's token embedding (and
untied output layer) has zero rows padding the vocabulary (to a multiple of 128 x tp) that
HF does not have.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

from megazero.checkpoint.base import Checkpoint, CheckpointError, safetensors_metadata
from megazero.checkpoint.hf_names import (
    EMBEDDING,
    GPT2_CONV1D,
    HEAD,
    STACKED,
    Piece,
    expert_pieces,
    fused_key,
    in_memory_key,
    model_config_from_hf,
    pieces,
)
from megazero.checkpoint.tensors import plain_shapes
from megazero.config.schema import ModelConfig
from megazero.data.tokenizer import spec_of_directory
from megazero.parallel.placement import Placement, placement


def from_hf(name: str, hf_tensor: torch.Tensor) -> torch.Tensor:
    """An HF GPT-2 tensor in megazero's storage layout (Conv1D weights transposed); the vocab
    padding rows are added by `fit_vocab` for the target tp."""
    return hf_tensor.t().contiguous() if name.endswith(GPT2_CONV1D) else hf_tensor


class HFFiles:
    """The tensors of an HF directory by (normalised) key: model.safetensors, the shards a
    model.safetensors.index.json names, or a weights_only pytorch_model.bin. Slices read
    only what they ask for."""

    def __init__(self, hf_dir: str) -> None:
        self.dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        self._files: dict[str, Any] = {}  # path -> safe_open or state_dict
        self._where: dict[str, tuple[str, str]] = {}  # normalised key -> (path, key in the file)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for key, file in weight_map.items():
                self._add(key, os.path.join(hf_dir, file))
            return
        found = [n for n in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(hf_dir, n))]
        if not found:
            raise CheckpointError(f"checkpoint.init_from_hf {hf_dir} has neither model.safetensors nor "
                                  f"pytorch_model.bin")
        path = os.path.join(hf_dir, found[0])
        for key in self._open(path).keys():
            self._add(key, path)

    def _open(self, path: str) -> Any:
        if path not in self._files:
            self._files[path] = safe_open(path, framework="pt") if path.endswith(".safetensors") else \
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return self._files[path]

    def _add(self, key: str, path: str) -> None:
        if key.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            return  # buffers older files store: the causal mask, rotary frequencies
        self._where[_normalised(key)] = (path, key)

    def keys(self) -> list[str]:
        return list(self._where)

    def has(self, key: str) -> bool:
        return key in self._where or in_memory_key(key) in self._where

    def slice(self, key: str) -> Any:
        """An indexable view of tensor `key` (safetensors slice or tensor), found under its published
        name or the one transformers' modules give it (hf_names.in_memory_key); KeyError when absent."""
        path, inner = self._where[key if key in self._where else in_memory_key(key)]
        f = self._open(path)
        return f.get_slice(inner) if path.endswith(".safetensors") else f[inner]

    def shape(self, key: str) -> tuple[int, ...]:
        s = self.slice(key)
        return tuple(s.get_shape() if hasattr(s, "get_shape") else s.shape)


def _normalised(key: str) -> str:
    """GPT2LMHeadModel's and LlamaForCausalLM's names: a bare GPT2Model / LlamaModel lacks the
    'transformer.' / 'model.' prefix."""
    if key.startswith(("transformer.", "model.", "lm_head.")):
        return key
    return ("model." if key.startswith(("layers.", "embed_tokens.", "norm.")) else "transformer.") + key


def _stacked(files: HFFiles, name: str, m: ModelConfig, shape: tuple[int, ...]) -> torch.Tensor:
    """Whole megazero tensor `name` (of full `shape`) from its HF pieces; a 3-D one from transformers'
    fused tensor when the directory has it, else from each expert's matrices."""
    if name.endswith(STACKED):
        fused = fused_key(name)
        if fused is not None and files.has(fused):
            return files.slice(fused)[:].contiguous()
        return torch.stack([_cat(files, expert_pieces(name, m, j)) for j in range(shape[0])])
    return _cat(files, pieces(name, m))


def _cat(files: HFFiles, parts: list[Piece]) -> torch.Tensor:
    try:
        read = [files.slice(p.key)[:] for p in parts]
    except KeyError as e:
        raise CheckpointError(f"{files.dir} has no tensor {e}: not a checkpoint of this model's shape") from None
    read = [t.t() if p.transposed else t for p, t in zip(parts, read, strict=True)]
    return (torch.cat(read) if len(read) > 1 else read[0]).contiguous()


def open_hf(path: str) -> Checkpoint:
    """A Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE
    directory as a Checkpoint
    (weights only)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            m = model_config_from_hf(json.load(f))
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"Hugging Face directory '{path}' cannot be read: {e}") from None
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        safetensors_metadata(single)
    shapes = plain_shapes(m)

    def stream(kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        """megazero's tensors in megazero's layout (fused projections stacked, Linear-shaped; no
        vocab padding), read one at a time."""
        files = HFFiles(path)
        return ((name, _stacked(files, name, m, shape)) for name, shape in shapes.items())

    return Checkpoint(path, "Hugging Face directory", m, spec_of_directory(path), None, shapes, stream)


# ----------------------------------------------------------------------------- init_from_hf

def hf_contents(hf_dir: str) -> tuple[str, int]:
    """What an HF directory holds, for the start-up line: its architecture (config.json's
    `architectures`, else its model_type) and its number of weight tensors (headers only)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    name = (hf.get("architectures") or [hf.get("model_type", "unknown architecture")])[0]
    return str(name), len(HFFiles(hf_dir).keys())


class HFInitialValues:
    """A run's starting parameters read from an HF directory, one parameter's shard at a time:
    safetensors slices (or a memory-mapped weights_only pytorch_model.bin) read only the rows or
    columns this rank keeps, from the HF tensor (piece) that holds them, never the whole model.
    An expert weight is read expert by expert, only this rank's experts (its placement's
    `expert_range` over the expert-parallel group), each cut over the expert-tensor-parallel
    group as its placement says.

    `value(name, param, tp_rank, tp_size, ep=(rank, size), etp=(rank, size))` returns the shard
    in megazero's layout (Linear [out, in] weights, fused projections stacked, the vocabulary
    padded with zero rows), fp32, on the CPU."""

    def __init__(self, hf_dir: str, m: ModelConfig) -> None:
        self.files, self.m = HFFiles(hf_dir), m

    def value(self, name: str, p: torch.nn.Parameter, tp_rank: int, tp_size: int,
              ep: tuple[int, int] = (0, 1), etp: tuple[int, int] = (0, 1)) -> torch.Tensor:
        if name == HEAD and self.m.tie_embeddings:
            name = EMBEDDING
        where = placement(p)
        if name.endswith(STACKED):
            return self._experts(name, where, ep, etp)
        vocab = name in (EMBEDDING, HEAD)
        return self._matrix(pieces(name, self.m), where if tp_size > 1 else Placement(where.full_shape),
                            tp_rank, tp_size, vocab, name == "transformer.wpe.weight")

    def _matrix(self, parts: list[Piece], where: Placement, tp_rank: int, tp_size: int, vocab: bool = False,
                positions: bool = False) -> torch.Tensor:
        """A 2-D tensor's shard (`where`: its placement, full shape included) from its pieces."""
        full = where.full_shape
        rows = [full[0] if q.rows < 0 else q.rows for q in parts]
        for q, r in zip(parts, rows, strict=True):
            self._check(q, (self.m.vocab_size if vocab else r, *full[1:]), positions)
        if vocab:
            where = Placement(full, 0)  # read by rows at any tp, so the padding rows come out as zeros
        if where.dim is None:
            where, tp_rank, tp_size = Placement(full, 0), 0, 1  # the whole tensor: one range
        dim = where.dim
        assert dim is not None
        ranges = where.ranges(tp_rank, tp_size)
        if dim == 1:
            out = [self._read(parts[0], 1, lo, hi, full) for lo, hi in ranges]
        else:
            out = [self._rows(parts, rows, lo, hi, full) for lo, hi in ranges]
        return torch.cat(out, dim=dim) if len(out) > 1 else out[0]

    def _experts(self, name: str, where: Placement, ep: tuple[int, int], etp: tuple[int, int]) -> torch.Tensor:
        """This rank's experts of a 3-D tensor, each its etp shard: from transformers' fused tensor
        when the directory has one, else from each expert's published matrices."""
        lo, hi = where.expert_range(*ep)
        one = Placement(where.full_shape[1:], None if where.dim is None else where.dim - 1, where.stride,
                        parts=where.parts)  # one expert's matrix and its split
        if etp[1] == 1:
            one = Placement(one.full_shape)
        fused = fused_key(name)
        if fused is not None and self.files.has(fused):
            return self._fused(fused, lo, hi, where.full_shape, one, etp)
        return torch.stack([self._matrix(expert_pieces(name, self.m, j), one, *etp) for j in range(lo, hi)])

    def _fused(self, key: str, lo: int, hi: int, full: tuple, one: Placement, etp: tuple[int, int]) -> torch.Tensor:
        """Experts [lo, hi) of transformers' fused [E, out, in] tensor, each cut as `one` says."""
        got = self.files.shape(key)
        if got != full:
            raise CheckpointError(f"{self.files.dir}: '{key}' has shape {list(got)}, but the model config needs "
                                  f"{list(full)}; the model section does not match this checkpoint")
        s = self.files.slice(key)
        if one.dim is None:
            return s[lo:hi].float()
        cut = [s[lo:hi, a:b] if one.dim == 0 else s[lo:hi, :, a:b] for a, b in one.ranges(*etp)]
        return torch.cat(cut, dim=one.dim + 1).float()

    def _check(self, piece: Piece, expected: tuple, positions: bool) -> None:
        key = piece.key
        try:
            got = self.files.shape(key)
        except KeyError:
            raise CheckpointError(f"{self.files.dir} has no tensor '{key}': not a checkpoint of this model's "
                                  f"shape") from None
        want = tuple(reversed(expected)) if piece.transposed else expected
        if got != want and not (positions and got[1:] == want[1:] and got[0] >= want[0]):
            raise CheckpointError(f"{self.files.dir}: '{key}' has shape {list(got)}, but the model config needs "
                                  f"{list(want)}; the model section does not match this checkpoint")

    def _rows(self, parts: list[Piece], rows: list[int], lo: int, hi: int, full: tuple) -> torch.Tensor:
        """Rows [lo, hi) of the stacked tensor: within one piece under TP (it splits each part), across
        pieces where a rank reads the whole tensor (tp 1: q | k | v, gate | up); rows past the last
        piece's are its padding."""
        out, start = [], 0
        for q, r in zip(parts, rows, strict=True):
            first, last = max(lo, start), hi if q is parts[-1] else min(hi, start + r)
            if first < last:
                out.append(self._read(q, 0, first - start, last - start, (r, *full[1:])))
            start += r
        return torch.cat(out) if len(out) > 1 else out[0]

    def _read(self, piece: Piece, dim: int, lo: int, hi: int, full: tuple) -> torch.Tensor:
        """Elements [lo, hi) along megazero dimension `dim` of one piece, in megazero's layout,
        fp32; indices past what the file stores (vocabulary padding) are zeros."""
        hf_dim = 1 - dim if piece.transposed else dim
        real_hi = min(hi, self.files.shape(piece.key)[hf_dim])
        shape = list(full)
        shape[dim] = hi - lo
        out = torch.zeros(shape)
        if lo < real_hi:
            s = self.files.slice(piece.key)
            t = s[lo:real_hi] if hf_dim == 0 else s[:, lo:real_hi]
            out.narrow(dim, 0, real_hi - lo).copy_(t.t() if piece.transposed else t)
        return out
