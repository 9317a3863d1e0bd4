"""One shard's windows: its documents (shards.py) tokenized in batches and packed (packing.py).

A ShardStream runs where the tokenizing happens (a loader process, or the trainer's own
process with data.loader_workers 0) and yields Items: a window with the shard's state after
it, or, at the end of an epoch, the state the next epoch starts from. The state is what the
checkpoint saves for the shard (see packing.py for why it holds a cursor and a skip):

    cursor   where the document that the carry-over comes from is found (shards.Cursor)
    skip     how many of that document's tokens (end-of-document token included) are behind
    carry    tokens waiting that are not from that document (only at an epoch's end)
    carry_docs  the documents those tokens are cut from (packing.Piece; only at an epoch's end)
    skipped  documents skipped so far because they are not UTF-8
    docs     documents this shard tokenized so far in the epoch
    epoch_docs  at an epoch's end: how many it tokenized in that epoch (none in any shard: the
             source holds no text)
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional, Protocol, Sequence

import numpy as np

from megazero.data.stream.packing import Packer
from megazero.data.stream.shards import Cursor, Document, shard_documents
from megazero.data.stream.sources import Source

BATCH_DOCS = 64
"""Documents encoded in one call to the tokenizer (about what `tokenizers` needs to be fast)."""
BATCH_CHARS = 1 << 20


class Encoder(Protocol):
    eod: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class Item(NamedTuple):
    window: Optional[np.ndarray]
    """seq_length + 1 tokens, or None at the end of an epoch."""
    state: dict
    documents: tuple = ()
    """The window's pieces of documents (packing.Piece), in order."""


def initial_state() -> dict:
    return {"cursor": list(Cursor()), "skip": 0, "carry": [], "skipped": 0, "docs": 0}


class ShardStream:
    """Shard `shard` of source number `index` from `state` on (initial_state() for a fresh one)."""

    def __init__(self, source: Source, index: int, shard: int, state: dict, seed: int, key: str,
                 holdout: tuple[int, ...], tokenizer: Encoder, seq_length: int) -> None:
        self.source, self.index, self.shard, self.seed, self.key = source, index, shard, seed, key
        self.holdout, self.tokenizer, self.seq_length = holdout, tokenizer, seq_length
        self.state = state
        self.tokens = 0  # tokens this stream encoded (the loader's measured supply)

    def items(self) -> Iterator[Item]:
        """Windows and end-of-epoch marks, for ever."""
        state = self.state
        while True:
            start = Cursor(*state["cursor"])
            packer = Packer(self.seq_length, self.tokenizer.eod, np.asarray(state["carry"]),
                            state.get("carry_docs", ()))  # (a state saved before pieces were kept has none)
            skip, skipped, docs = state["skip"], state["skipped"], state["docs"]
            documents = shard_documents(self.source, self.index, self.shard, start, self.seed, self.key, self.holdout)
            for batch in _batches(documents):
                encoded = iter(self.tokenizer.encode_batch([d.text for d in batch if d.text is not None]))
                for doc in batch:
                    if doc.text is None:
                        skipped += 1
                        continue
                    tokens = next(encoded)
                    self.tokens += len(tokens) + 1
                    docs += 1
                    for window, left_out in packer.add(tokens, skip, doc.name, start.epoch):
                        yield Item(window.copy(), {"cursor": list(doc.before), "skip": left_out, "carry": [],
                                                   "skipped": skipped, "docs": docs},
                                   tuple(tuple(p) for p in packer.window_pieces))
                    skip = 0
            state = {"cursor": list(Cursor(start.epoch + 1)), "skip": 0, "carry": packer.carry.tolist(),
                     "carry_docs": [list(p) for p in packer.pieces], "skipped": skipped, "docs": 0,
                     "epoch_docs": docs}
            yield Item(None, state)


def _batches(documents: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    chars = 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc.text or "")
        if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class Producer(Protocol):
    """Where the global stream takes each shard's next item from (in-process, or loader processes)."""

    def next_item(self, source: int, shard: int) -> Item: ...

    def close(self) -> None: ...


class LocalProducer:
    """Every shard in this process (data.loader_workers 0, tests)."""

    def __init__(self, streams: Sequence[Sequence[ShardStream]]) -> None:
        self.streams = streams
        self.iters: dict[tuple[int, int], Iterator[Item]] = {}

    def next_item(self, source: int, shard: int) -> Item:
        it = self.iters.get((source, shard))
        if it is None:
            it = self.iters[(source, shard)] = self.streams[source][shard].items()
        return next(it)

    def tokens(self) -> int:
        return sum(s.tokens for row in self.streams for s in row)

    def close(self) -> None:
        pass


def supply(producer: Any) -> Optional[float]:
    """Tokens/s the producer measured it can supply (None where it does not measure)."""
    rate = getattr(producer, "supply_tokens_per_s", None)
    return rate() if callable(rate) else None
