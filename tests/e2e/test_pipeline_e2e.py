"""End to end: `megazero.train` with pipeline parallelism reproduces the single-process
run (fp32 training and validation losses over 10 iterations, same global batch)."""

from __future__ import annotations

import itertools

import pytest

from helpers import train_records

BASE = ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--train.iters", "10",
        "--train.eval_interval", "5", "--train.eval_iters", "2"]


def _run(tmp_path, nproc: int, extra: list[str], name: str, base: list[str] = BASE) -> list[dict]:
    return train_records(tmp_path, nproc, base + extra, name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), 1, [], "ref")


def _max_diff(run: list[dict], ref: list[dict], key: str) -> float:
    pairs = [(a[key], b[key]) for a, b in zip(run, ref, strict=True) if key in b]
    assert len(run) == len(ref) and pairs and all(a is not None for a, _ in pairs)
    return max(abs(a - b) for a, b in pairs)


@pytest.mark.parametrize("nproc, layout", [
    pytest.param(2, ["--parallel.pp", "2"], marks=pytest.mark.slow),  # suite budget: pp 2 in zbh1's case below
    pytest.param(4, ["--parallel.pp", "4"], marks=pytest.mark.slow),  # pp 4 by default: test_pipeline's
    pytest.param(2, ["--parallel.pp", "2", "--parallel.vpp", "2"], marks=pytest.mark.slow),  # vpp: test_pipeline's
    # tp 2 x pp 2 x dp 2, slow (suite budget): tp 2 x pp 2 by default in test_pipeline's pp 4 case and the Megatron line
    pytest.param(8, ["--parallel.tp", "2", "--parallel.pp", "2"], marks=pytest.mark.slow),
    (4, ["--parallel.pp", "2", "--parallel.schedule", "zbh1", "--zero.stage", "2"]),  # deferred W, sharded grads
], ids=["pp2", "pp4", "pp2-vpp2", "tp2-pp2-dp2", "pp2-dp2-zbh1-zero2"])
def test_pipeline_losses_equal_single_process(tmp_path, reference, nproc, layout):
    run = _run(tmp_path, nproc, layout, "run")
    assert [r["iteration"] for r in run] == list(range(1, 11))
    diffs = {key: _max_diff(run, reference, key) for key in ("loss", "val_loss", "grad_norm")}
    print(f"{' '.join(layout)}: max |delta| vs single process {diffs}")  # shown with pytest -s
    assert all(d <= 1e-5 for d in diffs.values()), diffs


def _layouts(max_world: int):
    """Every (tp, pp, dp) with tp x pp x dp <= max_world."""
    for tp, pp, dp in itertools.product(range(1, 9), repeat=3):
        if tp * pp * dp <= max_world:
            yield tp, pp, dp


@pytest.mark.slow
def test_every_layout_up_to_8_ranks_trains(tmp_path):
    """Each layout runs 2 iterations under megazero.train and matches the single-process
    losses. pp values that do not divide the 8 layers split them unevenly; tp values that
    do not divide 8 heads get a model with tp heads of 16 (and its own reference)."""
    base = ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--train.iters", "2",
            "--model.num_layers", "8", "--model.seq_length", "16", "--train.micro_batch_size", "1"]
    references: dict[tuple[str, ...], list[dict]] = {}
    for tp, pp, dp in _layouts(8):
        heads = 8 if 8 % tp == 0 else tp
        gbs = 120 if 120 % dp == 0 else 56  # a global batch every dp divides (56 for dp 7)
        shared = ("--model.num_heads", str(heads), "--model.hidden_size", str(16 * heads),
                  "--train.global_batch_size", str(gbs))
        if shared not in references:
            references[shared] = _run(tmp_path, 1, list(shared), f"ref-{heads}-{gbs}", base)
        extra = list(shared) + ["--parallel.tp", str(tp), "--parallel.pp", str(pp)]
        if 8 % pp:
            extra += ["--parallel.pp_layers", str([8 // pp + (i < 8 % pp) for i in range(pp)]).replace(" ", "")]
        run = _run(tmp_path, tp * pp * dp, extra, f"tp{tp}-pp{pp}-dp{dp}", base)
        assert _max_diff(run, references[shared], "loss") <= 1e-5, (tp, pp, dp)
