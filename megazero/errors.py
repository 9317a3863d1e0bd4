"""The one error type for problems a user can fix, and the one way commands report them.

Every bad input (config, data, checkpoint, command line) raises a `UserError` subclass whose
message is one line naming the value and the fix. Entry points wrap their body in
`report_errors()`: the message is printed once as ``error: <message>`` (once per node when the
error is the same on every rank, by each failing rank otherwise) and the process exits 2.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import tempfile
import time
from typing import Iterator, Optional

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem the user can fix; the message is one line naming the value and the fix."""


@contextlib.contextmanager
def report_errors(*extra: type[BaseException], every_rank: bool = False) -> Iterator[None]:
    """Turn a `UserError` (and the `extra` types, e.g. OSError) into ``error: ...`` + exit 2.

    every_rank=False prints once per node: use it where every rank meets the same error
    (config validation, a collective that agreed on a failure)."""
    try:
        yield
    except (UserError, *extra) as e:  # type: ignore[misc]  # mypy cannot type a starred exception tuple
        if every_rank:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            print_once_per_node(f"error: {e}")
        _remember_user_error()
        sys.exit(EXIT_USER_ERROR)


def exit_if_failed_before() -> None:
    """On a torchrun restart: exit at once (status 2, nothing printed: the line was) when an
    earlier attempt of this launcher ended in a UserError. A config, data or checkpoint error
    is the same on every attempt; only crashes and lost peers are worth restarting for."""
    marker = _job_marker(attempt=False)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and marker and os.path.exists(marker + "-user"):
        sys.exit(EXIT_USER_ERROR)


def _remember_user_error() -> None:
    """Leave word for this launcher's later attempts (see exit_if_failed_before), and for a
    script around the launcher ($MEGAZERO_USER_ERROR_FILE): torchrun itself exits 1 whatever
    its workers' status, the scripts exit 2 for a user error, as megazero does."""
    marker = _job_marker(attempt=False)
    for path in (marker + "-user" if marker else None, os.environ.get("MEGAZERO_USER_ERROR_FILE")):
        if path:
            with contextlib.suppress(OSError), open(path, "a"):
                pass


def print_once_per_node(line: str, wait_s: float = 10.0) -> None:
    """Print `line` (met by every rank) on stderr once per node: by the first local rank to get
    here, whichever it is. Rank 0 alone is not enough: torchrun SIGTERMs the other workers as
    soon as one exits, so rank 0 could be killed before printing. The first rank claims a marker
    file; the others wait until it has printed before they exit."""
    marker = _job_marker()
    if marker is None:  # not under torchrun: rank 0 speaks for the job
        if int(os.environ.get("RANK", "0")) == 0:
            print(line, file=sys.stderr, flush=True)
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and os.path.getsize(marker) == 0:
            time.sleep(0.05)
        return
    _remove_stale_markers()
    print(line, file=sys.stderr, flush=True)
    os.write(fd, b"printed")
    os.close(fd)


def _job_marker(attempt: bool = True) -> Optional[str]:
    """A path unique to this node's workers of this torchrun attempt: the launcher's pid and
    start time (pids are reused) and the restart count (without it, with `attempt` False: of
    every attempt of this launcher). None when not under torchrun on Linux."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    launcher = os.getppid()
    try:
        with open(f"/proc/{launcher}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks
    except (OSError, IndexError):
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if attempt else "all"
    # megazero.launch's own directory, which it removes at exit; under plain torchrun the
    # system's (_remove_stale_markers clears what launchers that have exited left there).
    # A directory that is gone (a variable inherited from a launcher that has exited) is no home.
    where = os.environ.get("MEGAZERO_LAUNCH_DIR", "")
    where = where if os.path.isdir(where) else tempfile.gettempdir()
    return os.path.join(where, f"megazero-error-{launcher}-{started}-{restart}")


def _remove_stale_markers() -> None:
    """Markers of launchers that have exited (one small file per failed start otherwise stays)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "megazero-error-*")):
        pid = os.path.basename(path).split("-")[2]
        if not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.remove(path)
