"""AdamW on flat fp32 shards: the update rule, apart from where the state lives.

The optimizer calls it once per sub-group with lists of views (master weights, gradients,
moments); the same function serves state on the device, in host memory or staged from NVMe.
It is PyTorch's fused AdamW kernel (the one behind torch.optim.AdamW(fused=True)) on CPUs and
GPUs alike: one pass over memory per tensor instead of the ~9 of a foreach composition, and
element for element the same update whatever the sharding, so every layout agrees bitwise
with the single process. `python scripts/bench_offload.py adamw` measures it against the
machine's memory-bandwidth bound.
"""

from __future__ import annotations

import torch


def adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], *, lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
           step: int) -> None:
    """One AdamW step (bias-corrected, decoupled weight decay) of lists of flat fp32 tensors, in place."""
    if params:
        step_t = torch.tensor(float(step), device=params[0].device)  # read, not updated, by the kernel
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step_t] * len(params), lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
