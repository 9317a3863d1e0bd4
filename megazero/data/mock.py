"""A synthetic, learnable dataset for tests and smoke runs: no files, no tokenizer."""

from __future__ import annotations

import numpy as np

# Small steps keep the task easy: after two tokens the rest of a sample is determined, and a
# tiny model learns "next = current + step" quickly, so the loss visibly falls.
MAX_STEP = 8


class MockGPTDataset:
    """Sample i is an arithmetic progression modulo vocab_size, seq_length + 1 tokens long.

    Its start and step come from a generator seeded by (seed, i), so a sample is a pure
    function of (seed, i): every rank and every parallel layout sees the same data.
    """

    loss_masked = False  # every label counts

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size ({vocab_size}) must be at least 2")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, i])
        start = rng.integers(self.vocab_size)
        step = rng.integers(1, min(MAX_STEP, self.vocab_size - 1) + 1)
        return (start + step * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size

    def provenance(self, i: int) -> tuple[str, list[int]]:
        """Sample i's dataset ("mock") and documents: none, a mock sample is made, not cut from one."""
        return "mock", []
