#!/usr/bin/env python
"""Tokenize a corpus once into Megatron-LM MMIDIDX indexed datasets.

    python data_tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer gpt2bpe:data/tokenizer --output-prefix data/corpus --workers 2 --append-eod

writes data/corpus_text_document.{bin,idx} (one pair per --json-keys key) and the
.meta.json sidecar that lets training check the tokenizer. --input is a JSONL file, a plain
text file (one document per file), a folder or glob of them, local parquet/arrow/csv files, a
Hugging Face save_to_disk folder or hub name; without --input the embedded default corpus
(text shipped with Python) is used. Megatron-LM's tokenizer flags work too:
--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M, or
--tokenizer-type SentencePieceTokenizer --tokenizer-model FILE, or
--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (a directory with tokenizer.json).

Fine-tuning examples: JSONL records with a prompt and a completion,

    python data_tools/preprocess_data.py --input qa.jsonl --prompt-key prompt --completion-key completion \\
        --tokenizer gpt2bpe:data/tokenizer --output-prefix data/qa

write one document per example (prompt tokens, completion tokens, EOD) to
data/qa_prompt_completion_document.{bin,idx} and its loss mask, uint8 with the same document
sizes, to data/qa_prompt_completion_document_loss_mask.{bin,idx}: 1 on completion tokens and
the EOD (they count in the loss), 0 on prompt tokens. Training finds the mask beside the
dataset. Without --input the examples are question/answer pairs built from the embedded
corpus. A record with a missing key, an empty completion or a line that is not JSON stops
the run with its line number (or is skipped with --skip-bad-lines).

--merge P1 P2 ... --output-prefix OUT concatenates existing datasets into OUT.{bin,idx}.

Bad input stops with one line `error: ...` and exit status 2; outputs are written under
temporary names and only renamed into place when complete.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
import time
from itertools import chain
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

# Worker processes supply the parallelism; the tokenizers library's own thread pool would
# compete with them (and it cannot survive fork).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Run from a checkout without installing: the repository root holds the megazero package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from megazero.config.megatron import tokenizer_spec as megatron_tokenizer_spec  # noqa: E402
from megazero.config.schema import ConfigError  # noqa: E402
from megazero.data import DataError  # noqa: E402
from megazero.data.corpus import (  # noqa: E402
    CorpusChunk,
    parse_chunk,
    quiet_hugging_face,
    read_chunks,
    resolve_inputs,
    write_default_corpus,
    write_default_examples,
)
from megazero.data.indexed import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    index_path,
    loss_mask_prefix,
    read_metadata,
)
from megazero.data.tokenizer import build_tokenizer  # noqa: E402

META_FORMAT = "megazero-indexed-meta/1"
MAX_SKIPPED_SHOWN = 3
DEFAULT_CORPUS_NAME = f"default corpus (Python {platform.python_version()} documentation and docstrings)"
DEFAULT_EXAMPLES_NAME = f"default examples (questions on Python {platform.python_version()}'s standard library)"
LOSS_MASK = "loss_mask"  # the output key of an example dataset's mask


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", help="JSONL/text file, folder, glob, or Hugging Face dataset; default: the embedded corpus")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys (columns) to tokenize, one output each")
    g.add_argument("--split", default="train", help="split of a Hugging Face dataset")
    g.add_argument("--skip-bad-lines", action="store_true", help="count and skip unreadable records instead of stopping")
    g.add_argument("--prompt-key", help="fine-tuning examples: the key of the prompt (no loss on it) [prompt]")
    g.add_argument("--completion-key", help="fine-tuning examples: the key of the completion (counts in the loss) [completion]")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer", help="spec: gpt2bpe:DIR, gpt2bpe:VOCAB,MERGES or sentencepiece:FILE.model")
    g.add_argument("--tokenizer-type", help="Megatron name (GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer) or gpt2bpe/sentencepiece/hf")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json")
    g.add_argument("--merge-file", help="GPT-2 merges.txt")
    g.add_argument("--tokenizer-model", help="SentencePiece .model file; HuggingFaceTokenizer: a local directory with tokenizer.json")
    g.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.{bin,idx}")
    g.add_argument("--merge", nargs="+", metavar="PREFIX", help="merge these datasets into --output-prefix instead")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--dataset-impl", choices=["mmap"], default="mmap", help="accepted for Megatron compatibility")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers} must be at least 1")
    args.examples = None  # (prompt key, completion key) in fine-tuning mode
    if args.prompt_key or args.completion_key:
        args.examples = (args.prompt_key or "prompt", args.completion_key or "completion")
        if args.examples[0] == args.examples[1]:
            p.error(f"--prompt-key and --completion-key are both {args.examples[0]!r}; name two different keys")
        args.json_keys = list(args.examples)
        args.append_eod = True  # the model learns where a completion ends
    return args


def tokenizer_spec(args: argparse.Namespace) -> str:
    if args.tokenizer:
        return args.tokenizer
    if args.tokenizer_type:
        try:
            return megatron_tokenizer_spec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model)
        except ConfigError as e:
            raise DataError(str(e)) from None
    raise DataError(
        "no tokenizer: pass --tokenizer gpt2bpe:DIR (train one with data_tools/train_tokenizer.py) "
        "or --tokenizer-type with its files"
    )


# --- encoding (runs in worker processes) -----------------------------------------------------


class Encoded(NamedTuple):
    """One chunk's documents per key: tokens back to back and their lengths."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    documents: int
    empty: int
    skipped: list[str]
    nbytes: int


