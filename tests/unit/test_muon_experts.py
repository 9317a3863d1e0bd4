"""Muon on an MoE layer's expert weights: a 3-D [E, out, in] weight is orthogonalised expert by
expert (gate and up apart, as a dense SwiGLU c_fc), each matrix with the LR factor of its own
shape: the same updates as the dense path gives E separate 2-D matrices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megazero.parallel.comm import solo_group
from megazero.parallel.placement import Placement, place
from megazero.zero.muon import MuonExchange, is_muon_matrix, lr_factor, orthogonalize, split_matrices
from megazero.zero.partition import build_layout

E, ROWS, COLS, STEPS = 3, 12, 8, 5  # gate | up of 6 rows each, 8 inputs


def _exchange_updates(named: list[tuple[str, nn.Parameter]], grads: list[torch.Tensor], rule: str) -> list[torch.Tensor]:
    """What MuonExchange makes of each parameter's update U in one process: lr_factor x O."""
    layout = build_layout([(0, named)], {"dp_cp": (1, 0), "expert_dp": (1, 0)})
    flat = torch.zeros(layout.shard_numel)
    for (_, s), g in zip(layout.slots(), grads, strict=True):
        flat[s.offset: s.offset + s.numel] = g.reshape(-1)
    exchange = MuonExchange(layout, frozenset(n for n, _ in named), solo_group(), 0, 1, True, torch.device("cpu"),
                            STEPS, rule, torch.float32)
    exchange.step(lambda r: flat[r.shard_offset: r.shard_offset + r.length])
    return [flat[s.offset: s.offset + s.numel].view(s.shape) for _, s in layout.slots()]


def _param(shape: tuple[int, ...], where: Placement) -> nn.Parameter:
    return place(nn.Parameter(torch.empty(shape)), where)


@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
def test_expert_weight_equals_each_expert_matrix_on_its_own(rule):
    torch.manual_seed(0)
    u = torch.randn(E, ROWS, COLS)
    down = torch.randn(E, COLS, ROWS // 2)
    experts = [("transformer.h.0.mlp.experts.c_fc.weight", _param(u.shape, Placement(tuple(u.shape), stride=2,
                                                                                     experts=E))),
               ("transformer.h.0.mlp.experts.c_proj.weight", _param(down.shape, Placement(tuple(down.shape),
                                                                                          experts=E)))]
    assert all(is_muon_matrix(n) for n, _ in experts)
    got_fc, got_proj = _exchange_updates(experts, [u, down], rule)
    # The dense path on E separate 2-D parameters of each expert's shape (fused gate | up as a dense c_fc).
    dense = [(f"transformer.h.{j}.mlp.c_fc.weight", _param((ROWS, COLS), Placement((ROWS, COLS), 0, 2)))
             for j in range(E)] + [(f"transformer.h.{j}.mlp.c_proj.weight", _param((COLS, ROWS // 2),
                                                                                  Placement((COLS, ROWS // 2), 1)))
                                   for j in range(E)]
    want = _exchange_updates(dense, [*u.unbind(), *down.unbind()], rule)
    torch.testing.assert_close(got_fc, torch.stack(want[:E]), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_proj, torch.stack(want[E:]), rtol=0, atol=1e-6)
    # and by hand: each expert's gate, up and down orthogonalised alone, times its own shape's factor
    half = ROWS // 2
    for j in range(E):
        for block in (slice(0, half), slice(half, ROWS)):
            expected = orthogonalize(u[j, block], STEPS) * lr_factor((half, COLS), rule)
            torch.testing.assert_close(got_fc[j, block], expected, rtol=0, atol=1e-5)  # batched vs alone: rounding
        expected = orthogonalize(down[j], STEPS) * lr_factor((COLS, half), rule)
        torch.testing.assert_close(got_proj[j], expected, rtol=0, atol=1e-5)


def test_expert_matrices_are_each_experts_blocks():
    where = Placement((E, ROWS, COLS), stride=2, experts=E)
    matrices = split_matrices("transformer.h.1.mlp.experts.c_fc.weight", where, (E, ROWS, COLS), 0, 1)
    assert [m.shape for m in matrices] == [(ROWS // 2, COLS)] * (2 * E)
    runs = [(start, end) for m in matrices for start, end, _, _ in m.pieces]
    assert runs == [(i * ROWS // 2 * COLS, (i + 1) * ROWS // 2 * COLS) for i in range(2 * E)]  # tiling the weight
    assert not is_muon_matrix("transformer.h.1.mlp.router.weight")  # the router stays AdamW's
    assert not is_muon_matrix("transformer.h.1.mlp.shared_expert_gate.weight")
    assert is_muon_matrix("transformer.h.1.mlp.shared_expert.c_fc.weight")
    # gate | up is Muon's business only: the checkpoints' partition maps record the stride of a split tensor alone
    assert where.record()["tp_stride"] == 1 and Placement((ROWS, COLS), 0, 2).record()["tp_stride"] == 2

    # ep 2 over 2 experts, rank 1: every expert's matrices are listed (the same list on every rank),
    # only its own expert's hold runs
    two = Placement((2, ROWS, COLS), stride=2, experts=2)
    mine = split_matrices("x.mlp.experts.c_fc.weight", two, (1, ROWS, COLS), 0, 1, ep=(1, 2))
    assert [bool(m.pieces) for m in mine] == [False, False, True, True]
    assert [(s, e) for m in mine for s, e, _, _ in m.pieces] == [(0, ROWS // 2 * COLS), (ROWS // 2 * COLS, ROWS * COLS)]
    # etp 2: each expert's gate and up rows split as a dense gate | up is, each rank holding half of each block
    split = Placement((E, ROWS, COLS), 1, 2, experts=E)
    halves = split_matrices("x.mlp.experts.c_fc.weight", split, (E, ROWS // 2, COLS), 1, 2)
    assert [m.shape for m in halves] == [(ROWS // 2, COLS)] * (2 * E)
    quarter = ROWS // 4 * COLS
    assert [m.pieces for m in halves[:2]] == [[(0, quarter, ROWS // 4, ROWS // 4)],
                                              [(quarter, 2 * quarter, ROWS // 4, ROWS // 4)]]
    down = Placement((E, COLS, ROWS), 2, experts=E)  # c_proj: columns split
    cols = split_matrices("x.mlp.experts.c_proj.weight", down, (E, COLS, ROWS // 2), 0, 2)
    assert [m.shape for m in cols] == [(COLS, ROWS)] * E and cols[1].pieces == [(COLS * ROWS // 2, COLS * ROWS, 0,
                                                                                  ROWS // 2)]



@pytest.mark.parametrize("extra", [[], ["--model.moe_layer_freq", "[1,0,1,0]",
                                        "--model.moe_shared_expert_ffn_hidden_size", "32"]], ids=["mixtral", "mixed"])
def test_start_up_line_counts_each_experts_matrices(extra):
    """The optim line's count: a fused q|k|v or gate|up once, an expert weight once per expert."""
    from helpers import make_config
    from megazero.model.gpt import GPT
    from megazero.train.summary import muon_matrices, optim_line
    cfg = make_config(["--optim.name", "muon", *extra], base="configs/mixtral-tiny.yaml", world=1)
    with torch.device("meta"):
        named = GPT(cfg.model, None).named_parameters()
        matrices = sum(p.shape[0] if p.dim() == 3 else 1 for name, p in named if is_muon_matrix(name))
    assert muon_matrices(cfg.model) == matrices
    assert f"muon 0.02 on {matrices} matrices" in optim_line(cfg)
