"""Context parallelism (parallel.cp): the zig-zag layout, ring attention and Ulysses against
full-sequence causal attention (forward and gradients), the grid's cp groups, and training
that reproduces the single-process fp32 run (losses and gradient norms within 1e-5)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import (
    assert_parity,
    logged_by_layout,
    logged_losses,
    losses_saving_at_2,
    make_config,
    make_trainer,
    run_distributed,
)

# ----------------------------------------------------------------------------- layout and grid


def test_zigzag_positions_cover_the_sequence_once_with_even_causal_work():
    from megazero.parallel.context import shard_sequence, zigzag_positions
    for cp in (1, 2, 4):
        held = [zigzag_positions(32, r, cp) for r in range(cp)]
        assert sorted(np.concatenate(held).tolist()) == list(range(32))
        # Causal work of a rank: the keys its queries see, the same on every rank.
        assert len({int((p + 1).sum()) for p in held}) == 1
    assert zigzag_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    tokens = np.arange(16).reshape(2, 8)
    assert shard_sequence(tokens, 0, 2).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]


def test_grid_rank_order_and_cp_groups():
    """tp fastest, then cp, then dp, then pp; ZeRO's dp x cp group dp-major."""
    from megazero.parallel.grid import ProcessGrid
    grid = ProcessGrid(tp=2, pp=2, dp=2, cp=2)
    assert grid.world_size == 16
    c = grid.coords(1 + 2 * 1 + 4 * 1 + 8 * 1)
    assert (c.tp, c.cp, c.dp, c.pp) == (1, 1, 1, 1)
    assert all(grid.rank_of(**grid.coords(r)._asdict()) == r for r in range(16))
    assert grid.group_ranks("cp")[0] == [0, 2]
    assert grid.group_ranks("dp")[0] == [0, 4]
    assert grid.group_ranks("dp_cp")[0] == [0, 2, 4, 6]
    assert grid.group_ranks("pp")[0] == [0, 8]
    assert grid.dp_cp_index(grid.coords(6)) == 3


# ----------------------------------------------------------------------------- attention


def _full_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def _inputs(seq: int, heads: int = 4):
    g = torch.Generator().manual_seed(0)
    q, k, v, upstream = (torch.randn(2, heads, seq, 8, generator=g, dtype=torch.float64) for _ in range(4))
    return q, k, v, upstream


def _check_attention(grid, impl: str, kernel: str, groups: int = 4) -> float:
    """This rank's output and gradients against full causal attention (on the rank's zig-zag
    positions), with `groups` K/V heads for q's 4 (grouped-query attention below 4); the
    largest difference."""
    from megazero.parallel.context import ulysses_attention, zigzag_positions
    from megazero.parallel.ring_attention import ring_attention
    n, r = grid.cp, grid.cp_rank
    seq = 8 * n
    q, k, v, upstream = _inputs(seq)
    k, v = k[:, :groups].contiguous(), v[:, :groups].contiguous()
    dtype = torch.float64 if kernel == "reference" else torch.float32  # the CPU flash kernel: fp32
    full = [t.clone().to(dtype).requires_grad_() for t in (q, k, v)]
    ref = _full_attention(*full)
    ref.backward(upstream.to(dtype))
    mine = zigzag_positions(seq, r, n)
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in full]
    if impl == "ring":
        out = ring_attention(*local, grid.cp_group, kernel=kernel)
    else:
        out = ulysses_attention(*local, grid.cp_group, _full_attention)
    out.backward(upstream.to(dtype)[:, :, mine])
    diffs = [(out - ref[:, :, mine]).abs().max()]
    diffs += [(a.grad - b.grad[:, :, mine]).abs().max() for a, b in zip(local, full, strict=True)]
    return float(max(diffs))


ATTENTION_CASES = {("ring", "reference"): 1e-10, ("ring", "cpu_flash"): 1e-5, ("ulysses", "reference"): 1e-10}
# Grouped-query attention: (impl, kernel, K/V heads for 4 query heads). Ulysses at cp 2 sends
# the 2 groups as they are; at cp 4 (or 1 group) it widens them first.
GQA_CASES = {("ring", "reference", 2): 1e-10, ("ring", "cpu_flash", 1): 1e-5, ("ulysses", "reference", 2): 1e-10,
             ("ulysses", "reference", 1): 1e-10}


RING_DROPOUT = 0.3


def _ring_masks(grid, seq: int, seeds: list[int], shape: tuple[int, int]) -> torch.Tensor:
    """The dropout factors ring attention applied, as one [b, h, s, s] tensor over the whole
    sequence: this rank's blocks rebuilt from their seeds, all-gathered over the cp group."""
    import torch.distributed as dist

    from megazero.parallel.attention_block import dropout_scale
    from megazero.parallel.context import zigzag_positions
    from megazero.parallel.ring_attention import _block_of, _part
    n, r = grid.cp, grid.cp_rank
    mine = torch.as_tensor(zigzag_positions(seq, r, n))
    rows = torch.zeros(*shape, len(mine), seq, dtype=torch.float64)  # unvisited: causally masked anyway
    for step, seed in enumerate(seeds):  # step i attends to rank (r - i) mod n's block
        which_rows, which_cols = _block_of(step, grid.cp_group)
        theirs = torch.as_tensor(zigzag_positions(seq, (r - step) % n, n))
        q_at = _part(torch.arange(len(mine)), which_rows, 0)
        k_at = _part(theirs, which_cols, 0)
        factors = dropout_scale(seed, torch.Size((*shape, len(q_at), len(k_at))), RING_DROPOUT, torch.float64,
                                torch.device("cpu"))
        rows[:, :, q_at.unsqueeze(-1), k_at] = factors
    pieces = [torch.empty_like(rows) for _ in range(n)]
    dist.all_gather(pieces, rows, group=grid.cp_group.pg)
    full = torch.empty(*shape, seq, seq, dtype=torch.float64)
    for rank, piece in enumerate(pieces):
        full[:, :, torch.as_tensor(zigzag_positions(seq, rank, n))] = piece
    return full


def _check_ring_dropout(grid) -> float:
    """Ring attention with attention dropout against dropout on the whole row's softmax with
    the same masks (those the ring's block seeds give), forward and gradients, float64."""
    from megazero.parallel.attention_block import _draw_seed
    from megazero.parallel.context import zigzag_positions
    from megazero.parallel.ring_attention import ring_attention
    n, r = grid.cp, grid.cp_rank
    seq = 8 * n
    q, k, v, upstream = _inputs(seq)
    mine = zigzag_positions(seq, r, n)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(100 + r)
    out = ring_attention(*local, grid.cp_group, kernel="reference", dropout=RING_DROPOUT)
    out.backward(upstream[:, :, mine])
    torch.manual_seed(100 + r)  # the reference kernel's draws: one seed per block, in ring order
    masks = _ring_masks(grid, seq, [_draw_seed(torch.device("cpu")) for _ in range(n)], tuple(q.shape[:2]))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = (full[0] @ full[1].transpose(-1, -2)) / full[0].shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    ref = (torch.softmax(scores, -1) * masks) @ full[2]
    ref.backward(upstream)
    kept = float((masks[..., torch.ones(seq, seq, dtype=torch.bool).tril()] > 0).double().mean())
    assert abs(kept - (1 - RING_DROPOUT)) < 0.05, kept  # the masks drop what they should
    diffs = [(out - ref[:, :, mine]).abs().max()]
    diffs += [(a.grad - b.grad[:, :, mine]).abs().max() for a, b in zip(local, full, strict=True)]
    return float(max(diffs))


