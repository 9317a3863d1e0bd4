#!/usr/bin/env python
"""Train a tokenizer on a corpus, offline: GPT-2 byte-level BPE or SentencePiece.

    python data_tools/train_tokenizer.py --type gpt2bpe --vocab-size 8192 --output data/tokenizer
    python data_tools/train_tokenizer.py --type sentencepiece --input corpus.jsonl --vocab-size 8000 --output data/spm

gpt2bpe writes OUTPUT/vocab.json + merges.txt in GPT-2's format (<|endoftext|> is the last
id, the end of document); sentencepiece writes OUTPUT/tokenizer.model (its </s> is the end of
document). The printed spec (gpt2bpe:OUTPUT or sentencepiece:OUTPUT/tokenizer.model) is what
preprocess_data.py --tokenizer and the data.tokenizer config take. --input accepts what
preprocess_data.py accepts; without it the embedded default corpus is used.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run from a checkout without installing: the repository root holds the megazero package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.data import DataError  # noqa: E402
from megazero.data.corpus import iter_texts, quiet_hugging_face  # noqa: E402
from megazero.data.tokenizer import build_tokenizer, train_gpt2bpe, train_sentencepiece  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", required=True, choices=["gpt2bpe", "sentencepiece"], help="tokenizer kind")
    p.add_argument("--input", help="JSONL/text file, folder, glob, or Hugging Face dataset; default: the embedded corpus")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys (columns) holding the text")
    p.add_argument("--split", default="train", help="split of a Hugging Face dataset")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip unreadable records instead of stopping")
    p.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, end-of-document token included")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"], help="SentencePiece algorithm")
    p.add_argument("--output", required=True, help="output folder")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> str:
    """Train the tokenizer args describe; returns its spec."""
    texts = iter_texts(args.input, args.json_keys, args.split, args.skip_bad_lines)
    if args.type == "gpt2bpe":
        return train_gpt2bpe(texts, args.vocab_size, args.output)
    return train_sentencepiece(texts, args.vocab_size, args.output, args.model_type)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_hugging_face()
    start = time.perf_counter()
    try:
        spec = train(args)
        tokenizer = build_tokenizer(spec)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename}" if e.filename else f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    if tokenizer.vocab_size < args.vocab_size:
        print(f"warning: the corpus yields only {tokenizer.vocab_size:,} tokens of the {args.vocab_size:,} "
              f"--vocab-size asked for; use a larger corpus (--input) or a smaller --vocab-size", file=sys.stderr)
    print(f"trained {spec} in {seconds:.1f} s: vocab {tokenizer.vocab_size}, end of document id {tokenizer.eod}")
    print(f"use it with: --tokenizer {spec} (preprocess_data.py), data.tokenizer: {spec} (training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
