"""Documents packed into one sample, kept apart (Megatron's --reset-position-ids and
--reset-attention-mask; data.reset_position_ids, data.reset_attention_mask).

A packed sample holds the end of one document, whole documents and the start of another, each
ended by the end-of-document token. By default positions and attention run across those
boundaries (Megatron's default too). With the resets, as Megatron's get_ltor_masks_and_position_ids
does: a document is its tokens up to and including its end-of-document token; the positions
restart at 0 on the token after it, and a token attends only to the earlier tokens of its own
document. Both follow from the micro-batch's tokens alone, so every pipeline stage computes them
from the tokens it is handed (not from the hidden states it receives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class DocumentResets:
    """Which resets apply, and the end-of-document id that marks the boundaries."""

    eod: int
    positions: bool
    attention: bool

    def layout(self, tokens: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(position ids [b, s], or None without data.reset_position_ids; the attention mask
        [b, 1, s, s], True where query i may attend key j, or None without
        data.reset_attention_mask) of a micro-batch's tokens [b, s]."""
        s = tokens.shape[1]
        index = torch.arange(s, device=tokens.device)
        starts = torch.zeros_like(tokens, dtype=torch.long)  # 1 where a document starts after an end-of-document
        starts[:, 1:] = (tokens[:, :-1] == self.eod).long()
        positions = mask = None
        if self.positions:
            first = torch.where(starts.bool(), index, 0).cummax(dim=1).values  # where each token's document starts
            positions = index - first
        if self.attention:
            doc = starts.cumsum(dim=1)
            same = doc.unsqueeze(2) == doc.unsqueeze(1)
            mask = (same & (index.view(1, s, 1) >= index.view(1, 1, s))).unsqueeze(1)
        return positions, mask