def _check_attention_cases(cps: tuple[int, ...]) -> dict:
    """In one world: each cp of `cps` (cp x dp = the world), each case; this rank's differences."""
    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    out = {}
    for cp in cps:
        grid = ProcessGrid(tp=1, pp=1, dp=dist.get_world_size() // cp, cp=cp, rank=dist.get_rank())
        grid.build_groups()
        for impl, kernel in ATTENTION_CASES:
            out[(cp, impl, kernel)] = _check_attention(grid, impl, kernel)
        for impl, kernel, groups in GQA_CASES:
            out[(cp, impl, kernel, groups)] = _check_attention(grid, impl, kernel, groups)
        out[(cp, "ring", "reference-dropout")] = _check_ring_dropout(grid)
    return out


def test_ring_attention_and_ulysses_match_full_causal_attention():
    """Forward and gradients of every rank's positions at cp 2 (two groups of a world of 4)
    and cp 4, ring with the reference and the CPU flash block kernels, and Ulysses, each also
    with grouped K/V heads; and ring attention with dropout against dropout on the whole
    sequence's softmax, masks alike."""
    for per_rank in run_distributed(_check_attention_cases, 4, (2, 4)):
        assert len(per_rank) == 2 * (len(ATTENTION_CASES) + len(GQA_CASES) + 1)
        for (cp, impl, kernel, *groups), diff in per_rank.items():
            tol = GQA_CASES[(impl, kernel, *groups)] if groups else ATTENTION_CASES.get((impl, kernel), 1e-10)
            assert diff <= tol, (cp, impl, kernel, groups, diff)


def _check_block_kernel(device: str, dtype: torch.dtype, name: str, tol: float) -> None:
    """A block kernel's output, log-sum-exp and backward (given the final output and
    log-sum-exp) against the reference in fp32, causal and not, with fewer queries than keys."""
    from megazero.parallel.attention_block import REFERENCE, pick
    kernel = pick(torch.device(device), dtype)
    assert kernel.name == name
    g = torch.Generator().manual_seed(1)
    for causal, (sq, sk) in ((True, (128, 128)), (False, (64, 128))):
        q, k, v, dout = (torch.randn(2, 3, s, 64, generator=g).to(device, dtype) for s in (sq, sk, sk, sq))
        want = REFERENCE.forward(*(t.float() for t in (q, k, v)), causal, 0.125)
        got = kernel.forward(q, k, v, causal, 0.125)
        for a, b in zip(got[:2], want[:2], strict=True):
            torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol)
        grads = kernel.backward(dout, q, k, v, want[0].to(dtype), want[1], got[2], causal, 0.125)
        wanted = REFERENCE.backward(*(t.float() for t in (dout, q, k, v)), want[0], want[1], (), causal, 0.125)
        for a, b in zip(grads, wanted, strict=True):
            torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol)


def test_reference_block_kernel_drops_the_softmax_and_replays_its_mask():
    """With dropout p the block's output is (softmax . mask / (1-p)) V, its log-sum-exp that of
    the undropped scores, and its backward (given the seed it drew) autograd's of that formula;
    the CPU flash kernel, which has no dropout, is never picked for it."""
    from megazero.parallel.attention_block import REFERENCE, dropout_scale, pick
    assert pick(torch.device("cpu"), torch.float32, dropout=0.1).name == "reference"
    with pytest.raises(ValueError, match="cpu_flash attention kernel has no dropout"):
        pick(torch.device("cpu"), torch.float32, "cpu_flash", dropout=0.1)
    g = torch.Generator().manual_seed(2)
    for causal, (sq, sk) in ((True, (16, 16)), (False, (8, 16))):
        q, k, v, dout = (torch.randn(2, 3, s, 8, generator=g, dtype=torch.float64) for s in (sq, sk, sk, sq))
        out, lse, extras = REFERENCE.forward(q, k, v, causal, 0.3, 0.25)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        scores = leaves[0] @ leaves[1].transpose(-1, -2) * 0.3
        if causal:
            scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
        factors = dropout_scale(extras[0], scores.shape, 0.25, torch.float64, torch.device("cpu"))
        want = (torch.softmax(scores, -1) * factors) @ leaves[2]
        want.backward(dout)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
        grads = REFERENCE.backward(dout, q, k, v, out, lse, extras, causal, 0.3, 0.25)
        for got, leaf in zip(grads, leaves, strict=True):
            torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)
        assert set(factors.unique().tolist()) == {0.0, 1 / 0.75}


