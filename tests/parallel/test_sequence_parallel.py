"""Sequence parallelism (parallel.sequence_parallel): its collectives against the plain TP
path, per-rank dropout, and training that reproduces the single-process fp32 run at tp 2
and 4, with pipelining, recomputation and sharded ZeRO stages."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from helpers import assert_parity, logged_by_layout, make_grid, make_trainer, run_distributed

ITERS = 4


# ----------------------------------------------------------------------------- collectives


def _shard(x: torch.Tensor, g) -> torch.Tensor:
    return x.chunk(g.size, dim=1)[g.rank]


def _check_collectives(tp: int) -> bool:
    """Each SP f/g pair against the replicated path it replaces: same values on this rank's
    positions, forward and backward (upstream gradients differ per rank, as partial
    gradients do)."""
    from megazero.parallel.comm import (
        copy_to_tp,
        gather_from_sequence,
        reduce_from_tp,
        reduce_scatter_to_sequence,
    )
    g = make_grid(tp).tp_group
    torch.manual_seed(0)
    x = torch.randn(3, 8, 5)  # [b, s, h], the same on every rank
    upstreams = [torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(10 + r)) for r in range(g.size)]
    upstream = upstreams[g.rank]

    # Entering a TP region: all-gather / reduce-scatter against identity / all-reduce.
    shard = _shard(x, g).clone().requires_grad_()
    full = x.clone().requires_grad_()
    gathered, copied = gather_from_sequence(shard, g), copy_to_tp(full, g)
    torch.testing.assert_close(gathered, copied, rtol=0, atol=0)
    gathered.backward(upstream)
    copied.backward(upstream.clone())  # copy_to_tp sums its incoming gradient in place (as Megatron's does)
    torch.testing.assert_close(shard.grad, _shard(full.grad, g), rtol=1e-6, atol=1e-6)

    # Leaving it: reduce-scatter / all-gather against all-reduce / identity. Each rank's loss
    # term covers its own positions; the replicated path sees all of those terms on every rank.
    partial = (x * (g.rank + 1)).requires_grad_()
    partial_ref = partial.detach().clone().requires_grad_()
    scattered, reduced = reduce_scatter_to_sequence(partial, g), reduce_from_tp(partial_ref.clone(), g)
    torch.testing.assert_close(scattered, _shard(reduced, g), rtol=1e-6, atol=1e-6)
    scattered.backward(_shard(upstream, g))
    reduced.backward(torch.cat([u.chunk(g.size, dim=1)[r] for r, u in enumerate(upstreams)], dim=1))
    torch.testing.assert_close(partial.grad, partial_ref.grad, rtol=0, atol=0)
    _check_gathered_linear(x, g)
    return True


def _check_gathered_linear(x: torch.Tensor, g) -> None:
    """The fused column-parallel matmul (keeps the shard, gathers it again in backward), plain
    and with its weight gradient deferred (zbh1), against all-gather pair + F.linear."""
    import torch.nn.functional as F

    from megazero.parallel.comm import gather_from_sequence
    from megazero.parallel.weight_grad import WeightGradStore, gathered_linear
    upstream = torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(20 + g.rank))
    weight, bias = torch.randn(6, 5), torch.randn(6)
    ref_w, ref_b, ref_x = (t.clone().requires_grad_() for t in (weight, bias, _shard(x, g)))
    ref = F.linear(gather_from_sequence(ref_x, g), ref_w, ref_b)
    ref.backward(upstream)
    for store in (None, WeightGradStore()):
        w, b, xs = (t.clone().requires_grad_() for t in (weight, bias, _shard(x, g)))
        y = gathered_linear(xs, w, b, store, g)
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        with store.defer() if store is not None else contextlib.nullcontext():
            y.backward(upstream)
        if store is not None:
            assert w.grad is None
            store.run_next()
        for mine, want in [(xs.grad, ref_x.grad), (w.grad, ref_w.grad), (b.grad, ref_b.grad)]:
            torch.testing.assert_close(mine, want, rtol=1e-6, atol=1e-6)


def _check_layers(tp: int) -> bool:
    """Column-parallel -> GELU -> row-parallel with and without sequence parallelism: the
    same output on this rank's positions and the same weight gradients; the replicated
    row-parallel bias gets a partial gradient that sums to the plain one over TP."""
    import torch.nn.functional as F

    from megazero.model.layers import ColumnParallelLinear, RowParallelLinear
    from megazero.parallel.comm import all_reduce
    g = make_grid(tp).tp_group
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    layers = []
    for sequence_parallel in (False, True):
        torch.manual_seed(1)
        col, row = ColumnParallelLinear(16, 32), RowParallelLinear(32, 16)
        for p in list(col.parameters()) + list(row.parameters()):
            torch.nn.init.normal_(p)
        col.apply_tp(g)
        row.apply_tp(g)
        col.sequence_parallel = row.sequence_parallel = sequence_parallel
        layers.append((col, row))
    (col, row), (col_sp, row_sp) = layers
    y = row(F.gelu(col(x)))
    y_sp = row_sp(F.gelu(col_sp(_shard(x, g))))
    torch.testing.assert_close(y_sp, _shard(y, g), rtol=1e-5, atol=1e-5)
    y.pow(2).sum().backward()
    y_sp.pow(2).sum().backward()
    bias_grad = row_sp.bias.grad.clone()
    all_reduce(bias_grad, g)
    torch.testing.assert_close(bias_grad, row.bias.grad, rtol=1e-5, atol=1e-5)
    for mine, plain in [(col_sp.weight, col.weight), (col_sp.bias, col.bias), (row_sp.weight, row.weight)]:
        torch.testing.assert_close(mine.grad, plain.grad, rtol=1e-4, atol=1e-4)
    return True


def _check_dropout(tp: int) -> list[bool]:
    """Dropout outside TP regions: the same mask on every TP rank while activations are
    replicated, a distinct one per rank (the tracker's stream) once they are sequence-split."""
    from megazero.model.layers import Dropout
    from megazero.parallel.comm import all_gather_object
    from megazero.parallel.random import seed_everything
    g = make_grid(tp).tp_group
    out = []
    for sequence_parallel in (False, True):
        tracker = seed_everything(5, 0, g.rank, torch.device("cpu"))
        drop = Dropout(0.5, tracker)
        drop.sequence_parallel = sequence_parallel
        mask = drop(torch.ones(64)).ne(0).tolist()
        out.append(len({tuple(m) for m in all_gather_object(mask, g)}) == 1)
    return out


def _check_all(tp: int) -> list:
    return [_check_collectives(tp), _check_layers(tp), _check_dropout(tp)]


@pytest.mark.slow  # tp 4 runs in the fast test below, in the world of its training runs
def test_sequence_parallel_collectives_layers_and_dropout_tp2():
    _assert_checks(run_distributed(_check_all, 2, 2))


def _assert_checks(per_rank: list) -> None:
    for collectives, layers, (same_replicated, same_split) in per_rank:
        assert collectives and layers
        assert same_replicated and not same_split


# ----------------------------------------------------------------------------- training parity


SHORT = ["--data.mock", "true", "--train.iters", str(ITERS), "--model.seq_length", "32"]


def _records(extra: list[str]) -> list[tuple[float, float]]:
    from unittest import mock

    from megazero.zero.shard import ShardedParameters
    # ZeRO-Offload copies each gradient slice to the host as it is final only where there is a
    # device to copy from; forced here, so the host copies of partial SP gradients are checked.
    offload = "--zero.offload_optimizer" in extra
    with mock.patch.object(ShardedParameters, "_offloads_gradients", lambda self: True) if offload \
            else contextlib.nullcontext():
        tr = make_trainer(SHORT + extra)
    assert all(c.sequence_parallel for c in tr.chunks) == (tr.grid.tp > 1 and "true" in extra)
    with contextlib.redirect_stdout(io.StringIO()):
        records = tr.run()
    return [(r["loss"], r["grad_norm"]) for r in records] if tr.is_logger else []


def _layouts(layouts: dict[str, list[str]]) -> dict[str, list[tuple[float, float]]]:
    return logged_by_layout(_records, layouts)


SP = ["--parallel.sequence_parallel", "true"]
LAYOUTS_4 = {
    "tp4": ["--parallel.tp", "4", *SP],
    "tp2-pp2-recompute-full": ["--parallel.tp", "2", "--parallel.pp", "2", "--train.recompute", "full", *SP],
    "tp2-dp2-zero3-selective": ["--parallel.tp", "2", "--zero.stage", "3", "--train.recompute", "selective", *SP],
    "tp2-dp2-zero1-offload": ["--parallel.tp", "2", "--zero.stage", "1", "--zero.offload_optimizer", "cpu", *SP],
}
LAYOUTS_8 = {
    "tp2-dp4-zero2": ["--parallel.tp", "2", "--zero.stage", "2", *SP],
    "tp4-pp2": ["--parallel.tp", "4", "--parallel.pp", "2", *SP],
    "tp2-pp2-dp2-zero1": ["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "1", *SP],
    "tp2-pp2-vpp2": ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.vpp", "2", *SP],
    "tp2-pp2-dp2-zbh1-zero2": ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.schedule", "zbh1",
                               "--zero.stage", "2", *SP],
}


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, float]]:
    return run_distributed(_records, 1, [])[0]


