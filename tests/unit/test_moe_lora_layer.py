"""LoRA on an MoE layer's experts (model/lora.py ExpertLoRA): the stacked adapters give expert j's
tokens exactly W_j + alpha/r B_j A_j, gate and up each with its own adapter; experts split over
ranks are refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError
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


@pytest.mark.parametrize("split", ["ep", "etp"])
def test_adapters_on_experts_split_over_ranks_are_refused_in_one_line(split):
    """ep 2: this rank holds experts 0 and 1; etp 2: it holds half of every expert's width."""
    experts = GroupedExperts(4, H, 2 * FFN, "swiglu")
    if split == "ep":
        experts.c_fc.keep_experts(Group("ep", None, [0, 1], 0))
    else:
        experts.apply_etp(Group("etp", None, [0, 1], 0))
    for weight in (experts.c_fc, experts.c_proj) if split == "etp" else (experts.c_fc,):
        with pytest.raises(ConfigError, match="use --parallel.ep 1 --parallel.etp 1") as refused:
            ExpertLoRA(weight, R, ALPHA, 0.0)
        assert "\n" not in str(refused.value)
