"""AdamW on flat fp32 shards: the update rule, apart from where the state lives.

The optimizer calls it once per sub-group with lists of views (master weights, gradients,
moments); the same function serves state on the device, in host memory or staged from NVMe.
"""

from __future__ import annotations

import torch


def adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], decayed: list[torch.Tensor], *, lr: float, weight_decay: float,
           beta1: float, beta2: float, eps: float, step: int) -> None:
    """AdamW on lists of flat fp32 tensors. On the CPU element for element what
    torch.optim.AdamW (foreach=False) computes, so sharded and unsharded runs agree bitwise
    per element; on a GPU PyTorch's fused kernel (one launch per list, same update up to
    rounding)."""
    if params and params[0].device.type == "cuda":
        _fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, decayed, lr=lr, weight_decay=weight_decay,
                      beta1=beta1, beta2=beta2, eps=eps, step=step)
        return
    if decayed and weight_decay:
        torch._foreach_mul_(decayed, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2 ** step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


def _fused_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], decayed: list[torch.Tensor], *, lr: float, weight_decay: float,
                  beta1: float, beta2: float, eps: float, step: int) -> None:
    """The kernel behind torch.optim.AdamW(fused=True), once for the decayed tensors and
    once for the rest."""
    is_decayed = {id(t) for t in decayed}
    for wd, keep in ((weight_decay, True), (0.0, False)):
        idx = [i for i, p in enumerate(params) if (id(p) in is_decayed) == keep]
        if not idx:
            continue
        step_t = torch.tensor(float(step), device=params[idx[0]].device)  # read, not updated, by the kernel
        torch._fused_adamw_([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                            [exp_avg_sqs[i] for i in idx], [], [step_t] * len(idx), lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
