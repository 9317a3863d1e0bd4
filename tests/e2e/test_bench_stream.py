"""scripts/bench_stream.py's short form: it prints the raw `tokenizers` rate, the loader's
(per process) and their ratio, on a small corpus."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO, make_texts, write_jsonl


def test_bench_stream_prints_both_rates(tmp_path, bpe_spec):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", make_texts(300))
    proc = subprocess.run([sys.executable, "scripts/bench_stream.py", "--input", str(corpus), "--tokenizer", bpe_spec,
                           "--seq-length", "64", "--samples", "100"], cwd=str(REPO), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = re.search(r"raw batch encoding \(1 thread\): ([\d,.]+)k tokens/s", proc.stdout)
    loader = re.search(r"1 process\(es\): [\d,.]+k tokens/s = ([\d,.]+)k tokens/s per process", proc.stdout)
    ratio = re.search(r"ratio per process: ([\d.]+)x", proc.stdout)
    assert raw and loader and ratio, proc.stdout
    measured = float(loader.group(1).replace(",", "")) / float(raw.group(1).replace(",", ""))
    assert abs(measured - float(ratio.group(1))) <= 0.02  # the ratio is of the two printed rates
