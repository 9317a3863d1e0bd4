"""`INPUT=... STREAM=1 bash scripts/pretrain_gpt.sh` trains straight from raw JSONL: no dataset
is built, nothing is tokenized to disk; the tokens per source are in the metrics; run again,
it resumes the stream (the long form)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers import REPO, TINY_CONFIG, make_texts, write_jsonl


def _run(tmp_path, bpe_spec: str, iters: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "STREAM": "1", "INPUT": str(tmp_path / "corpus.jsonl"), "TOKENIZER": bpe_spec,
           "CONFIG": TINY_CONFIG, "NPROC": "2", "TP": "1", "PP": "1", "ZERO_STAGE": "0", "ITERS": str(iters),
           "RUN_DIR": str(tmp_path / "run"), "DATA_DIR": str(tmp_path / "data"),
           "MASTER_PORT": str(29500 + (os.getpid() + 7) % 1000)}
    return subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--train.log_interval", "2", "--data.loader_workers", "1",
                           "--train.eval_interval", "2", "--train.eval_iters", "1", "--optim.warmup_iters", "1"],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900)


def _records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]


def test_stream_launch_trains_without_preprocessing(tmp_path, bpe_spec):
    write_jsonl(tmp_path / "corpus.jsonl", make_texts(400))
    proc = _run(tmp_path, bpe_spec, 4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "tokenized on the fly by 1 loader process(es) per rank, nothing written to disk" in proc.stdout
    assert "loader process(es) per rank supply" in proc.stdout
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").glob("*.bin"))
    records = _records(tmp_path)
    assert [r["iteration"] for r in records] == [2, 4]
    assert records[-1]["stream_tokens"] == {str(tmp_path / "corpus.jsonl"): 4 * 16 * 64}
    assert all("val_loss" in r for r in records)
    assert "leaked" not in proc.stderr


@pytest.mark.slow
def test_stream_launch_resumes_the_stream(tmp_path, bpe_spec):
    write_jsonl(tmp_path / "corpus.jsonl", make_texts(400))
    assert _run(tmp_path, bpe_spec, 4).returncode == 0
    proc = _run(tmp_path, bpe_spec, 6)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert _records(tmp_path)[-1]["stream_tokens"] == {str(tmp_path / "corpus.jsonl"): 6 * 16 * 64}
