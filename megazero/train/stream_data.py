"""data.stream as a run's config asks for it: the training stream and its validation samples
(data/stream/ knows nothing of the config; this is where its settings are read), and the
pre-flight check of the sources."""

from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np

from megazero.config.schema import Config
from megazero.data.stream.dataset import StreamDataset, default_workers, validation_samples
from megazero.data.stream.setup import StreamSetup, setup_stream


def _setup(cfg: Config) -> StreamSetup:
    d = cfg.data
    return setup_stream(d.stream or [], d.stream_key, d.stream_valid_docs, cfg.train.seed, cfg.model.seq_length,
                        d.tokenizer)


def stream_datasets(cfg: Config, say: Callable[[str], None]) -> tuple[StreamDataset, Optional[list[np.ndarray]]]:
    """(train, valid) for data.stream: the training stream (its loader processes not started
    yet) and the validation samples (None without data.stream_valid or stream_valid_docs)."""
    d, t = cfg.data, cfg.train
    setup = _setup(cfg)
    workers = d.loader_workers
    if workers < 0:
        workers = default_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    setup.tokenizer()  # refuse a missing tokenizer here, not in the loader processes
    train = StreamDataset(setup, (t.iters + 1) * t.global_batch_size, workers, say=say)
    valid = None
    if t.eval_interval and (d.stream_valid or d.stream_valid_docs):
        valid = validation_samples(setup, d.stream_valid, max(1, t.eval_iters) * t.global_batch_size)
    return train, valid


def check_stream_sources(cfg: Config) -> None:
    """--validate-only's check of data.stream (nothing when the run does not stream)."""
    if cfg.data.stream:
        _setup(cfg).tokenizer()
