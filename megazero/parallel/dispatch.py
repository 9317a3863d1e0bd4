"""How routed tokens reach their experts and come back: the token dispatchers.

The MoE layer (model/moe.py) sorts its (token, expert) pairs by expert and hands them to a
dispatcher with the number of pairs per expert. The dispatcher returns the pairs that this
rank's experts compute, grouped by local expert, with their counts; `combine` takes the
experts' outputs back in that order and returns them in the order `dispatch` was given. The
model never knows how the tokens travelled.

- `LocalDispatch`: every expert is on this rank (expert parallelism 1): nothing moves.

Every rank of a group issues the same collectives in the same order, whatever the routing:
a dispatcher's calls depend only on the layer's shape, never on how many tokens an expert got.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TokenDispatcher(Protocol):
    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [N, h] sorted by global expert, counts [E] (int64, on the host's side of the
        split: their sum is N) -> this rank's experts' tokens [M, h] grouped by local expert,
        and their counts [E_local]."""
        ...

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        """The experts' outputs [M, h] in `dispatch`'s returned order -> [N, h] in its input order."""
        ...


class LocalDispatch:
    """All experts live here: dispatch and combine are identities."""

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tokens, counts

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs
