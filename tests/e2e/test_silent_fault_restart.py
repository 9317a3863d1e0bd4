"""A flipped bit under torchrun --max-restarts (issue 48): the replica check stops the job before the
save of the corrupted state with one line, torchrun restarts it, the restart resumes from the last
(checked) checkpoint and finishes with the losses of a run that never saw the fault. The short form
(the stop, no checkpoint of that state) is tests/parallel/test_silent_faults.py."""

from __future__ import annotations

import pytest

from helpers import REPO, read_jsonl, torchrun

ARGS = ["--config", "configs/gpt2-tiny.yaml", "--parallel.tp", "2", "--zero.stage", "1", "--train.iters", "6",
        "--train.log_interval", "1", "--train.replica_check_interval", "2", "--checkpoint.interval", "2"]


@pytest.mark.slow  # two 4-rank torchrun jobs, one restarted: ~1 min on an idle 2-core machine
def test_bitflip_restart_resumes_from_the_checked_checkpoint(tmp_path):
    clean = torchrun(4, [*ARGS, "--checkpoint.save", str(tmp_path / "a"), "--logging.jsonl", str(tmp_path / "a.jsonl")],
                     str(REPO))
    assert clean.returncode == 0, clean.stderr
    faulty = torchrun(4, [*ARGS, "--checkpoint.save", str(tmp_path / "b"), "--logging.jsonl", str(tmp_path / "b.jsonl"),
                          "--train.inject_fault", "bitflip:3:3"], str(REPO), restarts=1)
    assert faulty.returncode == 0, faulty.stderr
    output = faulty.stdout + faulty.stderr
    assert output.count("error: replica mismatch at iteration 4: ") == 1
    assert "resumed from" in output and "iter_0000002 at iteration 2" in output
    assert [r["loss"] for r in read_jsonl(str(tmp_path / "b.jsonl"))] == \
        [r["loss"] for r in read_jsonl(str(tmp_path / "a.jsonl"))]
