"""`python -m megazero.launch`: torchrun with megazero's exit codes and one-line failures.

It takes torchrun's arguments unchanged (``python -m megazero.launch --nproc_per_node 2
--max-restarts 3 -m megazero.train ...``) and differs only in how a failed job ends. torchrun
exits 1 whatever its workers' status and follows a worker's one-line ``error:`` with a
40-line ChildFailedError traceback. Here a user error (config, data, checkpoint: the workers
printed its line already) exits 2 with nothing more, and any other failure ends in one line
naming the first worker that failed, its exit status or signal, and torchrun's restarts.

A stop signal sent to the launcher (SIGTERM, SIGINT; torchrun forwards it to the workers, which
save and stop: train/lifecycle.StopRequest) ends the job in one line and exit status 0 when the
workers stopped cleanly, where torchrun prints a SignalException traceback and exits 1.

It leaves nothing in the system's temporary directory: torchrun's log directory (without
--log-dir, torchelastic makes a ``torchelastic_*`` one there per launch, holding each attempt's
error files, and never removes it) and the workers' markers live in one directory of the
launcher's own ($MEGAZERO_LAUNCH_DIR), removed when the launcher ends, however it ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Optional, Sequence

from megazero.errors import EXIT_USER_ERROR
from megazero.train.lifecycle import FINISHED, LAUNCHER_PID, STOPPED

JOB_VARIABLES = ("MEGAZERO_LAUNCH_DIR", "MEGAZERO_USER_ERROR_FILE", "MEGAZERO_STOPPED_FILE", LAUNCHER_PID)
"""What the launcher tells its workers through the environment, for this job alone."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.run import parse_args

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    scratch = tempfile.mkdtemp(prefix="megazero-launch-")
    saved = {k: os.environ.get(k) for k in JOB_VARIABLES}
    try:
        return _run(args, scratch)
    finally:  # also after restarts, failures and signals: the job's scratch goes with it
        shutil.rmtree(scratch, ignore_errors=True)
        # The variables name this job's files: a caller that goes on (a test, a script calling
        # main()) must not hand them to a later job.
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run(args: argparse.Namespace, scratch: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    if not args.log_dir:  # a --log-dir of the user's is theirs to keep
        args.log_dir = os.path.join(scratch, "torchelastic")
    os.environ["MEGAZERO_LAUNCH_DIR"] = scratch  # the workers' markers (errors._job_marker)
    # The workers leave this file when they end in a UserError (errors._remember_user_error).
    marker = os.path.join(scratch, "user-error")
    os.environ["MEGAZERO_USER_ERROR_FILE"] = marker
    stopped = os.path.join(scratch, "stopped")  # left by workers whose run is over: saved and stopped, or finished
    os.environ["MEGAZERO_STOPPED_FILE"] = stopped
    os.environ[LAUNCHER_PID] = str(os.getpid())  # a worker that finds another parent was orphaned: it leaves
    # torchrun's per-worker "failed (exitcode ...)" and "closing signal" lines repeat what the
    # summary line below says; its agent's warnings (restarts, rendezvous) stay.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal" not in record.getMessage())  # said by the stop line below
    try:
        run(args)
    except SignalException as signalled:
        ended = _clean_end(stopped)
        name = signal.Signals(signalled.sigval).name
        if ended == STOPPED:
            print(f"megazero.launch: {name}: the workers saved and stopped", file=sys.stderr, flush=True)
            return 0
        if ended == FINISHED:  # too late to stop anything: the job is complete
            print(f"megazero.launch: {name} after the workers finished and saved; nothing was stopped",
                  file=sys.stderr, flush=True)
            return 0
        print(f"error: megazero.launch: {name}: the workers were stopped before they could save (a stop during "
              f"start-up or a save); the last checkpoint is intact", file=sys.stderr, flush=True)
        return 128 + signalled.sigval
    except ChildFailedError as failed:
        if os.path.exists(marker):
            return EXIT_USER_ERROR
        rank, failure = failed.get_first_failure()
        status = (f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}")
        print(f"error: {failed.name}: worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
              f"ended with {status} after {args.max_restarts} allowed restart(s); its output above says why",
              file=sys.stderr, flush=True)
        return 1
    finally:
        # torchrun's handlers raise SignalException wherever this process is: from now on a stop
        # signal would turn the job's status into a traceback after the job is over.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    return 0


def _clean_end(path: str) -> Optional[str]:
    """How the workers' run ended by what they left in `path` (lifecycle.remember_clean_end):
    STOPPED if any stopped on a signal, else FINISHED if any finished, else None."""
    try:
        with open(path) as f:
            said = set(f.read().split())
    except OSError:
        return None
    return next((how for how in (STOPPED, FINISHED) if how in said), None)


if __name__ == "__main__":
    sys.exit(main())
