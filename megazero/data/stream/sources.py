"""What data.stream names, and reading its documents from a position.

A source is a path or glob of .jsonl, .jsonl.gz, .parquet or .txt files (one document a line,
a line, a row, a file), a folder of such files, or ``hf:NAME[:CONFIG][:SPLIT]``: a Hugging Face
dataset read with ``datasets.load_dataset(NAME, CONFIG, split=SPLIT, streaming=True)`` (NAME may
be a local folder of data files, which loads offline). Every problem found here is one
DataError line naming the source and the fix.

A document's place in a source is (file, offset, line): the file's index in the epoch's file
order, then a byte offset (.jsonl), a line count (.jsonl.gz), a row (.parquet, hf:) or 0/1
(.txt); `line` is the 1-based line or row number that error messages name. Readers yield raw
payloads and parse only the documents a shard keeps, so skipping another shard's documents
costs a line read, not a JSON decode.
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence

from megazero.data import DataError
from megazero.data.corpus import hub_unreachable_reason

FORMATS = (".jsonl.gz", ".jsonl", ".parquet", ".txt")
"""File suffixes a source may hold (.jsonl.gz before .jsonl: the longer match wins)."""
HF_PREFIX = "hf:"


@dataclass(frozen=True)
class Source:
    """One resolved source: its files in their natural (sorted) order, or a Hugging Face dataset."""

    spec: str
    """As data.stream gives it (what messages name)."""
    files: tuple[str, ...] = ()
    hf: Optional[tuple[str, Optional[str], str]] = None
    """(name, config, split) of an hf: source."""

    @property
    def num_files(self) -> int:
        return 1 if self.hf else len(self.files)


class Raw(NamedTuple):
    """One document as read: its payload (bytes of a JSONL line, text, or None for a null
    value), where the next document starts, and its 1-based line (or row) number."""

    payload: Any
    next_offset: int
    line: int


# --- data.stream ------------------------------------------------------------------------------


def parse_stream(value: Sequence[Any] | str) -> list[tuple[float, str]]:
    """(weight, source) pairs from one source or [w1, SRC1, w2, SRC2, ...] (weights normalised)."""
    items = [value] if isinstance(value, str) else [str(v) for v in value]
    if not items:
        raise DataError("data.stream is empty; give a source (a path, glob or hf:NAME) or [W1, SRC1, W2, SRC2, ...]")
    if len(items) == 1:
        return [(1.0, items[0])]
    weights, sources = items[::2], items[1::2]
    if len(items) % 2 or not all(_is_number(w) for w in weights) or any(_is_number(s) for s in sources):
        raise DataError(f"data.stream {items} is not [W1, SRC1, W2, SRC2, ...]; give one source, or a weight "
                        f"before each source")
    w = [float(x) for x in weights]
    if any(x <= 0 or not math.isfinite(x) for x in w):
        raise DataError(f"data.stream weights {w} must be positive numbers; drop a source rather than weigh it 0")
    return [(x / sum(w), s) for x, s in zip(w, sources)]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def source_format(path: str) -> str:
    """The format of a file by its suffix (one of FORMATS)."""
    lower = path.lower()
    for suffix in FORMATS:
        if lower.endswith(suffix):
            return suffix
    raise DataError(f"data.stream file {path!r} is none of {', '.join(FORMATS)}; convert it or leave it out "
                    f"of the glob")


def resolve_source(spec: str, key: str) -> Source:
    """The source `spec` names, checked: its files exist and hold documents with `key`."""
    if spec.startswith(HF_PREFIX):
        return _resolve_hf(spec, key)
    if glob.has_magic(spec):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"data.stream source {spec!r}: the glob matches no file; fix the pattern (quote it "
                            f"so the shell leaves it alone)")
    elif os.path.isdir(spec):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(spec) for f in names
                       if f.lower().endswith(FORMATS))
        if not files:
            raise DataError(f"data.stream source {spec!r}: the folder holds no {', '.join(FORMATS)} file")
    elif os.path.isfile(spec):
        files = [spec]
    else:
        raise DataError(f"data.stream source {spec!r}: no such file or folder; fix the path")
    for path in files:
        if source_format(path) == ".parquet":
            _require_column(path, key)
    source = Source(spec, tuple(files))
    if first_document(source, key) is None:
        raise DataError(f"data.stream source {spec!r} holds no documents ({len(files)} file(s), all empty); "
                        f"point it at data, or drop it")
    return source


def _require_column(path: str, key: str) -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"data.stream file {path!r} is Parquet but pyarrow is not installed; pip install pyarrow") \
            from None
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as e:  # pyarrow raises its own types for a file that is not Parquet
        raise DataError(f"data.stream file {path!r} is not a readable Parquet file ({e}); fix or remove it") from None
    if key not in names:
        raise DataError(f"data.stream file {path!r} has no column {key!r} (columns: {', '.join(names)}); "
                        f"set data.stream_key to one of them")


def _resolve_hf(spec: str, key: str) -> Source:
    parts = spec[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3:
        raise DataError(f"data.stream source {spec!r} is not hf:NAME[:CONFIG][:SPLIT]; e.g. hf:allenai/c4:en:train")
    name, config, split = parts[0], (parts[1] or None) if len(parts) > 1 else None, \
        parts[2] if len(parts) > 2 else "train"
    source = Source(spec, hf=(name, config, split))
    reason = None if os.path.isdir(name) else hub_unreachable_reason()  # milliseconds, not the hub client's retries
    if reason:
        raise DataError(f"data.stream source {spec!r} cannot be loaded: {name!r} is not a local folder, and {reason}")
    try:
        first = next(iter(_hf_dataset(source)), None)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (no connection, no such dataset, bad files)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"data.stream source {spec!r} cannot be loaded ({reason}); offline, give hf: a local folder "
                        f"of data files, or set HF_DATASETS_OFFLINE=1 to read the datasets cache") from None
    if first is None:
        raise DataError(f"data.stream source {spec!r} holds no documents; check its split ({split!r}) and config")
    if key not in first:
        raise DataError(f"data.stream source {spec!r} has no field {key!r} (fields: {', '.join(first)}); "
                        f"set data.stream_key to one of them")
    return source


def _hf_dataset(source: Source) -> Any:
    assert source.hf is not None
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets

    name, config, split = source.hf
    ds = datasets.load_dataset(name, config, split=split, streaming=True)
    if isinstance(ds, (datasets.IterableDatasetDict, datasets.DatasetDict)):
        raise DataError(f"data.stream source {source.spec!r} has splits {', '.join(ds)}; name one as "
                        f"hf:NAME:CONFIG:SPLIT")
    return ds


# --- reading ----------------------------------------------------------------------------------


def read_file(source: Source, file: int, offset: int, line: int, key: str) -> Iterator[Raw]:
    """The documents of `source`'s file number `file` (natural order) from `offset` on, where
    `line` lines (rows) have been read before it."""
    if source.hf is not None:
        return _hf(source, offset, key)
    path = source.files[file]
    fmt = source_format(path)
    if fmt == ".jsonl":
        return _jsonl(path, offset, line)
    if fmt == ".jsonl.gz":
        return _jsonl_gz(path, offset)
    if fmt == ".parquet":
        return _parquet(path, offset, key)
    return _txt(path, offset)


def _jsonl(path: str, offset: int, line: int) -> Iterator[Raw]:
    """Lines from byte `offset` (the start of line number `line` + 1)."""
    with _open(path, "rb") as f:
        f.seek(offset)
        while True:
            data = f.readline()
            if not data:
                return
            offset, line = offset + len(data), line + 1
            yield Raw(data, offset, line)


def _jsonl_gz(path: str, skip: int) -> Iterator[Raw]:
    """Lines of a gzip file after the first `skip` (gzip cannot seek: the skipped are decompressed)."""
    with _open(path, "rb", gzip.open) as f:
        for n, line in enumerate(f, start=1):
            if n > skip:
                yield Raw(line, n, n)


def _parquet(path: str, row: int, key: str) -> Iterator[Raw]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    first = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if first + n > row:
            for i, value in enumerate(pf.read_row_group(g, columns=[key]).column(0).to_pylist()):
                if first + i >= row:
                    yield Raw(value, first + i + 1, first + i + 1)
        first += n


def _txt(path: str, offset: int) -> Iterator[Raw]:
    if offset == 0:
        with _open(path, "rb") as f:
            data = f.read()
        if data.strip():
            yield Raw(TextBytes(data), 1, 1)


def _hf(source: Source, index: int, key: str) -> Iterator[Raw]:
    ds = _hf_dataset(source)
    if index:
        ds = ds.skip(index)
    for i, row in enumerate(ds, start=index + 1):
        yield Raw(row.get(key), i, i)


def _open(path: str, mode: str, opener: Any = open) -> Any:
    try:
        return opener(path, mode)
    except OSError as e:
        raise DataError(f"data.stream file {path!r} cannot be read ({e.strerror or e}); restore it, or restart the "
                        f"stream without its state (--checkpoint.load_data_state false)") from None


class TextBytes(bytes):
    """A .txt file's bytes: the whole document, decoded only by the shard that keeps it."""


