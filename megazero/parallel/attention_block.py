"""Attention of one block of queries against one block of keys, returning the log-sum-exp
of each query's scores, and its backward given the *final* output and log-sum-exp.

Ring attention (ring_attention.py) splits one causal attention into such blocks and merges
their partial outputs by the log-sum-exp rule; its backward hands each block the merged
output and log-sum-exp, which is exactly what a flash-attention backward needs to produce
that block's share of the gradients (P = exp(S - lse), D = rowsum(dO * O)).

Three implementations of the same contract (q [b, h, sq, d], k and v [b, h, sk, d]):

    reference   matmuls in fp32, the s_q x s_k scores materialized: any device and dtype,
                and the oracle the others are tested against
    cpu_flash   torch's CPU flash-attention kernel (aten::_scaled_dot_product_flash_attention_for_cpu
                and its backward): no s_q x s_k buffer, so long sequences fit in memory;
                no dropout
    cuda_flash  torch's CUDA flash-attention kernel (aten::_scaled_dot_product_flash_attention
                and its backward), for fp16/bf16 on CUDA

`pick(device, dtype, dropout)` chooses one; `reference` is the fallback wherever the others
do not apply. `causal` masks key j > query i within the block (both blocks start at the same
position: ring attention calls it only for a rank's own chunks).

Attention dropout (`dropout` p > 0) drops the block's normalized probabilities, each kept
one scaled by 1/(1-p); the log-sum-exp is that of the scores, undropped, so blocks still
merge by its rule, and the flash backward's rowsum(dO * O) of the final, dropped output is
still the row's sum of P * dP. The backward replays the forward's mask: the reference kernel
draws one seed per block from the default generator of the tensors' device (the caller's
stream: the per-rank one under tensor or context parallelism) and rebuilds the mask from
it; CUDA's kernel keeps its Philox seed and offset.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

BlockOut = tuple[torch.Tensor, torch.Tensor, tuple]
"""(output [b, h, sq, d] in q's dtype, log-sum-exp [b, h, sq] (accumulation_dtype), kernel extras for backward)."""


class BlockKernel(NamedTuple):
    name: str
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float, float], BlockOut]
    """(q, k, v, causal, scale, dropout) -> (out, lse, extras)."""
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(dout, q, k, v, out, lse, extras, causal, scale, dropout) -> (dq, dk, dv)."""
    dropout: bool
    """Whether it applies attention dropout."""


# ----------------------------------------------------------------------------- reference


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, else their own (float64 tests stay exact)."""
    return torch.promote_types(dtype, torch.float32)


def _up(x: torch.Tensor) -> torch.Tensor:
    return x.to(accumulation_dtype(x.dtype))


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(_up(q), _up(k).transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def dropout_scale(seed: int, shape: torch.Size, dropout: float, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The dropout mask of one block from its seed, as factors: 0 where dropped, 1/(1-p) where kept."""
    generator = torch.Generator(device=device).manual_seed(seed)
    keep = torch.rand(shape, generator=generator, device=device) >= dropout
    return keep.to(dtype) / (1.0 - dropout)


def _draw_seed(device: torch.device) -> int:
    """A block's mask seed, from the default generator of `device` (the caller's stream)."""
    return int(torch.randint(0, 2 ** 62, (1,), device=device).item())


def _reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                       dropout: float = 0.0) -> BlockOut:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    extras: tuple = ()
    if dropout > 0:
        seed = _draw_seed(q.device)
        p = p * dropout_scale(seed, p.shape, dropout, p.dtype, p.device)
        extras = (seed,)
    out = torch.matmul(p, _up(v))
    return out.to(q.dtype), lse, extras


def _reference_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, extras: tuple, causal: bool, scale: float,
                        dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))  # this block's share of the final softmax
    do = _up(dout)
    dp = torch.matmul(do, _up(v).transpose(-1, -2))  # d(dropped p)
    if dropout > 0:
        factors = dropout_scale(extras[0], p.shape, dropout, p.dtype, p.device)
        dv = torch.matmul((p * factors).transpose(-1, -2), do)
        dp = dp * factors
    else:
        dv = torch.matmul(p.transpose(-1, -2), do)
    delta = (do * _up(out)).sum(-1, keepdim=True)  # rowsum(dO * O) of the final output
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, _up(k))
    dk = torch.matmul(ds.transpose(-1, -2), _up(q))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE = BlockKernel("reference", _reference_forward, _reference_backward, dropout=True)


# ----------------------------------------------------------------------------- CPU flash


def _cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                       dropout: float = 0.0) -> BlockOut:
    assert dropout == 0.0, "the CPU flash kernel has no dropout (pick chooses the reference)"
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, _up(lse), ()


def _cpu_flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, extras: tuple, causal: bool, scale: float,
                        dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)


CPU_FLASH = BlockKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward, dropout=False)


# ----------------------------------------------------------------------------- CUDA flash


def _cuda_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                        dropout: float = 0.0) -> BlockOut:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout, causal, False, scale=scale)
    return out, _up(lse), (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, extras: tuple, causal: bool, scale: float,
                         dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = extras  # Philox seed and offset: the forward's mask
    # The sequence lengths of this block (the final out / lse may cover a different slice).
    max_q, max_k = q.shape[-2], k.shape[-2]
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cum_q, cum_k, max_q, max_k, dropout, causal,
        seed, offset, scale=scale)


CUDA_FLASH = BlockKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward, dropout=True)

KERNELS = {k.name: k for k in (REFERENCE, CPU_FLASH, CUDA_FLASH)}


def pick(device: torch.device, dtype: torch.dtype, name: Optional[str] = None, dropout: float = 0.0) -> BlockKernel:
    """The kernel for tensors on `device` in `dtype` (or the one `name`d): CUDA's flash kernel
    for fp16/bf16, the CPU flash kernel on the CPU without dropout, else the reference."""
    if name is not None:
        kernel = KERNELS[name]
        if dropout > 0 and not kernel.dropout:
            raise ValueError(f"the {name} attention kernel has no dropout (asked for {dropout:g}); use reference")
        return kernel
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and \
            hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"):
        return CUDA_FLASH
    if device.type == "cpu" and dropout == 0 and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return CPU_FLASH
    return REFERENCE


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
