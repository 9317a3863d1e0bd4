"""Exports of any Checkpoint (load.open_checkpoint), streamed one tensor at a time: host
memory stays near one full tensor however large the model.

    write_torch      one plain torch state_dict of the non-parallel model + FILE.config.json
    write_universal  the universal format (universal.py), which resumes at any layout
    write_hf         a Hugging Face directory (the mapping: hf_names.py); write_run_tokenizer
                     adds the tokenizer the run was trained with, for megazero and for transformers
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zipfile
from typing import IO, Iterable, Iterator

import torch

from megazero.atomic import atomic_write, write_bytes, write_text
from megazero.checkpoint import digest
from megazero.checkpoint.base import KINDS, Checkpoint
from megazero.checkpoint.hf_names import EMBEDDING, HEAD, STACKED, Piece, expert_pieces, hf_config, pieces
from megazero.checkpoint.tensors import fit_vocab, save_safetensors_streaming
from megazero.checkpoint.universal import UNIVERSAL_VERSION
from megazero.config.schema import ModelConfig
from megazero.data.hf_tokenizer import hf_tokenizer_files
from megazero.data.tokenizer import SPM_MODEL_NAME, Tokenizer, build_tokenizer, spec_of_directory
from megazero.model.layers import padded_vocab_size
from megazero.parallel.host import HostStaging


def save_streaming(path: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                   tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Write a torch.save-format state_dict one tensor at a time: the file's skeleton is
    saved without data, then each tensor's bytes are written at its record's offset. Host
    memory stays near one tensor however large the model (torch.save needs them all).
    Tensors may arrive on any device; device ones reach the file through a pinned buffer."""
    placeholders = {n: torch.empty(s, dtype=dtype) for n, s in shapes.items()}  # never touched: no RSS
    order = {n: i for i, n in enumerate(shapes)}  # storage keys follow the dict's order
    staging = HostStaging()
    with atomic_write(path, "w+b") as f:
        with torch.serialization.skip_data():
            torch.save(placeholders, f)
        offsets = _record_offsets(f)
        for name, t in tensors:
            if tuple(t.shape) != tuple(shapes[name]):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {shapes[name]}")
            f.seek(offsets[str(order[name])])
            staging.write(f, t.to(dtype))


def _record_offsets(f: IO[bytes]) -> dict[str, int]:
    """Byte offset of each data/<key> record's payload in a torch zip checkpoint (open file)."""
    out = {}
    with zipfile.ZipFile(f) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data":
                f.seek(info.header_offset)
                header = f.read(30)
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                out[parts[2]] = info.header_offset + 30 + name_len + extra_len
    return out


def write_torch(reader: Checkpoint, output: str, dtype: torch.dtype) -> None:
    """One plain state_dict for megazero's non-parallel GPT-2 (load with strict=True), and
    OUTPUT.config.json with the model config and tokenizer needed to use it and the file's digest."""
    assert isinstance(reader.model_config.vocab_size, int)
    shapes = _with_vocab_rows(reader, padded_vocab_size(reader.model_config.vocab_size, 1))  # re-padded for tp = 1
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    save_streaming(output, shapes, dtype,
                   ((n, fit_vocab(n, t, shapes[n])) for n, t in reader.tensors("master")))
    info = {"model": dataclasses.asdict(reader.model_config), "tokenizer": reader.tokenizer,
            "iteration": reader.iteration, "source": os.path.abspath(reader.ckpt), **digest.file_entry(output)}
    write_text(output + ".config.json", json.dumps(info, indent=1))


