"""What every checkpoint kind shares: the error type, the save directory's names and
integrity checks, and `Checkpoint`, the one interface that readers (sharded, universal, hf,
plain; load.open_checkpoint picks one) return and writers (export, adapter) take: the model
config, the tokenizer spec it names, and its full (unsharded) tensors by megazero parameter
name, streamed one at a time; sharded and universal ones also carry the optimizer state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from safetensors import SafetensorError, safe_open

from megazero.checkpoint import digest
from megazero.checkpoint.tensors import fit_vocab
from megazero.config.schema import ModelConfig
from megazero.errors import UserError

FORMAT_VERSION = 1
ITER_DIR = re.compile(r"iter_\d{7}$")  # not iter_*.tmp (being written) nor iter_*.old (being replaced)
MODEL_16BIT = "model_16bit.safetensors"
KINDS = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used (incomplete, corrupt, another model or format).

    With `bad_checkpoint` set, the message is completed, when first shown, by the last good
    checkpoint before it (a search that hashes older checkpoints: in distributed code rank 0
    alone runs it, see resume.py)."""

    def __init__(self, message: str, bad_checkpoint: Optional[str] = None):
        super().__init__(message)
        self.bad_checkpoint = bad_checkpoint
        self._hint: Optional[str] = None

    def __str__(self) -> str:
        if self.bad_checkpoint and self._hint is None:
            self._hint = last_good_hint(self.bad_checkpoint)
        return super().__str__() + (self._hint or "")


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank (disk full, unwritable directory); the same on every rank."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(tp: int, pp: int, dp: int) -> str:
    return f"rank_tp{tp:02d}_pp{pp:03d}_dp{dp:03d}.pt"


def complete_checkpoints(save_dir: str) -> list[str]:
    """Sealed checkpoint directories (with metadata.json), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(n for n in os.listdir(save_dir)
                  if ITER_DIR.match(n) and os.path.isfile(os.path.join(save_dir, n, "metadata.json")))


def last_good_hint(ckpt: str) -> str:
    """"; the last good checkpoint is ...": the newest older checkpoint whose every file
    verifies (older ones are not hashed once one is found)."""
    save_dir, bad = os.path.split(os.path.normpath(ckpt))
    bad = bad.removesuffix(".old")
    for name in reversed([n for n in complete_checkpoints(save_dir) if n < bad]):
        if is_intact(os.path.join(save_dir, name)):
            it = int(name.split("_")[1])
            return f"; the last good checkpoint is {name}: resume from it with --checkpoint.iteration {it}"
    return "; no earlier good checkpoint exists there"


def is_intact(ckpt: str) -> bool:
    """Does every file of checkpoint `ckpt` match the digest its metadata.json records?"""
    try:
        with open(os.path.join(ckpt, "metadata.json")) as f:
            files = json.load(f)["files"]
        for name, expected in files.items():
            digest.verify(os.path.join(ckpt, name), expected)
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def verified(path: str, expected: dict, what: str, fix: str = "", bad_checkpoint: Optional[str] = None,
             check: Callable[[str, dict], Any] = digest.verify) -> Any:
    """check(path, expected): the file checked against its recorded digest (digest.verify, or
    digest.load_torch reading it once) before any value in it is used; a mismatch raises
    CheckpointError "WHAT is corrupt: ...FIX"."""
    try:
        return check(path, expected)
    except digest.DigestError as e:
        raise CheckpointError(f"{what} is corrupt: {e}{fix}", bad_checkpoint) from None


ACCEPTED = ("a save directory (with a 'latest' file), an iter_NNNNNNN directory, a universal checkpoint "
            "(universal.json), a torch export (FILE with FILE.config.json beside it, or model_16bit.safetensors) "
            "a Hugging Face GPT-2 directory (config.json + model.safetensors) or a DeepSpeed checkpoint of one "
            "(DIR with latest naming global_stepN, a global_stepN folder or a universal one)")


def not_a_checkpoint(path: str, why: str) -> CheckpointError:
    """The one wording for a path that is none of the accepted kinds."""
    return CheckpointError(f"'{path}' is not a checkpoint ({why}); expected {ACCEPTED}")


def safetensors_metadata(path: str) -> dict[str, str]:
    """The header's metadata; a file that is no safetensors file is refused here, before use."""
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except SafetensorError as e:
        raise not_a_checkpoint(path, f"unreadable as safetensors: {e}") from None


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

    def tensors(self, kind: str = "master") -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter once, shaped as `shapes` says; the source must hold them all."""
        if kind != "master":
            self._require_training(f"its {kind} tensors")
        seen = set()
        for name, t in self.stream(kind):
            if name in self.shapes and name not in seen:
                seen.add(name)
                yield name, fit_vocab(name, t, self.shapes[name])
        missing = [n for n in self.shapes if n not in seen]
        if missing:
            raise CheckpointError(f"{self.kind} '{self.ckpt}' lacks {len(missing)} parameters of the model its "
                                  f"config describes, e.g. {missing[0]}")

    def trainer_state(self) -> dict:
        return self._require_training("its optimizer state").trainer_state()

    def started_from_hf(self) -> Optional[str]:
        """The Hugging Face directory the run started from (checkpoint.init_from_hf), while it
        still exists; None for a run that did not, or a checkpoint that does not record its run."""
        config = getattr(self.training, "config", None)
        start = config.checkpoint.init_from_hf if config is not None else None
        return start if start and os.path.isdir(start) else None

    @property
    def meta(self) -> dict:
        return self._require_training("its run config").meta

    def _require_training(self, what: str) -> Any:
        if self.training is None:
            raise CheckpointError(f"{self.kind} '{self.ckpt}' holds model weights only, not {what}; convert a save "
                                  f"directory, an iter_ directory or a universal checkpoint instead")
        return self.training
