"""The data.stream loader alone: tokens/s per loader process, against the `tokenizers` library's
raw batch encoding of the same text (the ceiling: what the loader adds is reading, shard
assignment, packing and moving windows between processes). Goal: >= 0.8x.

    python scripts/bench_stream.py [--input FILE.jsonl] [--tokenizer SPEC] [--workers 1]
        [--seq-length 1024] [--samples N]

Without --input the embedded corpus (text that ships with Python, ~2.9 MB) is written as JSONL
to a temporary folder; without --tokenizer a byte-level BPE of 8192 tokens is trained on it.
Both sides run one tokenizer thread per process (RAYON_NUM_THREADS=1), in batches of the
loader's size. Prints both rates and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before `tokenizers` is imported: one thread per process

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, not an install

from megazero.data.corpus import default_corpus_documents, write_default_corpus  # noqa: E402
from megazero.data.stream.dataset import StreamDataset  # noqa: E402
from megazero.data.stream.producer import BATCH_DOCS  # noqa: E402
from megazero.data.stream.setup import setup_stream  # noqa: E402
from megazero.data.tokenizer import build_tokenizer, train_gpt2bpe  # noqa: E402


def raw_rate(texts: list[str], spec: str) -> tuple[float, int]:
    """(tokens/s, tokens) of tokenizers' batch encoding, end-of-document token counted."""
    tok = build_tokenizer(spec)
    tic = time.perf_counter()
    tokens = 0
    for start in range(0, len(texts), BATCH_DOCS):
        tokens += sum(len(ids) + 1 for ids in tok.encode_batch(texts[start:start + BATCH_DOCS]))
    return tokens / (time.perf_counter() - tic), tokens


def loader_rate(path: str, spec: str, workers: int, seq_length: int, samples: int) -> float:
    """Tokens/s the loader delivers in packed windows, after a warm-up (the processes' start)."""
    ds = StreamDataset(setup_stream(path, "text", 0, 1, seq_length, spec), 10**12, workers)
    try:
        warm = max(1, samples // 10)
        ds.fetch(0, warm)
        tic = time.perf_counter()
        ds.fetch(warm, warm + samples)
        return samples * seq_length / (time.perf_counter() - tic)
    finally:
        ds.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="a JSONL file with a 'text' field (default: the embedded corpus)")
    p.add_argument("--tokenizer", help="a data.tokenizer spec (default: a BPE of 8192 trained on the input)")
    p.add_argument("--workers", type=int, default=1, help="loader processes (default: 1)")
    p.add_argument("--seq-length", type=int, default=1024, help="window length (default: 1024)")
    p.add_argument("--samples", type=int, default=0,
                   help="windows to time (default: about one epoch of the input, at most 4096)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.input or write_default_corpus(os.path.join(tmp, "corpus.jsonl"))
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        spec = args.tokenizer or train_gpt2bpe(default_corpus_documents(), 8192, os.path.join(tmp, "bpe"))
        raw, tokens = raw_rate(texts, spec)
        samples = args.samples or max(64, min(4096, tokens // args.seq_length))
        loader = loader_rate(path, spec, args.workers, args.seq_length, samples)
    per_worker = loader / max(1, args.workers)
    print(f"input: {path} ({len(texts):,} documents, {tokens:,} tokens); tokenizer {spec}; seq_length "
          f"{args.seq_length}; {samples:,} windows timed")
    print(f"tokenizers raw batch encoding (1 thread): {raw / 1e3:,.1f}k tokens/s")
    print(f"data.stream loader, {args.workers} process(es): {loader / 1e3:,.1f}k tokens/s = "
          f"{per_worker / 1e3:,.1f}k tokens/s per process")
    print(f"ratio per process: {per_worker / raw:.2f}x (goal >= 0.8x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
