"""One loader for every checkpoint kind a tool is given: `open_checkpoint(path)`.

    save directory        SAVE/ with a `latest` file (or `iteration` picks SAVE/iter_N)
    iter_ directory       SAVE/iter_NNNNNNN with metadata.json and the rank files
    universal checkpoint  DIR/universal.json + {master,exp_avg,exp_avg_sq}.safetensors
    torch export          FILE (one state_dict) with FILE.config.json beside it; also the
                          model_16bit.safetensors written during training
    Hugging Face GPT-2    DIR/config.json + model.safetensors

Each opens as a `Checkpoint`: the model config, the tokenizer spec it names, and its full
(unsharded) tensors by megazero parameter name, streamed one at a time. The first two and
universal ones also carry the optimizer state (Adam moments, loop position) that a
universal conversion needs; the others hold weights only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from megazero.checkpoint import digest, sharded
from megazero.checkpoint.export import ShardedReader, fit_vocab
from megazero.checkpoint.gathered import FILE_NAME as MODEL_16BIT
from megazero.checkpoint.gathered import plain_shapes
from megazero.checkpoint.safetensors_stream import stream_safetensors
from megazero.checkpoint.sharded import CheckpointError
from megazero.checkpoint.universal import UniversalReader
from megazero.config import ModelConfig
from megazero.model.lora import is_adapter

ACCEPTED = ("a save directory (with a 'latest' file), an iter_NNNNNNN directory, a universal checkpoint "
            "(universal.json), a torch export (FILE with FILE.config.json beside it, or model_16bit.safetensors) "
            "or a Hugging Face GPT-2 directory (config.json + model.safetensors)")


def not_a_checkpoint(path: str, why: str) -> CheckpointError:
    """The one wording for a path that is none of the accepted kinds."""
    return CheckpointError(f"'{path}' is not a checkpoint ({why}); expected {ACCEPTED}")


class Adapters(NamedTuple):
    """How to fold a LoRA fine-tune's adapters into its base weights."""

    scale: float
    """lora_alpha / lora_rank."""
    full: Callable[[str], torch.Tensor]
    """An adapter's full tensor by name."""


def lora_adapters(finetune: Optional[dict], full: Callable[[str], torch.Tensor]) -> Optional[Adapters]:
    """The Adapters of a run whose finetune config section is `finetune` (None: no LoRA)."""
    if not finetune or not finetune.get("lora_rank"):
        return None
    return Adapters(finetune["lora_alpha"] / finetune["lora_rank"], full)


