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
                and its backward): no s_q x s_k buffer, so long sequences fit in memory
    cuda_flash  torch's CUDA flash-attention kernel (aten::_scaled_dot_product_flash_attention
                and its backward), for fp16/bf16 on CUDA

`pick(device, dtype)` chooses one; `reference` is the fallback wherever the others do not
apply. `causal` masks key j > query i within the block (both blocks start at the same
position: ring attention calls it only for a rank's own chunks).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

BlockOut = tuple[torch.Tensor, torch.Tensor, tuple]
"""(output [b, h, sq, d] in q's dtype, log-sum-exp [b, h, sq] (accumulation_dtype), kernel extras for backward)."""


class BlockKernel(NamedTuple):
    name: str
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], BlockOut]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(dout, q, k, v, out, lse, extras, causal, scale) -> (dq, dk, dv)."""


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


def _reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> BlockOut:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _up(v))
    return out.to(q.dtype), lse, ()


def _reference_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, extras: tuple, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))  # this block's share of the final softmax
    do = _up(dout)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, _up(v).transpose(-1, -2))
    delta = (do * _up(out)).sum(-1, keepdim=True)  # rowsum(dO * O) of the final output
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, _up(k))
    dk = torch.matmul(ds.transpose(-1, -2), _up(q))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE = BlockKernel("reference", _reference_forward, _reference_backward)


# ----------------------------------------------------------------------------- CPU flash


def _cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> BlockOut:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, _up(lse), ()


def _cpu_flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, extras: tuple, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
    return dq, dk, dv


CPU_FLASH = BlockKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)


# ----------------------------------------------------------------------------- CUDA flash


def _cuda_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> BlockOut:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, _up(lse), (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, extras: tuple, causal: bool,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = extras
    # The sequence lengths of this block (the final out / lse may cover a different slice).
    max_q, max_k = q.shape[-2], k.shape[-2]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal,
        seed, offset, scale=scale)
    return dq, dk, dv


CUDA_FLASH = BlockKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)

KERNELS = {k.name: k for k in (REFERENCE, CPU_FLASH, CUDA_FLASH)}


def pick(device: torch.device, dtype: torch.dtype, name: Optional[str] = None) -> BlockKernel:
    """The kernel for tensors on `device` in `dtype` (or the one `name`d): CUDA's flash kernel
    for fp16/bf16, the CPU flash kernel on the CPU, else the reference."""
    if name is not None:
        return KERNELS[name]
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and \
            hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"):
        return CUDA_FLASH
    if device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return CPU_FLASH
    return REFERENCE


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
