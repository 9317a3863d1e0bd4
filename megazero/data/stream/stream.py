"""The global stream: one sequence of samples, whatever the layout, and its state.

Sample n comes from the source mixture.next_source picks; within a source, samples come from
its logical shards in turn (0, 1, ..., NUM_SHARDS - 1, 0, ...), a shard at the end of its
epoch being passed over until every shard of the source is there: then the source's next
epoch starts (its files in a new order, its documents dealt to the shards anew), and a line
says so. Nothing here depends on how many processes read the stream: every rank computes the
same sequence and keeps the samples of its own slice of each global batch.

The state (state_dict) is the position after the samples taken so far: per source its epoch,
whose turn it is, which shards have ended their epoch, and each shard's state as of its last
window taken (producer.py); the samples taken from each source (the mixture's state). Loading
it into a stream with other sources, weights, seed, seq_length, text key or held-out count is
refused: that would be another stream.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from megazero.data import DataError
from megazero.data.stream.mixture import next_source
from megazero.data.stream.producer import Item, Producer, initial_state
from megazero.data.stream.shards import NUM_SHARDS

STATE_VERSION = 1
FRESH_START = "--checkpoint.load_data_state false"


def stream_identity(specs: Sequence[str], weights: Sequence[float], seed: int, seq_length: int, key: str,
                    valid_docs: int) -> dict:
    """What makes two streams the same stream (saved with the state, compared on resume)."""
    return {"sources": list(specs), "weights": [round(float(w), 12) for w in weights], "seed": seed,
            "seq_length": seq_length, "key": key, "valid_docs": valid_docs, "num_shards": NUM_SHARDS,
            "version": STATE_VERSION}


def fresh_state(identity: dict) -> dict:
    k = len(identity["sources"])
    return {"identity": identity, "samples": 0, "taken": [0] * k,
            "sources": [{"epoch": 0, "turn": 0, "ended": [False] * NUM_SHARDS,
                         "shards": [initial_state() for _ in range(NUM_SHARDS)]} for _ in range(k)]}


def check_same_stream(saved: dict, identity: dict) -> None:
    """Refuse to continue a saved stream as another one, naming what differs."""
    mine = saved.get("identity", {})
    for field, value in identity.items():
        if mine.get(field) != value:
            raise DataError(f"the checkpoint's data stream has {field} {mine.get(field)!r} but this run's is "
                            f"{value!r}; restore them to continue that stream, or start this one anew with "
                            f"{FRESH_START}")


class Sample(NamedTuple):
    """One sample of the stream: its tokens, its source's number, the documents it is cut from."""

    window: np.ndarray
    """seq_length + 1 tokens (int32)."""
    source: int
    documents: tuple
    """Pieces of documents (packing.Piece), in order."""


class GlobalStream:
    """Samples in the global order, from `producer`, starting at `state` (fresh_state)."""

    def __init__(self, producer: Producer, state: dict, say: Callable[[str], None] = lambda line: None) -> None:
        self.producer, self.state, self.say = producer, state, say
        self.weights = state["identity"]["weights"]
        self.specs = state["identity"]["sources"]

    def next_sample(self) -> Sample:
        k = next_source(self.weights, self.state["taken"])
        item = self._from_source(k)
        self.state["taken"][k] += 1
        self.state["samples"] += 1
        assert item.window is not None
        return Sample(item.window, k, item.documents)

    def _from_source(self, k: int) -> Item:
        src = self.state["sources"][k]
        while True:
            if all(src["ended"]):
                self._next_epoch(k, src)
            s = src["turn"]
            src["turn"] = (s + 1) % NUM_SHARDS
            if src["ended"][s]:
                continue
            item: Item = self.producer.next_item(k, s)
            src["shards"][s] = item.state
            if item.window is not None:
                return item
            src["ended"][s] = True

    def _next_epoch(self, k: int, src: dict) -> None:
        if not any(shard.get("epoch_docs") for shard in src["shards"]):
            skipped = sum(shard["skipped"] for shard in src["shards"])
            raise DataError(f"data.stream source {self.specs[k]!r} yields no tokens in an epoch ({skipped} documents "
                            f"skipped as not UTF-8); point it at text, or drop it")
        src["epoch"] += 1
        src["ended"] = [False] * NUM_SHARDS
        src["turn"] = 0
        self.say(f"data.stream source {self.specs[k]!r}: epoch {src['epoch']} done after "
                 f"{self.state['taken'][k]} samples in all; epoch {src['epoch'] + 1} starts, reshuffled")

    def skipped_documents(self) -> int:
        return sum(shard["skipped"] for src in self.state["sources"] for shard in src["shards"])


def copy_state(state: dict) -> dict:
    """A deep copy made of plain lists and numbers (what the checkpoint holds)."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    out = plain(state)
    assert isinstance(out, dict)
    return out


def state_shards(state: dict) -> list[tuple[int, int, dict]]:
    """(source, shard, shard state) of every shard: what the loader processes start from."""
    return [(k, s, shard) for k, src in enumerate(state["sources"]) for s, shard in enumerate(src["shards"])]


def optional(state: Optional[dict], identity: dict) -> dict:
    """The state to start from: the saved one (checked to be this stream's), else a fresh one."""
    if state is None:
        return fresh_state(identity)
    check_same_stream(state, identity)
    return copy_state(state)
