"""Forward/backward schedules over the micro-batches of one iteration.

Every schedule returns this rank's share of the iteration loss: the sum over its
micro-batches of (token-loss sum / global token count), so the DP sum of the returned
values is the global mean loss and the gradients need no further rescaling (the loss is
normalised once, globally). Ranks that do not compute the loss return None.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megazero.model.gpt import GPT

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [b, s], labels [b, s])


def forward_backward_no_pipelining(chunk: GPT, microbatches: Sequence[Microbatch], num_tokens: int,
                                   optimizer=None, forward_only: bool = False) -> Optional[torch.Tensor]:
    """pp = 1: a plain loop of forward + backward per micro-batch (gradients accumulate)."""
    total = torch.zeros((), dtype=torch.float64)
    for tokens, labels in microbatches:
        with torch.set_grad_enabled(not forward_only):
            loss = chunk.loss(chunk(tokens), labels).sum() / num_tokens
        if not forward_only:
            optimizer.scale_loss(loss).backward()
        total += loss.detach().double()
    return total
