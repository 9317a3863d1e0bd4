"""sha256 digests of checkpoint files: computed while a file is written, checked while it
is read, before any value in it is used.

A digest entry is ``{"sha256": hex, "bytes": n}``. Files loaded whole are read once, hashed
as the bytes arrive, and deserialized from those very bytes (`load_torch`); beyond
IN_MEMORY_BYTES (a rank file of an offloaded run can exceed the host's free memory) they are
verified first and then memory-mapped, so their tensors are file-backed pages the kernel
can drop, not a second in-memory copy. Files that are memory-mapped and read piece by piece (resharding, export, universal checkpoints) are
hashed in one sequential read when first opened (`verify`), before the mapping is used.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import IO, Any, Optional

import torch

BLOCK = 1 << 22
IN_MEMORY_BYTES = 1 << 30


class DigestError(ValueError):
    """A file does not match its recorded digest; the message names the file and how."""


class HashingWriter:
    """A binary file wrapper that hashes what is written through it (torch.save writes
    its zip archive sequentially, so the digest costs no second pass over the file)."""

    def __init__(self, f: IO[bytes]):
        self.f, self.hash, self.nbytes = f, hashlib.sha256(), 0
        self.error: Optional[OSError] = None  # torch.save reports a failed write as a RuntimeError

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.nbytes += len(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> dict:
        return {"sha256": self.hash.hexdigest(), "bytes": self.nbytes}


def _check_size(path: str, expected: dict) -> None:
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise DigestError(f"{name} is missing")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise DigestError(f"{name} is truncated or overwritten ({size} bytes, {expected['bytes']} recorded)")


def _check_hash(path: str, digest: str, expected: dict) -> None:
    if digest != expected["sha256"]:
        raise DigestError(f"{os.path.basename(path)} fails its sha256 check")


def _sha256(path: str, copy: Optional[IO[bytes]] = None) -> str:
    """The file's sha256 in one sequential read (its bytes also written to `copy` when given)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
            if copy is not None:
                copy.write(block)
    return h.hexdigest()


def file_entry(path: str) -> dict:
    """The digest entry of a file already written (for writers that seek while writing)."""
    return {"sha256": _sha256(path), "bytes": os.path.getsize(path)}


def verify(path: str, expected: dict) -> None:
    """Hash the file in one sequential read and compare (for files used through mmap)."""
    _check_size(path, expected)
    _check_hash(path, _sha256(path), expected)


def load_torch(path: str, expected: dict) -> Any:
    """torch.load(weights_only=True) from the bytes read while hashing, once they checked
    out; a file over IN_MEMORY_BYTES is verified, then loaded memory-mapped."""
    if os.path.getsize(path) > IN_MEMORY_BYTES:
        verify(path, expected)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    _check_size(path, expected)
    data = io.BytesIO()
    _check_hash(path, _sha256(path, data), expected)
    data.seek(0)
    return torch.load(data, map_location="cpu", weights_only=True)
