"""DeepSpeed configs shaped like the ones people publish, read at the world size they were
written for and moved to 2 ranks (the command line's batch sizes win over the file's)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from helpers import REPO, read_jsonl, torchrun
from megazero.config import ConfigError
from megazero.config.deepspeed import FIXED, HANDLED, ROWS, SCHEDULER_DEFAULTS, SCHEDULERS, SIMPLE, markdown_table
from megazero.train.__main__ import load_config

# ZeRO-3 with parameters and optimizer offloaded to the CPU, bf16, WarmupDecayLR, for 8 GPUs
# (the shape of DeepSpeed's and Hugging Face's ZeRO-3 offload examples, without "auto").
ZERO3_OFFLOAD_BF16 = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 2000,
                                                      "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e6,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "gather_16bit_weights_on_model_save": True,
    },
}

# fp16 with dynamic loss scaling, Adam, WarmupLR, ZeRO-2, for 16 GPUs (DeepSpeedExamples' shape).
FP16_ADAM_WARMUP = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 100,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 1000,
                                                 "warmup_type": "linear"}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "initial_scale_power": 12, "hysteresis": 2,
             "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
}

# Hugging Face's ds_config_zero3.json: every value the Trainer fills in is "auto".
HF_ALL_AUTO = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {  # the ZeRO-3 offload section above, under the older name of the 16-bit gather
        **{k: v for k, v in ZERO3_OFFLOAD_BF16["zero_optimization"].items() if k != "gather_16bit_weights_on_model_save"},
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

MOCK = ["--data.mock", "true"]


def _load(tmp_path, ds: dict, world: int, overrides=()):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    return load_config(str(path), None, [*MOCK, *overrides], world_size=world)


def test_zero3_offload_bf16_at_its_own_world_size_and_moved(tmp_path, capsys):
    cfg = _load(tmp_path, ZERO3_OFFLOAD_BF16, world=8)
    t, z, o = cfg.train, cfg.zero, cfg.optim
    assert (t.global_batch_size, t.micro_batch_size, t.precision) == (64, 2, "bf16")
    assert (z.stage, z.offload_optimizer, z.offload_param, z.pin_memory) == (3, "cpu", "cpu", True)
    assert (o.lr, o.min_lr, o.warmup_iters, o.decay_iters, o.decay_style) == (2e-4, 0.0, 100, 2000, "linear")
    assert cfg.checkpoint.save_model_16bit  # DeepSpeed's current name, without stage3_
    assert "re-derived" not in capsys.readouterr().err
    # Moved to 2 ranks as written: the file's batch sizes do not multiply out there.
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, ZERO3_OFFLOAD_BF16, world=2)
    assert str(err.value) == ("DeepSpeed train_batch_size (64) must equal train_micro_batch_size_per_gpu x "
                              "gradient_accumulation_steps x dp (2 x 4 x 2 = 16); fix one of them, or, for another "
                              "world size than the file's, give the batch sizes on the command line "
                              "(--train.micro_batch_size, --train.global_batch_size): they win over the file")
    # The command line's global batch wins; the file's micro-batch stays; accumulation is re-derived.
    cfg = _load(tmp_path, ZERO3_OFFLOAD_BF16, world=2, overrides=["--train.global_batch_size", "8"])
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (8, 2)
    assert ("note: DeepSpeed gradient_accumulation_steps (4) is re-derived as 2 from the command line's batch "
            "sizes: train.global_batch_size 8 = train.micro_batch_size 2 x 2 x dp 2") in capsys.readouterr().err


def test_fp16_adam_warmup_at_its_own_world_size_and_moved(tmp_path, capsys):
    cfg = _load(tmp_path, FP16_ADAM_WARMUP, world=16)
    t, z, o = cfg.train, cfg.zero, cfg.optim
    assert (t.global_batch_size, t.micro_batch_size, t.precision) == (256, 16, "fp16")
    assert (z.stage, z.initial_loss_scale, z.loss_scale_window, z.hysteresis, z.min_loss_scale) == \
        (2, 4096.0, 500, 2, 1.0)
    assert z.bucket_size == 200_000_000
    assert (o.lr, o.beta2, o.weight_decay, o.warmup_iters, o.decay_style) == (1e-4, 0.999, 0.01, 1000, "constant")
    cfg = _load(tmp_path, FP16_ADAM_WARMUP, world=2,
                overrides=["--train.micro_batch_size", "4", "--train.global_batch_size", "16"])
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.precision) == (16, 4, "fp16")
    err = capsys.readouterr().err
    assert ("note: DeepSpeed gradient_accumulation_steps (1) is re-derived as 2 from the command line's batch "
            "sizes: train.global_batch_size 16 = train.micro_batch_size 4 x 2 x dp 2") in err
    assert err.count("re-derived") == 1


@pytest.mark.parametrize("world", [8, 2])
def test_hf_all_auto_keeps_megazeros_values(tmp_path, world):
    batch = ["--train.global_batch_size", str(4 * world)]  # megazero's micro-batch (4) on every rank
    defaults = load_config(None, None, [*MOCK, *batch], world_size=world)
    cfg = _load(tmp_path, HF_ALL_AUTO, world=world, overrides=batch)
    assert (cfg.zero.stage, cfg.zero.offload_optimizer, cfg.zero.offload_param) == (3, "cpu", "cpu")
    assert cfg.checkpoint.save_model_16bit and cfg.optim.decay_style == "linear"
    assert cfg.model == defaults.model and cfg.train.log_interval == 2000  # steps_per_print is no "auto"
    assert dataclasses.replace(cfg.train, log_interval=defaults.train.log_interval) == defaults.train
    o, d = cfg.optim, defaults.optim
    assert (o.lr, o.min_lr, o.warmup_iters, o.decay_iters, o.beta1, o.beta2, o.eps, o.weight_decay, o.clip_grad) == \
        (d.lr, d.min_lr, d.warmup_iters, d.decay_iters, d.beta1, d.beta2, d.eps, d.weight_decay, d.clip_grad)
    assert cfg.zero.bucket_size == defaults.zero.bucket_size and cfg.zero.prefetch == defaults.zero.prefetch
    # "enabled": "auto" keeps megazero's precision; the fp16 section's values then apply.
    fp16 = _load(tmp_path, HF_ALL_AUTO, world=world, overrides=["--train.precision", "fp16", *batch])
    assert fp16.train.precision == "fp16" and fp16.zero.initial_loss_scale == 65536.0


def test_autotp_size_sets_tp_and_the_data_parallel_degree(tmp_path, capsys):
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "tensor_parallel": {"autotp_size": 2}}
    cfg = _load(tmp_path, ds, world=4)  # dp = 4 / tp 2 = 2: 4 x 2 x 2 = 16
    assert cfg.parallel.tp == 2 and cfg.train.global_batch_size == 16
    # The command line's tp wins, and the batch check uses it (dp 4).
    with pytest.raises(ConfigError, match=r"\(4 x 2 x 4 = 32\)"):
        _load(tmp_path, ds, world=4, overrides=["--parallel.tp", "1"])
    assert _load(tmp_path, {**ds, "tensor_parallel": {"autotp_size": 0}}, world=2).parallel.tp == 1  # 0: AutoTP off
    _load(tmp_path, {**ds, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}, world=4)
    assert "tensor_parallel.tp_overlap_comm (true)" in capsys.readouterr().err


def test_one_batch_size_on_the_command_line(tmp_path, capsys):
    """The micro-batch alone on the command line: the file's global batch stays, accumulation
    is re-derived; without a global batch in the file the file's accumulation derives it."""
    cfg = _load(tmp_path, ZERO3_OFFLOAD_BF16, world=2, overrides=["--train.micro_batch_size", "4"])
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (64, 4)
    assert "gradient_accumulation_steps (4) is re-derived as 8" in capsys.readouterr().err
    cfg = _load(tmp_path, ZERO3_OFFLOAD_BF16, world=2, overrides=["--train.micro_batch_size", "8"])
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (64, 8)
    assert "re-derived" not in capsys.readouterr().err  # 64 = 8 x 4 x 2: the file's 4 holds, nothing to say
    ds = {k: v for k, v in ZERO3_OFFLOAD_BF16.items() if k != "train_batch_size"}
    cfg = _load(tmp_path, ds, world=2, overrides=["--train.micro_batch_size", "8"])
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (64, 8)  # 8 x 4 x 2
    assert "re-derived" not in capsys.readouterr().err


