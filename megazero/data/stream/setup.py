"""A resolved data.stream: its sources checked, and everything a loader process needs to read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from megazero.data import DataError
from megazero.data.stream.producer import ShardStream
from megazero.data.stream.shards import holdout_lines
from megazero.data.stream.sources import Source, parse_stream, resolve_source
from megazero.data.stream.stream import stream_identity
from megazero.data.tokenizer import build_tokenizer


@dataclass(frozen=True)
class StreamSetup:
    """Everything a loader process needs (picklable): resolved sources and how to read them."""

    sources: tuple[Source, ...]
    weights: tuple[float, ...]
    seed: int
    seq_length: int
    key: str
    valid_docs: int
    holdouts: tuple[tuple[int, ...], ...]
    tokenizer_spec: Optional[str] = None
    encoder: Any = field(default=None, compare=False)
    """A ready tokenizer object instead of a spec (tests)."""

    def tokenizer(self) -> Any:
        if self.encoder is not None:
            return self.encoder
        if not self.tokenizer_spec:
            raise DataError("data.stream needs data.tokenizer to tokenize the text; set it, e.g. gpt2bpe:DIR")
        return build_tokenizer(self.tokenizer_spec)

    def identity(self) -> dict:
        return stream_identity([s.spec for s in self.sources], self.weights, self.seed, self.seq_length, self.key,
                               self.valid_docs)


def setup_stream(stream: Sequence[Any] | str, key: str, valid_docs: int, seed: int, seq_length: int,
                 tokenizer_spec: Optional[str], encoder: Any = None) -> StreamSetup:
    """data.stream resolved and checked (every source exists and holds documents with `key`)."""
    pairs = parse_stream(stream)
    sources = tuple(resolve_source(spec, key) for _, spec in pairs)
    holdouts = tuple(holdout_lines(s, key, valid_docs) for s in sources)
    return StreamSetup(sources, tuple(w for w, _ in pairs), seed, seq_length, key, valid_docs, holdouts,
                       tokenizer_spec, encoder)


def shard_stream(setup: StreamSetup, k: int, s: int, state: dict, tokenizer: Any) -> ShardStream:
    return ShardStream(setup.sources[k], k, s, state, setup.seed, setup.key, setup.holdouts[k], tokenizer,
                       setup.seq_length)
