"""Metrics sinks: TensorBoard holds exactly the JSONL's numbers under Megatron-LM's tags, from
one rank; a restarted run leaves each iteration once (JSONL rewritten, TensorBoard purged, one
W&B run resumed); a run asking for TensorBoard without the package stops at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

from helpers import (
    REPO,
    assert_tensorboard_matches,
    make_config,
    make_trainer,
    read_jsonl,
    run_distributed,
    tensorboard_scalars,
)
from megazero.train.sinks import (
    SAMPLES_RUN,
    TensorBoardSink,
    WandbSink,
    claim,
    drop_records_after,
    saved_run_id,
    set_aside_other_runs,
)

ROOT = str(REPO)



def _events(log_dir: str) -> list[str]:
    return sorted(f for f in os.listdir(log_dir) if f.startswith("events.out.tfevents"))


# ----------------------------------------------------------------------------- TensorBoard


def _train_pp2(root: str) -> None:
    make_trainer(["--parallel.pp", "2", "--train.precision", "fp16", "--train.iters", "2", "--train.eval_interval", "2", "--train.eval_iters", "1",
                  "--logging.jsonl", os.path.join(root, "m.jsonl"),
                  "--logging.tensorboard", os.path.join(root, "tb")]).run()


def test_tensorboard_scalars_equal_the_jsonl_from_one_rank_at_pp2(tmp_path):
    """fp16 at pp 2: the loss scale is logged too, and the logging rank is rank 1 (last stage)."""
    run_distributed(_train_pp2, 2, str(tmp_path))
    records = read_jsonl(str(tmp_path / "m.jsonl"))
    assert [r["iteration"] for r in records] == [1, 2] and "val_loss" in records[1]
    tb = str(tmp_path / "tb")
    assert len(_events(tb)) == 1 and len(_events(os.path.join(tb, SAMPLES_RUN))) == 1  # one writer
    assert {"lm loss", "learning-rate", "grad-norm", "batch-size", "loss-scale", "lm loss validation ppl"} <= set(tensorboard_scalars(tb))
    assert_tensorboard_matches(tb, records)


def _record(iteration: int, loss: float) -> dict:
    return {"iteration": iteration, "loss": loss, "lr": 1e-3 * iteration, "grad_norm": 0.5, "tokens_per_sec": 1e4,
            "tflops_per_device": 0.01, "iteration_time_s": 0.1, "mfu": None, "peak_mem_gib": 0.25, "consumed_samples": 16 * iteration,
            "batch_size": 16, "skipped_iters": 0}


def test_tensorboard_purges_what_a_resumed_run_logs_again(tmp_path):
    """An attempt logs iterations 1-6 and dies; the next resumes from iteration 4 (64 samples)
    and logs 5-8 with other values: each step is there once, with the newer value past 4."""
    first = [_record(i, 10.0 - i) for i in range(1, 7)]
    second = [_record(i, 20.0 - i) for i in range(5, 9)]
    tb = str(tmp_path / "tb")
    for start, recs in ((0, first), (4, second)):
        sink = TensorBoardSink(tb, start, 16 * start)
        for rec in recs:
            sink.write(rec)
        sink.close()
    assert_tensorboard_matches(tb, first[:4] + second)


# ----------------------------------------------------------------------------- JSONL


def test_jsonl_drops_records_past_the_start_and_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"iteration": i, "loss": float(i)}) + "\n" for i in (1, 2, 3, 4, 5)]
    path.write_text("".join(lines) + '{"iteration": 6, "lo')  # a writer killed mid-line
    assert drop_records_after(str(path), 3) == 3
    assert path.read_text() == "".join(lines[:3])
    assert drop_records_after(str(path), 3) == 0 and path.read_text() == "".join(lines[:3])
    assert drop_records_after(str(tmp_path / "absent.jsonl"), 0) == 0


# ----------------------------------------------------------------------------- W&B


def test_wandb_restarts_resume_one_run_per_save_directory(tmp_path, monkeypatch):
    """Without wandb installed: a stand-in module records what wandb.init and log receive."""
    calls: list[tuple] = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data["loss"]))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs["id"], kwargs["resume"]))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = make_config(["--logging.wandb", "true", "--checkpoint.save", str(tmp_path / "ck")])
    for attempt in range(2):
        sink = WandbSink(cfg)
        sink.write(_record(5, 1.0 + attempt))
        sink.close()
    run_id = (tmp_path / "ck" / "wandb_run_id").read_text()
    assert calls == [("init", run_id, "allow"), ("log", 5, 1.0), ("finish",),
                     ("init", run_id, "allow"), ("log", 5, 2.0), ("finish",)]
    calls.clear()
    WandbSink(make_config(["--logging.wandb", "true"]))  # no save directory: nothing to resume
    monkeypatch.delenv("WANDB_MODE")  # megazero's default, offline: W&B cannot resume there
    WandbSink(cfg)
    assert calls == [("init", None, None), ("init", run_id, None)]


def test_another_runs_tensorboard_and_wandb_run_are_set_aside_and_a_resume_keeps_its_own(tmp_path):
    """A fresh run into a save directory another run used: a new run id (its own W&B run, not a
    resume of the other's), that run's TensorBoard directory and JSONL moved aside under its id.
    The same run resuming its checkpoint keeps both in place; a second move numbers the name."""
    save, tb, jsonl = tmp_path / "ck", tmp_path / "tb", tmp_path / "m.jsonl"
    outputs = ["--checkpoint.save", str(save), "--logging.tensorboard", str(tb), "--logging.jsonl", str(jsonl)]
    first = make_config(outputs)
    claim(first)  # as the first run's sinks open
    jsonl.write_text('{"iteration": 1}\n')
    (tb / "events.out.tfevents.1").write_text("first")
    old_id = saved_run_id(str(save))
    (save / "latest").write_text("iter_0000004")
    resume = make_config([*outputs, "--checkpoint.load", str(save)])
    assert set_aside_other_runs(resume) == [] and saved_run_id(str(save)) == old_id
    fresh = make_config([*outputs, "--model.hidden_size", "32"])
    lines = set_aside_other_runs(fresh)
    new_id = saved_run_id(str(save))
    assert new_id not in (None, old_id)
    assert lines == [f"logging.jsonl: {jsonl} held the metrics of another run; moved them to {tmp_path}/m.{old_id}.jsonl",
                     f"logging.tensorboard: {tb} held the metrics of another run; moved them to {tmp_path}/tb.{old_id}"]
    assert sorted(os.listdir(tmp_path)) == ["ck", f"m.{old_id}.jsonl", f"m.{old_id}.jsonl.run.json", f"tb.{old_id}"]
    assert (tmp_path / f"tb.{old_id}" / "events.out.tfevents.1").read_text() == "first"
    # The old run resumes in place of the new one's outputs: the new one's move aside, numbered when taken.
    claim(fresh)
    (save / "wandb_run_id").write_text(old_id)
    jsonl.write_text('{"iteration": 2}\n')
    assert len(set_aside_other_runs(resume)) == 2 and (tmp_path / f"m.{new_id}.jsonl").exists()
    claim(resume)
    jsonl.write_text("")
    (save / "wandb_run_id").write_text(new_id)
    set_aside_other_runs(resume)
    assert (tmp_path / f"m.{old_id}-2.jsonl").exists() and (tmp_path / f"tb.{old_id}-2").is_dir()


# ----------------------------------------------------------------------------- start-up


def test_tensorboard_without_the_package_is_one_line_at_start_up(tmp_path):
    code = ("import sys; sys.modules['tensorboard'] = None; from megazero.train.__main__ import main; "
            f"main(['--config', 'configs/gpt2-tiny.yaml', '--logging.tensorboard', {str(tmp_path / 'tb')!r}])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: logging.tensorboard ({tmp_path / 'tb'}) is set but tensorboard is not "
                                  f"installed; pip install tensorboard"), proc.stderr
    assert not os.path.exists(tmp_path / "tb")
