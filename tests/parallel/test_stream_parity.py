"""data.stream in training: the same losses at dp 1, 2 and 4; a resume at the same layout is
bitwise, one at another dp and number of loader processes continues the same stream; a resume
with other weights is refused in one line; tokens per source are logged."""

from __future__ import annotations

import contextlib
import gzip
import io
import json

import pytest

from helpers import make_texts, make_trainer, run_distributed, write_jsonl

ITERS = 6


@pytest.fixture(scope="module")
def stream_args(tmp_path_factory, bpe_spec) -> list[str]:
    """Two sources: JSONL (plain and gzip) and Parquet, weighted 0.7 / 0.3, 20 documents of each
    held out for validation; micro-batch 1 of a global batch of 8."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("stream")
    (root / "a").mkdir()
    write_jsonl(root / "a" / "part0.jsonl", make_texts(120, seed=1))
    with gzip.open(root / "a" / "part1.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in make_texts(120, seed=2))
    pq.write_table(pa.table({"text": make_texts(150, seed=3)}), root / "b.parquet", row_group_size=40)
    return ["--data.stream", "0.7", str(root / "a"), "0.3", str(root / "b.parquet"), "--data.tokenizer", bpe_spec,
            "--data.stream_valid_docs", "20", "--train.eval_interval", "3", "--train.eval_iters", "1",
            "--train.micro_batch_size", "1", "--train.global_batch_size", "8", "--train.iters", str(ITERS),
            "--data.loader_workers", "0"]


def _run(args: list[str]) -> list[dict]:
    trainer = make_trainer(args)
    with contextlib.redirect_stdout(io.StringIO()):
        return [{k: r.get(k) for k in ("iteration", "loss", "val_loss", "stream_tokens")} for r in trainer.run()]


def _resumed(args: list[str], ckpt: str, stop: int) -> list[dict]:
    save = ["--checkpoint.save", ckpt]
    return _run(args + save + ["--train.iters", str(stop)])


def _continue(args: list[str], ckpt: str) -> list[dict]:
    return _run(args + ["--checkpoint.load", ckpt])


@pytest.fixture(scope="module")
def straight(stream_args) -> list[dict]:
    return run_distributed(_run, 1, stream_args)[0]


def _close(a: list[dict], b: list[dict], tol: float) -> None:
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= tol, (a, b)
        if x["val_loss"] is not None or y["val_loss"] is not None:
            assert abs(x["val_loss"] - y["val_loss"]) <= tol, (a, b)


@pytest.mark.parametrize("dp", [2, 4])
def test_same_losses_at_any_dp(straight, stream_args, dp):
    """The global batches do not depend on dp (nor the loader processes: 2 per rank at dp 2)."""
    workers = ["--data.loader_workers", "2"] if dp == 2 else []
    _close(run_distributed(_run, dp, stream_args + workers)[0], straight, 1e-5)


def test_tokens_per_source_follow_the_weights(straight):
    last = straight[-1]["stream_tokens"]
    shares = [n / sum(last.values()) for n in last.values()]
    assert len(shares) == 2 and abs(shares[0] - 0.7) <= 1 / 8 * 0.3 + 1e-9  # 48 samples: within one sample
    assert sum(last.values()) == ITERS * 8 * 64


def test_resume_same_layout_is_bitwise_and_another_continues(straight, stream_args, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(_resumed, 1, stream_args, ckpt, 3)[0]
    assert first == straight[:3]
    same = run_distributed(_continue, 1, stream_args, ckpt)[0]
    assert same == straight[3:]  # bitwise: losses, validation, tokens per source
    other = run_distributed(_continue, 2, stream_args + ["--data.loader_workers", "1"], ckpt)[0]
    _close(other, straight[3:], 1e-5)


def _refused(args: list[str], ckpt: str) -> str:
    from megazero.data import DataError
    try:
        _run(args + ["--checkpoint.load", ckpt])
    except DataError as e:
        return str(e)
    return ""


def test_other_weights_are_refused_in_one_line(stream_args, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_resumed, 1, stream_args, ckpt, 2)
    args = list(stream_args)
    args[args.index("0.7")], args[args.index("0.3")] = "0.5", "0.5"
    message = run_distributed(_refused, 1, args, ckpt)[0]
    assert "weights" in message and "--checkpoint.load_data_state false" in message and "\n" not in message
    fresh = run_distributed(_continue, 1, args + ["--checkpoint.load_data_state", "false"], ckpt)[0]
    assert [r["iteration"] for r in fresh] == list(range(3, ITERS + 1))
