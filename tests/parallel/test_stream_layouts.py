"""data.stream's global order is a property of the data: at dp 4 with a loader process, tp 2 x dp 2
(micro-batch 2), pp 2 x dp 2 (micro-batch 4) and cp 2 x dp 2, the ranks together consume the
global batches of a one-process reference, and the documents they consume in an epoch are every
document of the source, each once (no repeats, no gaps). A batch skipped for a persistent NaN
names its streamed documents by FILE:LINE."""

from __future__ import annotations

import contextlib
import io
from collections import Counter

import numpy as np
import pytest

from helpers import make_texts, make_trainer, read_jsonl, run_distributed, write_jsonl
from megazero.data.stream.dataset import StreamDataset
from megazero.data.stream.setup import setup_stream
from megazero.parallel.context import shard_sequence

GBS, SEQ, SEED = 8, 64, 1234  # configs/gpt2-tiny.yaml's seq_length and train.seed
LAYOUTS = {
    "dp4, 1 loader process": ["--train.micro_batch_size", "1", "--data.loader_workers", "1"],
    "tp2 x dp2, mbs 2": ["--parallel.tp", "2", "--train.micro_batch_size", "2"],
    "pp2 x dp2, mbs 4": ["--parallel.pp", "2", "--train.micro_batch_size", "4"],
    "cp2 x dp2, mbs 1": ["--parallel.cp", "2", "--train.micro_batch_size", "1"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, bpe_spec) -> tuple[list[str], StreamDataset, int]:
    """(the run's arguments, the one-process reference stream, the global batches that take all of
    epoch 0: until every shard has given its first window of epoch 1, which holds its carry-over)."""
    root = tmp_path_factory.mktemp("layouts")
    write_jsonl(root / "a.jsonl", make_texts(30, seed=11))
    args = ["--data.stream", str(root / "a.jsonl"), "--data.tokenizer", bpe_spec, "--data.loader_workers", "0",
            "--train.global_batch_size", str(GBS), "--train.iters", "3", "--train.log_interval", "1"]
    reference = StreamDataset(setup_stream(str(root / "a.jsonl"), "text", 0, SEED, SEQ, bpe_spec), 10**9, workers=0)
    read = 0
    while True:
        reference.fetch(0, read + GBS)
        read += GBS
        pieces = [p for i in range(read) for p in reference.sample(i).documents]
        if sum(p[1] == 1 for p in pieces) >= 16 * 2:  # well past every shard's first window of epoch 1
            return args, reference, read // GBS


def _consumed(args: list[str], batches: int, jsonl: str) -> dict:
    """Per layout: this rank's coordinates and the inputs of its micro-batches of the first
    `batches` global batches; then a dp 4 run with a persistent NaN at iteration 2."""
    out = {}
    for name, layout in LAYOUTS.items():
        tr = make_trainer(args + layout)
        try:
            g = tr.grid
            rows = [[row for inputs, _ in tr.microbatches(tr.train_ds, b * GBS) for row in inputs.numpy()]
                    for b in range(batches)]
            out[name] = (g.dp_rank, g.cp_rank, g.cp, g.tp_rank, g.pp_rank, rows)
        finally:
            tr.train_ds.close()
    tr = make_trainer(args + ["--train.micro_batch_size", "1", "--train.inject_fault", "persistent_nan:0:2",
                              "--logging.jsonl", jsonl])
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        tr.run()
    out["printed"] = printed.getvalue()
    return out


def test_every_layout_consumes_the_same_global_batches_and_each_document_once(corpus, tmp_path):
    args, reference, batches = corpus
    jsonl = str(tmp_path / "nan.jsonl")
    ranks = run_distributed(_consumed, 4, args, batches, jsonl)
    for name in LAYOUTS:
        cp = ranks[0][name][2]
        # (cp rank, a row as that cp rank holds it) -> the reference sample it is
        index = {(c, shard_sequence(reference[i][None, :-1], c, cp)[0].tobytes()): i
                 for i in range(batches * GBS) for c in range(cp)}
        holders: dict[tuple[int, int], list] = {}
        for rank in ranks:
            dp, c, _, tp, pp, rows = rank[name]
            if (dp, c) in holders:  # a TP peer or a later pipeline stage holds the same micro-batches
                assert all(np.array_equal(x, y) for a, b in zip(holders[(dp, c)], rows) for x, y in zip(a, b)), name
            else:
                holders[(dp, c)] = rows
        consumed = []
        for b in range(batches):
            taken = Counter(index[(c, row.tobytes())] for (_, c), rows in holders.items() for row in rows[b])
            # every sample of global batch b, each once per cp rank: the reference's batch b
            assert taken == Counter({i: cp for i in range(b * GBS, (b + 1) * GBS)}), (name, b)
            consumed += sorted(taken)
        _each_document_once(reference, consumed, name)

    # a batch skipped for a persistent NaN names the streamed documents its samples are cut from
    printed = "".join(rank["printed"] for rank in ranks)
    event = next(r for r in read_jsonl(jsonl) if r.get("event") == "skipped_batch")
    assert event["iteration"] == 2 and [s["sample"] for s in event["samples"]] == list(range(GBS, 2 * GBS))
    for s in event["samples"]:
        assert (s["dataset"], s["documents"]) == reference.provenance(s["sample"])
        assert s["documents"] and all(d.startswith(args[1] + ":") for d in s["documents"])
    first = event["samples"][0]["documents"][0]
    assert f"batch skipped: samples {GBS}-{2 * GBS - 1} of {args[1]} (documents {first}, " in printed


def _each_document_once(reference: StreamDataset, consumed: list[int], name: str) -> None:
    """The samples consumed hold, in their inputs (a window's last token is the next one's first),
    every token of every document of epoch 0 once."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for i in consumed:
        left = SEQ
        for doc, epoch, first, end in reference.sample(i).documents:
            if left > 0 and epoch == 0:
                spans.setdefault(doc, []).append((first, first + min(end - first, left)))
            left -= end - first
    path = reference.setup.sources[0].files[0]
    assert sorted(spans) == sorted(f"{path}:{line}" for line in range(1, 31)), name  # no document left out
    for doc, pieces in spans.items():
        pieces.sort()
        assert pieces[0][0] == 0 and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), (name, doc, pieces)
        assert pieces[-1][1] == len(reference.setup.tokenizer().encode_batch([_text(doc)])[0]) + 1, (name, doc)


def _text(doc: str) -> str:
    import json
    path, line = doc.rsplit(":", 1)
    with open(path) as f:
        return json.loads(f.readlines()[int(line) - 1])["text"]


def _supply_lines(args: list[str]) -> list[str]:
    """The first log line's supply line, with the loaders measured at 1 token/s and at 10M."""
    from megazero.data.stream.dataset import StreamDataset
    printed = []
    for rate in (1.0, 1e7):
        StreamDataset.supply_tokens_per_s = lambda self, rate=rate: rate  # type: ignore[method-assign]
        tr = make_trainer(args + ["--train.iters", "2"])
        with contextlib.redirect_stdout(io.StringIO()) as out:
            tr.run()
        printed.append([line for line in out.getvalue().splitlines() if "supply" in line])
    return printed


def test_the_supply_line_warns_when_the_loaders_fall_short(corpus):
    short, enough = run_distributed(_supply_lines, 1, corpus[0])[0]
    assert len(short) == 1 and short[0].startswith("warning: data.stream: 0 loader process(es) per rank supply 0.0k "
                                                   "tokens/s (measured), the run consumes ")
    assert "raise data.loader_workers, or preprocess the corpus" in short[0]
    assert len(enough) == 1 and enough[0].startswith("data.stream: 0 loader process(es) per rank supply 10,000.0k")
