"""What the Megatron-LM training flags of the Llama examples change: the zero-centred norm of
--apply-layernorm-1p, LR schedules in samples (--lr-warmup-samples, --lr-decay-samples,
--train-samples, also under a batch ramp-up) and the decoupled LR of the embedding and output
layer (--decoupled-lr, --decoupled-min-lr); --optimizer and --sgd-momentum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError
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
