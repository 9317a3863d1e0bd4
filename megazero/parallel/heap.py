"""Host-heap settings that keep a training process's resident memory equal to what it holds.

glibc serves a request of at least M_MMAP_THRESHOLD bytes with its own mmap and unmaps it on
free; smaller ones come from heaps that are reused but rarely returned. The threshold starts
at 128 KiB and, by default, rises to the size of every mapped block freed, up to 32 MiB. A
training step allocates and frees tensors of a few to a few tens of MiB all the time
(gathered ZeRO-3 units, gradient buckets, activations): after the first free they land in the
heaps, whose free holes a later, larger request cannot use, and the process's resident memory
grows far past what it holds at any moment, more so with more ranks (more communication
threads, each with its own heap). A fixed threshold stops that rise.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc's malloc.h)
MMAP_THRESHOLD_BYTES = 4 << 20
"""Requests this large or larger are mapped and unmapped whole: past a few MiB the page
faults of a fresh mapping cost little beside the work done on most tensors. Buffers of that
size filled again every pass are reused instead (zero/grads.py's pool, zero/stage3.py's spare
memory): there the faults cost ZeRO-3 about a quarter of its speed on a CPU."""


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this process (see above); False where the C library is
    not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): no mallopt
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes))
