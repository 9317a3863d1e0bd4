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

The packer also keeps which documents its tokens are cut from, as pieces [document, epoch,
first, end): tokens first .. end - 1 of that document (its end-of-document token last). Each
window's pieces name the documents a sample holds (a batch the trainer skips, train/rerun.py),
and the pieces of all windows show that an epoch reads every document once.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import numpy as np

TOKEN_DTYPE = np.int32

Piece = list
"""[document, epoch, first, end]: tokens first .. end - 1 of a document (a JSON-friendly list:
the carry-over's pieces are saved in the checkpoint at an epoch's end)."""


class Packer:
    """Cuts a stream of documents into windows of seq_length + 1 tokens; `carry` is what waits."""

    def __init__(self, seq_length: int, eod: int, carry: np.ndarray | None = None,
                 pieces: Sequence[Sequence[Any]] = ()) -> None:
        self.seq_length, self.eod = seq_length, eod
        self.carry = np.asarray(carry if carry is not None else [], dtype=TOKEN_DTYPE)
        self.pieces: list[Piece] = [list(p) for p in pieces]
        """The documents the carry-over is cut from, in order (their lengths sum to len(carry))."""
        self.window_pieces: list[Piece] = []
        """The documents the window last yielded is cut from."""

    def add(self, tokens: list[int] | np.ndarray, skip: int = 0, document: Optional[str] = None,
            epoch: int = 0) -> Iterator[tuple[np.ndarray, int]]:
        """Append a document (less its first `skip` tokens, counting the end-of-document token
        appended to it) and yield each window now complete, with how many of this document's
        tokens the carry-over after it leaves out (its `skip` on resume). `document` names it
        in the pieces (window_pieces)."""
        doc = np.empty(len(tokens) + 1, dtype=TOKEN_DTYPE)
        doc[:-1], doc[-1] = tokens, self.eod
        waiting = len(self.carry)
        buffer = np.concatenate([self.carry, doc[skip:]])
        self.pieces.append([document, epoch, skip, len(doc)])
        s, start = self.seq_length, 0
        while len(buffer) - start >= s + 1:
            window = buffer[start:start + s + 1]
            self.window_pieces = self._advance(s, s + 1)
            start += s
            # The carry-over buffer[start:] is this document's tokens from skip + start - waiting on.
            yield window, skip + start - waiting
        self.carry = buffer[start:]

    def _advance(self, step: int, width: int) -> list[Piece]:
        """The pieces of the next `width` tokens; then drop the first `step` of them (windows
        overlap by one token: the last input's label is the next window's first input)."""
        window, left = [], width
        for doc, epoch, first, end in self.pieces:
            if left <= 0:
                break
            window.append([doc, epoch, first, first + min(end - first, left)])
            left -= end - first
        while step:
            doc, epoch, first, end = self.pieces[0]
            if end - first <= step:
                step -= end - first
                self.pieces.pop(0)
            else:
                self.pieces[0] = [doc, epoch, first + step, end]
                step = 0
        return window
