"""SIGTERM to megazero.launch ends the whole job with exit status 0 and no traceback: torchrun
forwards it, the workers save and stop, the launcher says so in one line (issue 39, 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import REPO
from megazero.harness.spawn import free_port


def test_sigterm_to_the_launcher_saves_and_exits_0(tmp_path):
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
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err
    assert "megazero.launch: SIGTERM: the workers saved and stopped\n" in err
    assert "SIGTERM: saved and stopped cleanly at iteration" in out
    assert (save / "latest").exists()
