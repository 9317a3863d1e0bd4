"""Where documents come from: the embedded default corpus and the user's inputs.

The default corpus is real English built from text that ships with Python itself: the
documentation topics behind ``help()`` (pydoc_data.topics), the docstrings of the standard
library read from its source with ``ast`` (nothing is imported, so no module runs), and a few
text files in the standard library folder. Nothing is downloaded and nothing is committed.

User inputs are JSONL files (one JSON object a line), plain text files (one document a file),
Hugging Face ``datasets`` data (a ``save_to_disk`` folder, local parquet/arrow/csv files, or a
hub name when online), a folder of such files, or a glob. They are read in chunks of raw
records; ``parse_chunk`` turns a chunk into texts and can run in a worker process, so the
costly JSON decoding happens in parallel while the file is still read in order.
"""

from __future__ import annotations

import ast
import functools
import glob
import json
import os
import socket
import sysconfig
import urllib.parse
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from megazero.atomic import atomic_write
from megazero.data import DataError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
HF_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
# Folders of the standard library that hold tests, bundled wheels or third-party code, not docs.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "_bundled"}
_EXTRA_TEXT_FILES = ("LICENSE.txt", "idlelib/*.txt", "email/*.rst")


# --- the default corpus ---------------------------------------------------------------------


@functools.lru_cache(maxsize=1)  # a few seconds of parsing; the result never changes
def default_corpus_documents() -> tuple[str, ...]:
    """The default corpus: documentation topics, then one document per standard-library module
    (its docstrings, pydoc style), then the shipped text files; deduplicated, fixed order.
    About 2.9 MB of English on CPython 3.11."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = (_render_module(name, tree) for name, tree in _stdlib_modules(stdlib))
    docs = [*_topic_documents(), *modules, *_text_file_documents(stdlib)]
    return tuple(dict.fromkeys(d for d in docs if d.strip()))


def write_default_corpus(path: str | os.PathLike) -> str:
    """Write the default corpus as JSONL ({"text": ...} per line) to path, atomically; return path."""
    return _write_jsonl(path, ({"text": doc} for doc in default_corpus_documents()))


@functools.lru_cache(maxsize=1)
def default_examples() -> tuple[tuple[str, str], ...]:
    """Question/answer pairs for fine-tuning, from the same standard-library source as the
    default corpus: for each documented public function or class, the prompt asks what it
    does and the completion is the first sentence of its docstring. Fixed order, deduplicated."""
    pairs: dict[str, str] = {}
    for module, tree in _stdlib_modules(Path(sysconfig.get_paths()["stdlib"])):
        for name, doc in _public_docstrings(tree.body, module):
            answer = _first_sentence(doc)
            if answer:
                pairs.setdefault(f"Question: What does {name} do?\nAnswer:", " " + answer)
    return tuple(pairs.items())


def _public_docstrings(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, str]]:
    """(dotted name, docstring) of the public functions and classes of a module or class body."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            name = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                yield name, doc
            if isinstance(node, ast.ClassDef):
                yield from _public_docstrings(node.body, name)


def _first_sentence(doc: str) -> str:
    """The docstring's first paragraph up to its first full stop, on one line ("" if none)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    sentence = paragraph if end < 0 else paragraph[: end + 1]
    return sentence if sentence.endswith(".") and len(sentence.split()) >= 3 else ""


def write_default_examples(path: str | os.PathLike) -> str:
    """Write default_examples() as JSONL ({"prompt": ..., "completion": ...} per line), atomically."""
    return _write_jsonl(path, ({"prompt": prompt, "completion": answer} for prompt, answer in default_examples()))


def _write_jsonl(path: str | os.PathLike, records: Iterator[dict[str, str]]) -> str:
    path = os.fspath(path)
    with atomic_write(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _topic_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return []
    return [topics[name] for name in sorted(topics)]


def _stdlib_modules(stdlib: Path) -> Iterator[tuple[str, ast.Module]]:
    """(dotted name, syntax tree) of the standard library's .py files, sorted, pruning skipped
    folders before walking them (site-packages alone can hold tens of thousands of files)."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        found.extend(Path(folder, f) for f in files if f.endswith(".py"))
    for path in sorted(found):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue  # e.g. lib2to3 fixtures written in Python 2
        yield ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__"), tree


def _render_module(name: str, tree: ast.Module) -> str:
    """pydoc-like text: the module's docstring, then each documented class and function."""
    parts = [doc for doc in (ast.get_docstring(tree), *_render_members(tree.body, indent="")) if doc]
    if not parts:
        return ""
    title = f"Module {name}"
    return "\n\n".join([f"{title}\n{'=' * len(title)}", *parts]) + "\n"


def _render_members(body: list[ast.stmt], indent: str) -> Iterator[str]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            header = f"{indent}def {node.name}({ast.unparse(node.args)})"
        elif isinstance(node, ast.ClassDef):
            header = f"{indent}class {node.name}"
        else:
            continue
        doc = ast.get_docstring(node)
        if doc:
            body_text = "\n".join(f"{indent}    {line}" if line else "" for line in doc.splitlines())
            yield f"{header}\n{body_text}"
        if isinstance(node, ast.ClassDef):
            yield from _render_members(node.body, indent + "    ")


