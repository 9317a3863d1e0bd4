"""A run's exit status is deterministic (issue 46, 9): 0 once its last iteration and save are
done, non-zero only after one line saying why. Each test forces one way a finished run used to
end otherwise: a worker orphaned by a killed launcher that trained on into the next job's
rendezvous and checkpoints, a stop signal reaching the launcher after its workers finished,
the final barrier losing a peer, a console that cannot take the last lines, a bare sys.exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from helpers import REPO
from megazero import launch
from megazero.train import lifecycle
from megazero.train.__main__ import exit_status
from megazero.train.lifecycle import FINISHED, STOPPED, launcher_gone

# A one-iteration run in this process alone (no torchrun), saving once.
TINY = ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--train.iters", "1", "--train.log_interval", "1"]


def _python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, text=True, capture_output=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})})


def _train_with(tmp_path, patch: str) -> subprocess.CompletedProcess:
    """`python -m megazero.train TINY` with `patch` (Python run first) injecting the late event."""
    args = [*TINY, "--checkpoint.save", str(tmp_path / "ck")]
    return _python("-c", f"{patch}\nfrom megazero.train.__main__ import main\nmain({args!r})")


def test_a_worker_whose_launcher_died_while_it_started_leaves_with_one_line(tmp_path):
    """The original: a launcher SIGKILLed while its workers were starting left them orphans,
    which then trained the killed job on, into the resumed job's rendezvous (same master port)
    and checkpoint directory. A worker finding another parent than its launcher now leaves."""
    save, killed = tmp_path / "ck", _dead_pid()
    done = _python("-m", "megazero.train", *TINY, "--checkpoint.save", str(save),
                   env={"RANK": "1", "TORCHELASTIC_RUN_ID": "killed", "MEGAZERO_LAUNCHER_PID": str(killed)})
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"error: rank 1: the launcher that started this worker (megazero.launch, pid {killed}) is gone "
        f"(killed while its workers started); exiting before touching the checkpoints"]
    assert not save.exists() and "iter " not in done.stdout


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_which_workers_are_orphans():
    """Under plain torchrun an orphan's parent is init (unless init may be torchrun itself); a
    worker of a job nested under a live megazero.launch (its variable inherited) is not one."""
    init_is_torchrun = lifecycle._may_be_launcher(1)  # a container started by `torchrun ...` (its pid 1)
    assert ("(torchrun) is gone" in (launcher_gone(1, None) or "")) != init_is_torchrun
    assert launcher_gone(os.getppid(), None) is None
    assert launcher_gone(os.getppid(), str(os.getppid())) is None
    assert launcher_gone(os.getppid(), str(os.getpid())) is None  # alive, an ancestor: nested
    assert "is gone" in (launcher_gone(os.getppid(), str(_dead_pid())) or "")


@pytest.mark.parametrize("ended", [FINISHED, STOPPED, None])
def test_a_stop_signal_to_the_launcher_after_its_workers_ended(monkeypatch, capsys, ended):
    """torchrun raises SignalException wherever its agent is: after the workers finished and
    saved the job is complete (status 0, one line), where it used to end 143 with a line saying
    the workers could not save."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def run(args) -> None:  # the workers ended (or not), then the late signal
        if ended:
            with open(os.environ["MEGAZERO_STOPPED_FILE"], "a") as f:
                f.write(ended + "\n")
        raise SignalException("late", signal.SIGTERM)

    monkeypatch.setattr("torch.distributed.run.run", run)
    for name in launch.JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = launch.main(["--nproc_per_node", "1", "-m", "megazero.train"])
        ignored = all(signal.getsignal(s) == signal.SIG_IGN for s in handlers)
        # The job's variables go with it: a later job in this process (a test) must not inherit
        # a directory that no longer exists (its workers' error lines then failed with a traceback).
        assert not [name for name in launch.JOB_VARIABLES if name in os.environ]
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    err = capsys.readouterr().err
    expected = {FINISHED: (0, "megazero.launch: SIGTERM after the workers finished and saved; nothing was stopped\n"),
                STOPPED: (0, "megazero.launch: SIGTERM: the workers saved and stopped\n"),
                None: (143, "error: megazero.launch: SIGTERM: the workers were stopped before they could save")}
    assert status == expected[ended][0] and err.startswith(expected[ended][1]) and err.count("\n") == 1, err
    assert ignored  # the job is over: a signal now cannot turn its status into a traceback
    assert not os.path.exists(os.environ.get("MEGAZERO_STOPPED_FILE", "")), "the word file is left in /tmp"


def test_a_late_stop_signal_to_a_finished_worker_changes_nothing(tmp_path):
    """SIGTERM and SIGUSR1 after the last save (torchrun's or Slurm's, late) are ignored: 0."""
    done = _train_with(tmp_path, "import os, signal\nfrom megazero.train import trainer\n"
                                 "run = trainer.Trainer.run\n"
                                 "def late(self):\n"
                                 "    out = run(self)\n"
                                 "    os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGUSR1)\n"
                                 "    return out\n"
                                 "trainer.Trainer.run = late")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "saved checkpoint" in done.stdout and "error" not in done.stderr


def test_a_peer_lost_at_the_final_barrier_is_one_line(tmp_path):
    """Every checkpoint is sealed, then the last collective fails: one line and status 1, where
    it was a traceback."""
    done = _train_with(tmp_path, "import torch.distributed as dist\n"
                                 "def barrier(*a, **k):\n"
                                 "    raise RuntimeError('[../third_party/gloo/gloo/transport/tcp/pair.cc:534] '\n"
                                 "                       'Connection closed by peer [127.0.0.1]:29500')\n"
                                 "dist.barrier = barrier")
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Connection closed by peer" in errors[0] and "Traceback" not in done.stderr
    assert "saved checkpoint" in done.stdout


def test_a_console_that_cannot_take_the_last_lines_keeps_the_status():
    """stdout closed under the run (a pipe's reader gone): the finished run still ends 0 (the
    interpreter's own exit ends such a run 120, and the flush used to raise: a traceback, 1)."""
    done = _python("-c", "import os, sys\nfrom megazero.train.__main__ import _leave\n"
                   "sys.stdout.write('iter 1/1\\n')\nos.close(1)\n_leave(0)", env={"PYTHONUNBUFFERED": ""})  # held in the buffer
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("warning: rank 0: could not flush <stdout>: ") and done.stderr.count("\n") == 1


def test_a_bare_sys_exit_is_the_status_python_gives_it(capsys):
    """sys.exit() is success and sys.exit("why") prints why: both used to end status 1, silently."""
    assert (exit_status(None), exit_status(0), exit_status(2)) == (0, 0, 2)
    assert exit_status("the reason") == 1
    assert capsys.readouterr().err == "error: the reason\n"
