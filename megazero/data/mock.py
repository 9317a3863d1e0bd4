"""A deterministic synthetic token stream for tests and benchmarks (data.mock: true).

Sample i is an arithmetic progression modulo the vocabulary with a start and step drawn
from a generator seeded by (seed, i): a pure function of (seed, i), so every layout sees
the same global batch, and learnable in context, so the loss visibly falls.
"""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        start, step = rng.integers(0, self.vocab_size), rng.integers(1, 8)
        return (start + step * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
