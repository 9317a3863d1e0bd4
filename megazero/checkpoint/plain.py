"""Reading weights-only files of the plain (non-parallel) model: a torch export (FILE, one
state_dict, with FILE.config.json beside it: export.write_torch) and model_16bit.safetensors
(written during training: gathered.py), each checked against its recorded digest first.
"""

from __future__ import annotations

import json
import os
import pickle

import torch
from safetensors import safe_open

from megazero.checkpoint import sharded
from megazero.checkpoint.base import (
    MODEL_16BIT,
    Checkpoint,
    CheckpointError,
    lora_adapters,
    not_a_checkpoint,
    safetensors_metadata,
    verified,
)
from megazero.checkpoint.tensors import plain_shapes, stream_safetensors
from megazero.config.schema import ModelConfig
from megazero.model.lora import is_adapter


def open_torch_export(path: str) -> Checkpoint:
    """A torch export FILE (with FILE.config.json beside it) as a Checkpoint."""
    sidecar = path + ".config.json"
    if not os.path.isfile(sidecar):
        raise not_a_checkpoint(path, f"a file without {os.path.basename(sidecar)} beside it")
    try:
        with open(sidecar) as f:
            info = json.load(f)
        m = ModelConfig(**info["model"])
    except (ValueError, KeyError, TypeError) as e:
        why = "no 'model' section" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"torch export config '{sidecar}' is unreadable ({why}); "
                              f"re-run convert --to torch") from None
    if "sha256" in info:  # the sidecar records the weights file's digest (older exports: none)
        verified(path, info, f"'{path}'", f"; re-export it with python -m megazero.convert --load {info.get('source')} "
                                          "--to torch")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise not_a_checkpoint(path, f"unreadable as a torch file: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise not_a_checkpoint(path, "the file holds no state_dict")
    return Checkpoint(path, "torch export", m, info.get("tokenizer"), info.get("iteration"), plain_shapes(m),
                      lambda kind: iter(state.items()))


def open_model_16bit(path: str) -> Checkpoint:
    """A model_16bit.safetensors file (anywhere; inside an iter_ directory, verified against its
    metadata) as a Checkpoint."""
    tokenizer, iteration = None, None
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "metadata.json")
    if os.path.isfile(beside):  # written into an iter_ directory: its metadata has its digest and the rest
        meta = sharded.read_metadata(os.path.dirname(beside))
        sharded.checked_file(os.path.dirname(beside), meta, os.path.basename(path))
        tokenizer, iteration = meta["config"]["data"].get("tokenizer"), meta["iteration"]
    metadata = safetensors_metadata(path)
    info = metadata.get("megazero_model")
    if not info:
        raise not_a_checkpoint(path, f"a safetensors file without megazero's model config; {MODEL_16BIT} "
                                     "has one, an HF model is passed as its directory")
    m = ModelConfig(**json.loads(info))

    def full(name: str) -> torch.Tensor:
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)

    with safe_open(path, framework="pt") as f:
        shapes = {**plain_shapes(m), **{n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if is_adapter(n)}}
    finetune = json.loads(metadata.get("megazero_finetune", "null"))
    return Checkpoint(path, "16-bit model", m, tokenizer, iteration, shapes,
                      lambda kind: stream_safetensors(path),
                      adapters=lora_adapters(finetune, full))
