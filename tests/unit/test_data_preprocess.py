"""preprocess_data.py: inputs of every kind, workers, merging, the default corpus, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, documents, make_texts, run, write_jsonl
from megazero.data.corpus import default_corpus_documents, write_default_corpus
from megazero.data.indexed import IndexedDataset, read_metadata
from megazero.data.tokenizer import build_tokenizer

SCRIPT = REPO / "data_tools" / "preprocess_data.py"


def test_jsonl_end_to_end(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    texts = make_texts(50)
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "out" / "c"
    code, stdout, _ = run(cli, capsys, "--input", str(corpus), "--tokenizer", bpe_spec, "--output-prefix", str(out), "--append-eod")
    assert code == 0
    assert "50 documents" in stdout and "MB/s" in stdout and "docs/s" in stdout
    tok = build_tokenizer(bpe_spec)
    prefix = tmp_path / "out" / "c_text_document"
    assert documents(prefix) == [tok.encode(t) + [tok.eod] for t in texts]
    assert IndexedDataset(prefix).dtype == np.uint16
    meta = read_metadata(prefix)
    assert meta["tokenizer"] == tok.identity() and meta["tokenizer_spec"] == bpe_spec
    assert meta["max_token_id"] == tok.eod and meta["num_documents"] == 50
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "c_text_document.bin", "c_text_document.idx", "c_text_document.meta.json"]


def test_two_workers_same_bytes_via_megatron_flags(tmp_path: Path, bpe_spec: str) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_texts(3000))
    folder = bpe_spec.split(":", 1)[1]
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        result = subprocess.run(
            [sys.executable, str(SCRIPT), "--input", str(corpus), "--json-keys", "text",
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{folder}/vocab.json",
             "--merge-file", f"{folder}/merges.txt", "--output-prefix", str(out),
             "--workers", str(workers), "--append-eod"],
            capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "3,000 documents" in result.stdout
        outputs.append([Path(f"{out}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")])
    assert outputs[0] == outputs[1]


def test_text_files_folder_and_glob(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    texts = ["First file.\nWith two lines.\n", "Second file, one line."]
    (tmp_path / "in").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i}.txt").write_text(text, encoding="utf-8")
    tok = build_tokenizer(bpe_spec)
    for name, spec in [("folder", tmp_path / "in"), ("glob", tmp_path / "in" / "*.txt")]:
        out = tmp_path / name
        assert run(cli, capsys, "--input", str(spec), "--tokenizer", bpe_spec, "--output-prefix", str(out))[0] == 0
        assert documents(Path(f"{out}_text_document")) == [tok.encode(t) for t in texts]


def test_hugging_face_inputs(cli, capsys, tmp_path: Path, spm_spec: str) -> None:
    import datasets

    texts = make_texts(30)
    ds = datasets.Dataset.from_dict({"content": texts, "n": list(range(30))})
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "data.parquet"))
    tok = build_tokenizer(spm_spec)
    for name in ("saved", "data.parquet"):
        out = tmp_path / f"out_{name}"
        code, _, err = run(cli, capsys, "--input", str(tmp_path / name), "--json-keys", "content",
                           "--tokenizer", spm_spec, "--output-prefix", str(out))
        assert code == 0, err
        assert documents(Path(f"{out}_content_document")) == [tok.encode(t) for t in texts]
    code, _, err = run(cli, capsys, "--input", str(tmp_path / "saved"), "--json-keys", "text",
                       "--tokenizer", spm_spec, "--output-prefix", str(tmp_path / "x"))
    assert code == 2 and "no column 'text' (columns: content, n)" in err


def test_several_keys(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"title": "A title", "body": "Some body text."}\n{"title": "B", "body": "More."}\n')
    assert run(cli, capsys, "--input", str(corpus), "--json-keys", "title", "body",
               "--tokenizer", bpe_spec, "--output-prefix", str(tmp_path / "o"))[0] == 0
    tok = build_tokenizer(bpe_spec)
    assert documents(tmp_path / "o_title_document") == [tok.encode("A title"), tok.encode("B")]
    assert documents(tmp_path / "o_body_document") == [tok.encode("Some body text."), tok.encode("More.")]


def test_merge(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    for name, seed in (("a", 1), ("b", 2)):
        write_jsonl(tmp_path / f"{name}.jsonl", make_texts(10, seed))
        run(cli, capsys, "--input", str(tmp_path / f"{name}.jsonl"), "--tokenizer", bpe_spec,
            "--output-prefix", str(tmp_path / name), "--append-eod")
    parts = [str(tmp_path / f"{n}_text_document") for n in "ab"]
    assert run(cli, capsys, "--merge", *parts, "--output-prefix", str(tmp_path / "m"))[0] == 0
    assert documents(tmp_path / "m") == documents(Path(parts[0])) + documents(Path(parts[1]))
    assert read_metadata(tmp_path / "m")["num_documents"] == 20


def test_default_corpus(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    path = write_default_corpus(tmp_path / "default.jsonl")
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    assert len(texts) == len(set(texts)) > 300
    assert sum(len(t.encode()) for t in texts) > 2_000_000  # a few MB of English
    from pydoc_data.topics import topics

    assert topics["if"] in texts and any(t.startswith("Module json\n") for t in texts)
    assert tuple(texts) == default_corpus_documents()
    code, stdout, _ = run(cli, capsys, "--tokenizer", bpe_spec, "--output-prefix", str(tmp_path / "d"), "--workers", "2")
    assert code == 0 and f"{len(texts):,} documents" in stdout
    assert read_metadata(tmp_path / "d_text_document")["source"].startswith("default corpus")


BAD_INPUTS = {
    "missing": (None, "no such file"),
    "empty": (b"\n\n", "holds no text"),
    "not json": (b'{"text": "ok"}\n{"text": broken\n', "bad.jsonl:2: not valid JSON"),
    "not an object": (b'{"text": "ok"}\n["text"]\n', "bad.jsonl:2: a JSON list, not an object"),
    "missing key": (b'{"text": "ok"}\n{"body": "x"}\n', "bad.jsonl:2: no key 'text' (keys: 'body')"),
    "not a string": (b'{"text": 5}\n', "bad.jsonl:1: 'text' is a int"),
    "not utf-8": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "bad.jsonl:2: not valid UTF-8 (byte 0xe9"),
    "lone surrogate": (b'{"text": "a\\ud800b"}\n', "bad.jsonl:1: 'text' holds an unpaired surrogate"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_one_line_no_output(cli, capsys, tmp_path: Path, bpe_spec: str, case: str) -> None:
    content, words = BAD_INPUTS[case]
    corpus = tmp_path / "bad.jsonl"
    if content is not None:
        corpus.write_bytes(content)
    (tmp_path / "out").mkdir()
    code, stdout, err = run(cli, capsys, "--input", str(corpus), "--tokenizer", bpe_spec,
                            "--output-prefix", str(tmp_path / "out" / "x"), "--append-eod")
    assert code == 2 and stdout == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err
    assert list((tmp_path / "out").iterdir()) == []  # nothing that looks complete, no temporaries


def test_skip_bad_lines_counts_them(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b'{"text": "one"}\nnot json\n{"text": "caf\xe9"}\n{"text": "two"}\n{"other": 1}\n')
    code, stdout, _ = run(cli, capsys, "--input", str(corpus), "--tokenizer", bpe_spec,
                          "--output-prefix", str(tmp_path / "o"), "--skip-bad-lines")
    assert code == 0 and "3 bad lines skipped, e.g. " in stdout and "c.jsonl:2" in stdout
    tok = build_tokenizer(bpe_spec)
    assert documents(tmp_path / "o_text_document") == [tok.encode("one"), tok.encode("two")]


def test_bad_tokenizer_and_datasets(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", ["hello"])
    code, _, err = run(cli, capsys, "--input", str(corpus), "--output-prefix", str(tmp_path / "o"))
    assert code == 2 and "no tokenizer" in err
    code, _, err = run(cli, capsys, "--input", str(corpus), "--tokenizer", "gpt2bpe:/nope", "--output-prefix", str(tmp_path / "o"))
    assert code == 2 and "train_tokenizer.py" in err
    # A foreign .idx and a truncated .bin given to --merge.
    run(cli, capsys, "--input", str(corpus), "--tokenizer", bpe_spec, "--output-prefix", str(tmp_path / "o"))
    good = tmp_path / "o_text_document"
    (tmp_path / "foreign.idx").write_bytes(b"PK\x03\x04" + bytes(60))
    (tmp_path / "foreign.bin").write_bytes(b"")
    code, _, err = run(cli, capsys, "--merge", str(good), str(tmp_path / "foreign"), "--output-prefix", str(tmp_path / "m"))
    assert code == 2 and "foreign.idx is not a Megatron MMIDIDX index" in err
    Path(f"{good}.bin").write_bytes(Path(f"{good}.bin").read_bytes()[:-1])
    code, _, err = run(cli, capsys, "--merge", str(good), "--output-prefix", str(tmp_path / "m"))
    assert code == 2 and "truncated or mismatched" in err
    assert not list(tmp_path.glob("m*"))


def test_cli_error_has_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--input", str(tmp_path / "missing.jsonl"), "--tokenizer", "gpt2bpe:x",
         "--output-prefix", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
