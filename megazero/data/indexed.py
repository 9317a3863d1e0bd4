"""Megatron-LM's MMIDIDX v1 indexed dataset: token ids in PREFIX.bin, their layout in PREFIX.idx.

Both files are byte-for-byte what Megatron-LM reads and writes, so datasets made by either
tool are interchangeable. PREFIX.idx, little endian:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version, 1
    u8        dtype code of the tokens (DTYPE_CODES)
    u64       sequence count S
    u64       document count D (one more than the number of documents)
    i32[S]    sequence lengths, in tokens
    i64[S]    sequence pointers: byte offset of each sequence in PREFIX.bin
    i64[D]    document indices: the first sequence of each document, then S

PREFIX.bin holds the sequences back to back. A document is usually one sequence (Megatron
makes several only when it splits sentences). Beside the two files, megazero keeps
PREFIX.meta.json (tokenizer identity, max token id, counts); Megatron ignores it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from array import array
from pathlib import Path
from types import TracebackType
from typing import Any, Iterable

import numpy as np

from megazero.atomic import publish
from megazero.data import DataError, read_json

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic, version, dtype code, sequence count, document count.
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


def index_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def data_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def meta_path(prefix: str | os.PathLike) -> str:
    """PREFIX.meta.json: megazero's sidecar (tokenizer identity, max token id, counts)."""
    return f"{os.fspath(prefix)}.meta.json"