def _text_file_documents(stdlib: Path) -> Iterator[str]:
    for pattern in _EXTRA_TEXT_FILES:
        for path in sorted(stdlib.glob(pattern)):
            try:
                yield path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue


# --- user inputs ----------------------------------------------------------------------------


class Source(NamedTuple):
    """One input: kind is "jsonl", "text" or "hf"; name is what error messages call it."""

    kind: str
    name: str
    dataset: Any = None  # the datasets.Dataset for kind "hf"


class CorpusChunk(NamedTuple):
    """Raw records read in order: payloads[i] is record number first + i of source.

    Payloads are raw bytes (a JSONL line, a whole text file) or, for "hf", the texts per key.
    """

    kind: str
    source: str
    first: int
    payloads: list[Any]
    nbytes: int


def resolve_inputs(spec: str, hf_split: str = "train") -> list[Source]:
    """The sources an --input value names: a file, a folder, a glob, or a Hugging Face dataset."""
    if glob.has_magic(spec):
        paths = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not paths:
            raise DataError(f"--input {spec!r}: no files match")
        return _file_sources(paths, hf_split)
    if os.path.isdir(spec):
        saved = ("dataset_info.json", "state.json", "dataset_dict.json")  # what datasets' save_to_disk writes
        if any(os.path.exists(os.path.join(spec, name)) for name in saved):
            return [_load_hf(spec, hf_split, from_disk=True)]
        paths = sorted(
            str(p) for p in Path(spec).rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.parts)
        )
        if not paths:
            raise DataError(f"--input {spec!r}: the folder holds no files")
        return _file_sources(paths, hf_split)
    if os.path.isfile(spec):
        return _file_sources([spec], hf_split)
    if os.path.splitext(spec)[1] or spec.startswith((".", "/", "~")):
        raise DataError(f"--input {spec!r}: no such file or folder")
    return [_load_hf(spec, hf_split, from_disk=False)]


def _file_sources(paths: list[str], hf_split: str) -> list[Source]:
    sources = []
    for path in paths:
        suffix = os.path.splitext(path)[1].lower()
        if suffix in JSONL_SUFFIXES:
            sources.append(Source("jsonl", path))
        elif suffix in HF_FILE_BUILDERS:
            sources.append(_load_hf(path, hf_split, from_disk=False, builder=HF_FILE_BUILDERS[suffix]))
        else:
            sources.append(Source("text", path))
    return sources


def quiet_hugging_face() -> None:
    """Ask datasets and the hub client for no progress bars and no retry warnings, so a CLI's
    stderr holds only its own progress and its one `error:` line. Environment variables (read
    when those libraries are imported) cost nothing when no Hugging Face input is used."""
    quiet = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "DATASETS_VERBOSITY": "error", "HF_HUB_VERBOSITY": "error"}
    for name, value in quiet.items():
        os.environ.setdefault(name, value)


def hub_unreachable_reason() -> str | None:
    """Why a hub name cannot load, found in milliseconds instead of after the hub client's
    retries; None when it may load (online, or offline mode reading the datasets cache)."""
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return None
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or ""
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return f"the Hugging Face hub ({host}) cannot be reached; pass a local path, or set HF_DATASETS_OFFLINE=1 to read the datasets cache"
    return None


def _load_hf(spec: str, split: str, from_disk: bool, builder: str | None = None) -> Source:
    if not from_disk and builder is None:
        reason = hub_unreachable_reason()
        if reason:
            raise DataError(f"--input {spec!r} is not a local file or folder, and {reason}")
    try:
        import datasets

        if from_disk:
            ds = datasets.load_from_disk(spec)
        elif builder:
            ds = datasets.load_dataset(builder, data_files=spec, split=split)
        else:
            ds = datasets.load_dataset(spec, split=split)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"--input {spec!r} has splits {', '.join(ds)}, not {split!r}; pick one with --split")
            ds = ds[split]
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (connection, file not found, schema)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"--input {spec!r} is not a local file or folder, and loading it with Hugging Face "
            f"datasets failed: {reason}"
        ) from None
    return Source("hf", spec, ds)


def read_chunks(sources: list[Source], keys: list[str], max_records: int = 512, max_bytes: int = 1 << 18) -> Iterator[CorpusChunk]:
    """Every record of every source, in order, in chunks of at most max_records / about max_bytes."""
    for source in sources:
        if source.kind == "jsonl":
            yield from _jsonl_chunks(source.name, max_records, max_bytes)
        elif source.kind == "text":
            if len(keys) > 1:
                raise DataError(f"{source.name} is plain text, one text per file; give one --json-keys key, not {len(keys)}")
            data = Path(source.name).read_bytes()
            yield CorpusChunk("text", source.name, 1, [data], len(data))
        else:
            yield from _hf_chunks(source, keys, max_records)