def _with_vocab_rows(reader: Checkpoint, rows: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint's shapes with `rows` rows of the token embedding and an untied output
    layer (their vocabulary padding)."""
    return {n: (rows, *s[1:]) if n in (EMBEDDING, HEAD) else s for n, s in reader.shapes.items()}


def write_universal(reader: Checkpoint, output: str) -> None:
    """Convert a checkpoint with optimizer state into the universal format (streamed, tensor
    by tensor)."""
    state = reader.trainer_state()  # first: a weights-only source fails before anything is written
    os.makedirs(output, exist_ok=True)
    assert isinstance(reader.model_config.vocab_size, int)
    shapes = _with_vocab_rows(reader, reader.model_config.vocab_size)  # no padding in the universal format
    files = {}
    for kind in KINDS:
        path = os.path.join(output, f"{kind}.safetensors")
        save_safetensors_streaming(path, shapes, torch.float32,
                                   ((n, fit_vocab(n, t, shapes[n])) for n, t in reader.tensors(kind)))
        files[os.path.basename(path)] = digest.file_entry(path)  # written by offset: hashed once complete
    meta = {"format_version": UNIVERSAL_VERSION, **state, "config": reader.meta["config"],
            "source": os.path.abspath(reader.ckpt), "files": files}
    write_text(os.path.join(output, "universal.json"), json.dumps(meta, indent=1))


def to_hf(name: str, full: torch.Tensor, m: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A full (unsharded) megazero tensor as the HF tensors that store it (hf_names.py); a 3-D one
    (experts) as each slice's, the published per-expert layout."""
    if name.endswith(STACKED):
        return [pair for j in range(full.shape[0]) for pair in _split(full[j], expert_pieces(name, m, j))]
    if name in (EMBEDDING, HEAD):
        full = full[: m.vocab_size]
    return _split(full, pieces(name, m))


def _split(full: torch.Tensor, parts: list[Piece]) -> list[tuple[str, torch.Tensor]]:
    rows = [full.shape[0] if p.rows < 0 else p.rows for p in parts]
    return [(p.key, t.t().contiguous() if p.transposed else t.contiguous())
            for p, t in zip(parts, full.split(rows), strict=True)]


def write_hf(output_dir: str, tensors: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]],
             m: ModelConfig, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None) -> None:
    """config.json + model.safetensors into `output_dir` (a GPT2LMHeadModel, LlamaForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM
    directory),
    streamed one tensor at a time (`shapes`: megazero's full shapes, in the order `tensors` yields
    them). A tied output layer is HF's tie: not stored."""
    os.makedirs(output_dir, exist_ok=True)
    tied = m.tie_embeddings
    # The HF tensors' shapes: to_hf of meta tensors (no memory) of the full shapes.
    out_shapes = {k: tuple(t.shape) for name, shape in shapes.items() if not (tied and name == HEAD)
                  for k, t in to_hf(name, torch.empty(shape, device="meta"), m)}
    converted = (pair for name, t in tensors if not (tied and name == HEAD) for pair in to_hf(name, t, m))
    save_safetensors_streaming(os.path.join(output_dir, "model.safetensors"), out_shapes, dtype, converted,
                               metadata={"format": "pt"})
    write_text(os.path.join(output_dir, "config.json"), json.dumps(hf_config(m, eos_token_id), indent=2))


# A Hugging Face directory's tokenizer files, whichever of them it has (GPT-2: vocab.json + merges.txt,
# Llama 2: tokenizer.model, Llama 3: tokenizer.json; the config files carry special tokens and templates).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      SPM_MODEL_NAME, "vocab.json", "merges.txt")


def write_run_tokenizer(reader: Checkpoint, output_dir: str) -> Tokenizer | None:
    """The tokenizer the run was trained with, into its HF export; None when it names none.

    A run that started from a Hugging Face directory (checkpoint.init_from_hf) and kept its
    tokenizer (data.tokenizer unset, or the same files) gets that directory's tokenizer files
    as they are, so transformers sees the original's special tokens and chat template; any
    other gets data.tokenizer written by write_hf_tokenizer."""
    start = reader.started_from_hf()
    start_spec = spec_of_directory(start) if start else None
    spec = reader.tokenizer or start_spec
    if spec is None:
        return None
    tokenizer = build_tokenizer(spec)
    if start and start_spec and build_tokenizer(start_spec).identity() == tokenizer.identity():
        _copy_tokenizer_files(start, tokenizer, output_dir, reader.model_config.seq_length)
    else:
        write_hf_tokenizer(tokenizer, output_dir, reader.model_config.seq_length)
    return tokenizer


def _copy_tokenizer_files(source_dir: str, tokenizer: Tokenizer, output_dir: str, model_max_length: int) -> None:
    """SOURCE_DIR's tokenizer files into OUTPUT_DIR; a directory without tokenizer.json or
    tokenizer_config.json (GPT-2 or Llama 2 style) gets megazero's, so AutoTokenizer loads it."""
    for name in HF_TOKENIZER_FILES:
        path = os.path.join(source_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                write_bytes(os.path.join(output_dir, name), f.read())
    for name, text in hf_tokenizer_files(tokenizer, model_max_length).items():
        if not os.path.isfile(os.path.join(source_dir, name)):
            write_text(os.path.join(output_dir, name), text)


def write_hf_tokenizer(tokenizer: Tokenizer, output_dir: str, model_max_length: int) -> None:
    """A megazero tokenizer, into an HF directory: megazero's own files (so megazero
    reads the directory back with the same tokenizer) and tokenizer.json +
    tokenizer_config.json (so `AutoTokenizer.from_pretrained` encodes the same ids)."""
    # An hf tokenizer's own file is the tokenizer.json hf_tokenizer_files writes.
    names = {"gpt2bpe": ("vocab.json", "merges.txt"), "sentencepiece": (SPM_MODEL_NAME,), "hf": ()}[tokenizer.kind]
    for source, name in zip(tokenizer.files, names):
        with open(source, "rb") as f:
            write_bytes(os.path.join(output_dir, name), f.read())
    for name, text in hf_tokenizer_files(tokenizer, model_max_length).items():
        write_text(os.path.join(output_dir, name), text)
