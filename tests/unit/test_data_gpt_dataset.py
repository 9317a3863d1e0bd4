"""GPT sample index: packing, epochs, splits, shuffle, blending, cache, resume, compatibility."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import make_texts
from megazero.data import DataError
from megazero.data.gpt_dataset import (
    blend_schedule,
    build_train_valid_test_datasets,
    check_compatibility,
    parse_blend,
    parse_split,
    split_document_ranges,
)
from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter
from megazero.data.tokenizer import build_tokenizer

SEQ = 16


def unique_token_dataset(prefix: Path, num_docs: int, first_id: int = 0, seed: int = 0) -> list[np.ndarray]:
    """Documents whose tokens are all distinct ids (document d's ids follow d-1's), so a
    token in a sample says exactly where it came from. Some documents are empty."""
    rng = np.random.default_rng(seed)
    docs, next_id = [], first_id
    for _ in range(num_docs):
        n = int(rng.integers(0, 3 * SEQ))
        docs.append(np.arange(next_id, next_id + n))
        next_id += n
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
        writer.finalize()
    return docs


def build(prefixes: list, num_samples: tuple[int, int, int], split: str = "80,10,10", seed: int = 1, **kw):
    return build_train_valid_test_datasets([str(p) for p in prefixes], split, SEQ, seed, num_samples, None, True, **kw)


def test_parse_split_and_ranges() -> None:
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1/1/2") == pytest.approx([0.25, 0.25, 0.5])
    for bad in ["", "a,b", "1,2,3,4", "-1,2", "0,0,0"]:
        with pytest.raises(DataError, match="data.split"):
            parse_split(bad)
    for n in [0, 1, 7, 1000, 1001]:
        ranges = split_document_ranges(n, parse_split("969,30,1"))
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_parse_blend() -> None:
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend("data/a_text_document") == (["data/a_text_document"], None)
    assert parse_blend(["0.3", "a", 0.7, "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(DataError, match="mixes weights and paths"):
        parse_blend(["0.3", "a", "b"])
    with pytest.raises(DataError, match="non-negative"):
        parse_blend(["0", "a", "0", "b"])


def test_every_token_once_per_epoch_and_no_sample_crosses_splits(tmp_path: Path) -> None:
    docs = unique_token_dataset(tmp_path / "d", 120)
    ranges = split_document_ranges(len(docs), parse_split("80,10,10"))
    datasets = build([tmp_path / "d"], (500, 100, 100))
    for ds, (lo, hi) in zip(datasets, ranges, strict=True):
        split_ids = np.concatenate(docs[lo:hi])
        per_epoch = len(split_ids) // SEQ  # samples a whole epoch provides
        samples = np.stack([ds[i] for i in range(len(ds))])
        assert samples.dtype == np.int64 and samples.shape == (len(ds), SEQ + 1)
        assert np.isin(samples, split_ids).all()  # nothing from another split
        for epochs in (1, 3):
            assert len(ds) >= epochs * per_epoch
            # Sample inputs tile the token stream, so the first `epochs` epochs' worth of
            # samples hold each token `epochs` times, but for the under-SEQ tail of each epoch.
            inputs = samples[: epochs * per_epoch, :-1].ravel() - split_ids.min()
            counts = np.bincount(inputs, minlength=len(split_ids))
            assert counts.sum() == epochs * per_epoch * SEQ
            assert counts.max() <= epochs and counts.min() >= epochs - 1
            if epochs == 1:
                assert (counts == 1).sum() > len(split_ids) - SEQ


def test_samples_pack_documents_across_boundaries(tmp_path: Path) -> None:
    docs = unique_token_dataset(tmp_path / "d", 50)
    doc_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    pos_of = np.concatenate([np.arange(len(d)) for d in docs])
    last_of = np.concatenate([np.full(len(d), len(d) - 1) for d in docs])
    train, _, _ = build([tmp_path / "d"], (200, 0, 0), split="1")
    crossings = 0
    for i in range(200):
        a, b = train[i][:-1], train[i][1:]
        same_doc_next = (doc_of[a] == doc_of[b]) & (pos_of[b] == pos_of[a] + 1)
        boundary = (pos_of[a] == last_of[a]) & (pos_of[b] == 0)
        assert (same_doc_next | boundary).all()  # a document's tail, then the next one's head
        crossings += int(boundary.sum())
    assert crossings > 0


def test_deterministic_and_resumable(tmp_path: Path) -> None:
    unique_token_dataset(tmp_path / "d", 80)
    short, _, _ = build([tmp_path / "d"], (50, 0, 0), split="1")
    long, _, _ = build([tmp_path / "d"], (900, 0, 0), split="1")
    # Sample i depends on (files, seed, i), not on how many samples the run asked for.
    for i in range(50):
        np.testing.assert_array_equal(short[i], long[i])
    other_seed, _, _ = build([tmp_path / "d"], (50, 0, 0), split="1", seed=2)
    assert any(not np.array_equal(short[i], other_seed[i]) for i in range(50))
    # Shuffled: consecutive samples are not consecutive stream positions.
    assert sum(int(long[i + 1][0] == long[i][-1]) for i in range(100)) < 20


def test_cache_is_built_once_and_required_elsewhere(tmp_path: Path) -> None:
    unique_token_dataset(tmp_path / "data" / "d", 60)
    prefix, cache = str(tmp_path / "data" / "d"), tmp_path / "cache"
    with pytest.raises(DataError, match="must build it first"):
        build_train_valid_test_datasets([prefix], "1", SEQ, 1, (100, 0, 0), str(cache), False)
    built, _, _ = build_train_valid_test_datasets([prefix], "1", SEQ, 1, (100, 0, 0), str(cache), True)
    files = sorted(p.name for p in cache.iterdir())
    assert files and all(not name.endswith(tuple(f".tmp{i}" for i in range(10))) for name in files)
    loaded, _, _ = build_train_valid_test_datasets([prefix], "1", SEQ, 1, (100, 0, 0), str(cache), False)
    assert isinstance(loaded.shuffle, np.memmap)  # the non-builder maps the cache
    for i in range(100):
        np.testing.assert_array_equal(built[i], loaded[i])
    # Asking for more than the cache holds is the builder's job, not a silent rebuild elsewhere.
    with pytest.raises(DataError, match="are needed"):
        build_train_valid_test_datasets([prefix], "1", SEQ, 1, (10**5, 0, 0), str(cache), False)
    # Beside the data by default.
    build_train_valid_test_datasets([prefix], "1", SEQ, 1, (10, 0, 0), None, True)
    assert list((tmp_path / "data").glob("d_indexmap.*.json"))


def test_empty_split_is_none(tmp_path: Path) -> None:
    unique_token_dataset(tmp_path / "d", 30)
    train, valid, test = build([tmp_path / "d"], (10, 10, 10), split="100,0,0")
    assert train is not None and valid is None and test is None
    _, valid, _ = build([tmp_path / "d"], (10, 0, 10), split="50,50,0")
    assert valid is None  # no samples asked


def test_blend_ratios_within_one_percent(tmp_path: Path) -> None:
    weights = [0.2, 0.3, 0.5]
    prefixes = []
    for k in range(3):
        unique_token_dataset(tmp_path / f"d{k}", 40, first_id=k * 100_000, seed=k)
        prefixes += [str(weights[k]), tmp_path / f"d{k}"]
    n = 3000
    train, _, _ = build(prefixes, (n, 0, 0), split="1")
    assert len(train) == n
    source = np.array([train[i][0] // 100_000 for i in range(n)])
    for k, w in enumerate(weights):
        assert abs(np.mean(source == k) - w) < 0.01
        for prefix in (100, 1000):  # every prefix of the schedule is close too
            assert abs(np.sum(source[:prefix] == k) - w * prefix) <= 1 + 1e-9
    # The schedule does not depend on its length.
    small, _ = blend_schedule(weights, 100)
    np.testing.assert_array_equal(small, blend_schedule(weights, n)[0][:100])


def test_blend_without_weights_follows_token_counts(tmp_path: Path) -> None:
    a = unique_token_dataset(tmp_path / "a", 30, seed=1)
    b = unique_token_dataset(tmp_path / "b", 90, first_id=100_000, seed=2)
    train, _, _ = build([tmp_path / "a", tmp_path / "b"], (2000, 0, 0), split="1")
    share_a = sum(int(train[i][0] < 100_000) for i in range(2000)) / 2000
    expected = sum(map(len, a)) / (sum(map(len, a)) + sum(map(len, b)))
    assert abs(share_a - expected) < 0.01


def test_out_of_vocab_token_is_an_error(tmp_path: Path) -> None:
    unique_token_dataset(tmp_path / "d", 30)
    train, _, _ = build([tmp_path / "d"], (20, 0, 0), split="1", vocab_size=50)
    with pytest.raises(DataError, match="model.vocab_size"):
        [train[i] for i in range(20)]


def preprocessed(prefix: Path, spec: str) -> str:
    """A dataset made as preprocess_data.py makes it, sidecar included."""
    tok = build_tokenizer(spec)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for text in make_texts(20):
            writer.add_document(tok.encode(text) + [tok.eod])
        writer.finalize({"tokenizer": tok.identity(), "max_token_id": writer.max_token_id})
    return str(prefix)


def test_check_compatibility(tmp_path: Path, bpe_spec: str, spm_spec: str) -> None:
    vocab = build_tokenizer(bpe_spec).vocab_size
    bpe_data, spm_data = preprocessed(tmp_path / "b", bpe_spec), preprocessed(tmp_path / "s", spm_spec)
    check_compatibility([bpe_data], bpe_spec, vocab)
    check_compatibility(["1.0", bpe_data], None, vocab + 64)
    with pytest.raises(DataError, match="tokenized with sentencepiece.*data.tokenizer 'gpt2bpe") as info:
        check_compatibility([spm_data], bpe_spec, vocab)
    assert "re-run data_tools/preprocess_data.py" in str(info.value)
    with pytest.raises(DataError, match="model.vocab_size is 100; set model.vocab_size to at least"):
        check_compatibility([bpe_data], None, 100)
    with pytest.raises(DataError, match=f"has {vocab} tokens but model.vocab_size is {vocab - 1}"):
        check_compatibility([bpe_data], bpe_spec, vocab - 1)
    with pytest.raises(DataError, match="tokenized with"):
        check_compatibility([bpe_data, spm_data], None, 10_000)
    # A Megatron-made dataset has no sidecar: nothing to compare, not an error.
    (tmp_path / "b.meta.json").unlink()
    check_compatibility([bpe_data], spm_spec, 10_000)
    assert IndexedDataset(bpe_data).num_documents == 20


def test_every_epoch_in_a_new_order(tmp_path: Path) -> None:
    """What Megatron's --dataloader-type cyclic adds (a reshuffle per epoch) megazero's samples
    always have: each epoch's documents in their own seeded order, its samples permuted within
    the epoch. Two epochs cover the same documents, in different orders."""
    docs = unique_token_dataset(tmp_path / "d", 60)
    doc_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    train, _, _ = build([tmp_path / "d"], (400, 0, 0), split="1")
    per_epoch = sum(len(d) for d in docs) // SEQ
    first_docs = [[int(doc_of[train[i][0]]) for i in range(e * per_epoch, (e + 1) * per_epoch)] for e in (0, 1)]
    assert first_docs[0] != first_docs[1]
    nonempty = [i for i, d in enumerate(docs) if len(d)]
    order = [[d for d in train.doc_order[e * len(docs):(e + 1) * len(docs)] if len(docs[d])] for e in (0, 1)]
    assert sorted(order[0]) == sorted(order[1]) == nonempty and order[0] != order[1]
    touched = [set(doc_of[np.stack([train[i][:-1] for i in range(e * per_epoch, (e + 1) * per_epoch)])].ravel())
               for e in (0, 1)]
    assert len(touched[0] ^ touched[1]) <= 2  # the same documents, but the under-SEQ tail of an epoch


def test_provenance_names_the_documents_a_sample_is_cut_from(tmp_path: Path) -> None:
    """What a skipped batch is named by (train/rerun.py): every document whose tokens the sample
    holds, by its id in the indexed dataset (the second split's ids continue the first's)."""
    docs = unique_token_dataset(tmp_path / "u", 40)
    owner = {int(t): d for d, doc in enumerate(docs) for t in doc}
    train, valid, _ = build([tmp_path / "u"], (30, 10, 0), split="50,50,0")
    for ds in (train, valid):
        for i in range(len(ds)):
            name, documents = ds.provenance(i)
            assert name == str(tmp_path / "u")
            assert sorted(documents) == sorted({owner[int(t)] for t in ds[i]})