def _flat(docs: list[list[int]], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """(documents back to back, their lengths)."""
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    return np.fromiter(chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum())), lengths


class Encoder:
    def __init__(
        self, spec: str, keys: list[str], append_eod: bool, skip_bad: bool, examples: tuple[str, str] | None = None
    ) -> None:
        self.tokenizer = build_tokenizer(spec)
        self.keys, self.append_eod, self.skip_bad, self.examples = keys, append_eod, skip_bad, examples

    def encode(self, chunk: CorpusChunk) -> Encoded:
        if self.examples:
            return self._encode_examples(chunk)
        records, skipped = parse_chunk(chunk, self.keys, self.skip_bad)
        tokens, lengths, empty = {}, {}, 0
        for key in self.keys:
            ids = [d for d in self.tokenizer.encode_batch([r[key] for r in records]) if d]
            # Documents with no tokens are left out: they would add nothing but an EOD.
            empty += len(records) - len(ids)
            if self.append_eod:
                ids = [[*d, self.tokenizer.eod] for d in ids]
            tokens[key], lengths[key] = _flat(ids, np.int32)
        return Encoded(tokens, lengths, len(records), empty, skipped, chunk.nbytes)

    def _encode_examples(self, chunk: CorpusChunk) -> Encoded:
        """One document per example, prompt + completion + EOD, and its loss mask (0 on the
        prompt, 1 on the rest); prompt and completion are tokenized apart, so the mask
        boundary falls exactly between them."""
        prompt_key, completion_key = self.examples
        flag = "--prompt-key/--completion-key"
        records, skipped = parse_chunk(chunk, self.keys, self.skip_bad, nonempty=(completion_key,), key_flag=flag)
        prompts = self.tokenizer.encode_batch([r[prompt_key] for r in records])
        completions = self.tokenizer.encode_batch([r[completion_key] for r in records])
        docs = [[*p, *c, self.tokenizer.eod] for p, c in zip(prompts, completions)]
        masks = [[0] * len(p) + [1] * (len(c) + 1) for p, c in zip(prompts, completions)]
        tokens, lengths = _flat(docs, np.int32)
        mask, mask_lengths = _flat(masks, np.uint8)
        return Encoded({"document": tokens, LOSS_MASK: mask}, {"document": lengths, LOSS_MASK: mask_lengths},
                       len(records), 0, skipped, chunk.nbytes)


_worker_encoder: Encoder | None = None  # one per worker process, set by the pool initializer


def _init_worker(*encoder_args: Any) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(*encoder_args)


def _encode_in_worker(chunk: CorpusChunk) -> Encoded:
    assert _worker_encoder is not None
    return _worker_encoder.encode(chunk)


def _encoded_chunks(chunks: Iterable[CorpusChunk], encoder_args: tuple, workers: int) -> Iterator[Encoded]:
    """Encoded chunks in input order, from `workers` processes (in this process for 1)."""
    if workers == 1:
        encoder = Encoder(*encoder_args)
        yield from map(encoder.encode, chunks)
        return
    import multiprocessing

    # Pool.imap reads its input as fast as it can; the semaphore bounds the chunks in flight
    # so a large corpus is never held in memory. Pool's feeder thread runs bounded(), and
    # `stop` lets it return when we stop early (the pool's shutdown waits for that thread).
    slots, stop = threading.Semaphore(4 * workers), threading.Event()

    def bounded() -> Iterator[CorpusChunk]:
        for chunk in chunks:
            while not slots.acquire(timeout=0.1):
                if stop.is_set():
                    return
            yield chunk

    with multiprocessing.Pool(workers, _init_worker, encoder_args) as pool:
        try:
            for encoded in pool.imap(_encode_in_worker, bounded()):
                slots.release()
                yield encoded
        finally:
            stop.set()


