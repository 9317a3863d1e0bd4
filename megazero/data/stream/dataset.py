"""What the trainer holds for data.stream: samples by index, the stream's state, validation.

StreamDataset serves sample i of the global stream the way an indexed dataset does (ds[i]),
for increasing i: `fetch(first, end)` reads the stream up to sample `end` (the trainer asks for
the whole global batch before taking its slice, so that every rank has read the same samples and meets
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
from megazero.data.stream.stream import GlobalStream, Sample, copy_state, optional, state_shards


def default_workers(ranks_per_node: int) -> int:
    """data.loader_workers -1 (the default): per rank, its share of the node's cores less the one
    it trains on; at least 1 (0, tokenizing in-process, is only ever asked for)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(NUM_SHARDS, cores // max(1, ranks_per_node) - 1))


class StreamDataset:
    """The training samples of data.stream (see the module docstring). The loader processes
    start at the first sample asked for, from the state given or loaded (load_state_dict) before."""

    loss_masked = False

    def __init__(self, setup: StreamSetup, num_samples: int, workers: int, state: Optional[dict] = None,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.setup, self.num_samples, self.workers, self.say = setup, num_samples, workers, say
        self.stream: Optional[GlobalStream] = None
        self.load_state_dict(state)

    def load_state_dict(self, state: Optional[dict], first_sample: int = 0) -> None:
        """Continue the stream from `state` (a saved state_dict: refused unless it is this
        stream's), or start it anew (None) as sample `first_sample` of the run."""
        assert self.stream is None, "the stream has started"
        self.start = optional(state, self.setup.identity())
        if state is None:
            self.start["samples"] = first_sample
        self.first = self.read = self.start["samples"]  # sample `read` is the next the stream gives
        self.samples: dict[int, Sample] = {}

    def _open(self) -> GlobalStream:
        if self.stream is None:
            start, setup = self.start, self.setup
            if self.workers > 0:
                producer: Any = PoolProducer(setup, state_shards(start), self.workers)
            else:
                tokenizer = setup.tokenizer()
                producer = LocalProducer([[shard_stream(setup, k, s, start["sources"][k]["shards"][s], tokenizer)
                                           for s in range(NUM_SHARDS)] for k in range(len(setup.sources))])
            self.stream = GlobalStream(producer, start, self.say)
        return self.stream

    def __len__(self) -> int:
        return self.num_samples

    def fetch(self, first: int, end: int) -> None:
        """Read the stream up to sample `end` (exclusive) and drop the samples before `first`."""
        stream = self._open()
        while self.read < end:
            self.samples[self.read] = stream.next_sample()
            self.read += 1
        for i in [i for i in self.samples if i < first]:
            del self.samples[i]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sample(i).window.astype(np.int64)

    def sample(self, i: int) -> Sample:
        """Sample i with where it comes from (it must not have been dropped: see fetch)."""
        if i < self.first:
            raise IndexError(f"sample {i} was read before this run resumed at sample {self.first}")
        if i >= self.read:
            self.fetch(i, i + 1)
        sample = self.samples.get(i)
        if sample is None:
            raise IndexError(f"sample {i} of the stream was read and dropped already")
        return sample

    def provenance(self, i: int) -> tuple[str, list[str]]:
        """(sample i's source, the documents it is cut from, as FILE:LINE or SPEC row N): how the
        trainer names a batch it skips (train/rerun.py)."""
        sample = self.sample(i)
        names: list[str] = []
        for name, *_ in sample.documents:
            if name not in names:  # a document that ends and starts the window (a short epoch) once
                names.append(name)
        return self.setup.sources[sample.source].spec, names

    def state_dict(self) -> dict:
        """The stream's state after the samples read (a copy: training goes on changing it)."""
        return copy_state(self.stream.state if self.stream is not None else self.start)

    def tokens_per_source(self) -> dict[str, int]:
        counts = self.state_dict()["taken"]
        return {s.spec: n * self.setup.seq_length for s, n in zip(self.setup.sources, counts)}

    def skipped_documents(self) -> int:
        """Documents skipped so far because they are not UTF-8."""
        return self.stream.skipped_documents() if self.stream is not None else 0

    def supply_tokens_per_s(self) -> Optional[float]:
        return supply(self.stream.producer) if self.stream is not None else None

    def describe(self, samples: int) -> str:
        """The start-up line: the sources, their weights, what the run reads, who tokenizes."""
        sources = ", ".join(f"{w:.0%} {s.spec} ({s.num_files} file(s))" if not s.hf else f"{w:.0%} {s.spec}"
                            for w, s in zip(self.setup.weights, self.setup.sources))
        who = f"{self.workers} loader process(es) per rank" if self.workers else "the trainer's process"
        return (f"data: stream {sources}; the run reads {samples:,} samples = {samples * self.setup.seq_length:,} "
                f"tokens, tokenized on the fly by {who}, nothing written to disk")

    def close(self) -> None:
        if self.stream is not None:
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


def supply_line(supplied: Optional[float], consumed: float, workers: int) -> Optional[str]:
    """The start-up comparison of what the loader processes can tokenize with what the run
    trains on (every rank's loaders read the whole global stream); a warning when short."""
    if supplied is None:
        return None
    line = (f"data.stream: {workers} loader process(es) per rank supply {supplied / 1e3:,.1f}k tokens/s "
            f"(measured), the run consumes {consumed / 1e3:,.1f}k tokens/s")
    if supplied < consumed:
        return (f"warning: {line}: training waits for data (time_data_wait_s); raise data.loader_workers, or "
                f"preprocess the corpus (docs/data.md)")
    return line
