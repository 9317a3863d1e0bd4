"""Attention and weight-gradient kernels at GPT-2 355M's shapes on one GPU: where the next
speed-up of issue 27 lies (attention ran at ~170 TFLOP/s with cuDNN SDPA and dropout on an H200;
the fp32 gradient accumulation cost ~9 ms per step as separate add kernels).

    python scripts/bench_attention.py [--batch 16] [--seq 1024] [--heads 16] [--head-dim 64]

Prints, per SDPA backend (cuDNN, flash, memory-efficient) and attention dropout 0 / 0.1, the
forward + backward time of causal attention on q/k/v views of one fused projection (as
megazero's blocks call it) and its TFLOP/s (causal: half the square); then a [16k x 4096] x
[16k x 1024] weight gradient accumulated into fp32 three ways: `torch.addmm(..., out_dtype=
torch.float32)` where the build has it, a bf16 matmul plus an fp32 add (megazero today), and
the bf16 matmul alone. A measurement, not a test; exits 1 without a CUDA device.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
import torch.nn.functional as F


def timed_ms(fn: Callable[[], object], repeat: int = 20) -> float:
    """Mean milliseconds of fn() over `repeat` calls after 3 warm-up calls, by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def attention_rows(b: int, s: int, h: int, d: int) -> list[str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    flops = 3.5 * 2 * b * s * s * h * d  # causal forward 2bs^2hd, backward ~2.5x the forward
    rows = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for p in (0.0, 0.1):
            def step(p: float = p) -> None:
                q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
                F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).backward(grad)
            try:
                with sdpa_kernel(backend):
                    ms = timed_ms(step)
                rows.append(f"attention {backend.name:<20} dropout {p}: {ms:7.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")
            except RuntimeError as e:
                rows.append(f"attention {backend.name:<20} dropout {p}: unavailable ({str(e).splitlines()[0][:80]})")
    return rows


def weight_grad_rows(tokens: int = 16384, out: int = 4096, inp: int = 1024) -> list[str]:
    x = torch.randn(tokens, inp, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, out, device="cuda", dtype=torch.bfloat16)
    main = torch.zeros(out, inp, device="cuda")
    rows = [f"wgrad bf16 matmul + fp32 add: {timed_ms(lambda: main.add_(dy.t() @ x)):.3f} ms",
            f"wgrad bf16 matmul alone:      {timed_ms(lambda: dy.t() @ x):.3f} ms"]
    try:
        ref = dy.t().float() @ x.float()
        got = torch.addmm(torch.zeros_like(main), dy.t(), x, out_dtype=torch.float32)
        err = float((got - ref).norm() / ref.norm())
        ms = timed_ms(lambda: torch.addmm(main, dy.t(), x, out_dtype=torch.float32))
        rows.insert(0, f"wgrad addmm out_dtype fp32:   {ms:.3f} ms (relative error {err:.1e})")
    except (RuntimeError, TypeError) as e:
        rows.insert(0, f"wgrad addmm out_dtype fp32: unavailable ({str(e).splitlines()[0][:80]})")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="sequences per batch (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
    ap.add_argument("--heads", type=int, default=16, help="attention heads (default: %(default)s)")
    ap.add_argument("--head-dim", type=int, default=64, help="channels per head (default: %(default)s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; run it on a GPU machine", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | b {args.batch} s {args.seq} "
          f"heads {args.heads} x {args.head_dim}")
    print("\n".join(attention_rows(args.batch, args.seq, args.heads, args.head_dim) + weight_grad_rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