# --- the two modes ---------------------------------------------------------------------------


class Progress:
    """Documents/s and MB/s while tokenizing: a tqdm bar on a terminal (with ETA when the
    input size is known), else a plain line every LOG_SECONDS for log files."""

    LOG_SECONDS = 30.0

    def __init__(self, total_bytes: int | None, enabled: bool) -> None:
        self.start = self.last_log = time.perf_counter()
        self.documents = self.nbytes = 0
        self.total_bytes = total_bytes
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", leave=False, mininterval=0.5)

    def update(self, encoded: Encoded) -> None:
        self.documents += encoded.documents
        self.nbytes += encoded.nbytes
        now = time.perf_counter()
        docs_per_s = self.documents / max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.documents:,} docs, {docs_per_s:,.0f} docs/s", refresh=False)
            self.bar.update(encoded.nbytes)
        elif self.enabled and now - self.last_log >= self.LOG_SECONDS:
            self.last_log = now
            done = f" ({100 * self.nbytes / self.total_bytes:.0f}%)" if self.total_bytes else ""
            mb_per_s = self.nbytes / 1e6 / (now - self.start)
            print(f"tokenizing: {self.nbytes / 1e6:,.1f} MB{done}, {self.documents:,} docs, "
                  f"{docs_per_s:,.0f} docs/s, {mb_per_s:,.2f} MB/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def preprocess(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize args.input into one dataset per key; returns the summary figures."""
    spec = tokenizer_spec(args)
    tokenizer = build_tokenizer(spec)  # fail on a bad tokenizer before reading anything
    with tempfile.TemporaryDirectory() as tmp:
        source = args.input or (DEFAULT_EXAMPLES_NAME if args.examples else DEFAULT_CORPUS_NAME)
        write_default = write_default_examples if args.examples else write_default_corpus
        sources = resolve_inputs(args.input or write_default(os.path.join(tmp, "default.jsonl")), args.split)
        # The bar shows a total (and ETA) when every input is a file of known size.
        total_bytes = None if any(s.kind == "hf" for s in sources) else sum(os.path.getsize(s.name) for s in sources)
        dtype = best_dtype(tokenizer.vocab_size)
        writers = _writers(args, dtype)
        try:
            summary = _tokenize_into(writers, sources, spec, args, total_bytes)
            if summary["documents"] == 0 or summary["tokens"] == 0:
                raise DataError(f"--input {source!r} holds no text to tokenize ({_record_counts(summary)})")
            for key, writer in writers.items():
                name = "+".join(args.examples) if args.examples else key
                meta = None if key == LOSS_MASK else _metadata(tokenizer, writer, source, name, args.append_eod)
                writer.finalize(meta)
        finally:
            for writer in writers.values():
                writer.abort()  # a no-op for finalized writers
    summary.update(outputs=[w.prefix for w in writers.values()], dtype=str(dtype))
    return summary


def _writers(args: argparse.Namespace, dtype: np.dtype) -> dict[str, IndexedDatasetWriter]:
    """One writer per output: per --json-keys key, or an example dataset and its loss mask."""
    if not args.examples:
        return {key: IndexedDatasetWriter(f"{args.output_prefix}_{key}_document", dtype) for key in args.json_keys}
    prefix = f"{args.output_prefix}_{args.examples[0]}_{args.examples[1]}_document"
    return {"document": IndexedDatasetWriter(prefix, dtype),
            LOSS_MASK: IndexedDatasetWriter(loss_mask_prefix(prefix), np.uint8)}


def _tokenize_into(
    writers: dict[str, IndexedDatasetWriter], sources: list, spec: str, args: argparse.Namespace, total_bytes: int | None
) -> dict[str, Any]:
    start = time.perf_counter()
    progress = Progress(total_bytes, enabled=not args.no_progress)
    counts = {"documents": 0, "empty": 0, "tokens": 0, "bytes": 0, "skipped": 0}
    examples: list[str] = []  # of skipped lines, for the summary; not all of them
    try:
        chunks = read_chunks(sources, args.json_keys)
        encoder_args = (spec, args.json_keys, args.append_eod, args.skip_bad_lines, args.examples)
        for encoded in _encoded_chunks(chunks, encoder_args, args.workers):
            for key, writer in writers.items():
                writer.add_documents(encoded.tokens[key], encoded.lengths[key])
                counts["tokens"] += len(encoded.tokens[key]) if key != LOSS_MASK else 0
            counts["documents"] += encoded.documents
            counts["empty"] += encoded.empty
            counts["bytes"] += encoded.nbytes
            counts["skipped"] += len(encoded.skipped)
            examples.extend(encoded.skipped[: MAX_SKIPPED_SHOWN - len(examples)])
            progress.update(encoded)
    finally:
        progress.close()
    return {**counts, "skipped_examples": examples, "seconds": time.perf_counter() - start}


def _record_counts(summary: dict[str, Any]) -> str:
    return f"{summary['documents']} documents, {summary['empty']} empty, {summary['skipped']} bad lines skipped"


def _metadata(tokenizer: Any, writer: IndexedDatasetWriter, source: str, key: str, append_eod: bool) -> dict[str, Any]:
    return {
        "format": META_FORMAT,
        "tokenizer": tokenizer.identity(),
        "tokenizer_spec": tokenizer.spec,
        "max_token_id": writer.max_token_id,
        "num_documents": writer.num_documents,
        "num_tokens": writer.num_tokens,
        "source": source,
        "json_key": key,
        "append_eod": append_eod,
    }


def merge(args: argparse.Namespace) -> dict[str, Any]:
    """Concatenate datasets (same dtype, same tokenizer when their sidecars say) into one."""
    start = time.perf_counter()
    datasets = [IndexedDataset(p) for p in args.merge]
    metas = [read_metadata(p) for p in args.merge]
    identities = {str(m["tokenizer"]) for m in metas if m and "tokenizer" in m}
    if len(identities) > 1:
        raise DataError(f"--merge inputs were made with different tokenizers ({len(identities)} distinct); merge only like with like")
    _merge_loss_masks(args.merge, args.output_prefix)
    with IndexedDatasetWriter(args.output_prefix, datasets[0].dtype) as writer:
        for prefix in args.merge:
            writer.add_index(prefix)
        meta = None
        if all(metas) and identities:
            meta = {**metas[0], "max_token_id": writer.max_token_id, "num_documents": writer.num_documents,
                    "num_tokens": writer.num_tokens, "source": " + ".join(args.merge)}
        writer.finalize(meta)
        summary = {"documents": writer.num_documents, "tokens": writer.num_tokens}
    nbytes = sum(os.path.getsize(f"{p}.bin") for p in args.merge)
    return {**summary, "empty": 0, "skipped": 0, "skipped_examples": [], "bytes": nbytes,
            "seconds": time.perf_counter() - start, "outputs": [args.output_prefix], "dtype": str(datasets[0].dtype)}


def _merge_loss_masks(prefixes: list[str], output_prefix: str) -> None:
    """Fine-tuning datasets merge with their loss masks; a mix with plain datasets is refused
    (the plain ones have no mask to merge, and dropping the others' would count their prompts)."""
    has_mask = [os.path.exists(index_path(loss_mask_prefix(p))) for p in prefixes]
    if not any(has_mask):
        return
    if not all(has_mask):
        plain, masked = prefixes[has_mask.index(False)], prefixes[has_mask.index(True)]
        raise DataError(f"--merge: {masked!r} has a loss mask (fine-tuning examples) but {plain!r} has none; "
                        f"merge fine-tuning datasets only with each other (training can blend the two kinds)")
    with IndexedDatasetWriter(loss_mask_prefix(output_prefix), np.uint8) as writer:
        for prefix in prefixes:
            writer.add_index(loss_mask_prefix(prefix))
        writer.finalize()


def format_summary(s: dict[str, Any]) -> str:
    secs = max(s["seconds"], 1e-9)
    lines = [
        f"wrote {', '.join(p + '.{bin,idx}' for p in s['outputs'])} ({s['dtype']})",
        f"{s['documents']:,} documents, {s['tokens']:,} tokens, {s['bytes'] / 1e6:,.2f} MB in {secs:.2f} s: "
        f"{s['documents'] / secs:,.0f} docs/s, {s['bytes'] / 1e6 / secs:,.2f} MB/s, {s['tokens'] / secs:,.0f} tokens/s",
    ]
    if s["empty"]:
        lines.append(f"{s['empty']:,} empty documents left out")
    if s["skipped"]:
        lines.append(f"{s['skipped']:,} bad lines skipped, e.g. {s['skipped_examples'][0]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_hugging_face()
    try:
        summary = merge(args) if args.merge else preprocess(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename}" if e.filename else f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; no output was written", file=sys.stderr)
        return 130
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
