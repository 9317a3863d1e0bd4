"""MMIDIDX v1 files: exact bytes, write -> read for both dtypes, merging, corrupt files; mock data."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from megazero.data import DataError
from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, read_metadata
from megazero.data.mock import MockGPTDataset


def random_documents(n: int, high: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(0, 40))) for _ in range(n)]


def write_dataset(prefix: Path, docs: list[np.ndarray], dtype: type, meta: dict | None = None) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
        writer.finalize(meta)
    return IndexedDataset(prefix)


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65_000), (np.int32, 2_000_000)])
def test_write_read_identical(tmp_path: Path, dtype: type, high: int) -> None:
    docs = random_documents(300, high)
    ds = write_dataset(tmp_path / "d", docs, dtype)
    assert ds.dtype == np.dtype(dtype) and len(ds) == ds.num_documents == len(docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    assert isinstance(ds.tokens, np.memmap)  # mapped, not loaded
    # Megatron's bulk layout: documents back to back.
    np.testing.assert_array_equal(np.asarray(ds.tokens), np.concatenate(docs))


def test_bytes_are_megatron_mmidx_v1(tmp_path: Path) -> None:
    """The exact bytes Megatron-LM writes, spelled out field by field."""
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        writer.add_document([5, 6, 7])
        writer.add_item([1])  # a document of two sequences (Megatron's sentence splitting)
        writer.add_item([2, 3])
        writer.end_document()
        writer.finalize()
    expected_idx = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)  # version
        + struct.pack("<B", 8)  # dtype code of uint16
        + struct.pack("<Q", 3)  # sequences
        + struct.pack("<Q", 3)  # document indices: documents + 1
        + np.array([3, 1, 2], np.int32).tobytes()  # lengths
        + np.array([0, 6, 8], np.int64).tobytes()  # byte pointers
        + np.array([0, 1, 3], np.int64).tobytes()  # document indices
    )
    assert (tmp_path / "d.idx").read_bytes() == expected_idx
    assert (tmp_path / "d.bin").read_bytes() == np.array([5, 6, 7, 1, 2, 3], np.uint16).tobytes()
    ds = IndexedDataset(tmp_path / "d")
    starts, lengths = ds.document_spans()
    assert starts.tolist() == [0, 3] and lengths.tolist() == [3, 3]
    assert ds.get(0, offset=1, length=2).tolist() == [6, 7]


def test_best_dtype_follows_megatron() -> None:
    assert best_dtype(50_257) == np.uint16 and best_dtype(65_499) == np.uint16
    assert best_dtype(65_500) == np.int32 and best_dtype(128_256) == np.int32


def test_ids_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        with pytest.raises(DataError, match="70000 does not fit uint16"):
            writer.add_document(np.array([1, 70_000]))


def test_merge_concatenates(tmp_path: Path) -> None:
    a, b = random_documents(20, 500, seed=1), random_documents(30, 500, seed=2)
    write_dataset(tmp_path / "a", a, np.uint16)
    write_dataset(tmp_path / "b", b, np.uint16)
    with IndexedDatasetWriter(tmp_path / "m", np.uint16) as writer:
        writer.add_index(tmp_path / "a")
        writer.add_index(tmp_path / "b")
        writer.finalize()
    merged = IndexedDataset(tmp_path / "m")
    direct = write_dataset(tmp_path / "direct", a + b, np.uint16)
    assert (tmp_path / "m.idx").read_bytes() == (tmp_path / "direct.idx").read_bytes()
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "direct.bin").read_bytes()
    assert merged.num_documents == direct.num_documents == 50


def test_merge_refuses_other_dtype(tmp_path: Path) -> None:
    write_dataset(tmp_path / "a", random_documents(3, 10), np.int32)
    with IndexedDatasetWriter(tmp_path / "m", np.uint16) as writer:
        with pytest.raises(DataError, match="int32"):
            writer.add_index(tmp_path / "a")
    assert not list(tmp_path.glob("m*"))


def test_unfinished_writer_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
            writer.add_document([1, 2])
            raise RuntimeError("crash mid-way")
    assert list(tmp_path.iterdir()) == []


def test_metadata_sidecar(tmp_path: Path) -> None:
    write_dataset(tmp_path / "d", [np.array([3, 9])], np.uint16, meta={"max_token_id": 9})
    assert read_metadata(tmp_path / "d") == {"max_token_id": 9}
    # Rewriting without metadata must not leave the old sidecar describing new data.
    write_dataset(tmp_path / "d", [np.array([1])], np.uint16)
    assert read_metadata(tmp_path / "d") is None


def corrupt(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: corrupt(p / "d.idx", 0, b"NOTMMIDX!"), "not a Megatron MMIDIDX"),
        (lambda p: corrupt(p / "d.idx", 9, struct.pack("<Q", 2)), "version 2"),
        (lambda p: corrupt(p / "d.idx", 17, b"\x63"), "unknown dtype code 99"),
        (lambda p: (p / "d.idx").write_bytes((p / "d.idx").read_bytes()[:-8]), "truncated or corrupt"),
        (lambda p: (p / "d.idx").write_bytes(b"MMIDIDX"), "truncated"),
        (lambda p: (p / "d.bin").write_bytes((p / "d.bin").read_bytes()[:-2]), "truncated or mismatched"),
        (lambda p: corrupt(p / "d.idx", 34 + 5 * 4 + 5 * 8, struct.pack("<q", 1)), "document indices"),
        (lambda p: (p / "d.bin").unlink(), "not found"),
        (lambda p: (p / "d.idx").write_bytes((p / "d.idx").read_bytes() + bytes(5)), "multimodal"),
    ],
)
def test_bad_files_fail_clearly(tmp_path: Path, damage, words: str) -> None:
    write_dataset(tmp_path / "d", random_documents(5, 100, seed=3), np.uint16)
    damage(tmp_path)
    with pytest.raises(DataError, match=words) as info:
        IndexedDataset(tmp_path / "d")
    assert "\n" not in str(info.value)


def test_mock_dataset_is_pure_and_learnable() -> None:
    ds = MockGPTDataset(num_samples=10, seq_length=16, vocab_size=100, seed=3)
    again = MockGPTDataset(num_samples=1000, seq_length=16, vocab_size=100, seed=3)
    assert len(ds) == 10
    for i in range(10):
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (17,)
        np.testing.assert_array_equal(sample, again[i])
        steps = np.diff(sample) % 100
        assert len(set(steps.tolist())) == 1 and steps[0] != 0  # an arithmetic progression mod vocab
    assert not np.array_equal(ds[0], MockGPTDataset(10, 16, 100, seed=4)[0])
    with pytest.raises(IndexError):
        ds[10]