class NotText(Exception):
    """A document that is not UTF-8: skipped and counted, not fatal."""


def document_text(raw: Raw, key: str, where: str) -> Optional[str]:
    """The text of a document read by `read_file` (None: a blank line, no document); `where`
    names it (file:line) in errors. A line that is not UTF-8 raises NotText."""
    payload = raw.payload
    if payload is None:
        raise DataError(f"{where}: field {key!r} is null; drop the record or set data.stream_key")
    if isinstance(payload, str):
        return payload
    if isinstance(payload, TextBytes):
        try:
            return payload.decode("utf-8")
        except UnicodeDecodeError:
            raise NotText() from None
    try:
        record = json.loads(payload)
    except UnicodeDecodeError:
        raise NotText() from None
    except ValueError as e:
        raise DataError(f"{where} is not valid JSON ({e}); fix or remove the line") from None
    if not isinstance(record, dict) or key not in record:
        fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} has no field {key!r} (it has: {fields}); set data.stream_key to the text field")
    text = record[key]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {key!r} is {type(text).__name__}, not text; set data.stream_key to the "
                        f"text field")
    return text


def is_blank(raw: Raw) -> bool:
    """A blank JSONL line is no document (it takes no place in the shard assignment)."""
    return isinstance(raw.payload, bytes) and not raw.payload.strip()


def first_document(source: Source, key: str) -> Optional[Raw]:
    """The first document of a source (None: it holds none)."""
    for file in range(source.num_files):
        for raw in read_file(source, file, 0, 0, key):
            if not is_blank(raw):
                return raw
    return None
