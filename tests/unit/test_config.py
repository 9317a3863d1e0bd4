"""Config loading, overrides and validation: every bad value stops with one clear line."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest

from helpers import REPO
from megazero.config import ConfigError, build_config, load_yaml, parse_overrides, resolve, validate
from megazero.model.layers import padded_vocab_size
from megazero.train.preflight import resolve_and_validate


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 6\n  hidden_size: 128\ntrain:\n  seed: 5\n")
    cfg = build_config(load_yaml(str(path)), ["--model.num_layers", "8", "--train.precision=bf16"])
    assert cfg.model.num_layers == 8  # CLI wins
    assert cfg.model.hidden_size == 128  # file wins over default
    assert cfg.train.seed == 5 and cfg.train.precision == "bf16"
    assert cfg.model.num_heads == 4  # default
    # The keys the user set are recorded, whatever their value: a default written out is set too.
    assert cfg.set_keys == {"model.num_layers", "model.hidden_size", "train.seed", "train.precision"}
    assert "set_keys" not in cfg.to_dict() and build_config({"train": {"seed": 1234}}) == build_config()  # not compared
    explicit = build_config(None, ["--data.mock", "true", "--zero.hysteresis", "2"])  # 2: the default
    resolve(explicit)
    with pytest.raises(ConfigError, match="zero.hysteresis configures the fp16 loss scaler"):
        validate(explicit, 1)


def test_override_parsing():
    assert parse_overrides(["--a.b", "1", "--c.d=x", "--e.f", "[1, 2]"]) == [
        ("a", "b", 1), ("c", "d", "x"), ("e", "f", [1, 2])]


def test_list_keys_accept_commas():
    """`a,b,c` is `a b c` for list keys, on the command line and in a file; a YAML list stays one value."""
    cfg = build_config({"parallel": {"pp_layers": "3,5"}},
                       ["--finetune.lora_targets", "c_attn,c_proj", "--data.prefix=0.3,A,0.7,B"])
    assert cfg.finetune.lora_targets == ["c_attn", "c_proj"] and cfg.parallel.pp_layers == [3, 5]
    assert cfg.data.prefix == [0.3, "A", 0.7, "B"]
    assert build_config(None, ["--data.prefix", "[0.3, A, 0.7, B]"]).data.prefix == [0.3, "A", 0.7, "B"]
    assert build_config(None, ["--data.split", "949,50,1"]).data.split == "949,50,1"  # not a list key


def test_data_prefix_accepts_single_value():
    cfg = build_config(None, ["--data.prefix", "data/x_text_document"])
    assert cfg.data.prefix == ["data/x_text_document"]


@pytest.mark.parametrize("overrides, world, message", [
    (["--model.foo", "1"], 1, "unknown config key 'model.foo'"),
    (["--modle.num_layers", "1"], 1, "unknown config section 'modle'"),
    (["--model.num_layers", "two"], 1, "model.num_layers ('two') must be an integer"),
    (["--train.precision", "fp8"], 1, "train.precision ('fp8') must be one of fp32, bf16, fp16"),
    (["--model.num_heads", "12", "--model.hidden_size", "120", "--parallel.tp", "5"], 5,
     "model.num_heads (12) must be divisible by parallel.tp (5)"),
    (["--train.global_batch_size", "30", "--train.micro_batch_size", "4"], 4,
     "train.global_batch_size (30) must be a multiple of micro_batch_size x dp (4 x 4 = 16)"),
    (["--parallel.tp", "2"], 3, "world size (3) must be divisible by parallel.tp x parallel.pp (2 x 1 = 2)"),
    (["--zero.stage", "4"], 1, "zero.stage (4) must be 0, 1, 2 or 3"),
    (["--model.num_layers", "6", "--parallel.pp", "4"], 4, "model.num_layers (6) must be divisible by parallel.pp (4)"),
    (["--model.num_layers", "8", "--parallel.pp", "2", "--parallel.vpp", "3"], 2,
     "parallel.vpp (3) must divide num_layers / pp (8 / 2 = 4); try vpp 1 or 2 or 4"),
    (["--model.dropout", "1.5"], 1, "model.dropout (1.5) must be in [0, 1)"),
    (["--model.hidden_size", "100", "--model.num_heads", "3"], 1,
     "model.hidden_size (100) must be divisible by model.num_heads (3)"),
    (["--optim.lr", "1e-4", "--optim.min_lr", "1e-3"], 1, "optim.min_lr (0.001) must not exceed optim.lr (0.0001)"),
    (["--parallel.tp", "4", "--parallel.sequence_parallel", "true", "--model.seq_length", "66"], 4,
     "parallel.sequence_parallel splits model.seq_length (66) over parallel.tp (4): make it a multiple of 4"),
    (["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--finetune.lora_rank", "8"], 2,
     "parallel.sequence_parallel cannot be combined with finetune.lora_rank (8)"),
    # issue 46, 5: Muon under LoRA stepped nothing, while its start-up line counted Newton-Schulz FLOPs
    (["--optim.name", "muon", "--finetune.lora_rank", "8"], 1,
     "optim.name muon with finetune.lora_rank 8: LoRA freezes the block matrices Muon steps"),
])
def test_bad_config_messages(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        resolve_and_validate(build_config({"data": {"mock": True}}, overrides), world)
    assert message in str(err.value)


def test_missing_data_is_an_error():
    with pytest.raises(ConfigError, match="no training data"):
        resolve_and_validate(build_config(None, []), 1)


def test_resolve_fills_in_the_auto_values_and_validate_changes_nothing():
    cfg = build_config({"data": {"mock": True}}, ["--model.num_layers", "4", "--parallel.pp", "2", "--parallel.vpp",
                                                  "2", "--train.global_batch_size", "8", "--train.micro_batch_size", "1"])
    resolve(cfg)
    assert cfg.model.vocab_size == 512 and cfg.parallel.schedule == "interleaved"
    resolved = copy.deepcopy(cfg)
    assert validate(cfg, 2) == 1 and cfg == resolved


def test_padded_vocab():
    assert padded_vocab_size(50257, 1) == 50304
    assert padded_vocab_size(50257, 2) == 50432
    assert padded_vocab_size(512, 4) == 512


def test_cli_bad_config_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml",
                           "--parallel.tp", "3"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: model.num_heads (4) must be divisible by parallel.tp (3)"


def test_cli_missing_config_file():
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", "nope.yaml"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "config file 'nope.yaml' does not exist" in proc.stderr


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b"])
def test_shipped_configs_validate(name):
    cfg = build_config(load_yaml(f"configs/{name}.yaml"))
    assert resolve_and_validate(cfg, cfg.parallel.tp * cfg.parallel.pp) == 1


def test_wandb_without_package_is_a_clear_error():
    import importlib.util
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml",
                           "--logging.wandb", "true"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: logging.wandb is true but wandb is not installed")


# ---------------------------------------------------------------------------- LR schedule


def _lr_run(args: list[str], poison_from: int = -1, poison_to: int = -1) -> dict:
    """Train the tiny model (world of one); NaN losses on iterations [poison_from, poison_to)."""
    import contextlib
    import io
    import os

    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    root = str(REPO)
    cfg = build_config(load_yaml(os.path.join(root, "configs/gpt2-tiny.yaml")),
                       ["--model.seq_length", "16", "--model.num_layers", "2", "--optim.warmup_iters", "2",
                        "--train.max_skipped_steps", "5"] + args)
    resolve_and_validate(cfg, 1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tr = Trainer(cfg, ProcessGrid.create(1, 1))
        tr.chunks[0].register_forward_hook(
            lambda m, a, out: out * float("nan") if poison_from <= tr.iteration < poison_to else out)
        records = tr.run()
    return {"lrs": {r["iteration"]: r["lr"] for r in records}, "printed": printed.getvalue(),
            "steps": tr.schedule.steps, "skipped": tr.skipped_iters}


def _lr_cases(tmp: str) -> dict:
    save = ["--checkpoint.save", tmp, "--checkpoint.load", tmp]
    return {"first": _lr_run(save + ["--train.iters", "6"]),
            "kept": _lr_run(save + ["--train.iters", "9", "--checkpoint.save", tmp + "/kept"]),
            "override": _lr_run(save + ["--train.iters", "9", "--checkpoint.save", tmp + "/override",
                                        "--optim.override_schedule", "true"]),
            "skipping": _lr_run(["--train.iters", "5"], poison_from=1, poison_to=3)}


def test_lr_schedule_is_kept_on_resume_and_skips_do_not_advance_it(tmp_path):
    from helpers import run_distributed
    from megazero.config import OptimConfig
    from megazero.train.lr import LRSchedule
    out = run_distributed(_lr_cases, 1, str(tmp_path))[0]
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_iters=2)
    six, nine = LRSchedule.from_config(optim, 6), LRSchedule.from_config(optim, 9)
    assert out["first"]["lrs"] == {i: pytest.approx(six.at(i - 1)) for i in range(1, 7)}
    # Raised train.iters: the checkpoint's curve goes on (decay over 6 done: min_lr), reported once.
    kept = out["kept"]
    assert kept["lrs"] == {i: pytest.approx(1e-4) for i in range(7, 10)}
    assert "lr schedule: keeping the checkpoint's; the config's change (decay_iters 6 -> 9)" in kept["printed"]
    assert "--optim.override_schedule true" in kept["printed"]
    over = out["override"]
    assert over["lrs"] == {i: pytest.approx(nine.at(i - 1)) for i in range(7, 10)}
    assert "optim.override_schedule is true, using the config's (decay_iters 6 -> 9)" in over["printed"]
    # Iterations 2 and 3 skipped (NaN loss): the schedule stays at step 1 until a step applies.
    skipping = out["skipping"]
    assert skipping["skipped"] == 2 and skipping["steps"] == 3
    five = LRSchedule.from_config(optim, 5)
    assert skipping["lrs"] == {1: pytest.approx(five.at(0)), 2: pytest.approx(five.at(1)), 3: pytest.approx(five.at(1)),
                               4: pytest.approx(five.at(1)), 5: pytest.approx(five.at(2))}


def test_lr_schedule_resume_without_change_is_silent():
    from megazero.config import OptimConfig
    from megazero.train.lr import LRSchedule
    schedule = LRSchedule.from_config(OptimConfig(), 10)
    saved = {**schedule.state_dict(), "steps": 4}
    assert schedule.resume(saved, override=False) is None and schedule.steps == 4


# ---------------------------------------------------------------------------- vocab_size auto


def _bpe_tokenizer(tmp_path) -> str:
    from megazero.data.tokenizer import train_gpt2bpe
    return train_gpt2bpe(["the list of words and the words of the list"] * 20, 300, tmp_path / "tok")


def test_vocab_size_auto_comes_from_the_tokenizer(tmp_path):
    from megazero.data.tokenizer import build_tokenizer
    spec = _bpe_tokenizer(tmp_path)
    size = build_tokenizer(spec).vocab_size
    cfg = build_config({"data": {"mock": True, "tokenizer": spec}})
    resolve_and_validate(cfg, 1)
    assert cfg.model.vocab_size == size  # the real size; the model pads it to 128 x tp
    cfg = build_config({"data": {"mock": True}})
    resolve_and_validate(cfg, 1)
    assert cfg.model.vocab_size == 512  # mock data without a tokenizer
    with pytest.raises(ConfigError) as err:
        resolve_and_validate(build_config({"data": {"mock": True, "tokenizer": spec}, "model": {"vocab_size": size - 1}}), 1)
    assert str(err.value) == (f"model.vocab_size ({size - 1}) is smaller than data.tokenizer {spec!r} ({size} tokens); "
                              f"set --model.vocab_size auto (or at least {size})")
    with pytest.raises(ConfigError, match="model.vocab_size auto needs data.tokenizer"):
        resolve_and_validate(build_config({"data": {"prefix": ["x_text_document"]}}), 1)
    with pytest.raises(ConfigError, match=r"model.vocab_size \('big'\) must be an integer or auto"):
        build_config(None, ["--model.vocab_size", "big"])


# ---------------------------------------------------------------------------- the user's language


def test_list_overrides_take_every_value_up_to_the_next_flag():
    cfg = build_config(None, ["--data.prefix", "0.3", "A", "0.7", "B", "--parallel.pp_layers", "1", "3",
                              "--model.num_layers", "4"])
    assert cfg.data.prefix == [0.3, "A", 0.7, "B"] and cfg.parallel.pp_layers == [1, 3] and cfg.model.num_layers == 4
    assert build_config(None, ["--data.prefix", "[0.5, A, 0.5, B]"]).data.prefix == [0.5, "A", 0.5, "B"]
    with pytest.raises(ConfigError, match="unexpected argument '5'"):
        build_config(None, ["--model.num_layers", "4", "5"])


def test_every_field_is_documented_in_help_and_readme():
    import dataclasses

    from megazero.config import SECTIONS, config_keys, markdown_table, reference
    text, table = reference(), markdown_table()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name} " in text and f"| `{section}.{f.name}` |" in table
    assert [key for key, *_, doc in config_keys() if not doc] == [], "fields without a docstring"
    docs = open("docs/configuration.md").read()
    assert table in docs, "docs/configuration.md's table is out of date: run python scripts/update_readme_config.py"


def test_cli_help_lists_every_key():
    from megazero.config import config_keys
    for flag in ("--help", "--help-config"):
        proc = subprocess.run([sys.executable, "-m", "megazero.train", flag], capture_output=True, text=True)
        assert proc.returncode == 0
        for key, _, default, _ in config_keys():
            assert f"--{key} {default}" in proc.stdout


# ---------------------------------------------------------------------------- DeepSpeed config

DS_ZERO3_BF16 = {  # as DeepSpeed's ZeRO-3 examples write it
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100,
                                                       "warmup_type": "linear", "cos_min_ratio": 0.1}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 2e7,
        "stage3_param_persistence_threshold": 1e6,
        "stage3_max_live_parameters": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _load(tmp_path, ds: dict, yaml_text: str = "data:\n  mock: true\n", overrides=(), world: int = 2):
    import json
    import os

    from megazero.train.__main__ import load_config
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    (tmp_path / "run.yaml").write_text(yaml_text)
    os.environ["WORLD_SIZE"] = str(world)
    try:
        return load_config(str(tmp_path / "run.yaml"), str(tmp_path / "ds_config.json"), list(overrides))
    finally:
        del os.environ["WORLD_SIZE"]


def test_deepspeed_zero3_bf16_config_round_trips(tmp_path, capsys):
    import yaml

    from megazero.config import has_key
    cfg = _load(tmp_path, DS_ZERO3_BF16, "model:\n  hidden_size: 128\ndata:\n  mock: true\n")
    t, z, o = cfg.train, cfg.zero, cfg.optim
    assert (t.global_batch_size, t.micro_batch_size, t.precision, t.log_interval) == (32, 4, "bf16", 10)
    assert (z.stage, z.sub_group_size, z.bucket_size) == (3, 1_000_000_000, 500_000_000)
    assert z.prefetch == 102  # 2e7 elements / (12 x 128^2 per block), rounded up
    assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.clip_grad) == (3e-4, 0.9, 0.95, 1e-8, 0.1, 1.0)
    assert (o.warmup_iters, o.decay_iters, o.decay_style, o.min_lr) == (100, 1000, "cosine", pytest.approx(3e-5))
    assert cfg.checkpoint.save_model_16bit and z.initial_loss_scale == 65536.0  # fp16 is disabled: untouched
    # The resolved config (what a run saves as config.yaml) reads back to the same config.
    from megazero.config import describe
    assert build_config(yaml.safe_load(describe(cfg))) == cfg
    # Keys without an equivalent are listed by name in one line (offload until it exists).
    offload = [] if has_key("zero.offload_optimizer") else [
        "zero_optimization.offload_optimizer.device (cpu)", "zero_optimization.offload_optimizer.pin_memory (true)"]
    listed = offload + ["zero_optimization.stage3_param_persistence_threshold (1e+06)",
                        "zero_optimization.stage3_max_live_parameters (1e+09)"]
    err = capsys.readouterr().err.strip()
    assert err == (f"warning: {tmp_path / 'ds_config.json'}: {len(listed)} DeepSpeed key(s) have no megazero "
                   f"equivalent and are ignored: {', '.join(listed)}")
    if offload == []:
        assert cfg.zero.offload_optimizer == "cpu" and cfg.zero.pin_memory is True
    # CLI overrides still win over the DeepSpeed file.
    assert _load(tmp_path, DS_ZERO3_BF16, overrides=["--zero.stage", "2"]).zero.stage == 2


@pytest.mark.parametrize("change, message", [
    ({"fp16": {"enabled": True}}, "DeepSpeed config enables both bf16 and fp16; enable one"),
    ({"train_batch_size": 30}, "DeepSpeed train_batch_size (30) must equal train_micro_batch_size_per_gpu x "
                               "gradient_accumulation_steps x dp (4 x 4 x 2 = 32)"),
    ({"optimizer": {"type": "Lamb"}}, "DeepSpeed optimizer.type (Lamb) is not supported: megazero trains with Adam/AdamW "
                                         "or SGD"),
    ({"zero_optimization": {"stage": 5}}, "zero.stage (5) must be 0, 1, 2 or 3"),
    ({"gradient_clipping": "high"}, "DeepSpeed gradient_clipping (megazero optim.clip_grad) ('high') must be a number"),
])
def test_bad_deepspeed_config_is_one_clear_line(tmp_path, change, message):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, {**DS_ZERO3_BF16, **change})
    assert message in str(err.value)


def test_deepspeed_fp16_scheduler_defaults_and_auto(tmp_path, capsys):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "train_batch_size": "auto",
          "fp16": {"enabled": True, "initial_scale_power": 12.0, "loss_scale_window": 500, "hysteresis": 4,
                   "min_loss_scale": 2, "consecutive_hysteresis": True},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_max_lr": 2e-3}}}
    cfg = _load(tmp_path, ds)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.precision) == (2, 12, "fp16")
    z = cfg.zero
    assert (z.initial_loss_scale, z.loss_scale_window, z.hysteresis, z.min_loss_scale) == (4096.0, 500, 4, 2.0)
    o = cfg.optim  # the scheduler's LR wins; DeepSpeed's WarmupDecayLR defaults: 1000 warmup steps from 0, log-shaped
    assert (o.lr, o.min_lr, o.warmup_iters, o.decay_iters, o.decay_style) == (2e-3, 0.0, 1000, 50, "linear")
    assert o.eps == 1e-8  # "auto": megazero's value
    err = capsys.readouterr().err
    # Only keys the config wrote are listed: not DeepSpeed's default warmup_type (log) it left out.
    assert "fp16.consecutive_hysteresis (true)" in err and "warmup_type" not in err


@pytest.mark.parametrize("change, message", [
    ({"zero_optimisation": {"stage": 3}}, "DeepSpeed key zero_optimisation.stage is unknown; did you mean "
                                          "zero_optimization.stage?"),
    ({"train_batch_sise": 32}, "DeepSpeed key train_batch_sise is unknown; did you mean train_batch_size?"),
    ({"fp16": {"enabled": False, "loss_scale_windw": 100}}, None),  # a disabled section is not read at all
    ({"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"wieght_decay": 0.1}}},
     "DeepSpeed key optimizer.params.wieght_decay is unknown; did you mean optimizer.params.weight_decay?"),
])
def test_deepspeed_typos_are_errors_with_the_key_meant(tmp_path, change, message):
    """A key one edit away from one megazero reads is a typo, not an unsupported DeepSpeed key:
    ignoring it would run with defaults (ZeRO-0 for a misspelt zero_optimization)."""
    if message is None:
        _load(tmp_path, {**DS_ZERO3_BF16, **change})
        return
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, {**DS_ZERO3_BF16, **change})
    assert str(err.value) == message


def test_json_config_is_read_as_deepspeed(tmp_path):
    import json
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}))
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", str(tmp_path / "ds.json"),
                           "--deepspeed-config", str(tmp_path / "ds.json")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: two DeepSpeed configs")
    from megazero.train.__main__ import load_config
    cfg = load_config(str(tmp_path / "ds.json"), None, ["--data.mock", "true"])
    assert cfg.train.micro_batch_size == 2 and cfg.train.precision == "bf16"
    (tmp_path / "bad.json").write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match=r"DeepSpeed config '.*bad.json' is not valid JSON: Expecting property name"):
        load_config(str(tmp_path / "bad.json"), None, [])


def test_readme_migration_tables_name_real_keys():
    import re

    from megazero.config import has_key
    from megazero.config.deepspeed import SIMPLE
    docs = open("docs/migration.md").read()
    megatron = docs[docs.index("## Coming from Megatron-LM"):docs.index("## Coming from DeepSpeed")]
    deepspeed = docs[docs.index("## Coming from DeepSpeed"):]  # to the end: its checkpoints section too
    pattern = r"`((?:model|parallel|zero|train|optim|data|checkpoint|logging)\.[a-z_0-9]+)"
    assert [k for k in re.findall(pattern, megatron) if not has_key(k)] == []
    # DeepSpeed rows may name keys that land later (offload): those the importer maps when present.
    assert [k for k in re.findall(pattern, deepspeed) if not has_key(k) and k not in SIMPLE.values()] == []
    assert [k for k in SIMPLE if f"`{k.split('.')[-1]}`" not in deepspeed and f"`{k}`" not in deepspeed] == []


@pytest.mark.parametrize("overrides, world", [
    (["--parallel.tp", "2"], 3),  # world size
    (["--parallel.tp", "3"], 3),  # heads
    (["--parallel.cp", "2", "--parallel.cp_impl", "ulysses", "--model.num_heads", "2", "--parallel.tp", "2"], 4),
    (["--parallel.pp", "2", "--parallel.vpp", "3", "--model.num_layers", "8"], 2),
])
def test_validation_and_the_planner_refuse_a_layout_by_the_same_rule(overrides, world):
    """config/rules.py is the one home of the layout rules: validate and the planner's
    layout_problem (and ProcessGrid.create, for the world size) give the same line."""
    from megazero.plan.planner import layout_problem
    cfg = build_config(None, ["--data.mock", "true", *overrides])
    resolve(cfg)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world)
    p = cfg.parallel
    assert layout_problem(cfg, world, p.tp, p.pp, p.vpp, None, p.cp, p.cp_impl) == str(err.value)


@pytest.mark.parametrize("args, suggestion", [
    (["--tp", "2"], "did you mean --parallel.tp?"),  # the planner's short alias, not --fp16
    (["--zero-stage", "3"], "did you mean --zero.stage?"),
    (["--cp", "2"], "did you mean --parallel.cp?"),
    (["--num-layer", "2"], "did you mean --num-layers (megazero's model.num_layers)?"),  # Megatron's flag
    (["--micro_batch_size", "2"], "did you mean --micro-batch-size"),
    (["--model.num_layer", "2"], "unknown config key 'model.num_layer'; did you mean model.num_layers?"),
    (["--modle.num_layers", "2"], "unknown config section 'modle'; did you mean model.num_layers?"),
    (["--train.itres", "2"], "did you mean train.iters?"),
])
def test_unknown_flags_and_keys_name_the_nearest(args, suggestion):
    """Issue 39 (4): every unknown flag or key gets the nearest megazero key, short alias or
    Megatron flag by edit distance."""
    from megazero.train.__main__ import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, None, args, 0, 2)
    assert suggestion in str(e.value)


def test_deepspeed_defaults_are_deepspeeds_and_named_in_one_line(tmp_path, capsys):
    """Issue 39 (5): what a DeepSpeed config leaves out gets DeepSpeed's default (WarmupLR's log
    warm-up, Adam's betas (0.9, 0.999), eps 1e-8 and weight decay 0, no clipping), named in one
    line; the YAML's and the command line's keys win over those defaults."""
    ds = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8, "optimizer": {"type": "Adam", "params": {}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 2e-3}}}
    o = _load(tmp_path, ds).optim
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.clip_grad, o.warmup_style) == (0.9, 0.999, 1e-8, 0.0, 0.0, "log")
    assert (o.lr, o.min_lr, o.warmup_iters) == (2e-3, 0.0, 10)
    line = [x for x in capsys.readouterr().err.splitlines() if "DeepSpeed's defaults" in x]
    assert line == [f"{tmp_path / 'ds_config.json'}: DeepSpeed's defaults for what it leaves out: optim.beta1 0.9, "
                    f"optim.beta2 0.999, optim.eps 1e-08, optim.weight_decay 0, optim.warmup_style log, optim.min_lr 0, "
                    f"optim.clip_grad 0"]
    o = _load(tmp_path, ds, "data:\n  mock: true\noptim:\n  beta2: 0.95\n", overrides=["--optim.clip_grad", "1"]).optim
    assert (o.beta2, o.clip_grad) == (0.95, 1.0)
    assert "optim.beta2" not in capsys.readouterr().err
    # The log warm-up: lr x ln(1 + i) / ln(1 + warm-up), up to the peak at the warm-up's end.
    from megazero.train.lr import LRSchedule
    schedule = LRSchedule(1.0, 0.0, 10, 100, "constant", warmup_style="log")
    assert schedule.at(0) == pytest.approx(math.log(2) / math.log(11)) and schedule.at(9) == pytest.approx(1.0)


def test_unused_cp_impl_is_named_and_scripts_validate_quietly():
    """Issue 39 (8): parallel.cp_impl at cp 1 gets a warning; --quiet (the scripts' validation
    steps before the run, which prints them once) prints errors alone."""
    cmd = [sys.executable, "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml", "--validate-only",
           "--config-only", "--parallel.cp_impl", "ulysses", "--optim.warmup_iters", "100"]
    loud = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert loud.returncode == 0 and loud.stderr.count("warning:") == 2, loud.stderr
    assert "warning: set but not read by this run, so they change nothing: parallel.cp_impl (read with " \
           "parallel.cp > 1)" in loud.stderr
    quiet = subprocess.run([*cmd, "--quiet"], cwd=REPO, capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.startswith("config OK")


def test_keys_set_that_the_run_never_reads_are_named_in_one_warning(tmp_path, capsys):
    """Issue 46, 5: optim.muon_lr (or any key the chosen options never read) was accepted in silence;
    the command line's and a DeepSpeed file's keys get one warning naming them all. A YAML config is a
    template (gpt2-124m.yaml names a pipeline schedule at pp 1): its keys are not warned of."""
    from megazero.train.__main__ import load_config
    cfg = load_config("configs/gpt2-tiny.yaml", None, ["--data.mock", "true", "--optim.muon_lr", "0.05",
                                                       "--optim.muon_ns_steps", "3", "--finetune.lora_alpha", "8"])
    assert cfg.optim.muon_lr == 0.05  # set, and named
    assert capsys.readouterr().err.splitlines() == [
        "warning: set but not read by this run, so they change nothing: optim.muon_lr (read with optim.name muon), "
        "optim.muon_ns_steps (read with optim.name muon), finetune.lora_alpha (read with finetune.lora_rank > 0); "
        "drop them or make that choice"]
    load_config("configs/gpt2-tiny.yaml", None, ["--data.mock", "true", "--optim.name", "muon", "--optim.muon_lr",
                                                 "0.05"])
    load_config(f"{REPO}/configs/gpt2-124m.yaml", None, ["--data.mock", "true"], world_size=1)
    assert capsys.readouterr().err == ""
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}}}')
    load_config(str(ds), None, ["--data.mock", "true", "--optim.name", "sgd"], world_size=1)
    warning = capsys.readouterr().err.splitlines()[-1]
    assert warning == ("warning: set but not read by this run, so they change nothing: optim.eps (read with optim.name "
                       "adamw or muon); drop them or make that choice")  # not DeepSpeed's defaults (beta1 ...)


def test_every_read_only_row_names_keys_of_the_schema():
    """A row left behind by a renamed key would silently stop warning."""
    import fnmatch

    from megazero.config import config_keys
    from megazero.config.reads import READ_ONLY
    keys = [key for key, *_ in config_keys()]
    assert [p for row in READ_ONLY for p in row.keys if not fnmatch.filter(keys, p)] == []
