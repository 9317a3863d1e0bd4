"""Tokenizers: GPT-2 byte-level BPE, SentencePiece and Hugging Face tokenizer.json, built from a
spec string; training the first two.

A tokenizer spec (the ``data.tokenizer`` config value, preprocess_data.py's ``--tokenizer``) is
``KIND:PATH``:

    gpt2bpe:DIR                      DIR holds vocab.json and merges.txt (GPT-2's own files,
                                     or those written by data_tools/train_tokenizer.py)
    gpt2bpe:VOCAB.json,MERGES.txt    the two files named separately
    sentencepiece:FILE.model         a SentencePiece model
    sentencepiece:DIR                DIR holds tokenizer.model
    hf:DIR                           DIR holds a `tokenizers` tokenizer.json (a Hugging Face
                                     directory, Llama 3 style); hf:FILE.json names the file
    DIR                              a Hugging Face model directory: its tokenizer files decide
                                     (vocab.json + merges.txt: gpt2bpe; tokenizer.model, Llama 2
                                     style: sentencepiece; else tokenizer.json: hf)

A tokenizer's identity (kind, vocabulary size, end-of-document id and a sha256 over its
files' bytes) is stored beside every dataset made with it, so that training can refuse a
dataset made with a different tokenizer. Paths are not part of the identity: the same files
anywhere are the same tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from megazero.atomic import atomic_write
from megazero.data import DataError, read_json

EOD_TOKEN = "<|endoftext|>"
KINDS = ("gpt2bpe", "sentencepiece", "hf")
SPM_MODEL_NAME = "tokenizer.model"
HF_TOKENIZER_NAME = "tokenizer.json"
T = TypeVar("T")


class _TokenizerFiles:
    """What every kind shares: the spec, the files (their bytes are part of its identity) and
    one message for a file the library cannot read."""

    kind: str
    vocab_size: int
    eod: int

    def __init__(self, spec: str, files: tuple[str, ...]) -> None:
        self.spec, self.files = spec, files
        for path in files:
            if not os.path.isfile(path):
                raise DataError(f"tokenizer {spec!r}: {path} not found; train one with "
                                f"data_tools/train_tokenizer.py or fix the path")

    def _load(self, load: Callable[[], T], failure: str) -> T:
        try:
            return load()
        except Exception as e:  # the libraries raise their own exception types for foreign files
            raise DataError(f"tokenizer {self.spec!r}: {failure} ({e})") from None

    def identity(self) -> dict[str, Any]:
        digest = hashlib.sha256()
        for path in self.files:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            digest.update(b"\x00")  # keep file boundaries part of the hash
        return {"type": self.kind, "vocab_size": self.vocab_size, "eod": self.eod, "sha256": digest.hexdigest()}


class _PipelineTokenizer(_TokenizerFiles):
    """A `tokenizers` pipeline, run without its added bos/eos (documents are plain text,
    preprocessing's --append-eod marks their ends)."""

    _tok: Any

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token(self, i: int) -> str:
        return self._tok.id_to_token(i) or ""

    def pipeline_json(self) -> str:
        """The pipeline in tokenizer.json form (data/hf_tokenizer.py builds on it)."""
        return self._tok.to_str()


class GPT2BPETokenizer(_PipelineTokenizer):
    """GPT-2's byte-level BPE from vocab.json + merges.txt, run by the `tokenizers` library.

    The text "<|endoftext|>" inside a document is encoded as ordinary text, never as the
    end-of-document id: only preprocessing's --append-eod puts document boundaries in data.
    """

    kind = "gpt2bpe"

    def __init__(self, vocab_file: str, merges_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        super().__init__(f"gpt2bpe:{vocab_file},{merges_file}", (vocab_file, merges_file))
        model = self._load(lambda: models.BPE.from_file(vocab_file, merges_file), "cannot load BPE files")
        self._tok = Tokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise DataError(f"tokenizer {self.spec!r}: {vocab_file} has no {EOD_TOKEN} entry for end of document")
        self.eod = eod
        self.vocab_size = self._tok.get_vocab_size()


class SentencePieceTokenizer(_TokenizerFiles):
    """A SentencePiece model; the end-of-document id is the model's </s> (eos) piece."""

    kind = "sentencepiece"

    def __init__(self, model_file: str) -> None:
        import sentencepiece as spm

        super().__init__(f"sentencepiece:{model_file}", (model_file,))
        self._sp = self._load(lambda: spm.SentencePieceProcessor(model_file=model_file), "not a SentencePiece model")
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise DataError(f"tokenizer {self.spec!r}: the model has no eos piece to use as end of document")
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # num_threads=1: parallelism comes from preprocessing's worker processes.
        return self._sp.encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(list(ids))


class HFTokenizer(_PipelineTokenizer):
    """A Hugging Face tokenizer.json (any `tokenizers` pipeline: Llama 3's byte-level BPE, ...).

    Special tokens written in the text (<|begin_of_text|>, ...) are matched, as transformers
    does. The end-of-document id is the directory's eos token: tokenizer_config.json's
    eos_token, else config.json's (or generation_config.json's) eos_token_id, the first of a list."""

    kind = "hf"

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        super().__init__(f"hf:{path}", (path,))
        self._tok = self._load(lambda: Tokenizer.from_file(path), "not a tokenizer.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._eos(os.path.dirname(path))

    def _eos(self, directory: str) -> int:
        token = _json_entry(os.path.join(directory, "tokenizer_config.json"), "eos_token")
        if isinstance(token, dict):  # an AddedToken written out: {"content": ..., ...}
            token = token.get("content")
        found = self._tok.token_to_id(token) if isinstance(token, str) else None
        if found is not None:
            return found
        for name in ("config.json", "generation_config.json"):
            eos = _json_entry(os.path.join(directory, name), "eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
            if isinstance(eos, int) and 0 <= eos < self.vocab_size:
                return eos
        raise DataError(f"tokenizer {self.spec!r}: no end-of-document token (eos_token in tokenizer_config.json "
                        f"or eos_token_id in config.json beside it)")


def _json_entry(path: str, key: str) -> Any:
    """KEY of the JSON object in PATH; None when the file or the key is missing."""
    value = read_json(path, "fix or remove it")
    return value.get(key) if isinstance(value, dict) else None


def spec_of_directory(directory: str) -> str | None:
    """The spec of the tokenizer files in a Hugging Face model directory: GPT-2's vocab.json +
    merges.txt, else a SentencePiece tokenizer.model (Llama 2 style, the tokenizer.json beside
    it being derived from it), else a tokenizer.json (Llama 3 style); None without any."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(directory, name))

    if has("vocab.json") and has("merges.txt"):
        return f"gpt2bpe:{directory}"
    if has(SPM_MODEL_NAME):
        return f"sentencepiece:{directory}"
    if has(HF_TOKENIZER_NAME):
        return f"hf:{directory}"
    return None


Tokenizer = GPT2BPETokenizer | SentencePieceTokenizer | HFTokenizer


def build_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer a spec string names (see the module docstring for the forms)."""
    kind, sep, path = spec.partition(":")
    if (not sep or kind not in KINDS) and os.path.isdir(spec):  # a Hugging Face model directory
        found = spec_of_directory(spec)
        if found is None:
            raise DataError(f"tokenizer {spec!r}: the directory holds no tokenizer files (vocab.json + merges.txt, "
                            f"tokenizer.model or tokenizer.json)")
        kind, _, path = found.partition(":")
    elif not sep or not path or kind not in KINDS:
        raise DataError(
            f"tokenizer spec {spec!r} is not KIND:PATH with KIND one of {', '.join(KINDS)}; "
            f"e.g. gpt2bpe:DIR (vocab.json + merges.txt), sentencepiece:FILE.model or hf:DIR (tokenizer.json)"
        )
    tokenizer: Tokenizer
    if kind == "gpt2bpe":
        if "," in path:
            vocab_file, merges_file = path.split(",", 1)
        else:
            vocab_file, merges_file = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
        tokenizer = GPT2BPETokenizer(vocab_file, merges_file)
    else:  # one file, or the directory holding it under its usual name
        cls, name = (HFTokenizer, HF_TOKENIZER_NAME) if kind == "hf" else (SentencePieceTokenizer, SPM_MODEL_NAME)
        tokenizer = cls(os.path.join(path, name) if os.path.isdir(path) else path)
    tokenizer.spec = spec  # as the user wrote it, for messages and the dataset sidecar
    return tokenizer


def train_gpt2bpe(texts: Iterable[str], vocab_size: int, output_dir: str | os.PathLike) -> str:
    """Train a GPT-2 style byte-level BPE; write OUTPUT_DIR/vocab.json + merges.txt; return its spec.

    As in GPT-2's own files, the ids start with the 256 byte symbols and <|endoftext|> is the
    last id, so the vocabulary holds at most vocab_size entries (fewer if the corpus runs out
    of merges).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"--vocab-size {vocab_size} is too small for byte-level BPE; use at least 257")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the last id is kept for <|endoftext|>
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    counter = _Counter(texts)
    tok.train_from_iterator(iter(counter), trainer)
    counter.require_some()
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = tok.model.save(tmp)
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        vocab[EOD_TOKEN] = len(vocab)
        with open(vocab_file, "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        _move_into(output_dir, [vocab_file, merges_file])
    return f"gpt2bpe:{output_dir}"


def train_sentencepiece(
    texts: Iterable[str], vocab_size: int, output_dir: str | os.PathLike, model_type: str = "bpe"
) -> str:
    """Train a SentencePiece model (byte fallback, so no text is unknown); write OUTPUT_DIR/tokenizer.model.

    The vocabulary holds at most vocab_size pieces (fewer if the corpus has no more to give)."""
    import sentencepiece as spm

    counter = _Counter(_paragraphs(texts))
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "tokenizer")  # writes tokenizer.model: SPM_MODEL_NAME
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(counter),
                model_prefix=prefix,
                vocab_size=vocab_size,
                # a corpus too small for vocab_size yields fewer pieces (train_tokenizer.py
                # says so) instead of failing, as byte-level BPE does
                hard_vocab_limit=False,
                model_type=model_type,
                byte_fallback=True,
                character_coverage=0.9995,
                # identity + kept whitespace: decode(encode(text)) == text, newlines included.
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                unk_id=0,
                bos_id=1,
                eos_id=2,
                pad_id=-1,
                max_sentence_length=1 << 16,
                minloglevel=2,
            )
        except RuntimeError as e:  # e.g. vocab_size smaller than the byte and special pieces
            counter.require_some()
            raise DataError(f"sentencepiece training failed: {str(e).strip().splitlines()[-1]}") from None
        _move_into(output_dir, [prefix + ".model"])
    return f"sentencepiece:{os.path.join(output_dir, SPM_MODEL_NAME)}"


class _Counter:
    """Passes the non-empty texts through, counting them, so an empty corpus gets a clear error."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts, self.count = texts, 0

    def __iter__(self) -> Iterator[str]:
        for text in self.texts:
            if text:
                self.count += 1
                yield text

    def require_some(self) -> None:
        if self.count == 0:
            raise DataError("the training corpus holds no text; check --input and --json-keys")


def _paragraphs(texts: Iterable[str]) -> Iterator[str]:
    # SentencePiece trains on "sentences" of bounded length; paragraphs keep the newlines
    # inside them, so the model learns pieces for line breaks and indentation.
    for text in texts:
        for paragraph in text.split("\n\n"):
            if paragraph.strip():
                yield paragraph


def _move_into(output_dir: str | os.PathLike, files: list[str]) -> None:
    """Move files into output_dir, each via a temporary name, so none is ever half-written."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for src in files:
        with open(src, "rb") as f, atomic_write(str(out / os.path.basename(src))) as g:
            shutil.copyfileobj(f, g)
