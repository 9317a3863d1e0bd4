"""The global gradient norm over TP, PP and DP, each element counted once, and the
inf/NaN check that decides whether a step is taken anywhere."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from megazero.parallel import comm


def grad_norm_and_overflow(pieces: Iterable[tuple[torch.Tensor, bool]], loss: Optional[torch.Tensor],
                           world: comm.Group, device: torch.device) -> tuple[float, bool]:
    """(L2 norm of the `counted` gradient pieces over the whole world, whether any rank saw
    inf/NaN in any piece or in its `loss` share).

    One all-reduce of two float64 sums: [counted sum of squares, the rest]. The second
    holds what must not enter the norm but must still be checked for overflow: TP-replicated
    copies, the tied head, a non-finite loss (as inf). `pieces` are (gradient, counted)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for grad, counted in pieces:
        sums[0 if counted else 1] += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
    if loss is not None:
        sums[1] += torch.where(torch.isfinite(loss.detach()), 0.0, float("inf")).double().to(device)
    comm.all_reduce(sums, world)
    return float(sums[0].sqrt()), not bool(torch.isfinite(sums).all())


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What the gradients are multiplied by so that their global norm is at most `max_norm`
    (0 disables clipping)."""
    if max_norm > 0 and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return 1.0