def test_a_zero_micro_batch_on_the_command_line_gets_the_validation_line(tmp_path):
    """Checked by validation's one line (no division by it while the file's batch keys are read)."""
    with pytest.raises(ConfigError, match=r"train.micro_batch_size \(0\) must be at least 1"):
        _load(tmp_path, ZERO3_OFFLOAD_BF16, world=2, overrides=["--train.micro_batch_size", "0"])


def test_a_parameter_of_another_scheduler_is_listed_as_unsupported(tmp_path, capsys):
    """cos_min_ratio belongs to WarmupCosineLR, warmup_max_lr to WarmupLR and WarmupDecayLR: each
    under the other is not read, and said so (DeepSpeed's constructor would refuse it)."""
    warmup = FP16_ADAM_WARMUP["scheduler"]
    _load(tmp_path, {**FP16_ADAM_WARMUP, "scheduler": {**warmup, "params": {**warmup["params"], "cos_min_ratio": 0.1}}},
          world=16)
    assert "scheduler.params.cos_min_ratio (0.1)" in capsys.readouterr().err
    cosine = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100,
                                                   "cos_min_ratio": 0.1, "warmup_max_lr": 1e-3}}
    cfg = _load(tmp_path, {**FP16_ADAM_WARMUP, "scheduler": cosine}, world=16)
    err = capsys.readouterr().err
    assert "scheduler.params.warmup_max_lr (0.001)" in err and "cos_min_ratio" not in err
    assert cfg.optim.decay_style == "cosine" and cfg.optim.decay_iters == 100


