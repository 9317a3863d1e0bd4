"""Logical shards: which documents of a source each shard reads, epoch by epoch, from a cursor.

A source's documents are split into NUM_SHARDS logical shards, a number fixed here and never
taken from the layout, so any data-parallel size or number of loader processes reads the same
shards. In epoch e the source's files are read in an order seeded by (seed, source, e), and
its non-blank documents counted in that order, g = 0, 1, ...; document g belongs to shard
(g + r) mod NUM_SHARDS, r drawn per block of NUM_SHARDS documents from (seed, source, e, block):
each shard takes one document of every block, which one changing from epoch to epoch (the
reshuffle). A shard's cursor is where its next document is looked for: (epoch, file in the
epoch's order, offset, line, documents counted before it). Every shard scans every document
but decodes only its own; a scan is a line read, about 1/1000 of the cost of tokenizing it.

Documents held out for validation (data.stream_valid_docs) are the first N of the source in
its natural order (sorted files); every epoch skips them, by their line numbers.
"""

from __future__ import annotations

import hashlib
from typing import Iterator, NamedTuple, Optional

import numpy as np

from megazero.data.stream.sources import NotText, Raw, Source, document_text, is_blank, read_file

NUM_SHARDS = 16
"""Logical shards per source. Changing it changes the global order (and invalidates saved streams)."""


class Cursor(NamedTuple):
    """Where a shard looks for its next document (see the module docstring)."""

    epoch: int = 0
    file: int = 0
    offset: int = 0
    line: int = 0
    docs: int = 0


def _seeded(*key: int) -> int:
    """A 64-bit number from integers: stable across processes and Python versions."""
    return int.from_bytes(hashlib.blake2b(np.asarray(key, dtype=np.int64).tobytes(), digest_size=8).digest(), "little")


def file_order(num_files: int, seed: int, source: int, epoch: int) -> np.ndarray:
    """The order the source's files are read in during `epoch`."""
    return np.random.default_rng([seed, source, epoch]).permutation(num_files)


def owner(doc: int, seed: int, source: int, epoch: int) -> int:
    """The shard that reads document number `doc` of `epoch` (counted in the epoch's order)."""
    block, slot = divmod(doc, NUM_SHARDS)
    return (slot + _rotation(seed, source, epoch, block)) % NUM_SHARDS


def _rotation(seed: int, source: int, epoch: int, block: int) -> int:
    return _seeded(seed, source, epoch, block) % NUM_SHARDS


def holdout_lines(source: Source, key: str, docs: int) -> tuple[int, ...]:
    """Per file (natural order): the last line number held out for validation (0: none), so
    that the first `docs` documents of the source are."""
    lines = [0] * source.num_files
    left = docs
    for f in range(source.num_files):
        if left <= 0:
            break
        for raw in read_file(source, f, 0, 0, key):
            if is_blank(raw):
                continue
            lines[f], left = raw.line, left - 1
            if left == 0:
                break
    return tuple(lines)


def where(source: Source, file: int, line: int) -> str:
    """A document's place as error messages name it: FILE:LINE, or SPEC row N."""
    return f"{source.spec} row {line}" if source.hf else f"{source.files[file]}:{line}"


class Document(NamedTuple):
    text: Optional[str]
    """None: not UTF-8, skipped (and counted)."""
    before: Cursor
    """The shard's cursor before this document: reading from it finds this document first."""
    after: Cursor
    name: str = ""
    """Where it is (FILE:LINE, or SPEC row N): how a skipped batch names it."""


def shard_documents(source: Source, index: int, shard: int, start: Cursor, seed: int, key: str,
                    holdout: tuple[int, ...]) -> Iterator[Document]:
    """Shard `shard` of source number `index`: its documents from `start` to the end of that
    epoch (holdout: holdout_lines, the validation documents every epoch skips)."""
    epoch, docs = start.epoch, start.docs
    order = file_order(source.num_files, seed, index, epoch)
    before = start
    block, rotation = -1, 0  # owner(), its rotation drawn once per block of documents
    for j in range(start.file, source.num_files):
        f = int(order[j])
        offset, line = (start.offset, start.line) if j == start.file else (0, 0)
        raw: Raw
        for raw in read_file(source, f, offset, line, key):
            if is_blank(raw) or raw.line <= holdout[f]:
                continue
            doc, docs = docs, docs + 1
            if doc // NUM_SHARDS != block:
                block = doc // NUM_SHARDS
                rotation = _rotation(seed, index, epoch, block)
            if (doc % NUM_SHARDS + rotation) % NUM_SHARDS != shard:
                continue
            after = Cursor(epoch, j, raw.next_offset, raw.line, docs)
            name = where(source, f, raw.line)
            try:
                text: Optional[str] = document_text(raw, key, name)
            except NotText:
                text = None
            yield Document(text, before, after, name)
            before = after
