"""Loader processes: the shards tokenized in parallel, the global order kept.

Shard (source k, shard s) lives in loader process (k * NUM_SHARDS + s) mod workers; each
process runs its shards' ShardStreams (producer.py) and sends their items back in order, a
few ahead of need (PREFETCH per shard, asked for in CHUNKs). The trainer's process takes each
shard's items in the order the global stream asks for them, so the number of processes changes
only who tokenizes, never what comes out.

A loader that meets bad data sends the one-line error in place of the shard's next item; the
trainer raises it when the stream reaches that item: the same sample on every rank, whatever
the timing. A loader whose parent is gone
exits by itself (the trainer leaves with os._exit, which runs no cleanup).
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
import os
import queue
import time
import traceback
from typing import Any, Iterator, NamedTuple

from megazero.data import DataError
from megazero.data.stream.producer import Item, ShardStream
from megazero.data.stream.shards import NUM_SHARDS

PREFETCH = 8
CHUNK = 4
POLL_S = 1.0


class Failed(NamedTuple):
    """In place of a shard's next item: the error its loader met there."""

    message: str


def worker_of(source: int, shard: int, workers: int) -> int:
    return (source * NUM_SHARDS + shard) % workers


class PoolProducer:
    """`workers` loader processes serving the shards of `setup` (a dataset.StreamSetup) from
    `states`: (source, shard, state) for every shard."""

    def __init__(self, setup: Any, states: list[tuple[int, int, dict]], workers: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads and groups
        self.workers = workers
        self.requests = [ctx.Queue() for _ in range(workers)]
        self.results = [ctx.Queue() for _ in range(workers)]
        self.buffers: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.outstanding: dict[tuple[int, int], int] = collections.defaultdict(int)
        self.busy = [0.0] * workers
        self.encoded = [0] * workers
        self.procs = []
        for w in range(workers):
            mine = [(k, s, st) for k, s, st in states if worker_of(k, s, workers) == w]
            proc = ctx.Process(target=_serve, args=(setup, mine, self.requests[w], self.results[w], os.getpid()),
                               daemon=True, name=f"megazero-loader-{w}")
            proc.start()
            self.procs.append(proc)
        for k, s, _ in states:
            self._ask(k, s, PREFETCH)

    def _ask(self, k: int, s: int, n: int) -> None:
        self.requests[worker_of(k, s, self.workers)].put((k, s, n))
        self.outstanding[(k, s)] += n

    def next_item(self, source: int, shard: int) -> Item:
        key, w = (source, shard), worker_of(source, shard, self.workers)
        while not self.buffers[key]:
            self._receive(w)
        item = self.buffers[key].popleft()
        if isinstance(item, Failed):  # raised where the stream reaches it: the same sample on every rank
            raise DataError(item.message)
        self.outstanding[key] -= 1
        if self.outstanding[key] <= PREFETCH - CHUNK:
            self._ask(source, shard, CHUNK)
        return item

    def _receive(self, w: int) -> None:
        while True:
            try:
                message = self.results[w].get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self.procs[w].is_alive():
                    raise DataError(f"data loader process {w} died (exit code {self.procs[w].exitcode}); see its "
                                    f"output above, or run with --data.loader_workers 0 to tokenize in-process") \
                        from None
        _, k, s, items, encoded, busy = message
        self.buffers[(k, s)].extend(items)
        self.encoded[w] += encoded
        self.busy[w] += busy

    def supply_tokens_per_s(self) -> float | None:
        """Tokens/s all loader processes together can encode, from their busy time so far."""
        rates = [e / b for e, b in zip(self.encoded, self.busy) if b > 0]
        return sum(rates) / len(rates) * self.workers if rates else None

    def close(self) -> None:
        for q in self.requests:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
            proc.close()
        for q in (*self.requests, *self.results):
            q.close()
            q.cancel_join_thread()
        # The queues' semaphores are released when collected: now, before the trainer's os._exit
        # (which collects nothing and would leave the resource tracker warning of leaks).
        self.procs, self.requests, self.results = [], [], []
        gc.collect()


def _serve(setup: Any, mine: list[tuple[int, int, dict]], requests: Any, results: Any, parent: int) -> None:
    """A loader process: answer (source, shard, n) with that shard's next n items."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core per loader: the parallelism is the processes
    try:
        from megazero.data.stream.setup import shard_stream

        tokenizer = setup.tokenizer()
        streams: dict[tuple[int, int], Iterator[Item]] = {}
        failed: set[tuple[int, int]] = set()
        counted: dict[tuple[int, int], ShardStream] = {}
        for k, s, state in mine:
            counted[(k, s)] = shard_stream(setup, k, s, state, tokenizer)
            streams[(k, s)] = counted[(k, s)].items()
        while True:
            try:
                request = requests.get(timeout=POLL_S)
            except queue.Empty:
                if os.getppid() != parent:
                    return
                continue
            if request is None:
                return
            k, s, n = request
            if (k, s) in failed:
                continue
            before, tic = counted[(k, s)].tokens, time.perf_counter()
            items = _next_items(streams[(k, s)], n)
            if items and isinstance(items[-1], Failed):
                failed.add((k, s))
            results.put(("items", k, s, items, counted[(k, s)].tokens - before, time.perf_counter() - tic))
    except Exception:  # setting up (the tokenizer): the trainer's process meets the same error itself
        traceback.print_exc()


def _next_items(stream: Iterator[Item], n: int) -> list[Any]:
    """The shard's next n items; bad data (or a bug) ends the list with a Failed."""
    items: list[Any] = []
    try:
        for _ in range(n):
            items.append(next(stream))
    except DataError as e:
        items.append(Failed(str(e)))
    except Exception as e:  # a bug, not bad data: its traceback on stderr, one line to the trainer
        traceback.print_exc()
        items.append(Failed(f"data loader process failed: {type(e).__name__}: {e}; run with --data.loader_workers 0 "
                            f"to see it in the trainer"))
    return items
