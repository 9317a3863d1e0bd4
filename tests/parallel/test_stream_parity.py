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

ITERS = 4  # eval at 2 and 4: the resume after 2 evaluates too


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
            "--data.stream_valid_docs", "20", "--train.eval_interval", "2", "--train.eval_iters", "1",
            "--train.micro_batch_size", "1", "--train.global_batch_size", "8", "--train.iters", str(ITERS),
            "--data.loader_workers", "0"]


def _run(args: list[str]) -> list[dict]:
    trainer = make_trainer(args)
    with contextlib.redirect_stdout(io.StringIO()):
        return [{k: r.get(k) for k in ("iteration", "loss", "val_loss", "stream_tokens")} for r in trainer.run()]


def _refused(args: list[str]) -> str:
    """The DataError's message a run of `args` stops with ("" if it trains to the end)."""
    from megazero.data import DataError
    try:
        _run(args)
    except DataError as e:
        return str(e)
    return ""


def _one_rank(args: list[str], root: str) -> dict:
    """In one process: the straight run; the same stopped after 2 iterations and resumed; a
    resume with other weights (refused), and with them under checkpoint.load_data_state false."""
    ckpt = ["--checkpoint.save", f"{root}/ckpt"]
    out = {"straight": _run(args), "first": _run(args + ckpt + ["--train.iters", "2"]),
           "same": _run(args + ["--checkpoint.load", f"{root}/ckpt"])}
    other = list(args)
    other[other.index("0.7")], other[other.index("0.3")] = "0.5", "0.5"
    out["refused"] = _refused(other + ["--checkpoint.load", f"{root}/ckpt"])
    out["fresh"] = _run(other + ["--checkpoint.load", f"{root}/ckpt", "--checkpoint.load_data_state", "false"])
    return out


def _two_ranks(args: list[str], root: str) -> dict:
    """On two ranks: the whole run at dp 2 with 2 loader processes per rank, and the one-rank
    checkpoint resumed at tp 2 with 1, and at dp 2 in-process."""
    return {"straight": _run(args + ["--data.loader_workers", "2"]),
            "resumed": _run(args + ["--data.loader_workers", "1", "--parallel.tp", "2",
                                    "--checkpoint.load", f"{root}/ckpt"]),
            "resumed_dp2": _run(args + ["--checkpoint.load", f"{root}/ckpt"])}


@pytest.fixture(scope="module")
def one_rank(stream_args, tmp_path_factory) -> tuple[dict, str]:
    root = str(tmp_path_factory.mktemp("stream-runs"))
    return run_distributed(_one_rank, 1, stream_args, root)[0], root


def _close(a: list[dict], b: list[dict], tol: float) -> None:
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= tol, (a, b)
        if x["val_loss"] is not None or y["val_loss"] is not None:
            assert abs(x["val_loss"] - y["val_loss"]) <= tol, (a, b)


def test_dp2_with_loader_processes_matches_and_tp2_resumes(one_rank, stream_args):
    """The global batches depend neither on dp nor on the loader processes; a checkpoint of
    the one-rank run continues the same stream at tp 2 with another number of them, and at dp 2."""
    runs, root = one_rank
    two = run_distributed(_two_ranks, 2, stream_args, root)[0]
    _close(two["straight"], runs["straight"], 1e-5)
    _close(two["resumed"], runs["straight"][2:], 1e-5)
    _close(two["resumed_dp2"], runs["straight"][2:], 1e-5)


@pytest.mark.slow
def test_dp4_matches(one_rank, stream_args):
    _close(run_distributed(_run, 4, stream_args)[0], one_rank[0]["straight"], 1e-5)


@pytest.mark.slow
def test_pp2_dp2_resumes_the_same_stream(one_rank, stream_args):
    runs, root = one_rank
    resumed = run_distributed(_run, 4, stream_args + ["--parallel.pp", "2", "--checkpoint.load", f"{root}/ckpt"])
    _close(next(r for r in resumed if r and r[0]["loss"] is not None), runs["straight"][2:], 1e-5)


def test_resume_at_the_same_layout_is_bitwise(one_rank):
    runs, _ = one_rank
    assert runs["first"] == runs["straight"][:2]
    assert runs["same"] == runs["straight"][2:]  # losses, validation, tokens per source: bitwise


def test_tokens_per_source_follow_the_weights(one_rank):
    last = one_rank[0]["straight"][-1]["stream_tokens"]
    shares = [n / sum(last.values()) for n in last.values()]
    assert len(shares) == 2 and abs(shares[0] - 0.7) <= 1 / (ITERS * 8)  # within one sample of the weight
    assert sum(last.values()) == ITERS * 8 * 64


def test_other_weights_are_refused_in_one_line(one_rank):
    runs, _ = one_rank
    message = runs["refused"]
    assert "weights" in message and "--checkpoint.load_data_state false" in message and "\n" not in message
    assert [r["iteration"] for r in runs["fresh"]] == list(range(3, ITERS + 1))


def test_bad_document_stops_every_rank_alike(tmp_path, bpe_spec):
    """A document without the text key, read by a loader process: every rank raises the same
    one line at the same sample (none waits in a collective for the others)."""
    lines = [json.dumps({"text": t}) for t in make_texts(200, seed=7)]
    lines[40] = json.dumps({"title": "no text"})
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    args = ["--data.stream", str(tmp_path / "a.jsonl"), "--data.tokenizer", bpe_spec, "--train.iters", "20",
            "--data.loader_workers", "1", "--train.micro_batch_size", "2", "--train.global_batch_size", "8"]
    messages = run_distributed(_refused, 2, args)
    assert messages[0] == messages[1] and "a.jsonl:41 has no field 'text'" in messages[0]


def _eod_masked_batches(args: list[str]) -> list:
    trainer = make_trainer(args + ["--data.eod_mask_loss", "true"])
    try:
        eod = trainer.eod_masked
        return [eod, trainer.loss_masked,
                [(i.numpy(), lab.numpy()) for i, lab in trainer.microbatches(trainer.train_ds, 0)]]
    finally:
        trainer.train_ds.close()


def test_eod_mask_loss_leaves_out_the_prediction_at_each_end_of_document(stream_args):
    eod, masked, batches = run_distributed(_eod_masked_batches, 1, stream_args)[0]
    assert masked and eod is not None
    ends = 0
    for inputs, labels in batches:
        at_eod = inputs == eod
        ends += int(at_eod.sum())
        assert (labels[at_eod] == -100).all() and (labels[~at_eod] >= 0).all()
        assert (labels[:, :-1][~at_eod[:, :-1]] == inputs[:, 1:][~at_eod[:, :-1]]).all()
    assert ends > 0
