"""Batch-size ramp-up (train.rampup_batch_size, Megatron's --rampup-batch-size) and the
warm-up as a fraction (optim.warmup_fraction): the batch sequence, the LR counted in samples,
parity over DP and a bitwise resume in the middle of the ramp."""

from __future__ import annotations

import contextlib
import io

import pytest

from helpers import make_config, make_trainer, run_distributed
from megazero.config import ConfigError, OptimConfig, TrainConfig
from megazero.train.batch_rampup import rampup_batch
from megazero.train.lr import LRSchedule

# micro 2, global 16: the batch starts at 4 and grows by 4 every 24 / 3 = 8 samples.
RAMP = ["--data.mock", "true", "--train.micro_batch_size", "2", "--train.global_batch_size", "16",
        "--train.rampup_batch_size", "4", "4", "24", "--optim.warmup_iters", "2", "--optim.decay_iters", "6",
        "--train.iters", "6"]
BATCHES = [4, 4, 8, 12, 16, 16]


def test_batch_sequence_follows_megatron():
    t = TrainConfig(micro_batch_size=2, global_batch_size=16, rampup_batch_size=[4, 4, 24])
    consumed, seen = 0, []
    for _ in range(6):
        seen.append(rampup_batch(t, 2, consumed))
        consumed += seen[-1]
    assert seen == BATCHES
    assert rampup_batch(t, 1, 23) == 12 and rampup_batch(t, 1, 24) == 16  # the last increment lands at SAMPLES


@pytest.mark.parametrize("ramp, dp, message", [
    ([4, 4], 1, "must be three non-negative integers START INCREMENT SAMPLES"),
    ([6, 4, 24], 1, "global_batch_size - START (16 - 6) must be a multiple of INCREMENT (4)"),
    ([4, 4, 24], 4, "START (4) must be a multiple of micro_batch_size x dp (2 x 4 = 8)"),
    ([32, 4, 24], 1, "START (32) must be in 1..global_batch_size (16)"),
    ([2, 2, 24], "vpp", "START and INCREMENT (2, 2) must be multiples of micro_batch_size x dp x pp (2 x 1 x 2 = 4)"),
])
def test_bad_rampup_is_one_line(ramp, dp, message):
    args = ["--train.micro_batch_size", "2", "--train.rampup_batch_size", *map(str, ramp)]
    if dp == "vpp":  # interleaved: every batch in whole rounds of pp micro-batches
        args, dp = args + ["--parallel.pp", "2", "--parallel.vpp", "2"], 2
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config(args, world=dp)


def test_lr_counts_samples_during_rampup():
    """Warm-up 2 iterations of the full batch = 32 samples: a first step of 4 samples ends 4/32 of the way."""
    s = LRSchedule.from_config(OptimConfig(lr=1.0, min_lr=0.0, warmup_iters=2, decay_style="linear"),
                               TrainConfig(iters=10, global_batch_size=16, rampup_batch_size=[4, 4, 24]))
    lrs = []
    for batch in BATCHES:
        lrs.append(s.current(batch))
        s.step(batch)
    assert lrs[:4] == [4 / 32, 8 / 32, 16 / 32, 28 / 32]
    assert lrs[4] == 1.0  # the step that crosses the warm-up's end (samples 28..44 of 32) runs at the peak
    assert lrs[5] == pytest.approx(1 - (44 / 16 - 2) / 8)  # then decay over iterations 2..10, counted in samples
    assert s.steps == sum(BATCHES)


def test_warmup_fraction_of_decay_iters():
    s = LRSchedule.from_config(OptimConfig(lr=1.0, min_lr=0.0, warmup_fraction=0.25, decay_iters=8), 100)
    assert s.warmup_iters == 2 and [s.at(i) for i in range(2)] == [0.5, 1.0]
    with pytest.raises(ConfigError, match=r"optim.warmup_iters \(5\) and optim.warmup_fraction \(0.1\) both set"):
        make_config(["--optim.warmup_fraction", "0.1"], world=1)  # the tiny config warms up 5 iterations


def _run(args: list[str]) -> list[dict]:
    trainer = make_trainer(args)
    with contextlib.redirect_stdout(io.StringIO()):
        return [{k: r[k] for k in ("loss", "lr", "batch_size", "consumed_samples")} for r in trainer.run()]


def _interrupted(args: list[str], ckpt: str) -> tuple[list[dict], list[dict]]:
    """The whole run, and the same run stopped after 3 iterations and resumed (one process)."""
    save = ["--checkpoint.save", ckpt]
    whole = _run(args)
    first = _run(args + save + ["--train.iters", "3"])  # stops before the batch of 12
    return whole, first + _run(args + save + ["--checkpoint.load", ckpt])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    return run_distributed(_interrupted, 1, RAMP, str(tmp_path_factory.mktemp("ramp") / "ckpt"))[0]


def test_resume_in_the_middle_of_the_ramp_is_bitwise(one_rank):
    whole, resumed = one_rank
    assert [r["batch_size"] for r in resumed] == BATCHES
    assert resumed == whole


def test_rampup_over_two_dp_ranks_equals_one(one_rank):
    one, two = one_rank[0], run_distributed(_run, 2, RAMP)[0]
    assert [r["batch_size"] for r in one] == BATCHES == [r["batch_size"] for r in two]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one, two, strict=True)) <= 1e-5
    assert [r["lr"] for r in one] == [r["lr"] for r in two]


def test_startup_counts_the_samples_a_ramp_consumes():
    """Issue 39 (8): the start-up lines count what the run consumes (less than iters x global batch)."""
    from megazero.train.batch_rampup import samples_after
    t = TrainConfig(micro_batch_size=2, global_batch_size=16, rampup_batch_size=[4, 4, 24], iters=6)
    assert samples_after(t, 2, 6) == sum(BATCHES) == 60
    assert samples_after(TrainConfig(global_batch_size=16, iters=6), 2, 6) == 96