def loss_mask_prefix(prefix: str | os.PathLike) -> str:
    """PREFIX_loss_mask: where a fine-tuning dataset keeps its loss mask, a uint8 MMIDIDX pair
    with the same sequence lengths (1: the token counts in the loss as a label, 0: it does not)."""
    return f"{os.fspath(prefix)}_loss_mask"


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else int32.

    The 65500 threshold (not 65536) is Megatron-LM's, kept so that the same vocabulary gives
    the same bytes from either tool.
    """
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def read_metadata(prefix: str | os.PathLike) -> dict[str, Any] | None:
    """The sidecar's contents, or None for a dataset without one (e.g. made by Megatron-LM)."""
    path = meta_path(prefix)
    meta = read_json(path, "delete it or re-run preprocessing")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise DataError(f"{path} is not a JSON object; delete it or re-run preprocessing")
    return meta


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx; both files are memory-mapped, never loaded whole.

    Opening checks everything that is O(1) to check: magic, version, dtype code, that the
    .idx size matches its header, that the document indices span all sequences, and that the
    .bin size matches the last pointer and length. A truncated or foreign file fails here
    with a DataError naming the file, not later with garbage tokens.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx, bin_ = index_path(self.prefix), data_path(self.prefix)
        for path in (idx, bin_):
            if not os.path.isfile(path):
                raise DataError(
                    f"dataset {self.prefix!r}: {path} not found; pass the prefix without "
                    f".bin/.idx, or make it with data_tools/preprocess_data.py"
                )
        self._read_index(idx)
        self._map_tokens(bin_)

    def _read_index(self, idx: str) -> None:
        size = os.path.getsize(idx)
        if size < _HEADER.size:
            raise DataError(f"{idx} is truncated ({size} bytes, header alone is {_HEADER.size})")
        with open(idx, "rb") as f:
            magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{idx} is not a Megatron MMIDIDX index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise DataError(f"{idx} has MMIDIDX version {version}; only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx} has unknown dtype code {code}; expected one of {sorted(DTYPE_CODES)}")
        expected = _HEADER.size + 12 * n_seq + 8 * n_doc
        if size == expected + n_seq and n_seq:
            # Megatron's multimodal variant appends one int8 mode per sequence.
            raise DataError(f"{idx} is a multimodal MMIDIDX index (sequence modes); only text datasets are supported")
        if size != expected:
            raise DataError(
                f"{idx} is {size} bytes but its header ({n_seq} sequences, {n_doc} document "
                f"indices) needs {expected}; the file is truncated or corrupt, re-run preprocessing"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        buf = np.memmap(idx, dtype=np.uint8, mode="r") if size else np.empty(0, np.uint8)
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(buf, np.int32, n_seq, offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(buf, np.int64, n_seq, offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(buf, np.int64, n_doc, offset)
        if n_doc == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n_seq:
            raise DataError(
                f"{idx}: document indices must run from 0 to the sequence count {n_seq}; "
                f"the file is corrupt, re-run preprocessing"
            )

    def _map_tokens(self, bin_: str) -> None:
        size = os.path.getsize(bin_)
        n_seq = len(self.sequence_lengths)
        expected = 0
        if n_seq:
            expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if size != expected:
            raise DataError(
                f"{bin_} is {size} bytes but {index_path(self.prefix)} describes {expected}; "
                f"the pair is truncated or mismatched, re-run preprocessing"
            )
        # np.memmap refuses empty files; an empty dataset is still a valid dataset.
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r") if size else np.empty(0, self.dtype)

    def __len__(self) -> int:
        """Number of sequences (Megatron's convention)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (ds[i]: all of them), a read-only view
        into the memory map."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        if not (0 <= offset and 0 <= length and offset + length <= n):
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {i} of length {n}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    __getitem__ = get

    def document_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(start token, length) of every document in the flat token array.

        A document's sequences are written back to back (by this writer and by Megatron's),
        so a document is one contiguous span even when it has several sequences.
        """
        first = self.document_indices[:-1]
        # Megatron writes a document with no sequences for an empty text; the end pointer
        # gives such a document (even the last) a valid, empty span.
        pointers = np.append(self.sequence_pointers, len(self.tokens) * self.dtype.itemsize)
        cum = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return pointers[first] // self.dtype.itemsize, cum[self.document_indices[1:]] - cum[first]


class IndexedDatasetWriter:
    """Writes PREFIX.bin/.idx (and the .meta.json sidecar) under temporary names.

    ``finalize()`` renames them into place, so a crash never leaves files that look complete;
    used as a context manager, whatever is not finalized by the end of the block is removed.
    The .idx is renamed last: a stale .idx from an older run can never pass as describing a
    new .bin, because the reader checks their sizes agree.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise DataError(f"dtype {self.dtype} has no MMIDIDX code; use uint16 or int32")
        self._limit = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None
        suffix = f".tmp{os.getpid()}"
        self._tmp = {p: p + suffix for p in (data_path(self.prefix), index_path(self.prefix), meta_path(self.prefix))}
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._tmp[data_path(self.prefix)], "wb")
        self._lengths = array("q")
        self._doc_indices = array("q", [0])
        self.max_token_id = -1

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence to the current document."""
        arr = np.asarray(tokens)
        self._write(arr)
        self._lengths.append(arr.size)

    def _write(self, arr: np.ndarray) -> None:
        """Append tokens to the .bin, refusing ids the dtype cannot hold (numpy would wrap them
        silently); track the max id."""
        if arr.size and arr.dtype.kind in "iu":
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or (self._limit is not None and hi > self._limit):
                raise DataError(f"token id {hi if lo >= 0 else lo} does not fit {self.dtype}; use int32")
            self.max_token_id = max(self.max_token_id, hi)
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents at once: tokens back to back, and their lengths."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        self._write(np.asarray(tokens))
        first = len(self._lengths)
        self._lengths.extend(lengths.tolist())
        self._doc_indices.extend(range(first + 1, first + len(lengths) + 1))

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the last call)."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """One document made of one sequence: the usual case."""
        self.add_item(tokens)
        self.end_document()

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append a whole existing dataset (merging); its dtype must be this writer's."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(f"cannot merge {prefix!r} ({other.dtype}) into a {self.dtype} dataset")
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.astype(np.int64).tolist())
        self._doc_indices.extend((other.document_indices[1:] + offset).tolist())
        if len(other.tokens):
            self.max_token_id = max(self.max_token_id, int(other.tokens.max()))
        with open(data_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 24)

    @property
    def num_documents(self) -> int:
        return len(self._doc_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(np.frombuffer(self._lengths, dtype=np.int64).sum())

    def finalize(self, metadata: dict[str, Any] | None = None) -> None:
        """Write the index (and the sidecar, when given) and move all files into place."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64)
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise DataError(f"a sequence of {int(lengths.max())} tokens is too long for MMIDIDX (int32 lengths)")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        idx_tmp = self._tmp[index_path(self.prefix)]
        with open(idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(self._doc_indices)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.frombuffer(self._doc_indices, dtype=np.int64).tobytes(order="C"))
        meta_tmp = self._tmp[meta_path(self.prefix)]
        if metadata is not None:
            with open(meta_tmp, "w", encoding="utf-8") as f:
                json.dump(metadata, f, indent=2, sort_keys=True)
                f.write("\n")
        else:
            # A sidecar left from an older dataset at this prefix would describe the wrong data.
            self._tmp.pop(meta_path(self.prefix))
            if os.path.exists(meta_path(self.prefix)):
                os.remove(meta_path(self.prefix))
        for final in (data_path(self.prefix), meta_path(self.prefix), index_path(self.prefix)):
            if final in self._tmp:
                publish(self._tmp[final], final)
        self._tmp.clear()

    def abort(self) -> None:
        """Remove the temporary files; the final names are left untouched."""
        self._bin.close()
        for tmp in self._tmp.values():
            if os.path.exists(tmp):
                os.remove(tmp)
        self._tmp.clear()

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # On success the caller finalizes (it has the metadata); anything left is abandoned.
        if self._tmp:
            self.abort()
