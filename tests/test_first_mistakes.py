"""Mistakes a new user makes in the first days (issue 25), replayed from the command line:
each ends in one clear line and exit status 2, never in a silent start from scratch."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megazero.train", "--config", os.path.join(ROOT, "configs/gpt2-tiny.yaml"),
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_load_path_that_names_nothing_is_refused_with_the_nearest_checkpoints(tmp_path):
    for run in ("runs/tiny/checkpoints", "runs/other/checkpoints"):
        os.makedirs(tmp_path / run)
        (tmp_path / run / "latest").write_text("iter_0000010\n")
    hint = "fix the path, or set it to checkpoint.save to resume from there when a checkpoint is present"
    for typo, near in [("runs/tiny/checkpoint", "runs/tiny/checkpoints"),  # under the deepest existing folder
                       ("runs/tyni", "runs/tiny/checkpoints, runs/other/checkpoints")]:  # most similar first
        proc = _train(["--checkpoint.load", typo, "--checkpoint.save", "runs/new", "--validate-only"], str(tmp_path))
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.splitlines() == [f"error: checkpoint.load '{typo}' does not exist (checkpoints nearby: "
                                            f"{near}); {hint}"]


def test_load_equal_to_save_may_be_empty_the_scripts_resume_if_present_pattern(tmp_path):
    proc = _train(["--checkpoint.load", "runs/new", "--checkpoint.save", "runs/new", "--validate-only"], str(tmp_path))
    assert proc.returncode == 0, proc.stderr
