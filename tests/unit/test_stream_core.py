"""The streaming core without processes: packing with carry-over, logical shards, the mixture,
the global order (the same at any dp), exact resume from any saved state, and every document
read once per epoch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megazero.data import DataError
from megazero.data.stream.dataset import StreamDataset
from megazero.data.stream.mixture import next_source
from megazero.data.stream.packing import Packer
from megazero.data.stream.setup import setup_stream
from megazero.data.stream.shards import NUM_SHARDS, Cursor, owner, shard_documents
from megazero.data.stream.stream import copy_state

SEQ = 16
EOD = 0


class IdTokenizer:
    """Document "d<ID> <LENGTH>" becomes LENGTH tokens of value ID + 1; end of document is 0.
    Windows then show which documents they hold, token by token."""

    eod = EOD
    vocab_size = 10_000

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            name, length = text.split()
            out.append([int(name[1:]) + 1] * int(length))
        return out


def write_docs(folder: Path, files: int, per_file: int, seed: int = 0, first: int = 0) -> dict[int, int]:
    """`files` JSONL files of id documents; returns {id: length}."""
    rng = np.random.default_rng(seed)
    lengths, doc = {}, first
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lines = []
        for _ in range(per_file):
            lengths[doc] = int(rng.integers(1, 3 * SEQ))
            lines.append(json.dumps({"text": f"d{doc} {lengths[doc]}"}))
            doc += 1
        (folder / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    return lengths


def make(stream, state=None, valid_docs: int = 0, seed: int = 1) -> StreamDataset:
    setup = setup_stream(stream, "text", valid_docs, seed, SEQ, None, IdTokenizer())
    return StreamDataset(setup, 10**9, workers=0, state=state)


def take(ds: StreamDataset, n: int) -> list[np.ndarray]:
    start = ds.read
    ds.fetch(start, start + n)
    return [ds[i] for i in range(start, start + n)]


def test_packer_windows_share_one_token_and_resume_by_skip():
    packer = Packer(4, EOD)
    windows = [(w.tolist(), skip) for doc in ([1] * 3, [2] * 7, [3] * 2) for w, skip in packer.add(doc)]
    stream = [1, 1, 1, 0, 2, 2, 2, 2, 2, 2, 2, 0, 3, 3, 0]
    assert [w for w, _ in windows] == [stream[k * 4:k * 4 + 5] for k in range(3)]
    # After window 1 the carry-over is document 2 less its first 4 tokens: replaying it so resumes.
    assert windows[1][1] == 4
    again = Packer(4, EOD)
    assert [w.tolist() for w, _ in again.add([2] * 7, skip=4)] == []
    assert [w.tolist() for w, _ in again.add([3] * 2)] == [windows[2][0]]


def test_each_document_has_one_shard_per_epoch_and_epochs_differ():
    for epoch in range(3):
        owners = [owner(g, 7, 0, epoch) for g in range(10 * NUM_SHARDS)]
        for block in range(10):  # each shard one document of every block
            assert sorted(owners[block * NUM_SHARDS:(block + 1) * NUM_SHARDS]) == list(range(NUM_SHARDS))
    assert [owner(g, 7, 0, 0) for g in range(64)] != [owner(g, 7, 0, 1) for g in range(64)]


def test_shard_documents_partition_the_source(tmp_path):
    lengths = write_docs(tmp_path / "a", files=3, per_file=20)
    setup = setup_stream(str(tmp_path / "a"), "text", 0, 1, SEQ, None, IdTokenizer())
    seen = []
    for s in range(NUM_SHARDS):
        docs = list(shard_documents(setup.sources[0], 0, s, Cursor(), 1, "text", setup.holdouts[0]))
        seen += [d.text for d in docs]
        # Reading a shard from any document's cursor finds the same documents from there on.
        if len(docs) > 2:
            again = shard_documents(setup.sources[0], 0, s, docs[2].before, 1, "text", setup.holdouts[0])
            assert [d.text for d in again] == [d.text for d in docs[2:]]
    assert sorted(int(t.split()[0][1:]) for t in seen) == sorted(lengths)


def test_mixture_share_within_one_percent():
    weights, taken = [0.5, 0.3, 0.2], [0, 0, 0]
    for n in range(1, 1001):
        taken[next_source(weights, taken)] += 1
        if n >= 100:
            assert all(abs(t / n - w) <= 0.01 for t, w in zip(taken, weights))


def test_stream_mixture_and_epochs(tmp_path):
    write_docs(tmp_path / "a", files=2, per_file=10)
    write_docs(tmp_path / "b", files=1, per_file=40, seed=1, first=1000)
    lines = []
    setup = setup_stream([0.7, str(tmp_path / "a"), 0.3, str(tmp_path / "b")], "text", 0, 1, SEQ, None, IdTokenizer())
    ds = StreamDataset(setup, 10**9, workers=0, say=lines.append)
    samples = take(ds, 400)
    assert ds.read == 400
    tokens = ds.tokens_per_source()
    total = sum(tokens.values())
    assert abs(tokens[str(tmp_path / "a")] / total - 0.7) <= 0.01
    # Source a's documents (ids < 1000) fill 70% of the samples, b's the rest; a ran out and restarted.
    from_a = sum(int(s[1] <= 1000 and s[1] != EOD or s[2] <= 1000 and s[2] != EOD) for s in samples)
    assert from_a > 0
    assert any("epoch 1 done" in line and "reshuffled" in line for line in lines)
    # the same share counted from what the samples hold: each token by the file of its document
    counts = {"a": 0, "b": 0}
    for i in range(400):
        for name, _, first, end in _inputs(ds.sample(i).documents):
            counts[Path(name.rsplit(":", 1)[0]).parent.name] += end - first
    assert sum(counts.values()) == 400 * SEQ and abs(counts["a"] / (400 * SEQ) - 0.7) <= 0.01


def test_resume_from_any_state_is_the_same_stream(tmp_path):
    write_docs(tmp_path / "a", files=3, per_file=15)
    write_docs(tmp_path / "b", files=1, per_file=25, seed=2, first=1000)
    stream = [0.6, str(tmp_path / "a"), 0.4, str(tmp_path / "b")]
    straight = take(make(stream), 300)
    ds = make(stream)
    for stop in (37, 150, 151):  # across epoch ends of both sources
        take(ds, stop - ds.read)
        resumed = make(stream, state=json.loads(json.dumps(copy_state(ds.state_dict()))))
        assert all(np.array_equal(a, b) for a, b in zip(take(resumed, 300 - stop), straight[stop:]))


def test_every_document_once_per_epoch_at_any_dp(tmp_path):
    """The samples all dp ranks train on in epoch 0 hold every document's tokens exactly once
    (inputs tile each shard's token stream; the epoch's last carry-overs hold the rest)."""
    lengths = write_docs(tmp_path / "a", files=4, per_file=25)
    ds = make(str(tmp_path / "a"))
    ds.fetch(0, 0)  # starts the stream, reading nothing
    carries: list[int] = []  # what waits in each shard at the end of epoch 0
    producer, next_item = ds.stream.producer, ds.stream.producer.next_item

    def recording(k, s):
        item = next_item(k, s)
        if item.window is None and item.state["cursor"][0] == 1:
            carries.extend(item.state["carry"])
        return item
    producer.next_item = recording
    epoch0 = []
    while True:
        sample = take(ds, 1)[0]
        if ds.stream.state["sources"][0]["epoch"] > 0:
            break
        epoch0.append(sample)
    for dp in (1, 2, 4):
        gbs, mbs = 8, 1
        consumed = []  # what each rank trains on: its slice of every global batch
        for rank in range(dp):
            for first in range(0, len(epoch0) - len(epoch0) % gbs, gbs):
                for j in range(gbs // (mbs * dp)):
                    consumed += [epoch0[first + j * mbs * dp + rank * mbs + k][:-1] for k in range(mbs)]
        consumed += [s[:-1] for s in epoch0[len(epoch0) - len(epoch0) % gbs:]]
        counts = np.bincount(np.concatenate(consumed + [np.asarray(carries, dtype=np.int64)]),
                             minlength=max(lengths) + 2)
        assert all(counts[d + 1] == n for d, n in lengths.items()), dp
        assert counts[EOD] == len(lengths)  # one end-of-document token each: no repeats, no gaps


def test_holdout_docs_never_train(tmp_path):
    write_docs(tmp_path / "a", files=2, per_file=20)
    ds = make(str(tmp_path / "a"), valid_docs=5)
    ids = np.unique(np.concatenate(take(ds, 200)))
    assert not set(ids.tolist()) & {1, 2, 3, 4, 5}  # documents 0..4 (tokens 1..5)


def test_refuses_another_stream(tmp_path):
    write_docs(tmp_path / "a", files=1, per_file=20)
    write_docs(tmp_path / "b", files=1, per_file=20, first=100)
    ds = make([0.5, str(tmp_path / "a"), 0.5, str(tmp_path / "b")])
    take(ds, 10)
    with pytest.raises(DataError, match="load_data_state false") as e:
        make([0.4, str(tmp_path / "a"), 0.6, str(tmp_path / "b")], state=ds.state_dict())
    assert "weights" in str(e.value) and "\n" not in str(e.value)


def test_loader_processes_change_nothing(tmp_path):
    """2 loader processes give the samples 0 give; a state saved there resumes in 3."""
    write_docs(tmp_path / "a", files=3, per_file=30)
    stream = str(tmp_path / "a")
    straight = take(make(stream), 120)
    setup = setup_stream(stream, "text", 0, 1, SEQ, None, IdTokenizer())
    pooled = StreamDataset(setup, 10**9, workers=2)
    try:
        assert all(np.array_equal(a, b) for a, b in zip(take(pooled, 60), straight))
        state = copy_state(pooled.state_dict())
    finally:
        pooled.close()
    resumed = StreamDataset(setup, 10**9, workers=3, state=state)
    try:
        assert all(np.array_equal(a, b) for a, b in zip(take(resumed, 60), straight[60:]))
        assert resumed.supply_tokens_per_s() > 0
    finally:
        resumed.close()


def test_supply_line_warns_when_the_loaders_fall_short():
    from megazero.data.stream.dataset import supply_line
    ok = supply_line(300e3, 20e3, 2)
    assert ok is not None and not ok.startswith("warning") and "300.0k" in ok and "20.0k" in ok
    short = supply_line(10e3, 20e3, 1)
    assert short is not None and short.startswith("warning: ") and "data.loader_workers" in short and "\n" not in short
    assert supply_line(None, 20e3, 0) is None  # in-process: nothing measured


def _document_tokens(name: str, lengths: dict[int, int], folder: Path) -> np.ndarray:
    """The tokens (end-of-document last) of the document at FILE:LINE, as IdTokenizer makes them."""
    path, line = name.rsplit(":", 1)
    doc = json.loads(Path(path).read_text().splitlines()[int(line) - 1])["text"].split()[0]
    ident = int(doc[1:])
    return np.asarray([ident + 1] * lengths[ident] + [EOD])


def _inputs(pieces) -> list[list]:
    """The pieces of a window's first SEQ tokens (its last is the next window's first)."""
    out, left = [], SEQ
    for name, epoch, first, end in pieces:
        if left > 0:
            out.append([name, epoch, first, first + min(end - first, left)])
        left -= end - first
    return out


def test_samples_name_their_documents_and_an_epoch_tiles_every_document_once(tmp_path):
    """Each sample's pieces (FILE:LINE, epoch, token range) are exactly its tokens; over epoch 0
    the inputs' pieces cover every document's tokens once, in one piece after another (no
    repeats, no gaps); provenance names the source and the documents; a resume (mid-epoch or at
    an epoch's end, where the carry-over's pieces come from the saved state) names the same."""
    lengths = write_docs(tmp_path / "a", files=3, per_file=20)
    lengths.update(write_docs(tmp_path / "b", files=1, per_file=30, seed=3, first=1000))
    stream = [0.6, str(tmp_path / "a"), 0.4, str(tmp_path / "b")]
    ds = make(stream)
    samples, n = [], 0
    while n < 3 * NUM_SHARDS:  # on until every shard's carry-over from epoch 0 is taken
        take(ds, 1)
        samples.append(ds.sample(ds.read - 1))
        n = n + 1 if min(src["epoch"] for src in ds.stream.state["sources"]) >= 1 else 0
    both_in_epoch_1 = len(samples) - n  # its shards still hold epoch 0's carry-over, with its pieces
    covered: dict[str, list[tuple[int, int]]] = {}
    for sample in samples:
        tokens = np.concatenate([_document_tokens(name, lengths, tmp_path)[first:end]
                                 for name, _, first, end in sample.documents])
        assert np.array_equal(tokens, sample.window)
        for name, epoch, first, end in _inputs(sample.documents):
            if epoch == 0:
                covered.setdefault(name, []).append((first, end))
    names = {f"{tmp_path / d / f'part{f}.jsonl'}:{line}" for d, files, per in (("a", 3, 20), ("b", 1, 30))
             for f in range(files) for line in range(1, per + 1)}
    assert set(covered) == names
    for name, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == len(_document_tokens(name, lengths, tmp_path)), name
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, spans)  # no overlap, no gap
    source, documents = make_until(stream, 6).provenance(5)
    assert source == stream[1 + 2 * samples[5].source]
    assert documents == list(dict.fromkeys(p[0] for p in samples[5].documents))
    for stop in (40, both_in_epoch_1):
        state = json.loads(json.dumps(copy_state(make_until(stream, stop).state_dict())))
        if stop == both_in_epoch_1:
            assert any(shard.get("carry_docs") for src in state["sources"] for shard in src["shards"])
        resumed = make(stream, state=state)
        take(resumed, len(samples) - stop)
        assert [resumed.sample(i).documents for i in range(stop, len(samples))] == \
            [s.documents for s in samples[stop:]]


def make_until(stream, n: int) -> StreamDataset:
    ds = make(stream)
    take(ds, n)
    return ds


def test_a_source_that_runs_out_starts_its_next_epoch_reshuffled_and_says_so(tmp_path):
    """Source b (small) runs out several times while a goes on: each time one line says so, and
    its next epoch reads every document again in another order (files and shards dealt anew)."""
    write_docs(tmp_path / "a", files=2, per_file=150)
    write_docs(tmp_path / "b", files=3, per_file=8, seed=5, first=1000)
    lines: list[str] = []
    setup = setup_stream([0.5, str(tmp_path / "a"), 0.5, str(tmp_path / "b")], "text", 0, 1, SEQ, None, IdTokenizer())
    ds = StreamDataset(setup, 10**9, workers=0, say=lines.append)
    order: dict[int, list[str]] = {}  # b's documents by epoch, in the order their first tokens are read
    while ds.read < 2000 and len(order) < 6:  # (an epoch's last carry-overs are read in the next ones)
        sample = take(ds, 1) and ds.sample(ds.read - 1)
        for name, epoch, first, _ in _inputs(sample.documents):
            if sample.source == 1 and first == 0:
                order.setdefault(epoch, []).append(name)
    b = str(tmp_path / "b")
    said = [line for line in lines if repr(b) in line]
    assert said[:3] == [f"data.stream source {b!r}: epoch {e} done after {n} samples in all; epoch {e + 1} starts, "
                        f"reshuffled" for e, n in zip((1, 2, 3), [int(line.split(" after ")[1].split()[0])
                                                                 for line in said[:3]])]
    assert not [line for line in lines if repr(str(tmp_path / "a")) in line]  # a has not run out
    epochs = [order[e] for e in (0, 1, 2)]
    assert all(sorted(e) == sorted(epochs[0]) and len(e) == 24 for e in epochs)  # every document, once
    assert epochs[0] != epochs[1] != epochs[2]  # in a new order each time


def test_validation_from_its_own_source_and_from_held_out_documents(tmp_path):
    """data.stream_valid SRC: its first documents, in natural order, packed as training packs them;
    data.stream_valid_docs N: the first N documents of each source (one source after the other)."""
    from megazero.data.stream.dataset import validation_samples
    lengths = write_docs(tmp_path / "valid", files=2, per_file=6, seed=9, first=500)
    write_docs(tmp_path / "a", files=1, per_file=30)
    setup = setup_stream(str(tmp_path / "a"), "text", 0, 1, SEQ, None, IdTokenizer())
    stream = np.concatenate([[d + 1] * n + [EOD] for d, n in sorted(lengths.items())])  # part0 then part1
    valid = validation_samples(setup, str(tmp_path / "valid"), 3)
    assert [v.tolist() for v in valid] == [stream[k * SEQ:k * SEQ + SEQ + 1].tolist() for k in range(3)]
    held = setup_stream(str(tmp_path / "a"), "text", 4, 1, SEQ, None, IdTokenizer())
    tokens = set(np.concatenate(validation_samples(held, None, 100)).tolist())
    assert tokens <= {EOD, 1, 2, 3, 4} and {1, 2, 3} <= tokens  # documents 0..3 (the 4th may wait in the carry)
