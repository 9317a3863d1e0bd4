"""Tokenizers: round trips, identity, specs, training, and bad specs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import SAMPLES, documents, load_script, make_texts, run, write_jsonl
from megazero.config.megatron import tokenizer_spec
from megazero.config.schema import ConfigError
from megazero.data import DataError
from megazero.data.tokenizer import build_tokenizer, train_gpt2bpe


@pytest.mark.parametrize("fixture", ["bpe_spec", "spm_spec"])
def test_round_trip(fixture: str, request: pytest.FixtureRequest) -> None:
    tok = build_tokenizer(request.getfixturevalue(fixture))
    for text in SAMPLES + make_texts(5, seed=1):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]


def test_gpt2bpe_files_and_eod(bpe_spec: str) -> None:
    folder = Path(bpe_spec.split(":", 1)[1])
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    assert (folder / "merges.txt").read_text(encoding="utf-8").startswith("#version: 0.2\n")
    tok = build_tokenizer(bpe_spec)
    # As in GPT-2's files: <|endoftext|> is the last id.
    assert tok.eod == vocab["<|endoftext|>"] == tok.vocab_size - 1 == len(vocab) - 1
    assert tok.vocab_size <= 400
    # The literal text is ordinary text, never a document boundary.
    assert tok.eod not in tok.encode("a <|endoftext|> b")


def test_spec_forms_share_identity(bpe_spec: str) -> None:
    folder = bpe_spec.split(":", 1)[1]
    by_files = build_tokenizer(f"gpt2bpe:{folder}/vocab.json,{folder}/merges.txt")
    by_megatron = build_tokenizer(tokenizer_spec("GPT2BPETokenizer", f"{folder}/vocab.json", f"{folder}/merges.txt", None))
    identity = build_tokenizer(bpe_spec).identity()
    assert by_files.identity() == by_megatron.identity() == identity
    assert set(identity) == {"type", "vocab_size", "eod", "sha256"} and identity["type"] == "gpt2bpe"


def test_identity_changes_with_files(bpe_spec: str, tmp_path: Path) -> None:
    other = train_gpt2bpe(make_texts(300, seed=7), 380, tmp_path / "other")
    assert build_tokenizer(other).identity()["sha256"] != build_tokenizer(bpe_spec).identity()["sha256"]


def test_sentencepiece_eod_and_dir_spec(spm_spec: str) -> None:
    tok = build_tokenizer(spm_spec)
    assert tok.eod == 2 and tok.vocab_size == 320
    folder = os.path.dirname(spm_spec.split(":", 1)[1])
    assert build_tokenizer(f"sentencepiece:{folder}").identity() == tok.identity()


@pytest.mark.parametrize(
    "spec, words",
    [
        ("bpe:x", "KIND:PATH"),
        ("gpt2bpe", "KIND:PATH"),
        ("gpt2bpe:/no/such/dir", "not found"),
        ("sentencepiece:/no/such.model", "not found"),
    ],
)
def test_bad_specs(spec: str, words: str) -> None:
    with pytest.raises(DataError, match=words):
        build_tokenizer(spec)


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "garbage.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a SentencePiece model"):
        build_tokenizer(f"sentencepiece:{tmp_path / 'garbage.model'}")
    (tmp_path / "vocab.json").write_text('{"a": 0}')
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(DataError, match="<\\|endoftext\\|>"):
        build_tokenizer(f"gpt2bpe:{tmp_path}")


def test_megatron_flags_need_their_files() -> None:
    with pytest.raises(ConfigError, match="--vocab-file"):
        tokenizer_spec("GPT2BPETokenizer", None, None, None)
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        tokenizer_spec("SentencePieceTokenizer", None, None, None)
    with pytest.raises(ConfigError, match="HuggingFaceTokenizer needs --tokenizer-model DIR"):
        tokenizer_spec("HuggingFaceTokenizer", None, None, None)
    with pytest.raises(ConfigError, match="not a hub name"):
        tokenizer_spec("HuggingFaceTokenizer", None, None, "meta-llama/Meta-Llama-3-8B")
    with pytest.raises(ConfigError, match="not supported"):
        tokenizer_spec("TikTokenizer", None, None, None)


def test_a_megatron_tokenizer_directory_is_read_by_what_it_holds(llama3_tokenizer_dir: str, tmp_path: Path) -> None:
    """HuggingFaceTokenizer --tokenizer-model DIR becomes the bare DIR spec: the front-end reads no files,
    the tokenizer reads the directory (tokenizer.json here), and an empty one is refused there, naming it."""
    spec = tokenizer_spec("HuggingFaceTokenizer", None, None, llama3_tokenizer_dir)
    assert spec == llama3_tokenizer_dir
    assert build_tokenizer(spec).kind == "hf"
    with pytest.raises(DataError, match="holds no tokenizer files"):
        build_tokenizer(tokenizer_spec("HuggingFaceTokenizer", None, None, str(tmp_path)))


@pytest.mark.parametrize("kind, size", [("gpt2bpe", 300), ("sentencepiece", 300)])
def test_train_tokenizer_cli(kind: str, size: int, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_texts(200))
    cli = load_script("train_tokenizer")
    out = tmp_path / "tok"
    assert cli.main(["--type", kind, "--input", str(corpus), "--vocab-size", str(size), "--output", str(out)]) == 0
    spec = capsys.readouterr().out.split()[1]
    tok = build_tokenizer(spec)
    assert tok.decode(tok.encode("the model data")) == "the model data"


def test_train_tokenizer_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cli = load_script("train_tokenizer")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert cli.main(["--type", "gpt2bpe", "--input", str(empty), "--vocab-size", "300", "--output", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no text" in err and err.count("\n") == 1
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("kind", ["gpt2bpe", "sentencepiece"])
def test_train_tokenizer_says_when_the_corpus_yields_fewer_tokens(kind: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_texts(100))
    cli = load_script("train_tokenizer")
    out = tmp_path / "tok"
    assert cli.main(["--type", kind, "--input", str(corpus), "--vocab-size", "50000", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    got = build_tokenizer(captured.out.split()[1]).vocab_size
    assert got < 50000
    assert captured.err == (f"warning: the corpus yields only {got:,} tokens of the 50,000 --vocab-size asked for; "
                            f"use a larger corpus (--input) or a smaller --vocab-size\n")


# ----------------------------------------------------------------------------- Hugging Face directories


def test_tokenizer_json_of_a_hugging_face_directory(llama3_tokenizer_dir: str, tmp_path: Path) -> None:
    """hf:DIR or the bare DIR: a tokenizer.json (Llama 3 style) encodes as transformers does without
    its added bos, decodes back, and ends documents with the directory's eos token."""
    transformers = pytest.importorskip("transformers")
    tok = build_tokenizer(llama3_tokenizer_dir)
    assert tok.kind == "hf" and tok.vocab_size == 300
    assert tok.identity() == build_tokenizer(f"hf:{llama3_tokenizer_dir}").identity()
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(llama3_tokenizer_dir, "tokenizer.json"))
    assert tok.eod == theirs.convert_tokens_to_ids("<|end_of_text|>")
    for text in SAMPLES + make_texts(5, seed=1):
        ids = tok.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False) and tok.decode(ids) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    from megazero.checkpoint.export import write_hf_tokenizer
    write_hf_tokenizer(tok, str(tmp_path / "export"), 64)  # convert --to hf of a run with it: the same ids
    again = build_tokenizer(str(tmp_path / "export"))
    assert (again.kind, again.eod, again.encode(SAMPLES[0])) == ("hf", tok.eod, tok.encode(SAMPLES[0]))
    # Without tokenizer_config.json, config.json's eos_token_id (a list: its first) decides.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(Path(llama3_tokenizer_dir, "tokenizer.json").read_bytes())
    (bare / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert build_tokenizer(str(bare)).eod == 7
    (bare / "config.json").unlink()
    with pytest.raises(DataError, match="no end-of-document token"):
        build_tokenizer(str(bare))
    with pytest.raises(DataError, match="holds no tokenizer files"):
        build_tokenizer(str(tmp_path))


def test_a_llama2_directory_uses_its_sentencepiece_model(spm_spec: str, llama3_tokenizer_dir: str,
                                                         tmp_path: Path) -> None:
    """tokenizer.model beside a tokenizer.json (Llama 2's directories): the SentencePiece model."""
    model = spm_spec.partition(":")[2]
    (tmp_path / "tokenizer.model").write_bytes(Path(model).read_bytes())
    (tmp_path / "tokenizer.json").write_bytes(Path(llama3_tokenizer_dir, "tokenizer.json").read_bytes())
    tok = build_tokenizer(str(tmp_path))
    assert tok.kind == "sentencepiece" and tok.identity() == build_tokenizer(spm_spec).identity()


def test_preprocess_with_a_hugging_face_directory(cli, capsys, tmp_path: Path, llama3_tokenizer_dir: str) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_texts(6))
    out = tmp_path / "out"
    code, _, _ = run(cli, capsys, "--input", str(corpus), "--tokenizer", llama3_tokenizer_dir,
                     "--output-prefix", str(out), "--append-eod")
    assert code == 0
    tok = build_tokenizer(llama3_tokenizer_dir)
    docs = documents(Path(str(out) + "_text_document"))
    assert docs == [[*tok.encode(t), tok.eod] for t in make_texts(6)]
