"""The one error type for problems a user can fix, and the one way commands report them.

Every bad input (config, data, checkpoint, command line) raises a `UserError` subclass whose
message is one line naming the value and the fix. Entry points wrap their body in
`report_errors()`: the message is printed once as ``error: <message>`` (by rank 0 when the
error is the same on every rank, by the failing rank otherwise) and the process exits 2.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem the user can fix; the message is one line naming the value and the fix."""


@contextlib.contextmanager
def report_errors(*extra: type[BaseException], every_rank: bool = False) -> Iterator[None]:
    """Turn a `UserError` (and the `extra` types, e.g. OSError) into ``error: ...`` + exit 2.

    every_rank=False prints on rank 0 only: use it where every rank meets the same error
    (config validation, a collective that agreed on a failure)."""
    try:
        yield
    except (UserError, *extra) as e:
        if every_rank or int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
