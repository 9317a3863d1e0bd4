"""The silent-fault checks' pure parts (issue 48): digests, the replica mismatch line, the straggler
verdict, the skipped batch's description, train.inject_fault's parsing and Megatron's rerun flags."""

from __future__ import annotations

import pytest
import torch

from helpers import make_config
from megazero.config import ConfigError
from megazero.config.megatron import translate
from megazero.data.mock import MockGPTDataset
from megazero.train.replicas import digest, mismatch
from megazero.train.rerun import describe_samples, samples_line
from megazero.train.stragglers import stragglers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_digest_sees_any_single_bit(dtype):
    t = torch.randn(1000).to(dtype)
    base = digest([t]).item()
    bits = t.view(torch.int32 if dtype == torch.float32 else torch.int16)
    for element, bit in ((0, 0), (500, 13), (999, bits.element_size() * 8 - 2)):
        flipped = bits.clone()
        flipped[element] ^= 1 << bit
        assert digest([flipped.view(dtype)]).item() != base
    assert digest([t[:400], t[400:]]).item() == base  # in pieces: the same sum


def test_mismatch_names_the_minority_behind_a_majority():
    keys = [["a#pp0", "b#pp0"]] * 4
    assert mismatch(7, keys, [[1, 2]] * 4) is None
    line = mismatch(7, keys, [[1, 2], [1, 2], [1, 9], [1, 2]])
    assert line is not None and line.startswith("replica mismatch at iteration 7: b differs between ranks")
    assert "ranks 0, 1, 3 (the majority) agree, rank(s) 2 hold another value" in line
    tie = mismatch(3, [["w#pp0#dp1@0"]] * 2, [[5], [6]])
    assert tie is not None and "w (DP slice 1) differs" in tie and "no majority: ranks 0 vs ranks 1" in tie
    # the damage spread to a second value: the one with a clear minority is named, the other counted
    both = mismatch(4, keys, [[1, 2], [1, 2], [3, 9], [1, 2]])
    assert both is not None and "a (and 1 other value(s))" in both


def test_stragglers_are_named_above_the_factor_and_the_noise():
    times = {"forward_backward": [1.0, 1.05, 2.2, 0.95], "optimizer": [0.1, 0.1, 0.1, 0.18]}
    lines = stragglers(10, times, 1.5)
    assert len(lines) == 1  # rank 3's optimizer is 1.8x its median but 0.08 s: below 10% of a 1.1 s step
    assert lines[0].startswith("iteration 10: straggler: rank 2 computes forward backward in 2200.0 ms, 2.1x the "
                               "ranks' median 1025.0 ms")
    assert stragglers(10, times, 3.0) == []


def test_skipped_samples_are_described():
    ds = MockGPTDataset(10, 8, 32, 1)
    samples = describe_samples(ds, 8, 4)  # the loader wraps around the dataset
    assert [s["sample"] for s in samples] == [8, 9, 0, 1]
    assert samples_line(samples) == "samples 8, 9, 0, 1 of mock"
    assert samples_line([{"sample": 3, "dataset": "d", "documents": [5, 6]},
                         {"sample": 4, "dataset": "d", "documents": [6]}]) == "samples 3-4 of d (documents 5, 6)"


@pytest.mark.parametrize("value, message", [
    ("bitflip:1", "must be KIND:RANK:ITER"), ("melt:0:1", "must be KIND:RANK:ITER"),
    ("slow:4:1", "RANK must be below the world size"), ("transient_nan:0:0", "ITER at least 1"),
])
def test_bad_inject_fault_is_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        make_config(["--train.inject_fault", value], world=4)


def test_bad_factors_and_intervals_are_refused():
    for args, message in ((["--train.spike_factor", "1"], "train.spike_factor"),
                          (["--train.straggler_factor", "0.5"], "train.straggler_factor"),
                          (["--train.replica_check_interval", "-1"], "train.replica_check_interval")):
        with pytest.raises(ConfigError, match=message):
            make_config(args, world=1)


def test_megatron_rerun_flags_translate():
    assert translate(["--rerun-mode", "disabled"]).overrides == ["--train.rerun_on", "none"]
    assert translate(["--rerun-mode", "validate_results"]).overrides == ["--train.rerun_on", "nan"]
    with pytest.raises(ConfigError, match="report_stats"):
        translate(["--rerun-mode", "report_stats"])
    spiky = translate(["--check-for-spiky-loss", "--check-for-nan-in-loss-and-grad"])
    cfg = make_config(spiky.overrides)
    spiky.apply(cfg)
    assert cfg.train.rerun_on == "spike"
    off = translate(["--rerun-mode", "disabled", "--check-for-spiky-loss"])
    with pytest.raises(ConfigError, match="--check-for-spiky-loss with train.rerun_on none"):
        off.apply(make_config(off.overrides))


def test_per_rank_compute_times_reach_tensorboard():
    from megazero.train.sinks import tensorboard_scalars
    rec = {"iteration": 5, "loss": 1.0, "rank_compute_s": {"forward_backward": [0.5, 0.7], "optimizer": [0.1, 0.2]}}
    tags = {tag: value for tag, value, _ in tensorboard_scalars(rec)}
    assert tags["compute-time/forward_backward/rank_1"] == 0.7 and tags["compute-time/optimizer/rank_0"] == 0.1
