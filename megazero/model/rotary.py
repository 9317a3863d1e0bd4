"""Rotary position embeddings (RoPE, Su et al. 2021) as the Llama family uses them.

Each query and key head of width d is rotated by its token's position p: the pairs
(x[i], x[i + d/2]) turn by the angle p * theta_i with theta_i = base^(-2i/d) (the
"rotate half" pairing of Hugging Face's Llama and Megatron's default, not the interleaved
one). Attention scores then depend on positions only through their difference.

The position is the token's place in the whole sequence, whatever the layout: under context
parallelism a rank holds its zig-zag chunks (parallel/context.py) and rotates each token by
its global position; under sequence parallelism attention runs on the gathered sequence;
while generating, each row's positions start after its left padding. So the caller passes
positions, never a range it assumes.

Llama 3.1 scaling (`model.rope_scaling` llama3) stretches the low frequencies by `factor`,
keeps the high ones, and blends the band between, by Meta's published rule. Angles are
computed in fp32 (as Hugging Face does, with autocast off), cos and sin then cast to the
activations' dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Llama3Scaling(NamedTuple):
    """Hugging Face's rope_scaling entries of rope_type llama3."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


def inverse_frequencies(head_dim: int, base: float, scaling: Llama3Scaling | None = None) -> torch.Tensor:
    """theta_i = base^(-2i/d) for i < d/2 (fp32, on the CPU), with Llama 3.1's scaling when given."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dimension, not {head_dim}")
    # On the CPU even while the model is built on the meta device: these are values, not parameters.
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    return inv if scaling is None else _llama3(inv, scaling)


def _llama3(inv: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    """Wavelengths longer than original / low_freq_factor are stretched by `factor`, those
    shorter than original / high_freq_factor kept, and the band between interpolated by how
    many of its wavelengths fit in the original context."""
    wavelen = 2 * math.pi / inv
    long_wave = s.original_max_position / s.low_freq_factor
    short_wave = s.original_max_position / s.high_freq_factor
    stretched = torch.where(wavelen > long_wave, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * stretched / s.factor + smooth * stretched
    between = (wavelen >= short_wave) & (wavelen <= long_wave)
    return torch.where(between, blended, stretched)


def rotary_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (fp32) of every position's angles, [..., s, d] for positions [..., s] ([s],
    or [b, s] when rows start at different places), laid out for rotate-half."""
    with torch.autocast(positions.device.type, enabled=False):
        angles = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)  # [..., s, d/2]
        both = torch.cat([angles, angles], dim=-1)
        return both.cos(), both.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Heads x [b, heads, s, d] rotated by their positions' tables ([s, d] or [b, s, d]), in
    x's dtype (the tables cast to it, as Hugging Face does)."""
    if cos.dim() == 3:  # per-row positions: broadcast over the heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin
