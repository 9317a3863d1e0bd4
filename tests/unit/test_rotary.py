"""Rotary position embeddings against Hugging Face's Llama (plain and Llama 3.1 scaling)."""

import pytest
import torch

from megazero.model.rotary import Llama3Scaling, apply_rotary, inverse_frequencies, rotary_tables

transformers = pytest.importorskip("transformers")


def _hf_rotated(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scaling: dict | None):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=4096, rope_theta=500000.0,
                      rope_scaling=scaling)
    rope = LlamaRotaryEmbedding(cfg)
    cos, sin = rope(q, positions)
    return apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("scaled", [False, True])
def test_rotary_equals_hugging_face_llama(scaled: bool):
    """Same angles, same rotate-half pairing: q and k rotated equal within 1e-6 (fp32), for
    per-row positions that start at different places (left-padded generation)."""
    scaling = Llama3Scaling(8.0, 1.0, 4.0, 256) if scaled else None
    hf_scaling = ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 256} if scaled else None)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 40, 32, generator=g) for _ in range(2))
    positions = torch.stack([torch.arange(40) + 3000, torch.arange(40)])
    inv = inverse_frequencies(32, 500000.0, scaling)
    cos, sin = rotary_tables(inv, positions)
    want_q, want_k = _hf_rotated(q, k, positions, hf_scaling)
    torch.testing.assert_close(apply_rotary(q, cos, sin), want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin), want_k, rtol=1e-6, atol=1e-6)
    if scaled:  # the scaling changes the low frequencies only
        plain = inverse_frequencies(32, 500000.0)
        assert torch.equal(inv[:2], plain[:2]) and not torch.allclose(inv[-2:], plain[-2:])


def test_rotary_scores_depend_on_position_differences_only():
    """q . k after rotation is the same for positions (p, p') and (p + t, p' + t)."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64) for _ in range(2))
    inv = inverse_frequencies(16, 10000.0).double()

    def score(pq: int, pk: int) -> float:
        cq, sq = (t.double() for t in rotary_tables(inv, torch.tensor([pq])))
        ck, sk = (t.double() for t in rotary_tables(inv, torch.tensor([pk])))
        return float((apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum())

    assert score(7, 3) == pytest.approx(score(107, 103), abs=1e-9)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)
