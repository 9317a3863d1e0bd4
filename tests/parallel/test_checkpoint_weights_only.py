"""Weights-only checkpoints (checkpoint.save_optimizer / save_rng false, Megatron's --no-save-optim
--no-save-rng) and loading a checkpoint's weights with a fresh optimizer (checkpoint.load_optimizer /
load_rng false, --no-load-optim --no-load-rng)."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

from helpers import run_distributed
from megazero.checkpoint.base import CheckpointError

WEIGHTS_ONLY = ["--checkpoint.save_optimizer", "false", "--checkpoint.save_rng", "false"]
FRESH = ["--checkpoint.load_optimizer", "false", "--checkpoint.load_rng", "false"]


def _trainer(args: list[str]):
    """(trainer, what it printed while built): the resume line among it."""
    import torch.distributed as dist

    from megazero.harness.configs import make_config
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    cfg = make_config(["--train.iters", "4", "--optim.decay_iters", "4", *args], world=dist.get_world_size())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(cfg, ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp))
    return trainer, out.getvalue()


def _run(trainer) -> tuple[list[float], str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = [r["loss"] for r in trainer.run()]
    return losses, out.getvalue()


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters()}


def _weights_only_runs(full: str, weights: str) -> dict:
    whole, _ = _run(_trainer(["--checkpoint.save", full, "--checkpoint.interval", "2"])[0])
    first = _trainer(["--train.iters", "2", "--checkpoint.save", weights, *WEIGHTS_ONLY])[0]
    _, save_line = _run(first)
    try:
        _trainer(["--checkpoint.load", weights])
        refusal = ""
    except CheckpointError as e:
        refusal = str(e)
    from_weights, resume_line = _trainer(["--checkpoint.load", weights, *FRESH])
    loaded = _params(from_weights)
    from_full = _trainer(["--checkpoint.load", full, "--checkpoint.iteration", "2", *FRESH])[0]
    return {"whole": whole, "save_line": save_line, "refusal": refusal, "resume_line": resume_line,
            "loaded_equal": all(torch.equal(loaded[n], v) for n, v in _params(first).items()),
            "from_weights": _run(from_weights)[0], "from_full": _run(from_full)[0]}


def test_weights_only_checkpoint_loads_with_a_fresh_optimizer(tmp_path):
    full, weights = str(tmp_path / "full"), str(tmp_path / "weights")
    r = run_distributed(_weights_only_runs, 1, full, weights)[0]
    assert "(without optimizer state and RNG state: it can be fine-tuned from, loaded with --checkpoint.load_optimizer " \
           "false and --checkpoint.load_rng false, but not resumed bitwise)" in r["save_line"]
    meta = json.load(open(os.path.join(weights, "iter_0000002", "metadata.json")))
    assert meta["without"] == ["optimizer", "rng"]
    assert "without" not in json.load(open(os.path.join(full, "iter_0000002", "metadata.json")))
    rank_file = next(n for n in os.listdir(os.path.join(weights, "iter_0000002")) if n.endswith(".pt"))
    state = torch.load(os.path.join(weights, "iter_0000002", rank_file), weights_only=True)
    assert state["optimizer"]["exp_avg"] is None and state["optimizer"]["master"] is not None and state["rng"] is None
    assert os.path.getsize(os.path.join(weights, "iter_0000002", rank_file)) < \
        0.5 * os.path.getsize(os.path.join(full, "iter_0000002", rank_file))
    # A whole resume is refused in one line naming the option.
    assert "holds no optimizer state (saved with checkpoint.save_optimizer false, Megatron's --no-save-optim): it " \
           "can be fine-tuned from, not resumed; load its weights with --checkpoint.load_optimizer false " \
           "(--no-load-optim)" in r["refusal"] and "\n" not in r["refusal"]
    assert ("with a fresh optimizer state (checkpoint.load_optimizer false: Adam's "
                                             "moments, step count and loss scale start afresh), RNG streams reseeded "
                                             "from train.seed (checkpoint.load_rng false)\n") in r["resume_line"]
    # The weights are those saved; from them a fresh optimizer trains exactly as from the full
    # checkpoint with its optimizer state left out, and not as the bitwise resume.
    assert r["loaded_equal"]
    assert r["from_weights"] == r["from_full"]
    assert r["from_weights"][0] == r["whole"][2] and r["from_weights"][1] != r["whole"][3]


def _resharded_runs(full: str, weights: str) -> tuple[list[float], list[float], str]:
    saved_at = ["--zero.stage", "1", "--train.iters", "2", "--checkpoint.save"]
    _run(_trainer([*saved_at, full])[0])
    _run(_trainer([*saved_at, weights, *WEIGHTS_ONLY])[0])
    at_tp2 = ["--parallel.tp", "2", "--checkpoint.load"]
    try:
        _trainer([*at_tp2, weights])
        refusal = ""
    except CheckpointError as e:
        refusal = str(e)
    return _run(_trainer([*at_tp2, weights, *FRESH])[0])[0], _run(_trainer([*at_tp2, full, *FRESH])[0])[0], refusal


@pytest.mark.slow  # suite budget: the one-rank test keeps the weights-only save and load
def test_weights_only_checkpoint_reshards(tmp_path):
    """Saved at dp 2 (ZeRO-1), loaded at tp 2: only the master weights are resharded."""
    results = run_distributed(_resharded_runs, 2, str(tmp_path / "full"), str(tmp_path / "weights"))
    from_weights, from_full, refusal = next(r for r in results if r[0][0] is not None)
    assert from_weights == from_full and len(from_weights) == 2
    assert "--checkpoint.load_optimizer false (--no-load-optim)" in refusal
