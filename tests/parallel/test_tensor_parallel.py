"""Tensor-parallel layers and the full model against their non-parallel twins (tp = 2, 4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import make_grid, run_distributed
from megazero.config import ModelConfig
from megazero.model.cross_entropy import vocab_parallel_cross_entropy
from megazero.model.gpt import GPT
from megazero.model.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megazero.parallel.comm import gather_from_tp
from megazero.parallel.placement import Placement, placement
from megazero.train.parallelize import apply_tensor_parallel


def _copy(full: torch.nn.Module, layer: torch.nn.Module, tp) -> torch.nn.Module:
    """`layer` holding `full`'s values, then split over `tp` (each rank keeps its shard)."""
    layer.load_state_dict(full.state_dict())
    layer.apply_tp(tp)
    return layer


def _check_layers(tp: int) -> bool:
    grid = make_grid(tp)
    g = grid.tp_group
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    # Column-parallel then row-parallel: the TP MLP pattern.
    col_full, row_full = ColumnParallelLinear(8, 24), RowParallelLinear(24, 8)
    for p in list(col_full.parameters()) + list(row_full.parameters()):
        torch.nn.init.normal_(p)
    col, row = _copy(col_full, ColumnParallelLinear(8, 24), g), _copy(row_full, RowParallelLinear(24, 8), g)
    x2 = x.detach().clone().requires_grad_()
    ref = row_full(torch.tanh(col_full(x)))
    out = row(torch.tanh(col(x2)))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    ref.pow(2).sum().backward()
    out.pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-5)
    for mine, full in [(col.weight, col_full.weight), (col.bias, col_full.bias),
                       (row.weight, row_full.weight), (row.bias, row_full.bias)]:
        torch.testing.assert_close(mine.grad, placement(mine).shard(full.grad, g.rank, g.size),
                                   rtol=1e-4, atol=1e-5)

    # Vocab-parallel embedding and cross-entropy (vocab 300 padded to 512; padding masked).
    emb_full = VocabParallelEmbedding(512, 8)
    torch.nn.init.normal_(emb_full.weight)
    emb = _copy(emb_full, VocabParallelEmbedding(512, 8), g)
    ids = torch.randint(0, 300, (2, 5))
    torch.testing.assert_close(emb(ids), emb_full(ids))
    logits_full = torch.randn(2, 5, 512, requires_grad=True)
    vocab_split = Placement(tuple(logits_full.shape), dim=2)
    logits = vocab_split.shard(logits_full.detach(), g.rank, g.size).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, ids, g, 300)
    ref_loss = F.cross_entropy(logits_full[..., :300].reshape(-1, 300), ids.reshape(-1), reduction="none").view(2, 5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    (loss * torch.arange(10.).view(2, 5)).sum().backward()
    (ref_loss * torch.arange(10.).view(2, 5)).sum().backward()
    torch.testing.assert_close(logits.grad, vocab_split.shard(logits_full.grad, g.rank, g.size), rtol=1e-5, atol=1e-6)
    return True


def _check_model(tp: int) -> dict:
    grid = make_grid(tp)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=300)
    ref, model = GPT(cfg), apply_tensor_parallel(GPT(cfg), grid.tp_group)
    ref.init_weights(7)
    model.init_weights(7)
    assert ref.padded_vocab == 384 and model.padded_vocab == 128 * tp * ((300 + 128 * tp - 1) // (128 * tp))
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        # same full weights at every TP degree (vocab padding rows aside)
        if name == "transformer.wte.weight":
            torch.testing.assert_close(gather_from_tp(q.detach().T, grid.tp_group).T[:300], p[:300], rtol=0, atol=0)
        else:
            torch.testing.assert_close(q, placement(q).shard(p, grid.tp_rank, tp), rtol=0, atol=0)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    ref_logits, logits = ref(tokens), model(tokens)
    torch.testing.assert_close(gather_from_tp(logits, grid.tp_group)[..., :300], ref_logits[..., :300],
                               rtol=1e-5, atol=1e-5)
    ref_loss, loss = ref.loss(ref_logits, labels).mean(), model.loss(logits, labels).mean()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    ref_loss.backward()
    loss.backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        want = placement(q).shard(p.grad, grid.tp_rank, tp)
        if name == "transformer.wte.weight":
            want = placement(q).shard(torch.cat([p.grad[:300], p.grad.new_zeros(model.padded_vocab - 300, 32)]),
                                      grid.tp_rank, tp)
        torch.testing.assert_close(q.grad, want, rtol=1e-4, atol=1e-6, msg=name)
    return {"loss": float(loss)}


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_match_single_process(tp):
    assert all(run_distributed(_check_layers, tp, tp))


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])  # tp 4 by default: the layers' test
def test_tp_model_matches_single_process(tp):
    out = run_distributed(_check_model, tp, tp)
    assert len({o["loss"] for o in out}) == 1  # every TP rank sees the same loss


def test_shard_roundtrip_with_stride():
    full = torch.arange(24.).view(12, 2)
    where = Placement((12, 2), dim=0, stride=3)
    shards = [where.shard(full, r, 2) for r in range(2)]
    assert shards[0][:2].tolist() == [[0, 1], [2, 3]] and shards[0][2:4].tolist() == [[8, 9], [10, 11]]
    assert where.ranges(0, 2) == [(0, 2), (4, 6), (8, 10)]  # the rows shard() keeps, for readers of files
    torch.testing.assert_close(where.unshard(shards), full)


def test_tied_embedding_rows_join_the_head_gradient_in_place():
    """With the embedding's gradient as rows (sparse_grad, under ZeRO), a tied weight's gradient
    is the head's dense one with the rows added into it, not a second V x h sum: the same
    values as F.embedding's sparse rows summed by autograd, in the head gradient's memory.
    Should the embedding's backward come first (the head's use made before it), the rows
    travel as F.embedding's and the values are the same."""
    from megazero.model.layers import TiedRows, VocabParallelEmbedding
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(1000, 64)
    torch.nn.init.normal_(emb.weight)
    emb.sparse_grad = True
    ids = torch.randint(0, 1000, (2, 16))
    seen: dict[str, int] = {}

    def tap(grad: torch.Tensor) -> torch.Tensor:
        seen["head"] = grad.data_ptr()
        return grad

    def grad_of(tied, head_first: bool = False) -> torch.Tensor:
        emb.weight.grad = None
        weight = tied.head(emb.weight) if head_first else None
        rows = emb(ids, tied)
        if weight is None:  # as the model does: the head after the embedding
            weight = emb.weight if tied is None else tied.head(emb.weight)
        if tied is not None:
            weight.register_hook(tap)
        (F.linear(rows, weight) ** 2).sum().backward()
        return emb.weight.grad
    plain = grad_of(None).clone()
    joined = grad_of(TiedRows())
    assert torch.equal(plain, joined)
    assert joined.data_ptr() == seen["head"] and joined.layout == torch.strided
    assert torch.equal(plain, grad_of(TiedRows(), head_first=True))