def test_sgd_is_translated_with_its_momentum(tmp_path, capsys):
    """Issue 46, 5: "type": "SGD" (torch.optim.SGD under DeepSpeed) was refused with "megazero trains
    with AdamW"; it is optim.name sgd, with its lr, momentum and weight decay (torch's 0 when left out)."""
    sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.8, "weight_decay": 1e-4, "nesterov": False,
                                     "foreach": True}}
    no_scheduler = {k: v for k, v in FP16_ADAM_WARMUP.items() if k != "scheduler"}  # it would set the LR
    o = _load(tmp_path, {**no_scheduler, "optimizer": sgd}, world=16).optim
    assert (o.name, o.lr, o.sgd_momentum, o.weight_decay) == ("sgd", 0.05, 0.8, 1e-4)
    assert "optim.beta2" not in capsys.readouterr().err  # Adam's defaults are not SGD's
    o = _load(tmp_path, {**FP16_ADAM_WARMUP, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}, world=16).optim
    assert (o.name, o.sgd_momentum, o.weight_decay) == ("sgd", 0.0, 0.0)
    assert "optim.sgd_momentum 0, optim.weight_decay 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"DeepSpeed optimizer.params.nesterov \(true\): megazero's SGD"):
        _load(tmp_path, {**FP16_ADAM_WARMUP, "optimizer": {"type": "SGD", "params": {"nesterov": True}}}, world=16)
    with pytest.raises(ConfigError, match=r"optimizer.type \(Lamb\) is not supported: megazero trains with Adam/AdamW "
                                          r"or SGD"):
        _load(tmp_path, {**FP16_ADAM_WARMUP, "optimizer": {"type": "Lamb"}}, world=16)


# ----------------------------------------------------------------------------- README's table (generated from ROWS)


def test_every_key_the_importer_reads_has_a_readme_row():
    """A mapping added to SIMPLE, FIXED or HANDLED without a row would be missing from README."""
    documented = {key for row in ROWS for key in row.keys}
    assert sorted({*SIMPLE, *FIXED, *HANDLED} - documented) == []
    # A row naming a key the importer no longer reads (renamed or dropped) would document nothing.
    read = {*SIMPLE, *FIXED, *HANDLED, *(f"scheduler.params.{name}" for name in SCHEDULER_DEFAULTS)}
    assert sorted(documented - read) == []


def test_each_readme_row_names_its_keys_and_every_scheduler():
    """Rows with hand-written cells must still name the keys they claim to document."""
    table = markdown_table()
    lines = table.splitlines()[2:]
    assert len(lines) == len(ROWS)
    for row, line in zip(ROWS, lines):
        assert [key for key in row.keys if key.rpartition(".")[2] not in line] == [], line
    assert [kind for kind in SCHEDULERS if f"`{kind}`" not in table] == []


def test_readme_deepspeed_table_is_current():
    doc = os.path.join(str(REPO), "docs", "migration.md")
    with open(doc) as f:
        assert markdown_table() in f.read(), \
            "docs/migration.md's DeepSpeed table is out of date: run python scripts/update_readme_config.py"


def _train_two_ranks(tmp_path, ds: dict, extra: list[str]) -> list[dict]:
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    out = tmp_path / "m.jsonl"
    root = str(REPO)
    proc = torchrun(2, ["--config", str(tmp_path / "ds_config.json"), *MOCK, "--train.iters", "2",
                        "--train.log_interval", "1", "--logging.jsonl", str(out), *extra], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(str(out))


@pytest.mark.slow  # ~15 s each on an idle 2-core machine; the config tests above are the short form
@pytest.mark.parametrize("name", ["zero3_offload_bf16", "fp16", "hf_auto"])
def test_published_configs_train_on_two_ranks(tmp_path, name):
    ds, extra = {"zero3_offload_bf16": (ZERO3_OFFLOAD_BF16, ["--train.global_batch_size", "8"]),
                 "fp16": (FP16_ADAM_WARMUP, ["--train.micro_batch_size", "2", "--train.global_batch_size", "8"]),
                 "hf_auto": (HF_ALL_AUTO, ["--train.precision", "bf16"])}[name]
    records = _train_two_ranks(tmp_path, ds, extra)
    assert [r["iteration"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
