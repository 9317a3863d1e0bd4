"""Packing: documents, each followed by the end-of-document token, cut into windows.

As for indexed data (gpt_dataset.py), a shard's tokens form one stream and its k-th window
is stream tokens [k * seq_length, k * seq_length + seq_length + 1): seq_length inputs and,
shifted by one, their labels, so consecutive windows share one token. What is left after a
window is the carry-over, the start of the next.

A carry-over is always a suffix of the last document added (a window is cut as soon as
seq_length + 1 tokens are there, so at most seq_length tokens wait before a document is
added). That is what keeps a shard's saved state small: after a window, the state is "the
document read from cursor C, less its first `skip` tokens" rather than the tokens themselves;
only at the end of an epoch, when several short documents may wait, are the (at most
seq_length) tokens saved as they are.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

TOKEN_DTYPE = np.int32


class Packer:
    """Cuts a stream of documents into windows of seq_length + 1 tokens; `carry` is what waits."""

    def __init__(self, seq_length: int, eod: int, carry: np.ndarray | None = None) -> None:
        self.seq_length, self.eod = seq_length, eod
        self.carry = np.asarray(carry if carry is not None else [], dtype=TOKEN_DTYPE)

    def add(self, tokens: list[int] | np.ndarray, skip: int = 0) -> Iterator[tuple[np.ndarray, int]]:
        """Append a document (less its first `skip` tokens, counting the end-of-document token
        appended to it) and yield each window now complete, with how many of this document's
        tokens the carry-over after it leaves out (its `skip` on resume)."""
        doc = np.empty(len(tokens) + 1, dtype=TOKEN_DTYPE)
        doc[:-1], doc[-1] = tokens, self.eod
        waiting = len(self.carry)
        buffer = np.concatenate([self.carry, doc[skip:]])
        s, start = self.seq_length, 0
        while len(buffer) - start >= s + 1:
            window = buffer[start:start + s + 1]
            start += s
            # The carry-over buffer[start:] is this document's tokens from skip + start - waiting on.
            yield window, skip + start - waiting
        self.carry = buffer[start:]