def _jsonl_chunks(path: str, max_records: int, max_bytes: int) -> Iterator[CorpusChunk]:
    with open(path, "rb") as f:
        lines: list[bytes] = []
        first, nbytes = 1, 0
        for line_no, line in enumerate(f, start=1):
            lines.append(line)
            nbytes += len(line)
            if len(lines) >= max_records or nbytes >= max_bytes:
                yield CorpusChunk("jsonl", path, first, lines, nbytes)
                lines, first, nbytes = [], line_no + 1, 0
        if lines:
            yield CorpusChunk("jsonl", path, first, lines, nbytes)


def _hf_chunks(source: Source, keys: list[str], batch_size: int) -> Iterator[CorpusChunk]:
    columns = source.dataset.column_names
    missing = [k for k in keys if k not in columns]
    if missing:
        raise DataError(
            f"{source.name}: no column {missing[0]!r} (columns: {', '.join(columns)}); pick one with --json-keys"
        )
    for start in range(0, len(source.dataset), batch_size):
        batch = source.dataset[start : start + batch_size]
        rows = [{k: batch[k][i] for k in keys} for i in range(len(batch[keys[0]]))]
        nbytes = sum(len(v.encode("utf-8")) for row in rows for v in row.values() if isinstance(v, str))
        yield CorpusChunk("hf", source.name, start, rows, nbytes)


class BadRecord(DataError):
    """A record that cannot be read; its message starts with file:line (or dataset[row])."""


def parse_chunk(
    chunk: CorpusChunk, keys: list[str], skip_bad: bool, nonempty: tuple[str, ...] = (), key_flag: str = "--json-keys"
) -> tuple[list[dict[str, str]], list[str]]:
    """The texts of each good record (key -> text), and a message per skipped bad record.

    Blank JSONL lines are not records. Without skip_bad the first bad record raises BadRecord.
    Keys in `nonempty` must hold more than whitespace; `key_flag` is the option a message
    about a missing key names as the fix.
    """
    texts, skipped = [], []
    for i, payload in enumerate(chunk.payloads):
        where = {
            "hf": f"{chunk.source}[{chunk.first + i}]",
            "jsonl": f"{chunk.source}:{chunk.first + i}",
        }.get(chunk.kind, chunk.source)
        try:
            record = _parse_record(chunk.kind, payload, keys, where, chunk.first + i == 1, key_flag)
            _require_nonempty(record, nonempty, where)
        except BadRecord as e:
            if not skip_bad:
                raise
            skipped.append(str(e))
            continue
        if record is not None:
            texts.append(record)
    return texts, skipped


def _require_nonempty(record: dict[str, str] | None, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if record is not None and not record[key].strip():
            raise BadRecord(f"{where}: {key!r} is empty; give every example a non-empty {key}, drop the line, "
                            f"or pass --skip-bad-lines")


def _parse_record(
    kind: str, payload: Any, keys: list[str], where: str, is_first: bool, key_flag: str = "--json-keys"
) -> dict[str, str] | None:
    if kind == "text":
        return {keys[0]: _decode(payload, where, is_first=True)}
    if kind == "hf":
        record = payload
    else:
        line = _decode(payload, where, is_first)
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadRecord(
                f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix the line or pass --skip-bad-lines"
            ) from None
        if not isinstance(record, dict):
            raise BadRecord(f"{where}: a JSON {type(record).__name__}, not an object; each line must be {{\"key\": text}}")
    for key in keys:
        if key not in record:
            present = ", ".join(map(repr, record)) or "none"
            raise BadRecord(f"{where}: no key {key!r} (keys: {present}); pick one with {key_flag}")
        if not isinstance(record[key], str):
            raise BadRecord(f"{where}: {key!r} is a {type(record[key]).__name__}, not a string")
        _require_encodable(record[key], key, where)
    return {key: record[key] for key in keys}


def _require_encodable(text: str, key: str, where: str) -> None:
    """Refuse lone surrogates: JSON can escape them ("\\ud800") but no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecord(
            f"{where}: {key!r} holds an unpaired surrogate {text[e.start]!r} at character {e.start}; "
            f"fix the text or pass --skip-bad-lines"
        ) from None


def _decode(data: bytes, where: str, is_first: bool) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(
            f"{where}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
            f"convert the file to UTF-8 (e.g. iconv) or pass --skip-bad-lines"
        ) from None
    # A byte order mark is legal at the start of a file but is not part of the text.
    return text.removeprefix("\ufeff") if is_first else text


def iter_texts(spec: str | None, keys: list[str], hf_split: str = "train", skip_bad: bool = False) -> Iterator[str]:
    """Every text of an --input value (all keys of each record, in order); the default corpus for None."""
    if spec is None:
        yield from default_corpus_documents()
        return
    for chunk in read_chunks(resolve_inputs(spec, hf_split), keys):
        records, _ = parse_chunk(chunk, keys, skip_bad)
        for record in records:
            yield from record.values()
