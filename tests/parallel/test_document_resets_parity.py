"""data.reset_position_ids and data.reset_attention_mask (Megatron's --reset-position-ids,
--reset-attention-mask) in training, for streamed and indexed data alike: tp 2 with sequence
parallelism (full recompute) and, under slow, pp 2 (selective recompute) give the one-process
losses, and the resets change them (the per-document reference is tests/unit/test_document_resets.py)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from helpers import make_texts, make_trainer, run_distributed, write_jsonl
from megazero.data.indexed import IndexedDatasetWriter
from megazero.data.tokenizer import build_tokenizer

RESETS = ["--data.reset_position_ids", "true", "--data.reset_attention_mask", "true"]
LAYOUTS = {"tp2 sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--train.recompute", "full"],
           "pp2": ["--parallel.pp", "2", "--train.recompute", "selective"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory, bpe_spec) -> dict[str, list[str]]:
    """The arguments of each kind of data: raw JSONL streamed, and an indexed dataset whose
    documents each end in the end-of-document token (as preprocess_data.py --append-eod writes)."""
    root = tmp_path_factory.mktemp("resets")
    write_jsonl(root / "a.jsonl", make_texts(200, seed=5))
    tokenizer = build_tokenizer(bpe_spec)
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(root / "docs"), np.uint16) as writer:
        for _ in range(300):
            doc = rng.integers(0, tokenizer.vocab_size, int(rng.integers(3, 40)))
            doc[-1] = tokenizer.eod
            writer.add_document(doc)
        writer.finalize()
    common = ["--data.tokenizer", bpe_spec, "--train.iters", "3", "--train.micro_batch_size", "2",
              "--train.global_batch_size", "4", "--train.log_interval", "1"]
    return {"stream": [*common, "--data.stream", str(root / "a.jsonl"), "--data.loader_workers", "0"],
            "indexed": [*common, "--data.prefix", str(root / "docs"), "--data.split", "100,0,0"]}


def _losses(args: list[str]) -> list[float]:
    trainer = make_trainer(args)
    with contextlib.redirect_stdout(io.StringIO()):
        return [r["loss"] for r in trainer.run()]


def _one_rank(data: dict) -> dict:
    return {kind: (_losses([*args, *RESETS]), _losses(args)) for kind, args in data.items()}


def _layout(data: dict, layout: list[str]) -> dict:
    return {kind: _losses([*args, *RESETS, *layout]) for kind, args in data.items()}


@pytest.fixture(scope="module")
def reference(data) -> dict:
    return run_distributed(_one_rank, 1, data)[0]


def test_the_resets_change_the_losses(reference):
    for kind, (reset, plain) in reference.items():
        assert len(reset) == 3 and all(abs(a - b) > 1e-4 for a, b in zip(reset, plain)), kind


@pytest.mark.parametrize("name", [pytest.param("tp2 sp"), pytest.param("pp2", marks=pytest.mark.slow)])
def test_resets_match_one_process(data, reference, name):
    ranks = run_distributed(_layout, 2, data, LAYOUTS[name])
    for kind, losses in ranks[-1].items():  # the last rank holds the loss at pp 2
        np.testing.assert_allclose(losses, reference[kind][0], rtol=0, atol=1e-5, err_msg=f"{kind} {name}")
