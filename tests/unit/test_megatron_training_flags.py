"""What the Megatron-LM training flags of the Llama examples change: the zero-centred norm of
--apply-layernorm-1p, LR schedules in samples (--lr-warmup-samples, --lr-decay-samples,
--train-samples, also under a batch ramp-up) and the decoupled LR of the embedding and output
layer (--decoupled-lr, --decoupled-min-lr); --optimizer and --sgd-momentum; the mixture-of-experts
flags (issue 45, 8), read as the config they produce (MoE layers are refused at validation until
they are built)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.config import Config, ConfigError, build_config
from megazero.config.megatron import translate
from megazero.model.gpt import norm
from megazero.train.__main__ import load_config
from megazero.train.lr import LRSchedule


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_is_a_norm_with_weight_one_plus_w(kind):
    cfg = load_config(None, None, f"--mock-data --normalization {kind} --apply-layernorm-1p".split(), 0, 1)
    assert cfg.model.zero_centered_norm
    layer = norm(cfg.model)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 5, cfg.model.hidden_size)
    shape, eps = (cfg.model.hidden_size,), cfg.model.layernorm_eps
    if kind == "LayerNorm":
        torch.nn.init.normal_(layer.bias)
        expected = F.layer_norm(x, shape, 1 + layer.weight, layer.bias, eps)
    else:
        expected = F.rms_norm(x, shape, 1 + layer.weight, eps)
    assert torch.equal(layer(x), expected)


def test_apply_layernorm_1p_starts_as_the_plain_model():
    """The stored weights start at 0, so the first forward equals the model without the flag."""
    from megazero.model.gpt import GPT
    plain = load_config(None, None, ["--mock-data", "--normalization", "RMSNorm"], 0, 1).model
    centred = load_config(None, None, "--mock-data --normalization RMSNorm --apply-layernorm-1p".split(), 0, 1).model
    models = [GPT(m) for m in (plain, centred)]
    for model in models:
        model.init_weights(seed=1)
        model.eval()  # no dropout
    assert not models[1].transformer.ln_f.weight.any()
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        assert torch.equal(models[0](tokens), models[1](tokens))


def test_schedule_in_samples():
    """--lr-warmup-samples 24 --lr-decay-samples 96 at global batch 8: 3 and 12 iterations' worth,
    counted in samples; a warm-up of samples that do not fill whole batches stays exact."""
    line = ("--mock-data --global-batch-size 8 --micro-batch-size 2 --train-iters 20 --lr 1e-3 --min-lr 1e-4 "
            "--lr-decay-style linear --lr-warmup-samples 20 --lr-decay-samples 100").split()
    cfg = load_config(None, None, line, 0, 1)
    s = LRSchedule.from_config(cfg.optim, cfg.train)
    assert (s.unit, s.warmup_iters, s.decay_iters) == (8, 2.5, 12.5)
    lrs = []
    for _ in range(15):
        lrs.append(s.current(8))
        s.step(8)
    assert lrs[0] == pytest.approx(1e-3 * 8 / 20) and lrs[1] == pytest.approx(1e-3 * 16 / 20)
    # after the warm-up: linear from 1e-3 at sample 20 to 1e-4 at sample 100
    assert lrs[5] == pytest.approx(1e-4 + (1 - (40 - 20) / 80) * 9e-4)
    assert lrs[14] == pytest.approx(1e-4)


def test_train_samples_counts_the_ramp_up():
    """--train-samples 100 at global batch 16 with a ramp 8 -> 16 over 32 samples: the steps
    of 8 (until 32 samples are consumed), then of 16."""
    base = "--mock-data --global-batch-size 16 --micro-batch-size 8 --train-samples 100".split()
    assert load_config(None, None, base, 0, 1).train.iters == 6  # 100 // 16
    ramped = load_config(None, None, [*base, "--rampup-batch-size", "8", "8", "32"], 0, 1).train
    assert ramped.iters == 4 + (100 - 32) // 16  # 8, 8, 8, 8 (32 samples), then 16s
    with pytest.raises(ConfigError, match="--train-samples 100 and --train-iters 5 both set the run's length"):
        load_config(None, None, [*base, "--train-iters", "5"], 0, 1)


def test_decoupled_schedule_follows_the_main_curve():
    cfg = load_config(None, None, ("--mock-data --train-iters 10 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 "
                                   "--decoupled-lr 5e-3 --decoupled-min-lr 5e-4").split(), 0, 1)
    main = LRSchedule.from_config(cfg.optim, cfg.train)
    decoupled = main.decoupled(cfg.optim)
    assert decoupled is not None
    for step in range(10):
        main.steps = decoupled.steps = step
        assert decoupled.current() == pytest.approx(5 * main.current())
    cfg.optim.decoupled_min_lr = None  # left out: the main min_lr
    assert main.decoupled(cfg.optim).min_lr == 1e-4  # type: ignore[union-attr]
    cfg.optim.decoupled_lr = None
    assert main.decoupled(cfg.optim) is None


@pytest.mark.parametrize("flags, name, momentum", [("", "adamw", 0.9), ("--optimizer adam", "adamw", 0.9),
                                                   ("--optimizer sgd", "sgd", 0.9),
                                                   ("--optimizer sgd --sgd-momentum 0.8", "sgd", 0.8),
                                                   ("--optimizer muon", "muon", 0.9)])
def test_optimizer_flags_pick_the_update_rule(flags, name, momentum):
    o = load_config(None, None, ["--mock-data", *flags.split()], 0, 1).optim
    assert (o.name, o.sgd_momentum) == (name, momentum)


def test_sgd_momentum_out_of_range_is_one_line():
    with pytest.raises(ConfigError, match=r"optim.sgd_momentum \(1\) must be in \[0, 1\)"):
        load_config(None, None, "--mock-data --optimizer sgd --sgd-momentum 1".split(), 0, 1)


# ----------------------------------------------------------------------------- mixture of experts (issue 45, 8)


def _translated(line: str, *args: str) -> Config:
    """The config a Megatron line (and `args`, each one argument) produces before validation, which refuses
    MoE layers until they are built."""
    t = translate(["--mock-data", *line.split(), *args])
    cfg = build_config({}, t.overrides)
    t.apply(cfg)
    return cfg


@pytest.mark.parametrize("line, expected", [
    ("--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
     "--moe-router-load-balancing-type seq_aux_loss",
     {"model.num_experts": 8, "model.moe_router_topk": 2, "model.moe_ffn_hidden_size": 48,
      "model.moe_aux_loss_coeff": 0.01, "model.moe_z_loss_coeff": 0.001, "model.moe_load_balancing": "seq_aux_loss"}),
    # DeepSeek-V3's router
    ("--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 4 "
     "--moe-router-group-topk 2 --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3",
     {"model.moe_router_score_function": "sigmoid", "model.moe_router_topk_scaling_factor": 2.5,
      "model.moe_router_num_groups": 4, "model.moe_router_group_topk": 2, "model.moe_router_enable_expert_bias": True,
      "model.moe_router_bias_update_rate": 0.001}),
    # Qwen2-MoE: softmax before the top-k, a gated shared expert, q/k/v biases
    ("--moe-router-pre-softmax --moe-shared-expert-intermediate-size 96 --moe-shared-expert-gate --add-qkv-bias",
     {"model.moe_router_pre_softmax": True, "model.moe_shared_expert_ffn_hidden_size": 96,
      "model.moe_shared_expert_gate": True, "model.qkv_bias": True}),
    ("--moe-expert-capacity-factor 1.25 --moe-token-drop-policy position --moe-pad-expert-input-to-capacity",
     {"model.moe_capacity_factor": 1.25, "model.moe_token_drop_policy": "position", "model.moe_pad_to_capacity": True}),
    ("--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type allgather "
     "--moe-per-layer-logging --qk-layernorm",
     {"parallel.ep": 4, "parallel.etp": 1, "parallel.moe_dispatcher": "allgather", "logging.moe_per_layer": True,
      "model.qk_layernorm": True}),
])
def test_moe_flags_become_the_moe_keys(line, expected):
    cfg = _translated(line)
    assert {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in expected} == expected
    assert set(expected) <= cfg.set_keys


@pytest.mark.parametrize("raw, value", [
    ("2", 2),
    ("([0]*3+[1]*5)", [0, 0, 0, 1, 1, 1, 1, 1]),  # DeepSeek-style: the first layers dense
    ("[0,1,1,1]", [0, 1, 1, 1]),
    ("([1]*3+[0]*1)*2", [1, 1, 1, 0, 1, 1, 1, 0]),  # Megatron's help text's example
    ("2*[1, 0]", [1, 0, 1, 0]),
    ("[1]", [1]),  # a one-layer list stays a list
])
def test_moe_layer_freq_expressions(raw, value):
    assert _translated("", "--moe-layer-freq", raw).model.moe_layer_freq == value  # one argument, as a shell quotes it


@pytest.mark.parametrize("raw", ["__import__('os').system('true')", "[0]*[1]", "[[1]]", "1+[1]", "[True]", "[1]*-1",
                                 "[1]*10**9", "[1]*99999*99999", "[0.5]", "layers"])
def test_moe_layer_freq_reads_only_lists_of_integers_over_plus_and_times(raw):
    with pytest.raises(ConfigError, match=r"--moe-layer-freq .*: write an integer k \(every k-th layer MoE\) or a list "
                                          r"of 0 \(dense\) and 1 \(MoE\) built with \+ and \*, e.g. '\(\[0\]\*3"):
        translate(["--moe-layer-freq", raw])


def test_kv_channels_sets_the_head_width_only_when_it_differs():
    """Llama lines pass --kv-channels h / heads (nothing to set); Qwen3's 128 at h 2048 and 32 heads is
    model.kv_channels."""
    cfg = _translated("--hidden-size 64 --num-attention-heads 4 --kv-channels 16")
    assert cfg.model.kv_channels == 0 and "model.kv_channels" not in cfg.set_keys
    assert _translated("--hidden-size 64 --num-attention-heads 4 --kv-channels 32").model.kv_channels == 32
    with pytest.raises(ConfigError, match=r"--kv-channels \(0\) must be a positive head width"):
        _translated("--kv-channels 0")


def test_router_dtype_and_layer_recompute_say_what_megazero_does():
    """fp32 routing is what megazero always does (silent); fp64 is said in one line. Megatron's MoE-layer
    recompute becomes whole-block recompute, the nearest setting that frees the MoE layers' activations."""
    t = translate("--moe-router-dtype fp32".split())
    assert (t.overrides, t.told, t.ignored) == ([], [], [])
    t = translate("--moe-router-dtype fp64 --moe-layer-recompute".split())
    assert t.told == ["--moe-router-dtype fp64: megazero routes in fp32 in every precision (router logits, "
                      "probabilities and combine weights), not fp64",
                      "--moe-layer-recompute: megazero recomputes whole transformer blocks, each MoE layer among them "
                      "(train.recompute full): the MoE layers' activations are freed as in Megatron, attention's too"]
    assert _translated("--recompute-activations --moe-layer-recompute").train.recompute == "full"
    with pytest.raises(ConfigError, match="--moe-router-dtype bf16: megazero builds fp32, fp64; bf16 is outside"):
        translate("--moe-router-dtype bf16".split())


