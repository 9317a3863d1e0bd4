"""Write-to-temporary-then-rename, the only way megazero writes a file or directory that
a reader may take for complete.

The data is written under a temporary name, flushed and fsynced, renamed over the final
name, and the parent directory is fsynced so that the rename itself survives a power loss.
A crash at any moment leaves either the old complete file or the new complete one.

    with atomic_write(path) as f: ...          one file, written in one go
    write_bytes(path, data) / write_text(path, text)
    publish(tmp, path)                         a file written elsewhere under a temporary name
    atomic_dir(path, write)                    a whole directory (write(tmp_dir) fills it)
    prepare_dir(path) / commit_dir(path)       the same in two steps, for writers that are
                                               several processes (sharded checkpoints)
    remove_dir(path)                           delete, never leaving a half-deleted PATH
    rename_aside(path, new)                    move a file or directory to a free name
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import IO, Callable, Iterator, Optional

TMP_SUFFIX = ".tmp"  # a directory being written
OLD_SUFFIX = ".old"  # the previous version of a directory, while the new one is renamed in
DEL_SUFFIX = ".del"  # a directory being deleted


def _fsync(path: str) -> None:
    """Make file `path`'s data, or the renames and creations inside directory `path`, durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def publish(tmp: str, path: str) -> None:
    """Rename the finished file `tmp` over `path`, durably (file, rename and directory)."""
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(_parent(path))


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb", encoding: Optional[str] = None) -> Iterator[IO]:
    """`with atomic_write(p) as f: f.write(...)` -- p appears only once complete; on an
    exception the temporary file is removed and p is left as it was. Modes: "wb", "w"
    (text, `encoding`), "w+b" (writers that read back or seek, e.g. torch.save then patch)."""
    if mode not in ("w", "wb", "w+b"):
        raise ValueError(f"atomic_write mode must be 'w', 'wb' or 'w+b', not {mode!r}")
    os.makedirs(_parent(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
        publish(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_bytes(path: str, data: bytes) -> None:
    with atomic_write(path) as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)


def prepare_dir(path: str) -> str:
    """A fresh, empty PATH.tmp to build directory `path` in (leftovers of a crash removed)."""
    path = path.rstrip("/")
    recover_dir(path)
    tmp = path + TMP_SUFFIX
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def commit_dir(path: str) -> None:
    """Rename the finished PATH.tmp to `path`, replacing an existing `path`.

    There is never a moment in which neither version exists: the old one is renamed aside
    to PATH.old, the new one in, and only then the old one removed. A crash between the two
    renames leaves PATH.old complete; `recover_dir` (and readers, see `existing_dir`) find it."""
    path = path.rstrip("/")
    parent, tmp, old = _parent(path), path + TMP_SUFFIX, path + OLD_SUFFIX
    _fsync(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync(parent)
    remove_dir(old)


def remove_dir(path: str) -> None:
    """Delete a directory so that no reader ever sees it half deleted under its own name:
    it is renamed to PATH.del first (a kill during the deletion leaves only that name)."""
    path = path.rstrip("/")
    if not os.path.exists(path):
        return
    shutil.rmtree(path + DEL_SUFFIX, ignore_errors=True)
    os.replace(path, path + DEL_SUFFIX)
    _fsync(_parent(path))
    shutil.rmtree(path + DEL_SUFFIX, ignore_errors=True)


def rename_aside(path: str, new: str) -> None:
    """Move file or directory `path` to `new`, which must not exist (nothing is replaced), durably."""
    if os.path.lexists(new):
        raise FileExistsError(f"{new} exists; not moving {path} over it")
    os.rename(path, new)
    _fsync(_parent(new))


def recover_dir(path: str) -> None:
    """Undo a crash between commit_dir's two renames: PATH.old back to PATH."""
    path = path.rstrip("/")
    if not os.path.exists(path) and os.path.isdir(path + OLD_SUFFIX):
        os.replace(path + OLD_SUFFIX, path)
        _fsync(_parent(path))


def existing_dir(path: str) -> str:
    """`path`, or PATH.old when a crash interrupted its replacement (read-only readers use
    this instead of repairing the directory: they may run on many ranks at once)."""
    path = path.rstrip("/")
    return path + OLD_SUFFIX if not os.path.exists(path) and os.path.isdir(path + OLD_SUFFIX) else path


def atomic_dir(path: str, write: Callable[[str], None]) -> None:
    """Build directory `path` by calling write(tmp_dir) and renaming it into place; on an
    exception the temporary directory is removed and `path` is left as it was."""
    tmp = prepare_dir(path)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(path)
