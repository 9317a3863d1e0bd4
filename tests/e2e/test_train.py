"""End to end: `megazero.train` under torchrun reproduces the single-process losses."""

from __future__ import annotations

import pytest

from helpers import make_trainer, run_distributed, train_records

BASE = ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--train.iters", "10"]


def _run(tmp_path, nproc: int, extra: list[str], name: str) -> list[dict]:
    return train_records(tmp_path, nproc, BASE + extra, name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), 1, [], "ref")


def test_reference_learns_and_logs(reference):
    assert [r["iteration"] for r in reference] == list(range(1, 11))
    for key in ("iteration", "loss", "lr", "grad_norm", "tokens_per_sec"):
        assert all(key in r for r in reference)
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.05


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])  # tp 4: test_tensor_parallel's layers
def test_tensor_parallel_losses_equal_single_process(tmp_path, reference, tp):
    run = _run(tmp_path, tp, ["--parallel.tp", str(tp)], f"tp{tp}")
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(run, reference, strict=True)) <= 1e-5
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(run, reference, strict=True)) <= 1e-5


def _logged(args: list[str]) -> list[tuple[int, bool]]:
    import contextlib
    import io

    trainer = make_trainer(args)
    with contextlib.redirect_stdout(io.StringIO()):
        records = trainer.run()
    return [(r["iteration"], "val_loss" in r) for r in records]


def test_evaluation_runs_on_its_own_schedule():
    """eval_interval 3 with log_interval 5 over 7 iterations: validation at 3, 6 and the last
    iteration, each with a record; plain log records at 5 (and the last)."""
    got = run_distributed(_logged, 1, ["--data.mock", "true", "--train.iters", "7", "--train.log_interval", "5",
                                       "--train.eval_interval", "3", "--train.eval_iters", "1"])[0]
    assert got == [(3, True), (5, False), (6, True), (7, True)]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_compiled_blocks_equal_eager(tmp_path, reference, recompute):
    """train.compile (torch.compile of each block, or each MLP under selective recompute)
    around ZeRO-3's hooks gives the eager losses (minutes on CPU: slow)."""
    extra = ["--train.compile", "true", "--train.recompute", recompute, "--zero.stage", "3", "--train.iters", "3"]
    run = _run(tmp_path, 1, extra, f"compile-{recompute}")
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(run, reference[:3], strict=True)) <= 1e-5
