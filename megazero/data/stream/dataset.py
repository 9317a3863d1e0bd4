"""What the trainer holds for data.stream: samples by index, the stream's state, validation.

StreamDataset serves sample i of the global stream the way an indexed dataset does (ds[i]),
for increasing i: `fetch(n)` reads the stream up to sample n (the trainer asks for the whole
global batch before taking its slice, so that every rank has read the same samples and meets
a bad document at the same place), and `state_dict()` is the stream's position after them.

Validation samples are made once, in-process, from data.stream_valid (its first documents)
or from the documents data.stream_valid_docs holds out of each source, packed one source
after the other.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np

from megazero.data import DataError
from megazero.data.stream.packing import Packer
from megazero.data.stream.pool import PoolProducer
from megazero.data.stream.producer import LocalProducer, supply
from megazero.data.stream.setup import StreamSetup, shard_stream
from megazero.data.stream.shards import NUM_SHARDS, where
from megazero.data.stream.sources import (
    NotText,
    Source,
    document_text,
    is_blank,
    read_file,
    resolve_source,
)
from megazero.data.stream.stream import GlobalStream, optional, state_shards


def default_workers(ranks_per_node: int) -> int:
    """data.loader_workers 0 means in-process; the default (-1) takes the cores the ranks leave."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(NUM_SHARDS, cores // max(1, ranks_per_node) - 1))


class StreamDataset:
    """The training samples of data.stream (see the module docstring)."""

    loss_masked = False

    def __init__(self, setup: StreamSetup, num_samples: int, workers: int, state: Optional[dict] = None,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.setup, self.num_samples = setup, num_samples
        start = optional(state, setup.identity())
        self.first = start["samples"]  # the sample index the stream resumes at
        if workers > 0:
            producer: Any = PoolProducer(setup, state_shards(start), workers)
        else:
            tokenizer = setup.tokenizer()
            producer = LocalProducer([[shard_stream(setup, k, s, start["sources"][k]["shards"][s], tokenizer)
                                       for s in range(NUM_SHARDS)] for k in range(len(setup.sources))])
        self.stream = GlobalStream(producer, start, say)
        self.samples: dict[int, np.ndarray] = {}
        self.read = self.first  # samples read from the stream (the next one is sample `read`)

    def __len__(self) -> int:
        return self.num_samples

    def fetch(self, first: int, end: int) -> None:
        """Read the stream up to sample `end` (exclusive) and drop the samples before `first`."""
        while self.read < end:
            self.samples[self.read] = self.stream.next_sample()
            self.read += 1
        for i in [i for i in self.samples if i < first]:
            del self.samples[i]

    def __getitem__(self, i: int) -> np.ndarray:
        if i < self.first:
            raise IndexError(f"sample {i} was read before this run resumed at sample {self.first}")
        if i >= self.read:
            self.fetch(i, i + 1)
        sample = self.samples.get(i)
        if sample is None:
            raise IndexError(f"sample {i} of the stream was read and dropped already")
        return sample.astype(np.int64)

    def state_dict(self) -> dict:
        return self.stream.state

    def tokens_per_source(self) -> dict[str, int]:
        return self.stream.tokens_per_source(self.setup.seq_length)

    def supply_tokens_per_s(self) -> Optional[float]:
        return supply(self.stream.producer)

    def close(self) -> None:
        self.stream.producer.close()


def validation_samples(setup: StreamSetup, valid: Optional[str], count: int) -> list[np.ndarray]:
    """`count` validation samples (fewer when the held-out text is shorter): the first documents
    of the source `valid`, or the held-out documents of each source."""
    tokenizer = setup.tokenizer()
    packer = Packer(setup.seq_length, tokenizer.eod)
    out: list[np.ndarray] = []
    plan: list[tuple[Source, Optional[tuple[int, ...]]]]
    if valid:
        plan = [(resolve_source(valid, setup.key), None)]
    else:
        plan = [(src, holdout) for src, holdout in zip(setup.sources, setup.holdouts)]
    for source, holdout in plan:
        texts = _first_texts(source, setup.key, holdout)
        for start in range(0, len(texts), 64):
            for tokens in tokenizer.encode_batch(texts[start:start + 64]):
                out.extend(w.astype(np.int64) for w, _ in packer.add(tokens))
                if len(out) >= count:
                    return out[:count]
    if not out:
        what = f"data.stream_valid {valid!r}" if valid else f"the {setup.valid_docs} held-out documents"
        raise DataError(f"{what} hold fewer than seq_length + 1 ({setup.seq_length + 1}) tokens, no validation "
                        f"sample; raise data.stream_valid_docs, or set train.eval_interval 0")
    return out


def _first_texts(source: Source, key: str, holdout: Optional[tuple[int, ...]], limit: int = 100_000) -> list[str]:
    """In natural order: the held-out documents' texts (holdout: their last line per file), or
    the first `limit` documents of a validation source (holdout None)."""
    texts: list[str] = []
    for f in range(source.num_files):
        if holdout is not None and not holdout[f]:
            continue
        for raw in read_file(source, f, 0, 0, key):
            if holdout is not None and raw.line > holdout[f]:
                break
            if is_blank(raw):
                continue
            try:
                texts.append(document_text(raw, key, where(source, f, raw.line)) or "")
            except NotText:
                continue
            if len(texts) >= limit:
                return texts
    return texts
