#!/usr/bin/env python
"""Preprocessing throughput (MB/s, documents/s, tokens/s) at 1 and 2 workers.

    python scripts/bench_preprocess.py [--tokenizer SPEC] [--generated-mb 32] [--workers 1 2]

Two corpora: the embedded default corpus, and a larger one generated from its paragraphs
(seeded, so every run measures the same bytes). Without --tokenizer, a GPT-2 byte-level BPE
of 8192 tokens is trained on the default corpus first (not timed). Each row runs
data_tools/preprocess_data.py's pipeline in this process and times the tokenize-and-write
stage (the fastest of --repeats runs) and its CPU time (MB/cpu-s: worker efficiency, which
other load on the machine does not change); the outputs of different worker counts are
checked to be identical bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import sys
import tempfile
from pathlib import Path

import numpy as np

from megazero.atomic import atomic_write
from megazero.data.corpus import default_corpus_documents
from megazero.data.tokenizer import build_tokenizer, train_gpt2bpe

REPO = Path(__file__).resolve().parents[1]


def load_preprocess():
    """data_tools/preprocess_data.py as a module (registered, so worker processes can find it)."""
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "data_tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module
    spec.loader.exec_module(module)
    return module


def write_generated_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
    """Documents of 1-12 paragraphs drawn (seeded) from the default corpus, up to `megabytes`."""
    paragraphs = [p for doc in default_corpus_documents() for p in doc.split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    target, written = megabytes * 1e6, 0
    with atomic_write(str(path), "w", encoding="utf-8") as f:
        while written < target:
            picks = rng.integers(0, len(paragraphs), size=int(rng.integers(1, 13)))
            line = json.dumps({"text": "\n\n".join(paragraphs[i] for i in picks)}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
    return path


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the pool's workers, once it closes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(preprocess, corpus: str | None, spec: str, workers: int, out: Path) -> dict:
    argv = ["--tokenizer", spec, "--output-prefix", str(out), "--workers", str(workers), "--append-eod", "--no-progress"]
    if corpus:
        argv += ["--input", corpus]
    cpu_before = cpu_seconds()
    summary = preprocess.preprocess(preprocess.parse_args(argv))
    # CPU time spent per MB does not depend on what else the machine runs; wall time does.
    summary["cpu_seconds"] = cpu_seconds() - cpu_before
    summary["digest"] = [Path(f"{p}.{ext}").read_bytes() for p in summary["outputs"] for ext in ("bin", "idx")]
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="tokenizer spec; default: train an 8192-token GPT-2 BPE on the default corpus")
    p.add_argument("--generated-mb", type=float, default=32.0, help="size of the generated corpus (default: %(default)s)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="tokenizing processes of each row (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="runs per row; the fastest is reported (shared machines are noisy) (default: %(default)s)")
    p.add_argument("--output-json", help="also write the rows here")
    args = p.parse_args()
    preprocess = load_preprocess()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        spec = args.tokenizer or train_gpt2bpe(default_corpus_documents(), 8192, os.path.join(tmp, "tok"))
        tok = build_tokenizer(spec)
        generated = write_generated_corpus(Path(tmp) / "generated.jsonl", args.generated_mb)
        print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, tokenizer {tok.kind} vocab {tok.vocab_size}")
        print(f"{'corpus':<10} {'MB':>7} {'docs':>8} {'tokens':>11} {'workers':>7} {'s':>7} "
              f"{'MB/s':>6} {'docs/s':>8} {'tokens/s':>10} {'speedup':>7} {'MB/cpu-s':>8}")
        for name, corpus in (("default", None), ("generated", str(generated))):
            base, first_digest = None, None
            for workers in args.workers:
                runs = [measure(preprocess, corpus, spec, workers, Path(tmp) / f"{name}_{workers}") for _ in range(args.repeats)]
                s = min(runs, key=lambda r: r["seconds"])
                first_digest = first_digest or s["digest"]
                assert s["digest"] == first_digest, "worker counts produced different datasets"
                base = base or s["seconds"]
                row = {"corpus": name, "mb": s["bytes"] / 1e6, "documents": s["documents"], "tokens": s["tokens"],
                       "workers": workers, "seconds": s["seconds"], "mb_per_s": s["bytes"] / 1e6 / s["seconds"],
                       "docs_per_s": s["documents"] / s["seconds"], "tokens_per_s": s["tokens"] / s["seconds"],
                       "speedup": base / s["seconds"], "mb_per_cpu_s": s["bytes"] / 1e6 / s["cpu_seconds"]}
                rows.append(row)
                print(f"{name:<10} {row['mb']:>7.2f} {row['documents']:>8,} {row['tokens']:>11,} {workers:>7} "
                      f"{row['seconds']:>7.2f} {row['mb_per_s']:>6.2f} {row['docs_per_s']:>8,.0f} "
                      f"{row['tokens_per_s']:>10,.0f} {row['speedup']:>6.2f}x {row['mb_per_cpu_s']:>8.2f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
