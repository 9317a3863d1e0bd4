"""Sharded initialization (DeepSpeed's zero.Init, torchtitan's meta-device init).

The model is built on the meta device: shapes and names, no memory. Before ZeRO lays the
parameters out, each one is replaced by a *hollow* parameter of the same shape on the
run's device, which holds no memory either; ZeRO then writes only what this rank
owns (its TP shard, its pipeline stage's chunks and, at stage 3, its DP partition) into its
flat buffers, drawing each value from the model's layout-independent `initial_value`, one
parameter at a time. No rank ever holds the whole model.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from megazero.zero.partition import ShardableModel


def replace_meta_parameters(chunks: Sequence[nn.Module | ShardableModel], device: torch.device, hollow: bool = False) -> bool:
    """Give every meta-device parameter of `chunks` real (uninitialized) memory on `device`,
    or none at all when `hollow`, keeping its Parameter attributes (its placement: torch's
    Module.to_empty would drop it). True when there were any."""
    found = False
    for chunk in chunks:
        for module in chunk.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.device.type == "meta":
                    setattr(module, name, _on_device(p, device, hollow))
                    found = True
    return found


def _on_device(p: nn.Parameter, device: torch.device, hollow: bool) -> nn.Parameter:
    t = torch.empty(p.shape, dtype=p.dtype, device=device)
    if hollow:
        # Keep the shape, drop the memory (never touched on the host; a transient block of
        # the caching allocator on a GPU): ZeRO points .data at its own buffers.
        t.untyped_storage().resize_(0)
    out = nn.Parameter(t, requires_grad=p.requires_grad)
    out.__dict__.update(p.__dict__)
    return out
