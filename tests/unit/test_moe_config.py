"""The mixture-of-experts keys (issue 45, 1): typed and validated in one line each, the defaults a
dense model, and what megazero cannot train yet (experts split over other ranks than the TP
group's, Muon on experts split over ranks) refused at start-up instead of trained otherwise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megazero.config import ConfigError, build_config
from megazero.train.preflight import resolve_and_validate

MOE = ["--model.num_experts", "8", "--model.num_layers", "4"]


def _refusal(overrides: list[str], world: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        resolve_and_validate(build_config({"data": {"mock": True}}, overrides), world)
    return str(err.value)


def test_defaults_are_a_dense_model():
    cfg = build_config({"data": {"mock": True}})
    m, p = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_capacity_factor, m.qk_layernorm, m.kv_channels, m.qkv_bias) == (0, None, False, 0, False)
    assert (p.ep, p.etp, p.expert_tp) == (1, 0, 1)
    assert resolve_and_validate(cfg, 1) == 1


@pytest.mark.parametrize("overrides", [
    [],  # Mixtral: 8 experts, top-2
    ["--model.moe_layer_freq", "0", "1", "1", "1", "--model.moe_ffn_hidden_size", "32"],  # first layer dense
    ["--model.moe_layer_freq", "2"],
    ["--model.moe_router_score_function", "sigmoid", "--model.moe_router_enable_expert_bias", "true",
     "--model.moe_router_num_groups", "4", "--model.moe_router_group_topk", "2",
     "--model.moe_router_topk_scaling_factor", "2.5"],  # DeepSeek-V3's router
    ["--model.moe_shared_expert_ffn_hidden_size", "64", "--model.moe_shared_expert_gate", "true",
     "--model.moe_router_pre_softmax", "true"],  # Qwen2-MoE
    ["--model.moe_capacity_factor", "1.25", "--model.moe_token_drop_policy", "position"],
    ["--parallel.ep", "4", "--parallel.tp", "2", "--parallel.etp", "1"],  # experts over tp x dp ranks
])
def test_a_valid_moe_config_passes_every_rule(overrides):
    """Valid configs pass (dp is the world over tp); at tp 2 also with etp left to its default, tp
    (each expert split over the TP group)."""
    world, tp = (8, 2) if "--parallel.ep" in overrides else (1, 1)
    assert resolve_and_validate(build_config({"data": {"mock": True}}, MOE + overrides), world) == world // tp
    if "--parallel.ep" in overrides:
        cfg = build_config({"data": {"mock": True}}, MOE + overrides[:-2])
        assert cfg.parallel.expert_tp == 2 and resolve_and_validate(cfg, world) == world // tp


@pytest.mark.parametrize("overrides, world, message", [
    (["--model.moe_router_topk", "9"], 1, "model.moe_router_topk (9) must be in 1..model.num_experts (8), e.g. 2"),
    (["--model.moe_router_topk", "1"], 1, "model.moe_router_topk 1 with softmax after the top-k gives every token "
                                          "weight 1 and the router no gradient"),
    (["--model.moe_layer_freq", "0", "1"], 1, "model.moe_layer_freq ([0, 1]) must list 0 (dense) or 1 (MoE) for "
                                              "each of model.num_layers (4) layers, e.g. [0, 1, 1, 1]"),
    (["--model.moe_layer_freq", "0", "2", "1", "1"], 1, "model.moe_layer_freq ([0, 2, 1, 1]) must list 0"),
    (["--model.moe_layer_freq", "0,0,0,0"], 1, "model.moe_layer_freq ([0, 0, 0, 0]) makes no layer MoE"),
    (["--model.moe_layer_freq", "0"], 1, "model.moe_layer_freq (0) must be at least 1"),
    (["--model.moe_router_num_groups", "3", "--model.moe_router_group_topk", "1"], 1,
     "model.moe_router_num_groups (3) must divide model.num_experts (8) into equal groups; try 2 or 4"),
    (["--model.moe_router_num_groups", "4", "--model.moe_router_group_topk", "5"], 1,
     "model.moe_router_group_topk (5) must be in 1..model.moe_router_num_groups (4)"),
    (["--model.moe_router_group_topk", "2"], 1, "model.moe_router_group_topk (2) needs model.moe_router_num_groups"),
    (["--model.moe_router_num_groups", "4", "--model.moe_router_group_topk", "1", "--model.moe_router_topk", "3"],
     1, "model.moe_router_topk (3) exceeds the experts of moe_router_group_topk (1) groups of 2"),
    (["--model.moe_router_enable_expert_bias", "true"], 1,
     "model.moe_router_enable_expert_bias biases sigmoid scores (DeepSeek-V3); set "
     "model.moe_router_score_function sigmoid"),
    (["--model.moe_router_score_function", "sigmoid", "--model.moe_router_pre_softmax", "true"], 1,
     "model.moe_router_pre_softmax applies to softmax scores, but moe_router_score_function is sigmoid"),
    (["--model.moe_token_drop_policy", "position"], 1, "model.moe_token_drop_policy applies when tokens are dropped, "
                                                       "but model.moe_capacity_factor is null (dropless)"),
    (["--model.moe_pad_to_capacity", "true"], 1, "model.moe_pad_to_capacity applies when tokens are dropped"),
    (["--model.moe_capacity_factor", "0"], 1, "model.moe_capacity_factor (0) must be positive"),
    (["--model.moe_shared_expert_gate", "true"], 1, "model.moe_shared_expert_gate gates the shared expert, but "
                                                    "model.moe_shared_expert_ffn_hidden_size is 0 (none)"),
    (["--model.moe_aux_loss_coeff", "-1"], 1, "model.moe_aux_loss_coeff (-1.0) must not be negative"),
    (["--model.moe_load_balancing", "sinkhorn"], 1, "model.moe_load_balancing ('sinkhorn') must be one of aux_loss, "
                                                    "seq_aux_loss, global_aux_loss, none"),
    (["--parallel.ep", "3"], 4, "parallel.ep (3) x parallel.etp (1) must divide the ranks of a pipeline stage, "
                                "tp x cp x dp (1 x 1 x 4 = 4); try ep 2 or 4"),
    (["--parallel.ep", "4", "--model.num_experts", "6", "--model.moe_router_topk", "2"], 4,
     "parallel.ep (4) must divide model.num_experts (6): each EP rank holds whole experts; try ep 2"),
    (["--parallel.tp", "2", "--parallel.etp", "4"], 8,
     "parallel.etp (4) must be 1 or parallel.tp (2): experts split over other ranks than the TP group's are not "
     "built; use --parallel.etp 2 (the default) or --parallel.etp 1"),
    (["--parallel.tp", "2", "--parallel.etp", "2", "--model.moe_ffn_hidden_size", "33"], 2,
     "the experts' MLP width (33, model.moe_ffn_hidden_size) must be divisible by parallel.etp (2)"),
])
def test_bad_moe_values_are_one_line_each(overrides, world, message):
    assert message in _refusal(MOE + overrides, world)


def test_dense_split_without_experts_is_refused():
    assert ("parallel.ep (2) and parallel.etp (0) split experts, but model.num_experts is 0 (a dense model); set "
            "model.num_experts, or parallel.ep 1 and parallel.etp 0") in _refusal(["--parallel.ep", "2"], 2)


QWEN = ["--model.normalization", "rmsnorm", "--model.position_embedding", "rope", "--model.activation", "swiglu",
        "--model.bias", "false", "--model.num_query_groups", "2"]


@pytest.mark.parametrize("overrides, tp", [
    (["--model.qk_layernorm", "true", "--model.kv_channels", "24"], 2),  # Qwen3: QK-norm, heads of 24, not h / heads
    (["--model.qkv_bias", "true"], 2),  # Qwen2: biases on q, k, v alone
    (["--model.num_heads", "3", "--model.kv_channels", "16", "--model.num_query_groups", "1"], 1),  # 64 / 3: no
])
def test_dense_attention_keys_validate(overrides, tp):
    """QK-norm, a head size of its own and q/k/v-only biases are built: they pass validation."""
    cfg = build_config({"data": {"mock": True}}, QWEN + overrides + ["--parallel.tp", str(tp)])
    assert resolve_and_validate(cfg, tp) == 1


@pytest.mark.parametrize("overrides, message", [
    (["--model.kv_channels", "15"], "rotary embeddings need an even head dimension: model.kv_channels is 15"),
    (["--model.kv_channels", "-8"], "model.kv_channels (-8) must not be negative"),
    (["--model.num_heads", "3"], "model.hidden_size (64) must be divisible by model.num_heads (3); or set "
                                 "model.kv_channels, the head size"),
])
def test_bad_head_sizes_are_one_line(overrides, message):
    assert message in _refusal(QWEN + overrides)


def test_dense_keys_at_their_dense_values_pass():
    """kv_channels equal to hidden / heads and qkv_bias beside model.bias true build the model of today."""
    cfg = build_config({"data": {"mock": True}}, ["--model.kv_channels", "16", "--model.qkv_bias", "true"])
    assert resolve_and_validate(cfg, 1) == 1


def test_experts_split_over_other_ranks_than_tp_stop_at_start_up_with_one_line():
    """etp = tp trains (tests/parallel/test_moe_expert_tensor_parallel.py); an etp other than 1 and tp
    stops the launch with one line and exit code 2."""
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml",
                           "--model.num_experts", "8", "--parallel.ep", "2", "--parallel.tp", "2", "--parallel.etp",
                           "4", "--validate-only", "--train.global_batch_size", "32", "--world-size", "8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: parallel.etp (4) must be 1 or parallel.tp (2): experts split over other ranks than the TP group's are "
        "not built; use --parallel.etp 2 (the default) or --parallel.etp 1"]


def test_lora_on_the_experts_and_on_attention_passes():
    """An MLP target of an MoE model adapts its experts (tests/parallel/test_moe_lora.py), Mixtral's
    names (w1, w3, w2) included."""
    llama_moe = MOE + ["--model.normalization", "rmsnorm", "--model.position_embedding", "rope", "--model.activation",
                       "swiglu", "--finetune.lora_rank", "4"]
    for targets in (["q_proj", "down_proj"], ["q_proj", "o_proj"], ["w1", "w3", "w2"]):
        cfg = build_config({"data": {"mock": True}}, llama_moe + ["--finetune.lora_targets", *targets])
        assert resolve_and_validate(cfg, 1) == 1
