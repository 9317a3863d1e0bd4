"""LoRA on an MoE layer's experts (model/lora.py ExpertLoRA): the stacked adapters give expert j's
tokens exactly W_j + alpha/r B_j A_j, gate and up each with its own adapter; experts split over
ranks are refused in one line."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.model.lora import ExpertLoRA
from megazero.model.moe import GroupedExperts
from megazero.parallel.comm import Group

E, H, FFN, R, ALPHA = 3, 8, 5, 2, 4.0


def _experts() -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(E, H, FFN, "swiglu")
    ExpertLoRA(experts.c_fc, R, ALPHA, 0.0, ("gate_proj", 0, FFN))
    ExpertLoRA(experts.c_fc, R, ALPHA, 0.0, ("up_proj", FFN, 2 * FFN))
    ExpertLoRA(experts.c_proj, R, ALPHA, 0.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)  # B too: the adapters count from the start
    return experts


def test_expert_adapters_are_each_experts_own():
    experts = _experts()
    counts = torch.tensor([4, 0, 3])  # an expert without tokens too
    x = torch.randn(int(counts.sum()), H)
    got = experts(x, counts)
    s = ALPHA / R
    fc, proj = experts.c_fc, experts.c_proj
    rows = []
    for j, xj in enumerate(x.split(counts.tolist())):
        gate = fc.weight[j, :FFN] + s * fc.gate_proj.lora_B.weight[j] @ fc.gate_proj.lora_A.weight[j]
        up = fc.weight[j, FFN:] + s * fc.up_proj.lora_B.weight[j] @ fc.up_proj.lora_A.weight[j]
        down = proj.weight[j] + s * proj.lora_B.weight[j] @ proj.lora_A.weight[j]
        rows.append((F.silu(xj @ gate.t()) * (xj @ up.t())) @ down.t())
    torch.testing.assert_close(got, torch.cat(rows), rtol=0, atol=1e-5)
    assert experts.c_fc.gate_proj.lora_A.weight.shape == (E, R, H)
    assert experts.c_proj.lora_B.weight.shape == (E, H, R)


def test_adapters_of_experts_split_over_ep_and_etp_are_this_ranks_parts():
    """At ep 2 a rank's adapters are its experts' (their placement the full [E, ...]). Split over
    expert-TP ranks (GroupedExperts.apply_etp), c_fc's B is cut by rows as its weight (A whole),
    c_proj's A by columns as its weight (B whole), as a dense projection's under TP."""
    from megazero.parallel.placement import placement
    experts = GroupedExperts(4, H, FFN, "swiglu")
    experts.c_fc.keep_experts(Group("ep", None, [0, 1], 0))  # ep 2: this rank holds experts 0 and 1
    lora = ExpertLoRA(experts.c_fc, R, ALPHA, 0.0)
    assert lora.holder.lora_A.weight.shape == (2, R, H) and lora.holder.lora_B.weight.shape == (2, 2 * FFN, R)
    assert placement(lora.holder.lora_A.weight).full_shape == (4, R, H)
    assert not placement(lora.holder.lora_B.weight).sharded  # whole experts: nothing recorded as split
    split = GroupedExperts(4, H, 2 * FFN, "swiglu")
    split.apply_etp(Group("etp", None, [0, 1], 0))  # etp 2: half of every expert's width
    up, down = ExpertLoRA(split.c_fc, R, ALPHA, 0.0), ExpertLoRA(split.c_proj, R, ALPHA, 0.0)
    a, b = (placement(w) for w in (up.holder.lora_A.weight, up.holder.lora_B.weight))
    assert up.holder.lora_A.weight.shape == (4, R, H) and not a.sharded
    assert up.holder.lora_B.weight.shape == (4, 2 * FFN, R) and (b.dim, b.stride, b.full_shape) == (1, 2, (4, 4 * FFN, R))
    a, b = (placement(w) for w in (down.holder.lora_A.weight, down.holder.lora_B.weight))
    assert down.holder.lora_A.weight.shape == (4, R, FFN) and (a.dim, a.full_shape) == (2, (4, R, 2 * FFN))
    assert down.holder.lora_B.weight.shape == (4, H, R) and not b.sharded