@dataclasses.dataclass
class Checkpoint:
    """Any checkpoint kind, seen the same way by convert, generate and friends."""

    ckpt: str
    """The file or directory read (a save directory resolves to its iter_ directory)."""
    kind: str
    model_config: ModelConfig
    tokenizer: Optional[str]
    """Tokenizer spec (gpt2bpe:DIR, sentencepiece:FILE) the checkpoint names, or None."""
    iteration: Optional[int]
    shapes: dict[str, tuple[int, ...]]
    """Full shape of every parameter of the non-parallel model (no tied head), in order;
    the embedding's vocab padding is whatever the source has."""
    stream: Callable[[str], Iterator[tuple[str, torch.Tensor]]]
    """kind ("master", "exp_avg", "exp_avg_sq") -> (name, full tensor) pairs."""
    training: Optional[Any] = None
    """The ShardedReader / UniversalReader holding the optimizer state; None: weights only."""
    adapters: Optional[Adapters] = None
    """A LoRA fine-tune's adapters (their names are in `shapes` too); None without LoRA."""

    def names(self) -> list[str]:
        return list(self.shapes)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def tensors(self, kind: str = "master", dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter once, shaped as `shapes` says; the source must hold them all."""
        if kind != "master":
            self._require_training(f"its {kind} tensors")
        seen = set()
        for name, t in self.stream(kind):
            if name in self.shapes and name not in seen:
                seen.add(name)
                t = fit_vocab(name, t, self.shapes[name])
                yield name, t if dtype is None else t.to(dtype)
        missing = [n for n in self.shapes if n not in seen]
        if missing:
            raise CheckpointError(f"{self.kind} '{self.ckpt}' lacks {len(missing)} parameters of the model its "
                                  f"config describes, e.g. {missing[0]}")

    def trainer_state(self) -> dict:
        return self._require_training("its optimizer state").trainer_state()

    @property
    def meta(self) -> dict:
        return self._require_training("its run config").meta

    def _require_training(self, what: str) -> Any:
        if self.training is None:
            raise CheckpointError(f"{self.kind} '{self.ckpt}' holds model weights only, not {what}; convert a save "
                                  f"directory, an iter_ directory or a universal checkpoint instead")
        return self.training


def open_checkpoint(path: str, iteration: int = 0) -> Checkpoint:
    """Open any accepted kind (see the module docstring); CheckpointError names the fix."""
    if not os.path.exists(path):
        raise not_a_checkpoint(path, "no such file or directory")
    if iteration:
        if not sharded.complete_checkpoints(path):
            raise CheckpointError(f"--iteration {iteration} picks an iter_ directory inside a save directory, "
                                  f"but '{path}' holds none; pass the checkpoint itself without --iteration")
        return _sharded(_iteration_dir(path, iteration), "save directory")
    if os.path.isfile(path):
        return _open_file(path)
    if os.path.isfile(os.path.join(path, "universal.json")):
        return _universal(path)
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return _sharded(path, "iter_ directory")
    if os.path.isfile(os.path.join(path, sharded.LATEST)):
        return _sharded(sharded.resolve(path), "save directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return _hf(path)
    complete = sharded.complete_checkpoints(path)
    if complete:
        raise CheckpointError(f"save directory '{path}' has no '{sharded.LATEST}' file; pass one of its "
                              f"checkpoints, e.g. {os.path.join(path, complete[-1])}")
    raise not_a_checkpoint(path, "a directory without latest, metadata.json, universal.json or config.json")


def _iteration_dir(save_dir: str, iteration: int) -> str:
    ckpt = sharded.resolve(save_dir, iteration)
    if not os.path.isdir(ckpt):
        have = ", ".join(sharded.complete_checkpoints(save_dir)) or "none"
        raise CheckpointError(f"save directory '{save_dir}' has no {os.path.basename(ckpt)} "
                              f"(complete checkpoints: {have})")
    return ckpt


def _sharded(ckpt: str, kind: str) -> Checkpoint:
    reader = ShardedReader(ckpt)
    shapes = {n: reader.full_shape(n) for n in reader.names()}
    return Checkpoint(ckpt, kind, reader.model_config, reader.config.data.tokenizer, reader.iteration, shapes,
                      reader.tensors, training=reader, adapters=lora_adapters(reader.meta["config"].get("finetune"),
                                                                              reader.full))


def _universal(path: str) -> Checkpoint:
    reader = UniversalReader(path)
    master = reader.files["master"]
    stored = set(master.keys())
    names = [n for n in plain_shapes(reader.model_config) if n in stored] + [n for n in master.keys() if is_adapter(n)]
    shapes = {n: tuple(master.get_slice(n).get_shape()) for n in names}
    return Checkpoint(path, "universal checkpoint", reader.model_config, reader.config.data.tokenizer,
                      reader.meta["iteration"], shapes, lambda kind: ((n, reader.full(n, kind)) for n in shapes),
                      training=reader, adapters=lora_adapters(reader.meta["config"].get("finetune"), reader.full))


def _open_file(path: str) -> Checkpoint:
    if path.endswith(".safetensors"):
        return _model_16bit(path)
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
        _verified(path, info, f"re-export it with python -m megazero.convert --load {info.get('source')} --to torch")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise not_a_checkpoint(path, f"unreadable as a torch file: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise not_a_checkpoint(path, "the file holds no state_dict")
    return Checkpoint(path, "torch export", m, info.get("tokenizer"), info.get("iteration"), plain_shapes(m),
                      lambda kind: iter(state.items()))


def _verified(path: str, expected: dict, fix: str) -> None:
    """Check a file against its recorded digest before any value in it is used."""
    try:
        digest.verify(path, expected)
    except digest.DigestError as e:
        raise CheckpointError(f"'{path}' is corrupt: {e}; {fix}") from None


def _safetensors_metadata(path: str) -> dict[str, str]:
    """The header's metadata; a file that is no safetensors file is refused here, before use."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except SafetensorError as e:
        raise not_a_checkpoint(path, f"unreadable as safetensors: {e}") from None


def _model_16bit(path: str) -> Checkpoint:
    tokenizer, iteration = None, None
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "metadata.json")
    if os.path.isfile(beside):  # written into an iter_ directory: its metadata has its digest and the rest
        meta = sharded.read_metadata(os.path.dirname(beside))
        sharded.verify_file(os.path.dirname(beside), meta, os.path.basename(path))
        tokenizer, iteration = meta["config"]["data"].get("tokenizer"), meta["iteration"]
    metadata = _safetensors_metadata(path)
    info = metadata.get("megazero_model")
    if not info:
        raise not_a_checkpoint(path, f"a safetensors file without megazero's model config; {MODEL_16BIT} "
                                     "has one, an HF model is passed as its directory")
    m = ModelConfig(**json.loads(info))
    from safetensors import safe_open

    def full(name: str) -> torch.Tensor:
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)

    with safe_open(path, framework="pt") as f:
        shapes = {**plain_shapes(m), **{n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if is_adapter(n)}}
    finetune = json.loads(metadata.get("megazero_finetune", "null"))
    return Checkpoint(path, "16-bit model", m, tokenizer, iteration, shapes,
                      lambda kind: stream_safetensors(path),
                      adapters=lora_adapters(finetune, full))


def _hf(path: str) -> Checkpoint:
    from megazero.checkpoint.hf import from_hf, read_hf

    try:
        m, _ = read_hf(path)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"Hugging Face directory '{path}' cannot be read: {e}") from None
    _safetensors_metadata(os.path.join(path, "model.safetensors"))

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
