"""SIGTERM to megazero.launch ends the whole job with exit status 0 and no traceback: torchrun
forwards it, the workers save and stop, the launcher says so in one line (issue 39, 2). The same
for the scripts: their shell passes the signal on to the launcher and exits with its status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, TINY_CONFIG, make_texts, write_jsonl
from megazero.harness.spawn import free_port


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],  # suite budget
                         ids=lambda s: s.name)
def test_a_stop_signal_to_the_launcher_saves_and_exits_0(tmp_path, sig):
    """SIGTERM, or Ctrl-C's SIGINT (the workers take it as a stop request under the launcher)."""
    jsonl, save = tmp_path / "m.jsonl", tmp_path / "ck"
    cmd = [sys.executable, "-m", "megazero.launch", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml", "--data.mock", "true",
           "--train.iters", "100000", "--checkpoint.save", str(save), "--logging.jsonl", str(jsonl)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and \
            (not jsonl.exists() or len(jsonl.read_text().splitlines()) < 2):
        time.sleep(0.5)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err and "KeyboardInterrupt" not in err, err
    assert f"megazero.launch: {sig.name}: the workers saved and stopped\n" in err
    assert f"{sig.name}: saved and stopped cleanly at iteration" in out
    assert (save / "latest").exists()


def _wait_for_records(proc: subprocess.Popen, jsonl: Path, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and \
            (not jsonl.exists() or len(jsonl.read_text().splitlines()) < count):
        time.sleep(0.5)
    assert proc.poll() is None, "the run ended before it was signalled"


@pytest.mark.parametrize("sig", [signal.SIGTERM, *(pytest.param(s, marks=pytest.mark.slow)  # suite budget
                                             for s in (signal.SIGINT, signal.SIGUSR1))], ids=lambda s: s.name)
def test_a_stop_signal_to_the_script_saves_and_exits_0(tmp_path, bpe_spec, sig):
    """The signal goes to pretrain_gpt.sh's bash process alone (as `kill <pid>` would): the shell
    passes it on (scripts/args.sh `launch`), waits for the launcher and exits with its status."""
    save = tmp_path / "ck"
    env = {**os.environ, "CONFIG": TINY_CONFIG, "NPROC": "1", "TP": "1", "PP": "1", "ZERO_STAGE": "0",
           "TOKENIZER": bpe_spec, "INPUT": str(write_jsonl(tmp_path / "corpus.jsonl", make_texts(200))),
           "DATA_DIR": str(tmp_path / "data"), "RUN_DIR": str(tmp_path / "run"), "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(["bash", "scripts/pretrain_gpt.sh", "--train.iters", "100000", "--checkpoint.save",
                             str(save)], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _wait_for_records(proc, tmp_path / "run" / "metrics.jsonl", 1)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:  # a launcher left behind by its shell (the session is the shell's pid) ends with the test
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "saved and stopped cleanly at iteration" in out, out[-2000:]
    assert (save / "latest").exists()
    assert "== done" not in out  # stopped, not finished


def test_sigterm_to_plain_torchruns_workers_saves_and_torchrun_exits_0(tmp_path):
    """What the README says of plain torchrun: the signal sent to its workers (`pkill -TERM -P
    <torchrun's pid>`), not to torchrun, stops them cleanly, and torchrun exits 0."""
    jsonl, save = tmp_path / "m.jsonl", tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml", "--data.mock", "true",
           "--train.iters", "100000", "--checkpoint.save", str(save), "--logging.jsonl", str(jsonl)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for_records(proc, jsonl, 2)
    subprocess.run(["pkill", "-TERM", "-P", str(proc.pid)], check=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err
    assert "SIGTERM: saved and stopped cleanly at iteration" in out
    assert (save / "latest").exists()
