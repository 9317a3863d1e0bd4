"""The mixture: which source the next sample comes from.

Weights count tokens, and every sample is seq_length tokens, so a weighted round robin over
samples is one over tokens: sample n + 1 comes from the source furthest behind its share,
argmax_k (w_k * (n + 1) - taken_k), ties to the lower k. Every prefix of the sequence is
within one sample of its weights (so within 1% after 100 samples per source), and it depends
on nothing but the weights: its whole state is the number taken from each source. No random
draw is needed, so none is saved.
"""

from __future__ import annotations

from typing import Sequence


def next_source(weights: Sequence[float], taken: Sequence[int]) -> int:
    """The source of the next sample, after `taken[k]` samples of each source k."""
    n = sum(taken) + 1
    best, lag = 0, float("-inf")
    for k, (w, t) in enumerate(zip(weights, taken)):
        behind = w * n - t
        if behind > lag + 1e-12:  # a strict margin: rounding never breaks a tie differently
            best, lag = k, behind
    return best
