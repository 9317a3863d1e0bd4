"""Config loading, overrides and validation: every bad value stops with one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megazero.config import ConfigError, build_config, load_yaml, padded_vocab_size, parse_overrides, validate


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 6\n  hidden_size: 128\ntrain:\n  seed: 5\n")
    cfg = build_config(load_yaml(str(path)), ["--model.num_layers", "8", "--train.precision=bf16"])
    assert cfg.model.num_layers == 8  # CLI wins
    assert cfg.model.hidden_size == 128  # file wins over default
    assert cfg.train.seed == 5 and cfg.train.precision == "bf16"
    assert cfg.model.num_heads == 4  # default


def test_override_parsing():
    assert parse_overrides(["--a.b", "1", "--c.d=x", "--e.f", "[1, 2]"]) == [
        ("a", "b", 1), ("c", "d", "x"), ("e", "f", [1, 2])]


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
])
def test_bad_config_messages(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate(build_config({"data": {"mock": True}}, overrides), world)
    assert message in str(err.value)


def test_missing_data_is_an_error():
    with pytest.raises(ConfigError, match="no training data"):
        validate(build_config(None, []), 1)


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
    assert validate(cfg, cfg.parallel.tp * cfg.parallel.pp) == 1


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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = build_config(load_yaml(os.path.join(root, "configs/gpt2-tiny.yaml")),
                       ["--model.seq_length", "16", "--model.num_layers", "2", "--optim.warmup_iters", "2",
                        "--train.max_skipped_steps", "5"] + args)
    validate(cfg, 1)
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
    from distributed import run_distributed

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