def test_moe_kernel_flags_are_named_in_the_warning_line():
    t = translate("--moe-grouped-gemm --moe-permute-fusion --moe-router-fusion --moe-shared-expert-overlap".split())
    assert t.overrides == [] and t.warning() == (
        "warning: Megatron-LM flags accepted with no effect here (kernel and implementation choices megazero makes "
        "itself): --moe-grouped-gemm, --moe-permute-fusion, --moe-router-fusion, --moe-shared-expert-overlap")


def test_moe_flags_outside_reach_are_named_in_one_line():
    with pytest.raises(ConfigError) as err:
        translate("--num-experts 8 --moe-enable-deepep --moe-deepep-num-sms 20 --moe-use-upcycling "
                  "--moe-router-padding-for-fp8".split())
    line = str(err.value)
    assert "\n" not in line and line.startswith("--moe-enable-deepep, --moe-deepep-num-sms: DeepEP's fused dispatch "
                                                "kernels (Megatron's flex dispatcher) are outside megazero's reach")
    assert "; --moe-use-upcycling: megazero does not turn a dense checkpoint into an MoE one" in line
    assert "; --moe-router-padding-for-fp8: megazero has no FP8 training" in line


@pytest.mark.parametrize("line, message", [
    ("--moe-token-dispatcher-type flex", "--moe-token-dispatcher-type flex: megazero builds alltoall, allgather; flex "
                                         "is outside its reach"),
    ("--moe-router-load-balancing-type sinkhorn", "--moe-router-load-balancing-type sinkhorn: megazero builds aux_loss, "
                                                  "seq_aux_loss, global_aux_loss, none; sinkhorn is outside its reach"),
    ("--moe-token-drop-policy probs", "--moe-token-drop-policy needs --moe-expert-capacity-factor"),
    ("--moe-pad-expert-input-to-capacity", "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
])
def test_moe_flag_values_outside_reach_are_one_line(line, message):
    with pytest.raises(ConfigError, match=message):
        translate(line.split())
