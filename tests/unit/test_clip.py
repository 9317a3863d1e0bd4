"""The global gradient norm's sum of squares (zero/clip.py): fp32 row norms summed in float64."""

import math

import torch

from megazero.zero.clip import NORM_ROW, row_norms


def _square_sum(t: torch.Tensor) -> float:
    return float(torch.cat(row_norms(t)).double().square().sum())


def test_row_norms_match_a_float64_sum_of_squares():
    """Rows of a size that does not divide the length, values over many magnitudes: within
    1e-7 relative of the float64 reference."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3 * 1_000_003, generator=g) * torch.rand(3 * 1_000_003, generator=g) ** 4 * 1e3
    assert t.numel() % NORM_ROW
    exact = float(t.double().square().sum())
    assert abs(_square_sum(t) - exact) <= 1e-7 * exact
    short = t[:NORM_ROW - 1]  # only the shorter last row
    assert math.isclose(_square_sum(short), float(short.double().square().sum()), rel_tol=1e-6)
    assert row_norms(torch.zeros(0)) == []


def test_non_finite_values_and_fp32_overflow_read_as_overflow():
    for bad in (float("nan"), float("inf"), 3e19):  # 3e19 squared is beyond fp32's range
        t = torch.ones(1000)
        t[517] = bad
        assert not math.isfinite(_square_sum(t))
