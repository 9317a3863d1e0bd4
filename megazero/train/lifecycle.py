"""A training worker's life under torchrun: how it starts again, stops early, and dies.

- Restart: torchrun's `--max-restarts` starts every worker again after one fails
  (TORCHELASTIC_RESTART_COUNT > 0); `resume_on_restart` points the run at its own save
  directory so that every restart resumes from the latest complete checkpoint; the metrics
  sinks then drop what the failed attempt logged past it (train/sinks.py).
- Orphans: torchrun starts each worker in a session of its own, so a SIGKILLed launcher
  leaves its workers training on and writing checkpoints. `die_with_launcher` ends a worker
  the moment its launcher goes (the kernel's parent-death signal, and a parent-pid watchdog
  where that is missing); SIGKILL runs no handler, so the checkpoint directory is not touched.
  A worker whose launcher died before it got there (while it started) leaves with one line.
- Early stop: SIGTERM (torchrun's and Slurm's), SIGUSR1 (Slurm's `--signal` before the
  time limit) and `train.exit_duration_minutes` become a save and a clean exit (`StopRequest`).
- Lost peers: a collective whose peer died or stopped responding becomes one line naming
  this rank and the operation (`describe_comm_failure`) instead of a traceback per rank, and
  exit status 1 (`LostPeerExit`). Every process group waits train.timeout_minutes at most
  (parallel/grid.py): on gloo the waiting collective raises; on NCCL the watchdog thread sees
  it, and `NcclErrorWatch` prints the same line before the watchdog aborts the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable, NoReturn, Optional

from megazero.config.schema import Config
from megazero.errors import UserError

if TYPE_CHECKING:
    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid

# Megatron's --exit-duration-in-mins counts from the start of the process, not of training.
PROCESS_START = time.monotonic()
_PR_SET_PDEATHSIG = 1
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMM_FILE = os.path.join(_PACKAGE_DIR, "parallel", "comm.py")  # every collective is issued and waited there


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resume_on_restart(cfg: Config) -> Optional[str]:
    """On a torchrun restart, resume from the latest checkpoint this run saved (whatever
    checkpoint.load was: it named where the first attempt started). Returns a line to print."""
    c = cfg.checkpoint
    if not restart_count() or not c.save or not os.path.isfile(os.path.join(c.save, "latest")):
        return None
    c.load, c.iteration = c.save, 0
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    return f"torchrun restart {restart_count()} of {limit}: resuming from the latest checkpoint in {c.save}"


STOPPED, FINISHED = "stopped", "finished"
"""What a worker leaves in $MEGAZERO_STOPPED_FILE (see remember_clean_end)."""


def remember_clean_end(how: str) -> None:
    """Leave word for megazero.launch ($MEGAZERO_STOPPED_FILE) that this worker's run is over and
    its last checkpoint sealed: it saved and `STOPPED` on a signal, or `FINISHED` train.iters. A
    stop signal reaching the launcher after that (torchrun raises SignalException) then ends the
    job with status 0: there is nothing left to save."""
    path = os.environ.get("MEGAZERO_STOPPED_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:  # a word lost only costs that late-signal case
            f.write(how + "\n")


class LoadPathError(UserError):
    """checkpoint.load names nothing: training from scratch instead would hide the mistake."""


def refuse_missing_load(cfg: Config) -> None:
    """checkpoint.load must name something that exists, unless it is checkpoint.save (the
    resume-if-present pattern of the scripts: a first run starts from scratch and says so).
    The error names the checkpoint directories nearest to the path given."""
    c = cfg.checkpoint
    if not c.load or os.path.exists(c.load) or os.path.abspath(c.load) == os.path.abspath(c.save or ""):
        return
    near = nearest_checkpoints(c.load)
    where = f"checkpoints nearby: {', '.join(near)}" if near else "no checkpoint directory near it"
    raise LoadPathError(f"checkpoint.load '{c.load}' does not exist ({where}); fix the path, or set it to "
                        f"checkpoint.save to resume from there when a checkpoint is present")


def nearest_checkpoints(path: str, limit: int = 3, depth: int = 3) -> list[str]:
    """Checkpoint directories (holding `latest`, `universal.json`, or an iter_ directory) under
    the deepest existing ancestor of `path`, most similar to `path` first."""
    import difflib

    root = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(root):
        root = os.path.dirname(root)
    found = []
    for here, dirs, files in os.walk(root):
        if here[len(root):].count(os.sep) >= depth:
            dirs.clear()
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if {"latest", "latest_checkpointed_iteration.txt", "universal.json"} & set(files) or \
                os.path.basename(here).startswith("iter_"):
            found.append(here if os.path.isabs(path) else os.path.relpath(here))  # as the user wrote theirs
            dirs.clear()
    return sorted(found, key=lambda d: -difflib.SequenceMatcher(None, d, os.path.normpath(path)).ratio())[:limit]


def attempt_store(timeout_s: float) -> Optional[dist.Store]:
    """On a torchrun restart with the launcher's own store (static rendezvous, or c10d's shared
    store), that store under a prefix of this attempt's own: it outlives the previous attempt,
    whose gloo addresses the new workers would read otherwise ("Gloo connectFullMesh failed ...
    Connection refused"). None when there is nothing stale: a first start, or a store that rank 0
    hosts afresh each round (c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which multi-node
    jobs want: node agents may count restarts differently)."""
    if not restart_count() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist  # here, not at the top: --validate-only needs no torch

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"megazero/attempt_{restart_count()}", store)


LAUNCHER_PID = "MEGAZERO_LAUNCHER_PID"
"""Set by megazero.launch to its own pid: the parent its workers must have."""


def die_with_launcher(poll_s: float = 0.5) -> None:
    """Under torchrun, SIGKILL this worker as soon as its launcher is gone; leave at once (one
    line, status 1) when it is gone already."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not under torchrun
        return
    if sys.platform.startswith("linux"):
        # The parent-death signal follows the thread that forked us: torchrun forks from its
        # main thread, and the watchdog below covers any case where that does not hold.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    launcher = os.getppid()  # read after prctl: a launcher that died in between shows here (prctl(2))
    gone = launcher_gone(launcher, os.environ.pop(LAUNCHER_PID, None) or None)  # popped: not our children's
    if gone:
        print(f"error: rank {os.environ.get('RANK', '?')}: {gone}", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(launcher, poll_s), name="megazero-launcher-watch",
                     daemon=True).start()


def launcher_gone(parent: int, expected: Optional[str]) -> Optional[str]:
    """Why this worker's launcher is already gone (None: it is our `parent`). A launcher SIGKILLed
    while its workers were still starting leaves them orphans: they would train on, join the
    next job's rendezvous on the same master port and write into its checkpoint directory.
    `expected` is megazero.launch's pid (alive but not our parent: we are a nested job's worker,
    its variable inherited); under plain torchrun an orphan's parent is init, unless init may be
    the launcher itself (torchrun as a container's first process): then it is never called gone."""
    if expected is not None and expected.isdigit() and int(expected) != parent and not _alive(int(expected)):
        return (f"the launcher that started this worker (megazero.launch, pid {expected}) is gone (killed while "
                f"its workers started); exiting before touching the checkpoints")
    if expected is None and parent == 1 and not _may_be_launcher(1):
        return ("the launcher that started this worker (torchrun) is gone (killed while its workers started); "
                "exiting before touching the checkpoints")
    return None


def _may_be_launcher(pid: int) -> bool:
    """Whether process `pid` may be a launcher: a Python process, or one whose command line names
    torch (torchrun, or a shell running it); unknown counts as may."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().decode(errors="replace").lower()
    except OSError:
        return True
    return "python" in command or "torch" in command


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _watch_parent(launcher: int, poll_s: float) -> None:
    while os.getppid() == launcher:  # an orphan is re-parented to init or a subreaper
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGKILL)


class StopRequest:
    """Why this rank wants to stop before train.iters; the trainer takes the maximum code over
    all ranks (train/signals.py), so every rank saves and stops at the same iteration."""

    NONE, DEADLINE, SIGUSR1, SIGTERM, SIGINT = range(5)
    _NAMES = {SIGUSR1: "SIGUSR1", SIGTERM: "SIGTERM", SIGINT: "SIGINT"}

    def __init__(self, exit_duration_minutes: float):
        self.exit_duration_minutes = exit_duration_minutes
        self.deadline = PROCESS_START + exit_duration_minutes * 60 if exit_duration_minutes else None
        self.signalled = self.NONE
        # Under megazero.launch a Ctrl-C (SIGINT, which torchrun forwards) is a stop request like
        # SIGTERM; under plain torchrun or alone it keeps Python's KeyboardInterrupt.
        self.stops = (signal.SIGTERM, signal.SIGINT) if os.environ.get("MEGAZERO_STOPPED_FILE") else (signal.SIGTERM,)
        for sig in (*self.stops, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        # Each signal keeps its own code, so the stop line names the one received (Ctrl-C: SIGINT).
        code = {signal.SIGTERM: self.SIGTERM, signal.SIGINT: self.SIGINT}.get(signal.Signals(signum), self.SIGUSR1)
        self.signalled = max(self.signalled, code)

    def code(self) -> int:
        """This rank's reason to stop now (NONE to go on)."""
        if self.signalled:
            return self.signalled
        return self.DEADLINE if self.deadline is not None and time.monotonic() >= self.deadline else self.NONE

    def reason(self, code: int) -> str:
        if code == self.DEADLINE:
            return f"train.exit_duration_minutes ({self.exit_duration_minutes:g}) reached"
        return self._NAMES[code]


def describe_comm_failure(error: BaseException, rank: int, timeout_s: Optional[float] = None) -> Optional[str]:
    """One line for an error raised by a collective or p2p op (a peer died, or timed out after
    train.timeout_minutes = `timeout_s` / 60); None for any other error."""
    from megazero.parallel.comm import CollectiveTimeout  # here: --validate-only needs no torch

    if isinstance(error, UserError):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    text = str(error)
    if not (isinstance(error, CollectiveTimeout) or any("torch/distributed" in f.filename for f in frames)
            or "gloo" in text or "NCCL" in text or any(f.filename == _COMM_FILE for f in frames)):
        return None
    # The operation (innermost frame of ours) and who called it from another file: a collective
    # waited on from the communication thread shows its ring step, then the waiting caller.
    ours = [f for f in frames if f.filename.startswith(_PACKAGE_DIR)]
    named = ours[-1:] + [f for f in reversed(ours) if f.filename != ours[-1].filename][:1]
    where = " <- ".join(f"{f.name} ({os.path.relpath(f.filename, _PACKAGE_DIR)}:{f.lineno})" for f in named)
    # gloo: "[file.cc:553] Connection closed by peer [addr]:port. This is typically ..." -> the middle
    detail = re.sub(r"^\[[^\]]*\] ", "", text.strip().splitlines()[0]).split(". ")[0] if text.strip() else ""
    return _lost_peer_line(rank, where or "a collective", detail or type(error).__name__, timeout_s)


def _lost_peer_line(rank: int, where: str, detail: str, timeout_s: Optional[float]) -> str:
    line = (f"rank {rank}: {where} failed: a peer process died or stopped responding ({detail}); the job stops; "
            f"run it again (or let torchrun --max-restarts) to resume from the latest checkpoint")
    if timeout_s and re.search(r"timed? ?out", detail, re.IGNORECASE):
        line += (f"; if the peers were only slow (a long save, data loading), raise train.timeout_minutes "
                 f"({timeout_s / 60:g})")
    return line


class LostPeerExit:
    """Ends this rank with one `error: ...` line and exit status 1: called by the main thread
    (a collective raised) or by `NcclErrorWatch`, whichever comes first. It leaves with os._exit:
    gloo's and NCCL's teardown would wait on the lost peer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, line: str) -> NoReturn:
        with self._lock:  # a second caller waits here until the process is gone
            print(f"error: {line}", file=sys.stderr, flush=True)
            os._exit(1)


class NcclErrorWatch:
    """Under NCCL a collective that times out, or whose peer fails, raises nowhere the rank
    waits: torch's watchdog thread notices it, sleeps about a minute for debug dumps, then tears
    the process down with a C++ abort. This thread polls the grid's groups for that verdict
    (ProcessGrid.comm_errors) and reports it first, as the line gloo's error gives. Nothing
    to watch on gloo."""

    def __init__(self, grid: ProcessGrid, report: Callable[[str], object], poll_s: float = 1.0):
        self.grid, self.report, self.poll_s = grid, report, poll_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        if grid.backend == "nccl":
            threading.Thread(target=self._run, name="megazero-nccl-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            with self._lock:  # never query a group that stop() let the caller destroy
                if self._stopped.is_set():
                    return
                errors = self.grid.comm_errors()
            for group, kind in errors.items():
                timeout_s = self.grid.timeout_s
                after = f" after {timeout_s:g} s" if kind == "TIMEOUT" and timeout_s else ""
                self.report(_lost_peer_line(self.grid.rank, f"a collective on group {group}",
                                            f"NCCL watchdog: {kind}{after}", timeout_s))
                return

    def stop(self) -> None:
        """Stop watching (before the process groups are destroyed)."""
        with self._lock:
            self._stopped.set()
