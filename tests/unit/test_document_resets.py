"""Megatron's --reset-position-ids and --reset-attention-mask: positions restart after each
end-of-document token and attention stays within each document, so a packed sample's logits are
those of its documents each run alone (GPT-2's learned positions; Llama's rotary ones)."""

from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.model.documents import DocumentResets
from megazero.model.gpt import GPT

EOD = 7
CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=24, vocab_size=64, dropout=0.0)
LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=24, vocab_size=64, dropout=0.0,
                    normalization="rmsnorm", position_embedding="rope", activation="swiglu", bias=False,
                    num_query_groups=2, tie_embeddings=False)


def _megatron_layout(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's get_ltor_masks_and_position_ids with both resets, as its loop writes it
    (mask True where attention is allowed, the opposite of Megatron's)."""
    b, s = tokens.shape
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).repeat(b, 1, 1)
    positions = torch.arange(s).repeat(b, 1)
    for row in range(b):
        prev = 0
        for i in (tokens[row] == EOD).nonzero().flatten().tolist():
            mask[row, i + 1:, :i + 1] = False
            positions[row, i + 1:] -= i + 1 - prev
            prev = i + 1
    return positions, mask.unsqueeze(1)


def _packed(seed: int) -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """Two rows of documents (ending in EOD, the last cut off) and each row's (start, end) spans."""
    g = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for lengths in ([5, 1, 9, 4, 10], [24], [1, 1, 22]):
        row, at, mine = [], 0, []
        for n in lengths:
            doc = torch.randint(8, 64, (n,), generator=g).tolist()
            doc[-1] = EOD
            row += doc
            mine.append((at, min(at + n, 24)))
            at += n
        rows.append(row[:24])
        spans.append([(a, b) for a, b in mine if a < 24])
    return torch.tensor(rows), spans


def _model(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    model.init_weights(seed=3)
    return model.eval()


def test_layout_is_megatrons():
    tokens, _ = _packed(0)
    tokens[1, 0] = EOD  # a row that starts with an end of document
    positions, mask = DocumentResets(EOD, True, True).layout(tokens)
    expected_positions, expected_mask = _megatron_layout(tokens)
    assert torch.equal(positions, expected_positions) and torch.equal(mask, expected_mask)
    assert DocumentResets(EOD, True, False).layout(tokens)[1] is None
    assert DocumentResets(EOD, False, True).layout(tokens)[0] is None


@pytest.mark.parametrize("cfg, positions", [(CFG, True), (LLAMA, True), (LLAMA, False)],
                         ids=["gpt2-both", "llama-both", "llama-mask-only"])
def test_packed_logits_are_each_documents_alone(cfg, positions):
    """Rotary attention sees relative positions only: with it the mask alone keeps documents apart."""
    model = _model(cfg)
    tokens, spans = _packed(1)
    with torch.no_grad():
        plain = model(tokens)
        model.document_resets = DocumentResets(EOD, positions, True)
        packed = model(tokens, tokens=tokens)
        for row, row_spans in enumerate(spans):
            for a, b in row_spans:
                alone = model(tokens[row:row + 1, a:b])  # no `tokens`: one document, nothing to reset
                torch.testing.assert_close(packed[row, a:b], alone[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[0, 5:], packed[0, 5:], atol=1e-3)  # the resets changed the second document on


def test_without_the_tokens_nothing_changes():
    """Generation and callers without the micro-batch's tokens: the model as before, bit for bit."""
    model = _model(CFG)
    tokens, _ = _packed(2)
    with torch.no_grad():
        plain = model(tokens)
        model.document_resets = DocumentResets(EOD, True, True)
        assert torch.equal(model(tokens), plain)
