"""The vocab-parallel cross-entropy against a float64 reference (fp32 to rounding, bf16 to its
rounding of the gradient), across chunk boundaries, padded vocab and negative labels, at tp 1
and tp 2; and its memory: forward + backward allocate one logits-sized buffer, the gradient."""

from __future__ import annotations

import pytest
import torch

from helpers import run_distributed
from megazero.model.cross_entropy import vocab_parallel_cross_entropy
from megazero.parallel.comm import solo_group

VOCAB, WIDTH = 300, 384  # padded vocab: columns 300..383 are padding


def _reference(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, vocab: int):
    """Loss and logits gradient in float64 from log_softmax over the real vocab; the loss of a
    negative label is 0 (as GPT.loss masks it) and so is its gradient."""
    full = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(full[..., :vocab], dim=-1)
    loss = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    loss = loss.masked_fill(labels < 0, 0.0)
    (loss * weight).sum().backward()
    return loss.detach(), full.grad


def _ours(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, tp, vocab: int, rows=None):
    x = logits.detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, labels, tp, vocab, rows).masked_fill(labels < 0, 0.0)
    (loss * weight).sum().backward()
    return loss.detach(), x.grad


def _inputs(seed: int, width: int = WIDTH, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 37, width, generator=g) * 4  # 111 tokens: no chunk size below divides it
    labels = torch.randint(0, vocab, (3, 37), generator=g)
    labels[0, :7] = -100  # fine-tuning's masked prompt tokens
    labels[2, -1] = -1
    return logits, labels, torch.rand(3, 37, generator=g)


def _check(loss, grad, ref_loss, ref_grad, dtype) -> None:
    # fp32 math either way: the loss is the float64 one to fp32 rounding
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    assert grad.dtype == dtype
    # fp32: rounding only; bf16: the gradient's rounding to bf16 (8 bits of mantissa) only
    rtol, atol = (1e-5, 1e-7) if dtype == torch.float32 else (2 ** -8, 1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, 1, 16, 200])  # the policy, one row, 7 chunks with a short last, one chunk
def test_matches_float64_reference(dtype, rows):
    logits, labels, weight = _inputs(0)
    logits = logits.to(dtype)
    ref_loss, ref_grad = _reference(logits, labels, weight, VOCAB)
    loss, grad = _ours(logits, labels, weight, solo_group(), VOCAB, rows)
    _check(loss, grad, ref_loss, ref_grad, dtype)
    assert (grad[..., VOCAB:] == 0).all()  # padding columns: exactly 0
    assert (grad[labels < 0] == 0).all()  # masked tokens: no gradient


def test_negative_labels_keep_their_unmasked_value_and_padding_ids_give_inf():
    """A negative label selects no logit: its unmasked loss is log(sum(exp(x - max))), finite,
    as before (GPT.loss masks it); a label in the vocab padding still gives an infinite loss."""
    logits, labels, _ = _inputs(1)
    labels[1, 3] = VOCAB + 5
    with torch.no_grad():  # eval runs without autograd
        loss = vocab_parallel_cross_entropy(logits, labels, solo_group(), VOCAB)
    real = logits[..., :VOCAB].double()
    want = torch.logsumexp(real, -1) - real.amax(-1)
    torch.testing.assert_close(loss[labels < 0].double(), want[labels < 0], rtol=1e-6, atol=1e-6)
    assert loss[1, 3] == float("inf")


def _peak_and_big_allocations(fn, threshold: int) -> tuple[int, list[int]]:
    """Peak of (bytes allocated - bytes freed) while fn runs, and each allocation >= threshold,
    from the profiler's memory records in time order (the CPU allocator has no peak counter)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert records, "the profiler recorded no allocations"
    live = peak = 0
    big = []
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
        big += [e.nbytes()] if e.nbytes() >= threshold else []
    return peak, big


def test_forward_backward_allocate_one_logits_sized_buffer():
    logits = (torch.randn(8, 128, 1024) * 4).bfloat16().requires_grad_()
    labels = torch.randint(-1, 1000, (8, 128))

    def step():
        vocab_parallel_cross_entropy(logits, labels, solo_group(), 1000).sum().backward()

    peak, big = _peak_and_big_allocations(step, logits.nbytes // 2)
    assert big == [logits.nbytes], big  # the gradient, and no other buffer half the logits' size
    # beside it, fp32 chunks of 1/8 of the tokens (a quarter of the bf16 logits) and [tokens] vectors
    assert peak <= 1.3 * logits.nbytes, (peak, logits.nbytes)


def _tp2(dtype: torch.dtype) -> bool:
    from megazero.parallel.grid import ProcessGrid
    from megazero.parallel.placement import Placement
    grid = ProcessGrid(tp=2, pp=1, dp=1, rank=torch.distributed.get_rank())
    grid.build_groups()
    tp = grid.tp_group
    # vocab 150 in 2 x 192 columns: rank 0 holds 150 real ids and padding, rank 1 padding only
    for vocab in (VOCAB, 150):
        logits, labels, weight = _inputs(2, vocab=vocab)
        logits = logits.to(dtype)
        ref_loss, ref_grad = _reference(logits, labels, weight, vocab)
        tp.counter.clear()
        vocab_split = Placement(tuple(logits.shape), dim=2)
        loss, grad = _ours(vocab_split.shard(logits, tp.rank, 2), labels, weight, tp, vocab, rows=16)
        assert tp.counter["all_reduce_calls"] == 3, tp.counter  # max, target logit, sum: not per chunk
        _check(loss, grad, ref_loss, vocab_split.shard(ref_grad, tp.rank, 2), dtype)
    return True


def test_tp2_matches_float64_reference():
    assert run_distributed(_tp2, 2, torch.bfloat16) == [True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_fused_cuda_path_matches_reference_without_fp32_copy():
    """On CUDA the chunk functions are compiled: same values, and no fp32 temporary (the eager
    fallback's one chunk here would be an fp32 copy of all the logits: twice their size)."""
    from megazero.model import cross_entropy as ce
    logits, labels, weight = (t.cuda() for t in _inputs(3))
    logits = logits.repeat(32, 8, 16).bfloat16()  # 96 x 296 tokens x 6144 columns (vocab 6000)
    labels, weight = labels.repeat(32, 8), weight.repeat(32, 8)
    ref_loss, ref_grad = _reference(logits, labels, weight, 6000)
    for rows in (1000, None):  # 28 chunks with a short last (recompiles with a dynamic row count), one chunk
        x = logits.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = vocab_parallel_cross_entropy(x, labels, solo_group(), 6000, rows).masked_fill(labels < 0, 0.0)
        (loss * weight).sum().backward()
        peak = torch.cuda.max_memory_allocated() - base
        assert not ce._FUSION.broken
        _check(loss, x.grad, ref_loss, ref_grad, torch.bfloat16)
        if rows is None:
            assert peak <= 1.1 * logits.nbytes, (peak, logits.nbytes)
