"""SGD with momentum on flat fp32 shards (optim.name sgd: Megatron's --optimizer sgd).

torch.optim.SGD's rule, no dampening, no Nesterov: the gradient gains weight_decay x weight
(L2, not decoupled), the momentum buffer becomes momentum x buffer + gradient, the weight
moves by -lr x buffer. torch starts the buffer as the first gradient; megazero's starts at
zero (the exp_avg slot of the optimizer's state), and momentum x 0 + g is g exactly, so
the first step agrees bitwise too (and a fresh optimizer state after a resume is a first step).
PyTorch's fused SGD kernel runs it on CPUs and GPUs alike, one pass per tensor.
"""

from __future__ import annotations

import torch


def sgd_(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], *, lr: float,
         weight_decay: float, momentum: float) -> None:
    """One SGD step of lists of flat fp32 tensors, in place."""
    if params:
        torch._fused_sgd_(params, grads, buffers, weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)
