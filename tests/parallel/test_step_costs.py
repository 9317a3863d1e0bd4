"""What one training iteration costs beyond its arithmetic, checked on CPU: device->host
reads (issue 27 req. 4: at most one per iteration, none per micro-batch) and, under
train.compile, recompilations after warm-up (req. 3: none) and graph breaks (none from
hooks, RNG swaps or ZeRO-3 gathers)."""

from __future__ import annotations

import contextlib
import functools

import pytest

from helpers import make_trainer, run_distributed

TINY = ["--model.seq_length", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
        "--zero.bucket_size", "20000", "--data.mock", "true", "--checkpoint.save", "null",
        "--checkpoint.load", "null", "--logging.jsonl", "null"]


# ----------------------------------------------------------------------------- host syncs

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def _counting_reads(counts: list[str]):
    """Every way a tensor's value reaches Python (each is a blocking device->host read on a
    GPU), and explicit synchronizes, recorded by name while inside."""
    import torch
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, original):
        @functools.wraps(original)
        def read(self, *args, **kwargs):
            counts.append(name)
            return original(self, *args, **kwargs)
        return read
    sync = torch.cuda.synchronize
    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(name, original))
        torch.cuda.synchronize = lambda *a, **k: counts.append("synchronize")
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.cuda.synchronize = sync


def _reads_per_iteration(args: list[str]) -> list[list[str]]:
    tr = make_trainer(TINY + args)
    tr.train_step()  # warm-up: first-use paths (lazy buffers) are not the steady state
    out = []
    for _ in range(2):
        counts: list[str] = []
        with _counting_reads(counts):
            tr.train_step()
        out.append(counts)
    return out


@pytest.mark.parametrize("world, args", [
    (1, ["--zero.stage", "1", "--train.global_batch_size", "16"]),  # 8 micro-batches: none of them reads
    pytest.param(2, ["--zero.stage", "2"], marks=pytest.mark.slow),
    (2, ["--zero.stage", "3", "--parallel.pp", "2", "--parallel.schedule", "1f1b", "--train.global_batch_size", "8"]),
    pytest.param(2, ["--parallel.tp", "2", "--zero.stage", "0", "--train.precision", "bf16"], marks=pytest.mark.slow),
], ids=["stage1-8mb", "stage2-dp2", "stage3-pp2", "tp2-bf16"])
def test_an_iteration_reads_the_device_once(world, args):
    """train_step makes one device->host read (the step's sums: grad norm, overflow, global
    loss, step signals), whatever the number of micro-batches, on every rank."""
    for rank, iterations in enumerate(run_distributed(_reads_per_iteration, world, args)):
        for counts in iterations:
            assert counts == ["tolist"], f"rank {rank}: {counts}"


def _fine_tuning_reads() -> list[str]:
    import numpy as np
    tr = make_trainer(TINY + ["--zero.stage", "1"])
    tr.loss_masked = True  # the count of loss tokens stays on the device: no read for it
    tokens, labels = tr.microbatches(tr.train_ds, 0)[0]
    labels[:, :5] = -100
    assert np.asarray(tr.counted_tokens([(tokens, labels)]).shape).size == 0  # a 0-d tensor, not an int
    counts: list[str] = []
    with _counting_reads(counts):
        tr.train_step()
    return counts


def test_counting_loss_tokens_needs_no_read():
    assert run_distributed(_fine_tuning_reads, 1)[0] == ["tolist"]


# ----------------------------------------------------------------------------- compile


def _compile_counters(args: list[str], iters: int = 5) -> dict:
    """Train under train.compile (dynamo with the aot_eager backend: the same graphs, breaks
    and recompilations as inductor, without C++ compilation) and snapshot dynamo's counters
    after every iteration."""
    import torch
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils
    original = torch.compile
    torch.compile = functools.partial(original, backend="aot_eager")
    torch._dynamo.reset()
    dynamo_utils.counters.clear()  # reset() keeps them: a previous case's graph breaks would count here
    try:
        tr = make_trainer(TINY + ["--train.compile", "true"] + args)
        snapshots, losses = [], []
        for _ in range(iters):
            losses.append(tr.train_step()["loss"])
            snapshots.append({kind: dict(dynamo_utils.counters[kind]) for kind in ("stats", "frames", "recompiles")})
        breaks = sorted(reason.splitlines()[0] for reason in dynamo_utils.counters["graph_break"])
    finally:
        torch.compile = original
    return {"snapshots": snapshots, "breaks": breaks, "losses": losses}


def _compiled_and_eager(cases: list[list[str]]) -> list[dict]:
    out = []
    for args in cases:
        got = _compile_counters(args)
        got["eager"] = [make_trainer(TINY + args).train_step()["loss"] for _ in range(1)]
        out.append(got)
    return out


CASES = {
    "stage0-none": ["--zero.stage", "0", "--train.recompute", "none", "--model.dropout", "0.1"],
    "stage1-none": ["--zero.stage", "1", "--train.recompute", "none", "--train.precision", "bf16"],
    "stage2-selective": ["--zero.stage", "2", "--train.recompute", "selective"],
    "stage3-none": ["--zero.stage", "3", "--train.recompute", "none"],
    "stage3-selective": ["--zero.stage", "3", "--train.recompute", "selective", "--model.dropout", "0.1"],
    "stage3-full": ["--zero.stage", "3", "--train.recompute", "full"],
}


@pytest.mark.parametrize("names", [
    ["stage1-none", "stage3-selective"],
    pytest.param(["stage0-none", "stage2-selective", "stage3-none", "stage3-full"], marks=pytest.mark.slow),
], ids=["short", "rest"])
def test_compiled_blocks_do_not_recompile_after_warm_up(names):
    """After iteration 3 dynamo compiles nothing more at any ZeRO stage and recomputation;
    without selective recompute the blocks have no graph break at all (hooks, RNG streams
    and stage-3 gathers stay outside the graphs), and the first step's loss is eager's."""
    for name, got in zip(names, run_distributed(_compiled_and_eager, 1, [CASES[n] for n in names], timeout=600)[0],
                         strict=True):
        snaps = got["snapshots"]
        assert snaps[2] == snaps[-1], f"{name}: dynamo compiled again after iteration 3: {snaps[2]} -> {snaps[-1]}"
        assert snaps[-1]["stats"].get("unique_graphs", 0) >= 1, f"{name}: nothing was compiled"
        if "selective" in name:  # the recomputed attention core, disabled on purpose: one break per block
            assert all("disable" in b for b in got["breaks"]), f"{name}: {got['breaks']}"
        else:
            assert got["breaks"] == [], f"{name}: {got['breaks']}"
        assert abs(got["losses"][0] - got["eager"][0]) <= 1e-5, name