def test_cpu_flash_block_kernel_agrees_with_the_reference():
    _check_block_kernel("cpu", torch.float32, "cpu_flash", 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_flash_block_kernel_agrees_with_the_reference():
    """Ring attention's CUDA block kernel (flash, bf16): the contract the ring relies on."""
    _check_block_kernel("cuda", torch.bfloat16, "cuda_flash", 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_flash_block_kernel_replays_its_dropout_mask():
    """With dropout the CUDA block kernel draws its Philox offset from the CUDA generator as SDPA's
    flash path does, and its backward replays that mask: output and gradients equal SDPA's own
    (same seed, flash backend) autograd."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megazero.parallel.attention_block import CUDA_FLASH
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 3, 128, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    torch.cuda.manual_seed(5)
    out, lse, extras = CUDA_FLASH.forward(q, k, v, True, 0.125, 0.2)
    grads = CUDA_FLASH.backward(dout, q, k, v, out, lse, extras, True, 0.125, 0.2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.cuda.manual_seed(5)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want = F.scaled_dot_product_attention(*leaves, dropout_p=0.2, is_causal=True, scale=0.125)
    want.backward(dout)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=0)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-2, atol=1e-2)
    undropped = CUDA_FLASH.forward(q, k, v, True, 0.125, 0.0)[0]
    assert (out - undropped).abs().max() > 1e-2  # it did drop


# ----------------------------------------------------------------------------- training parity

ITERS = 4
SHORT = ["--data.mock", "true", "--train.iters", str(ITERS), "--model.seq_length", "32"]


def _records(extra: list[str]) -> list[tuple[float, float]]:
    """(loss, grad norm) of each iteration, on the logging rank (empty elsewhere)."""
    def make():
        tr = make_trainer(SHORT + extra)
        assert all(c.cp.size == tr.grid.cp for c in tr.chunks)
        return tr
    return logged_losses(make)


def _layouts(layouts: dict[str, list[str]]) -> dict[str, list[tuple[float, float]]]:
    return logged_by_layout(_records, layouts)


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, float]]:
    return run_distributed(_records, 1, [])[0]


def _assert_parity(runs: dict, reference: list) -> None:
    assert_parity(runs, reference, ITERS)


RING, ULYSSES = ["--parallel.cp", "2"], ["--parallel.cp", "2", "--parallel.cp_impl", "ulysses"]
LAYOUTS_2 = {"cp2-ring-selective": RING + ["--train.recompute", "selective"], "cp2-ulysses": ULYSSES}
LAYOUTS_4 = {"cp2-dp2-zero3-ring": RING + ["--zero.stage", "3"],
             "cp2-dp2-zero3-ulysses-full": ULYSSES + ["--zero.stage", "3", "--train.recompute", "full"]}


def test_context_parallel_2_ranks(reference):
    """cp 2 alone, by ring (with selective recomputation: the ring runs again in backward) and by Ulysses."""
    _assert_parity(run_distributed(_layouts, 2, LAYOUTS_2)[0], reference)


COMPILE = ["--train.compile", "true"]


COMPILED = {"ring": RING + COMPILE, "ulysses-full": ULYSSES + COMPILE + ["--train.recompute", "full"]}


@pytest.mark.slow  # suite budget: compiled blocks are checked by test_step_costs by default
@pytest.mark.parametrize("case", ["ring", "ulysses-full"])
def test_compiled_blocks_with_context_parallelism(reference, case):
    """train.compile at cp 2: the blocks compiled around the eager attention core (ring, and
    Ulysses under full recomputation) give the single process's losses and norms."""
    _assert_parity(run_distributed(_layouts, 2, {f"cp2-{case}-compile": COMPILED[case]})[0], reference)


def _model_states(extra: list[str]) -> tuple[dict, dict]:
    """This rank's model-state bytes on the device, measured and as the planner predicts them."""
    import torch.distributed as dist

    from megazero.plan.planner import Cluster, ParallelLayout, predict
    tr = make_trainer(SHORT + extra)
    measured = {k: v for k, v in tr.optimizer.model_state_bytes().items() if not k.startswith("offloaded")}
    p, z, t, g = tr.cfg.parallel, tr.cfg.zero, tr.cfg.train, tr.grid
    layout = ParallelLayout(p.tp, p.pp, g.dp, p.vpp, z.stage, t.micro_batch_size, t.recompute, p.sequence_parallel,
                            False, p.cp, p.cp_impl)
    cluster = Cluster(dist.get_world_size(), 8, 1.0, None)
    return measured, predict(tr.cfg, layout, cluster, ranks=[g.pp_rank], device="cpu").rank(g.pp_rank).states


def _parity_and_states(layouts: dict[str, list[str]], states: dict[str, list[str]]) -> tuple[dict, dict]:
    return _layouts(layouts), {name: _model_states(extra) for name, extra in states.items()}


STATES_4 = {"cp2-dp2-zero3": RING + ["--zero.stage", "3"], "dp4-zero3": ["--zero.stage", "3"],
            "cp2-dp2-zero1": RING + ["--zero.stage", "1"], "dp4-zero1": ["--zero.stage", "1"]}


@pytest.mark.slow  # suite budget: cp 2 x dp 2 ZeRO-3 runs by default in test_llama_family's checkpoint test
def test_context_parallel_with_zero3_4_ranks(reference):
    """cp 2 x dp 2 at ZeRO-3 (sharded over dp x cp), ring and Ulysses (full recomputation); the
    model states of cp 2 x dp 2 equal dp 4's (ZeRO-1 and 3: shards over all 4) and the planner's."""
    out = run_distributed(_parity_and_states, 4, LAYOUTS_4, STATES_4)
    _assert_parity(out[0][0], reference)
    for _, states in out:
        for name, (measured, predicted) in states.items():
            assert measured == predicted, (name, measured, predicted)
        for stage in (1, 3):
            assert states[f"cp2-dp2-zero{stage}"][0] == states[f"dp4-zero{stage}"][0]


TP2 = ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]
LAYOUTS_4_SLOW = {"cp4-ring": ["--parallel.cp", "4"],
                  "cp4-ulysses": ["--parallel.cp", "4", "--parallel.cp_impl", "ulysses"],
                  "cp2-tp2-sp-ring": RING + TP2,
                  "cp2-tp2-sp-ulysses": ULYSSES + ["--parallel.tp", "2"],
                  "cp2-pp2-ring-1f1b-full": RING + ["--parallel.pp", "2", "--train.recompute", "full"],
                  "cp2-pp2-ulysses-interleaved": ULYSSES + ["--parallel.pp", "2", "--parallel.vpp", "2"]}
LAYOUTS_8_SLOW = {"tp2-cp2-pp2-ring-zero1": RING + TP2 + ["--parallel.pp", "2", "--zero.stage", "1"],
                  "tp2-cp2-pp2-ulysses-zero3": ULYSSES + ["--parallel.tp", "2", "--parallel.pp", "2",
                                                          "--zero.stage", "3"],
                  "cp2-dp4-zero2-offload": RING + ["--zero.stage", "2", "--zero.offload_optimizer", "cpu"]}


@pytest.mark.slow
def test_context_parallel_4_ranks_slow(reference):
    """cp 4 (ring, Ulysses), cp 2 x tp 2 (with sequence parallelism), cp 2 x pp 2 (1F1B with full
    recomputation, interleaved)."""
    _assert_parity(run_distributed(_layouts, 4, LAYOUTS_4_SLOW)[0], reference)


@pytest.mark.slow
def test_context_parallel_8_ranks_slow(reference):
    """tp 2 x cp 2 x pp 2 (ring at ZeRO-1, Ulysses at ZeRO-3) and cp 2 x dp 4 with the optimizer offloaded."""
    _assert_parity(run_distributed(_layouts, 8, LAYOUTS_8_SLOW)[0], reference)


# ----------------------------------------------------------------------------- checkpoints


def _save_at_cp2_then_resume(save: str, universal: str) -> dict:
    """cp 2 x dp 2 at ZeRO-1: train ITERS, saving after 2; resume that checkpoint at the same
    layout, at cp 1 (dp 4) and cp 4 (dp 1), and from its universal export at cp 4."""
    import torch.distributed as dist

    from megazero.convert import main as convert_main
    common = SHORT + ["--zero.stage", "1"]
    t = make_trainer(common + RING + ["--checkpoint.save", save])
    out = {"straight": losses_saving_at_2(t, ITERS)}
    if dist.get_rank() == 0:
        with contextlib.redirect_stdout(io.StringIO()):
            convert_main(["--load", save, "--to", "universal", "--output", universal])
    dist.barrier()
    for name, layout, load in [("same", RING, save), ("cp1", [], save), ("cp4", ["--parallel.cp", "4"], save),
                               ("universal-cp4", ["--parallel.cp", "4", "--parallel.cp_impl", "ulysses"], universal)]:
        t = make_trainer(common + layout + ["--checkpoint.load", load])
        out[name] = [t.train_step()["loss"] for _ in range(ITERS - 2)]
    return out if t.is_logger else {}


@pytest.mark.slow
def test_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(tmp_path, reference):
    """Exactly: the same layout bitwise, cp 1 and cp 4 (resharded) and the universal export
    within 1e-5 of the uninterrupted run, which equals the single process."""
    out = next(r for r in run_distributed(_save_at_cp2_then_resume, 4, str(tmp_path / "save"), str(tmp_path / "uni"))
               if r)
    losses = [loss for loss, _ in reference]
    assert max(abs(a - b) for a, b in zip(out["straight"], losses, strict=True)) <= 1e-5
    assert out["same"] == out["straight"][2:]
    for name in ("cp1", "cp4", "universal-cp4"):
        assert max(abs(a - b) for a, b in zip(out[name], losses[2:], strict=True)) <= 1e-5, (name, out)


# ----------------------------------------------------------------------------- bad input

BAD = [
    (["--parallel.cp", "3"], 3, "parallel.cp (3) cuts model.seq_length (64) into 2 x cp = 6 equal chunks: make "
                                "seq_length a multiple of 6 or change parallel.cp"),
    (["--parallel.cp", "0"], 1, "parallel.cp (0) must be at least 1"),
    (["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.cp_impl", "ulysses", "--model.num_heads", "2",
      "--model.hidden_size", "64"], 4,
     "parallel.cp_impl ulysses gives each rank num_heads / (tp x cp) heads, but model.num_heads (2) is not divisible "
     "by 2 x 2 = 4; change parallel.cp or use parallel.cp_impl ring"),
    (["--parallel.cp", "2", "--parallel.tp", "2"], 6, "world size (6) must be divisible by parallel.tp x parallel.pp "
                                                      "x parallel.cp (2 x 1 x 2 = 4)"),
    (["--parallel.cp", "4", "--parallel.tp", "4", "--parallel.sequence_parallel", "true", "--model.seq_length",
      "40"], 16, "parallel.sequence_parallel splits model.seq_length / parallel.cp (4) (40) over parallel.tp (4)"),
    (["--parallel.cp_impl", "rings"], 1, "parallel.cp_impl ('rings') must be one of ring, ulysses"),
]


@pytest.mark.parametrize("args, world, message", BAD)
def test_bad_context_parallel_config_is_refused_with_the_fix(args, world, message):
    from megazero.errors import UserError
    with pytest.raises(UserError) as err:
        make_config(args, world=world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_cp_stops_the_command_with_one_line():
    import subprocess
    import sys

    from helpers import REPO
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml",
                           "--parallel.cp", "3", "--world-size", "3", "--validate-only", "--config-only"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == ["error: " + BAD[0][2]]


# ----------------------------------------------------------------------------- planner


def test_planner_searches_cp_and_divides_activations_by_it():
    from megazero.plan import formulas as F
    from megazero.plan.planner import Cluster, ParallelLayout, PlanError, plan, predict
    cfg = make_config(["--model.seq_length", "32768", "--train.global_batch_size", "8"], world=1)
    cluster = Cluster(8, 8, 80.0, 989e12)
    preds = plan(cfg, cluster, {})
    assert {p.layout.cp for p in preds} == {1, 2, 4, 8}
    one, four = (predict(cfg, ParallelLayout(1, 1, 8 // cp, cp=cp, zero_stage=1), cluster) for cp in (1, 4))
    layer = [F.layer_activation_bytes(shape) for shape in
             (F.ActivationShape(1, 32768 // cp, 64, 4, 256, 512, cp=cp) for cp in (1, 4))]
    assert layer[0] == 4 * layer[1]
    assert four.worst.bytes["cp"] > 0 == one.worst.bytes["cp"]
    assert four.worst.states["optimizer"] == one.worst.states["optimizer"]  # ZeRO shards over dp x cp: 8 either way
    assert "cp4" in four.layout.label()
    fixed = plan(cfg, cluster, {"cp": 4, "cp_impl": "ulysses"})
    assert {(p.layout.cp, p.layout.cp_impl) for p in fixed} == {(4, "ulysses")}
    with pytest.raises(PlanError, match=r"--cp 3 must cut model.seq_length \(32768\) into 2 x cp chunks"):
        plan(cfg, cluster, {"cp": 3})
    with pytest.raises(PlanError, match=r"tp x cp \(1 x 8\) must divide model.num_heads \(4\); closest that fits: "
                                        r"cp 4, or --cp-impl ring"):
        plan(cfg, cluster, {"cp": 8, "cp_impl": "ulysses"})
    assert {p.layout.cp for p in plan(cfg, cluster, {"cp_impl": "ulysses"})} == {1, 2, 4}


LORA = ["--finetune.lora_rank", "4"]


@pytest.mark.slow
def test_context_parallel_with_lora():
    """LoRA adapters (everything else frozen) at cp 2, ring and Ulysses, against the single process with LoRA."""
    lora_reference = run_distributed(_records, 1, LORA)[0]
    _assert_parity(run_distributed(_layouts, 2, {"cp2-ring-lora": RING + LORA,
                                                 "cp2-ulysses-lora": ULYSSES + LORA})[0], lora_reference)


# ----------------------------------------------------------------------------- dropout


def test_dropout_streams_differ_per_cp_rank_and_cp_rank_0_keeps_the_seed():
    """cp ranks hold different positions: their dropout masks (both streams) must be independent;
    cp rank 0 draws what a run without context parallelism draws."""
    (d0, t0), (d1, t1), (plain, plain_tp) = _draws(cp_rank=0), _draws(cp_rank=1), _draws()
    assert not torch.equal(d0, d1) and not torch.equal(t0, t1)
    assert torch.equal(d0, plain) and torch.equal(t0, plain_tp)


def _draws(**cp_rank) -> tuple[torch.Tensor, torch.Tensor]:
    """A draw from the default stream and one from the TP stream after seeding stage 0, TP rank 0."""
    from megazero.parallel.random import seed_everything
    tracker = seed_everything(7, 0, 0, torch.device("cpu"), **cp_rank)
    with tracker.fork("tp"):
        tp_draw = torch.rand(4)
    return torch.rand(4), tp_draw


DROPOUT = ["--model.dropout", "0.1"]


def _assert_recompute_replays_dropout(impl: list[str], modes: tuple[str, ...]) -> None:
    """With dropout (per-cp-rank streams; attention dropout per rank's heads, and under the ring
    per rank's queries): recomputation replays the masks exactly (the same losses and norms as
    no recomputation), and dropout does drop (the losses differ from a run without it)."""
    runs = run_distributed(_layouts, 2, {mode: impl + DROPOUT + ["--train.recompute", mode] for mode in modes}
                           | {"no-dropout": impl})[0]
    for mode in modes[1:]:
        for got, want in zip(runs[mode], runs[modes[0]], strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-6, (mode, runs)
    dropped = max(abs(a[1] - b[1]) for a, b in zip(runs[modes[0]], runs["no-dropout"], strict=True))
    assert dropped > 1e-3, runs  # the gradient norms tell


@pytest.mark.slow  # suite budget
def test_ring_dropout_replayed_by_recompute():
    """Ring attention's block masks (seeds drawn from the per-rank stream) replay under selective
    recomputation, which runs the ring again inside backward."""
    _assert_recompute_replays_dropout(RING, ("none", "selective"))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_dropout_replayed_by_recompute(impl):
    _assert_recompute_replays_dropout(RING if impl == "ring" else ULYSSES, ("none", "full", "selective"))