def _assert_parity(runs: dict, reference: list) -> None:
    assert_parity(runs, reference, ITERS)


def _checks_and_layouts(tp: int, layouts: dict[str, list[str]]) -> tuple[list, dict]:
    return _check_all(tp), _layouts(layouts)


def test_sequence_parallel_4_ranks(reference):
    """One world of 4: the collectives, layers and dropout at tp 4, then training at tp 4,
    tp 2 x pp 2 (full recompute) and tp 2 x dp 2 (ZeRO-3 with selective recompute; ZeRO-1
    with the optimizer on the host, its gradients copied there during backward)."""
    out = run_distributed(_checks_and_layouts, 4, 4, LAYOUTS_4)
    _assert_checks([checks for checks, _ in out])
    _assert_parity(out[0][1], reference)


@pytest.mark.slow
def test_sequence_parallel_matches_single_process_8_ranks(reference):
    _assert_parity(run_distributed(_layouts, 8, LAYOUTS_8)[0], reference)


DROPOUT = ["--parallel.tp", "2", "--parallel.pp", "2", "--model.dropout", "0.1", *SP]


@pytest.mark.slow
def test_sequence_parallel_dropout_replayed_by_recompute():
    """With dropout, per-TP-rank masks in the sequence-split stream: full and selective
    recomputation replay them exactly (losses and gradient norms equal to no recomputation)."""
    runs = run_distributed(_layouts, 4, {mode: DROPOUT + ["--train.recompute", mode]
                                         for mode in ("none", "full", "selective")})[0]
    for mode in ("full", "selective"):
        for got, want in zip(runs[mode], runs["none"], strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-6, (mode, runs)
