"""Write-to-temporary-then-rename, the only way megazero writes a file or directory that
a reader may take for complete.

The data is written under a temporary name, flushed and fsynced, renamed over the final
name, and the parent directory is fsynced so that the rename itself survives a power loss.
A crash at any moment leaves either the old complete file or the new complete one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import IO, Callable, Iterator


def fsync_dir(path: str) -> None:
    """Make the renames and creations inside directory `path` durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """`with atomic_write(p) as f: f.write(...)` -- p appears only once complete; on an
    exception the temporary file is removed and p is left as it was."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', not {mode!r}")
    os.makedirs(_parent(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_dir(_parent(path))


def write_bytes(path: str, data: bytes) -> None:
    with atomic_write(path) as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def atomic_dir(path: str, write: Callable[[str], None]) -> None:
    """Build directory `path` by calling write(tmp_dir) and renaming it into place.

    An existing `path` is replaced without a moment in which neither version exists under
    a name a reader trusts: the old one is first renamed aside, then the new one in, then
    the old one removed."""
    path = path.rstrip("/")
    parent = _parent(path)
    os.makedirs(parent, exist_ok=True)
    tmp, old = f"{path}.tmp", f"{path}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    fsync_dir(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)
