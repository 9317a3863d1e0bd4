"""data.stream's bad inputs, each one line naming the source and the fix; the formats and the
hf: form on a local folder; the config rules (one data source, precedence, the vocabulary)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

from helpers import make_config, make_texts, write_jsonl
from megazero.config import ConfigError
from megazero.data import DataError
from megazero.data.stream.dataset import StreamDataset, validation_samples
from megazero.data.stream.setup import setup_stream


def _stream(stream, bpe_spec: str, key: str = "text", valid_docs: int = 0) -> StreamDataset:
    return StreamDataset(setup_stream(stream, key, valid_docs, 1, 32, bpe_spec), 10**6, workers=0)


def _one_line(excinfo, *needles: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)


def test_glob_without_match_and_missing_file(tmp_path, bpe_spec):
    with pytest.raises(DataError) as e:
        _stream(str(tmp_path / "*.jsonl"), bpe_spec)
    _one_line(e, "*.jsonl", "matches no file", "fix the pattern")
    with pytest.raises(DataError) as e:
        _stream(str(tmp_path / "missing.jsonl"), bpe_spec)
    _one_line(e, "missing.jsonl", "no such file", "fix the path")


def test_document_without_the_key_names_file_and_line(tmp_path, bpe_spec):
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": t}) for t in make_texts(40)]
    lines[17] = json.dumps({"body": "no text here"})
    path.write_text("\n".join(lines) + "\n")
    ds = _stream(str(path), bpe_spec)
    with pytest.raises(DataError) as e:
        ds.fetch(0, 200)
    _one_line(e, f"{path}:18", "'text'", "body", "data.stream_key")


def test_parquet_without_the_column(tmp_path, bpe_spec):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["a b c"] * 5}), tmp_path / "a.parquet")
    with pytest.raises(DataError) as e:
        _stream(str(tmp_path / "a.parquet"), bpe_spec)
    _one_line(e, "a.parquet", "no column 'text'", "content", "data.stream_key")


def test_empty_source(tmp_path, bpe_spec):
    (tmp_path / "a.jsonl").write_text("\n\n")
    (tmp_path / "b.jsonl").write_text("")
    with pytest.raises(DataError) as e:
        _stream(str(tmp_path / "*.jsonl"), bpe_spec)
    _one_line(e, "*.jsonl", "holds no documents", "2 file(s)")


def test_hf_name_not_loadable_offline(monkeypatch, bpe_spec):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        _stream("hf:no-such-user/no-such-dataset", bpe_spec)
    _one_line(e, "hf:no-such-user/no-such-dataset", "cannot be loaded", "local folder")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_hf_local_folder_streams_offline(tmp_path, bpe_spec, monkeypatch, fmt):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    if fmt == "jsonl":
        write_jsonl(tmp_path / "data" / "train.jsonl", make_texts(60, seed=4))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": make_texts(60, seed=4)}), tmp_path / "data" / "train.parquet")
    ds = _stream(f"hf:{tmp_path / 'data'}", bpe_spec)
    ds.fetch(0, 20)
    straight = [ds[i] for i in range(10, 20)]
    resumed = StreamDataset(ds.setup, 10**6, workers=0)
    first = StreamDataset(ds.setup, 10**6, workers=0)
    first.fetch(0, 10)
    resumed.load_state_dict(first.state_dict())
    resumed.fetch(10, 20)
    assert all(np.array_equal(a, resumed[10 + i]) for i, a in enumerate(straight))


def test_non_utf8_line_is_skipped_and_counted(tmp_path, bpe_spec):
    texts = make_texts(50, seed=5)
    path = tmp_path / "a.jsonl"
    with open(path, "wb") as f:
        for i, t in enumerate(texts):
            f.write(b'{"text": "caf\xe9 latin-1"}\n' if i == 7 else (json.dumps({"text": t}) + "\n").encode())
    ds = _stream(str(path), bpe_spec)
    ds.fetch(0, 300)  # several epochs: counted once per epoch
    assert ds.stream is not None and ds.stream.skipped_documents() >= 1


def test_formats_and_validation_docs(tmp_path, bpe_spec):
    """.jsonl, .jsonl.gz, .txt (one document a file) and a glob over them; the held-out
    documents make the validation samples and never train."""
    texts = make_texts(30, seed=6)
    write_jsonl(tmp_path / "a.jsonl", texts[:10])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[10:20])
    for i, t in enumerate(texts[20:]):
        (tmp_path / f"c{i}.txt").write_text(t)
    ds = _stream(str(tmp_path / "*"), bpe_spec, valid_docs=3)
    valid = validation_samples(ds.setup, None, 4)
    assert 1 <= len(valid) <= 4 and all(len(v) == 33 for v in valid)
    ds.fetch(0, 40)
    assert all(len(ds[i]) == 33 for i in range(40))


def test_one_data_source_and_a_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("data.prefix and data.stream are both given on the command line")):
        make_config(["--data.stream", "a.jsonl", "--data.prefix", "P"], world=1)
    write_jsonl(tmp_path / "a.jsonl", make_texts(5))
    with pytest.raises(DataError) as e:
        setup_stream(str(tmp_path / "a.jsonl"), "text", 0, 1, 32, None).tokenizer()
    _one_line(e, "data.stream needs data.tokenizer")


def test_command_line_source_replaces_the_files(bpe_spec):
    """configs/gpt2-tiny.yaml says data.mock true; --data.stream replaces it."""
    cfg = make_config(["--data.stream", "a.jsonl", "--data.tokenizer", bpe_spec, "--model.vocab_size", "auto"], world=1)
    assert cfg.data.stream == ["a.jsonl"] and not cfg.data.mock
    with pytest.raises(ConfigError, match="are both given in the config file"):
        make_config([], base={"data": {"mock": True, "stream": ["a.jsonl"]}}, world=1)


def test_tokenizer_larger_than_the_model(bpe_spec):
    with pytest.raises(ConfigError) as e:
        make_config(["--data.stream", "a.jsonl", "--data.tokenizer", bpe_spec, "--model.vocab_size", "100"], world=1)
    _one_line(e, "model.vocab_size (100)", "data.tokenizer")


def test_weights_must_pair_with_sources(bpe_spec, tmp_path: Path):
    with pytest.raises(DataError) as e:
        _stream(["0.5", "a.jsonl", "b.jsonl"], bpe_spec)
    _one_line(e, "[W1, SRC1, W2, SRC2, ...]")


def test_megatron_eod_and_reset_flags(bpe_spec):
    from helpers import REPO, TINY_CONFIG
    from megazero.train.__main__ import load_config
    config = str(REPO / TINY_CONFIG)
    assert load_config(config, None, ["--eod-mask-loss", "--data.tokenizer", bpe_spec], 1, 1).data.eod_mask_loss
    cfg = load_config(config, None, ["--reset-position-ids", "--reset-attention-mask", "--data.tokenizer", bpe_spec],
                      1, 1)
    assert cfg.data.reset_position_ids and cfg.data.reset_attention_mask
    for flag, key in (("--reset-position-ids", "data.reset_position_ids"),
                      ("--reset-attention-mask", "data.reset_attention_mask")):
        with pytest.raises(ConfigError) as e:
            load_config(config, None, [flag], 1, 1)
        _one_line(e, f"{key} needs data.tokenizer")
        with pytest.raises(ConfigError) as e:
            load_config(config, None, [flag, "--data.tokenizer", bpe_spec, "--context-parallel-size", "2"], 0, 2)
        _one_line(e, f"{key} needs parallel.cp 1", "cp is 2")
    with pytest.raises(ConfigError, match="data.eod_mask_loss needs data.tokenizer"):
        make_config(["--data.eod_mask_loss", "true"], world=1)


def test_loader_workers_default_to_the_cores_the_ranks_leave(monkeypatch):
    """data.loader_workers -1: per rank, its share of the node's cores less the one it trains on
    (at least 1, at most one per logical shard), from LOCAL_WORLD_SIZE ranks on the node."""
    from megazero.data.stream.dataset import default_workers
    from megazero.data.stream.shards import NUM_SHARDS
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert [default_workers(n) for n in (1, 4, 8, 16, 32)] == [NUM_SHARDS, 7, 3, 1, 1]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert default_workers(2) == 1


def test_default_loader_workers_follow_the_ranks_on_the_node(monkeypatch, tmp_path, bpe_spec):
    from megazero.train.stream_data import stream_datasets
    write_jsonl(tmp_path / "a.jsonl", make_texts(20))
    cfg = make_config(["--data.stream", str(tmp_path / "a.jsonl"), "--data.tokenizer", bpe_spec,
                       "--model.vocab_size", "auto"], world=1)
    assert cfg.data.loader_workers == -1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    for ranks, workers in (("1", 15), ("4", 3)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        train, _ = stream_datasets(cfg, lambda line: None)
        assert train.workers == workers
        assert f"tokenized on the fly by {workers} loader process(es) per rank" in train.describe(8)


def test_tokens_per_source_reach_tensorboard():
    from megazero.train.sinks import tensorboard_scalars
    rec = {"iteration": 4, "consumed_samples": 32, "loss": 1.0, "stream_tokens": {"a/*.jsonl": 1536, "hf:b": 512}}
    tags = {tag: (value, vs_samples) for tag, value, vs_samples in tensorboard_scalars(rec)}
    assert tags["stream_tokens/a/*.jsonl"] == (1536, True) and tags["stream_tokens/hf:b"] == (512, True)


def test_stream_valid_source_makes_the_validation_samples(tmp_path, bpe_spec):
    from megazero.train.stream_data import stream_datasets
    write_jsonl(tmp_path / "train.jsonl", make_texts(40, seed=1))
    write_jsonl(tmp_path / "valid.jsonl", make_texts(120, seed=2))
    cfg = make_config(["--data.stream", str(tmp_path / "train.jsonl"), "--data.stream_valid",
                       str(tmp_path / "valid.jsonl"), "--data.tokenizer", bpe_spec, "--model.vocab_size", "auto",
                       "--train.eval_interval", "2", "--train.eval_iters", "2", "--data.loader_workers", "0"], world=1)
    train, valid = stream_datasets(cfg, lambda line: None)
    assert valid is not None and len(valid) == 2 * cfg.train.global_batch_size
    tokenizer = train.setup.tokenizer()
    first = tokenizer.encode_batch([make_texts(40, seed=2)[0]])[0]
    assert valid[0][:len(first) + 1].tolist() == [*first, tokenizer.eod][:cfg.model.seq_length + 1]
    train.fetch(0, 4)
    assert not any(np.array_equal(train[i], v) for i in range(4) for v in valid)
