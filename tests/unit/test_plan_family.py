"""The planner's formulas for the Llama family (issue 34, requirement 7): parameters per rank
against a hand count and against the built model, FLOPs against torch's FLOP counter on a real
forward and backward, and the trainer's MFU on those FLOPs. GPT-2's own numbers are pinned in
tests/e2e/test_plan.py (measured states, bytes and activations, Llama layouts among them)."""

from __future__ import annotations

import pytest

from helpers import run_distributed
from megazero.config import build_config
from megazero.model.layers import padded_vocab_size
from megazero.plan import formulas as F

LLAMA = {"normalization": "rmsnorm", "position_embedding": "rope", "activation": "swiglu", "num_query_groups": 2,
         "ffn_hidden_size": 96, "bias": False, "tie_embeddings": False}
SHAPES = {"gpt2": {}, "llama": LLAMA, "llama-tied": {**LLAMA, "tie_embeddings": True},
          "gqa-bias-gelu": {"num_query_groups": 2, "ffn_hidden_size": 96},
          "swiglu-bias-mha": {"activation": "swiglu", "position_embedding": "rope", "tie_embeddings": False},
          "multi-query-rmsnorm": {"num_query_groups": 1, "normalization": "rmsnorm", "bias": False},
          "qwen3": {**LLAMA, "qk_layernorm": True, "kv_channels": 24}, "qwen2": {**LLAMA, "qkv_bias": True}}


def model_config(extra: dict, layers: int = 4):
    return build_config({"model": {"num_layers": layers, "hidden_size": 64, "num_heads": 4, "seq_length": 32,
                                   "vocab_size": 200, **extra}, "data": {"mock": True}})


def hand_count(m, tp: int, layers: int, pre: bool, post: bool) -> int:
    """One rank's parameters, written out matrix by matrix: column-parallel weights and
    biases split over tp, row-parallel weights split, their biases and the norms whole (QK-norm's too)."""
    h, f, kv, gates = m.hidden_size, m.ffn_size, m.query_groups * m.head_dim, 2 if m.activation == "swiglu" else 1
    q = m.num_heads * m.head_dim
    vocab = padded_vocab_size(m.vocab_size, tp)
    norm = h if m.normalization == "rmsnorm" else 2 * h
    attention = (q + 2 * kv) * h // tp + q * h // tp + ((q + 2 * kv) // tp if m.bias or m.qkv_bias else 0)
    attention += (h if m.bias else 0) + (2 * m.head_dim if m.qk_layernorm else 0)
    mlp = gates * f * h // tp + f * h // tp + ((gates * f // tp + h) if m.bias else 0)
    total = layers * (attention + mlp + 2 * norm)
    if pre:
        total += vocab // tp * h + (m.seq_length * h if m.position_embedding == "learned" else 0)
    if post:
        total += norm + (vocab // tp * h if not m.tie_embeddings or not pre else 0)
    return total


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_planner_parameters_per_rank_equal_a_hand_count(shape, tp, pp):
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    cfg = model_config(SHAPES[shape])
    pred = predict(cfg, ParallelLayout(tp, pp, 1), Cluster(tp * pp, 8, 80.0, None), ranks=list(range(pp)))
    per_stage = cfg.model.num_layers // pp
    for r in range(pp):
        assert pred.rank(r).params == hand_count(cfg.model, tp, per_stage, r == 0, r == pp - 1), (shape, tp, pp, r)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_planner_parameters_equal_the_built_model(shape):
    """The planner's stages, summed, hold what the built model (materialized, one process)
    holds, plus the last stage's copy of a tied embedding; model_parameters counts it."""
    from megazero.model.gpt import GPT
    from megazero.plan.planner import Cluster, ParallelLayout, predict
    cfg = model_config(SHAPES[shape])
    m = cfg.model
    built = sum(p.numel() for p in GPT(m).parameters())
    assert built == F.model_parameters(m, padded_vocab_size(m.vocab_size, 1))
    for pp in (1, 2, 4):
        pred = predict(cfg, ParallelLayout(1, pp, 1), Cluster(pp, 8, 80.0, None), ranks=list(range(pp)))
        copy = padded_vocab_size(m.vocab_size, 1) * m.hidden_size if m.tie_embeddings and pp > 1 else 0
        assert sum(r.params for r in pred.ranks) == built + copy, (shape, pp)


def counted_flops_per_token(m) -> float:
    """torch's FLOP counter over one forward and backward of the whole model (the math
    attention kernel, whose matmuls it counts), per token."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megazero.model.gpt import GPT
    model = GPT(m)
    model.init_weights(0)
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model.loss(model(tokens), tokens).sum().backward()
    return counter.get_total_flops() / tokens.numel()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_model_flops_equal_counted_flops(shape):
    """6 x matmul parameters (SwiGLU's three matrices, grouped K/V, the head) + 12 L q s equal
    the FLOPs torch counts (a vocabulary of whole 128-rows, so the head has no padding)."""
    m = model_config({**SHAPES[shape], "vocab_size": 256}).model
    assert F.model_flops_per_token(m) == counted_flops_per_token(m)
    h, L, s, f, kv = m.hidden_size, m.num_layers, m.seq_length, m.ffn_size, m.query_groups * m.head_dim
    q, mlp = m.num_heads * m.head_dim, (3 if m.activation == "swiglu" else 2) * h * f  # q: h unless kv_channels
    assert F.model_flops_per_token(m) == 6 * (L * (2 * h * q + 2 * h * kv + mlp) + 256 * h) + 12 * L * q * s


def test_gpt2_formulas_unchanged():
    """GPT-2 124M: 4 h^2 + 2 h f per block, the published 124M parameters (tied, learned positions)."""
    from helpers import REPO
    from megazero.config.parse import load_yaml
    m = build_config(load_yaml(str(REPO / "configs/gpt2-124m.yaml"))).model
    h, f, L = 768, 3072, 12
    assert F.matmul_parameters(m) == L * (4 * h * h + 2 * h * f) + 50257 * h
    assert F.model_flops_per_token(m) == 6 * F.matmul_parameters(m) + 12 * L * h * 1024
    assert F.executed_flops_per_token(m, "full") == F.model_flops_per_token(m) + 2 * L * (4 * h * h + 2 * h * f) \
        + 4 * L * h * 1024
    assert F.model_parameters(m) == 124_439_808


def _trainer_flops(extra: list[str]) -> tuple:
    from helpers import make_trainer
    tr = make_trainer(extra)
    return tr.flops_per_token, tr.cfg.model


def test_logged_mfu_uses_the_family_flops():
    """The trainer's TFLOP/s (and so the logged MFU) multiplies tokens/s by these FLOPs."""
    args = [f"--model.{k}={v}" for k, v in {**LLAMA, "vocab_size": 256}.items()]
    logged, m = run_distributed(_trainer_flops, 1, args)[0]
    assert m.activation == "swiglu" and m.query_groups == 2 and not m.tie_embeddings
    assert logged == F.model_flops_per_token(m) == counted_flops_per_token(m)
