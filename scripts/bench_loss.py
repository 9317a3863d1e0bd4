"""Time and memory of the vocab-parallel cross-entropy on one CUDA device (tp = 1).

    python scripts/bench_loss.py [--tokens 16384] [--vocab 50257] [--padded 50304] [--iters 20]

For GPT-2 355M's micro-batch (16 x 1024 tokens, bf16 logits over 50304 padded ids) it runs
forward + backward of: megazero's loss with its compiled (fused) chunk kernels, the same loss
with the eager chunk functions, and, as a floor that is not a candidate (it needs the padded
columns sliced off, i.e. a copy), F.cross_entropy on the bf16 logits. Printed per variant: ms
per forward + backward (CUDA events, after warm-up, which includes compilation), the peak
memory above the logits (the gradient included), and the largest difference of the loss and
the gradient from the fused variant's. A measurement: nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from megazero.model import cross_entropy as ce
from megazero.parallel.comm import solo_group


def measure(name: str, loss_fn: Callable, logits: torch.Tensor, labels: torch.Tensor, iters: int, warmup: int = 3):
    """ms per forward + backward, peak bytes above the logits, and (loss, grad) of the last step."""
    x = logits.detach().requires_grad_()
    n = labels.numel()

    def step():
        x.grad = None
        loss = loss_fn(x, labels)
        (loss.masked_fill(labels < 0, 0.0).sum() / n).backward()
        return loss

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    x.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        loss = step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    peak = torch.cuda.max_memory_allocated() - base
    print(f"{name:<28} {ms:8.3f} ms   peak +{peak / 2**20:8.1f} MiB ({peak / logits.nbytes:.2f} x logits)"
          f"   warm-up {first:.1f} s", flush=True)
    return loss.detach(), x.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per loss call (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=50257, help="true vocabulary size (default: %(default)s)")
    ap.add_argument("--padded", type=int, default=50304, help="vocabulary padded for the matmul (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per variant (default: %(default)s)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_loss.py needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(args.tokens, args.padded, device="cuda", generator=g) * 3).bfloat16()
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    labels[: args.tokens // 10] = -100  # fine-tuning's masked prompt tokens
    tp = solo_group()
    print(f"{args.tokens} tokens x {args.padded} logits (vocab {args.vocab}), bf16: logits "
          f"{logits.nbytes / 2**20:.0f} MiB; {torch.cuda.get_device_name()}, torch {torch.__version__}")

    fused = measure("megazero fused", lambda x, t: ce.vocab_parallel_cross_entropy(x, t, tp, args.vocab),
                    logits, labels, args.iters)
    assert not ce._FUSION.broken, "the compiled path fell back to eager"
    results = {"megazero fused": fused}
    ce._FUSION.broken = True  # the eager reference, same chunk functions
    results["megazero eager"] = measure(
        "megazero eager", lambda x, t: ce.vocab_parallel_cross_entropy(x, t, tp, args.vocab), logits, labels,
        args.iters)
    ce._FUSION.broken = False
    results["F.cross_entropy (floor)"] = measure(
        "F.cross_entropy (floor)",
        lambda x, t: F.cross_entropy(x[:, : args.vocab], t.clamp(min=0), reduction="none"),
        logits, labels, args.iters)
    loss0, grad0 = fused
    for name, (loss, grad) in results.items():
        ok = labels >= 0
        dl = (loss[ok].float() - loss0[ok].float()).abs().max().item()
        dg = (grad[:, : args.vocab].float() - grad0[:, : args.vocab].float()).abs().max().item()
        print(f"{name:<28} max |loss - fused| {dl:.2e}   max |grad - fused| {dg:.2e}")


if __name__ == "__main__":
    main()
