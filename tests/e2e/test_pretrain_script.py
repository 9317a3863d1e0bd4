"""The main job end to end (short form): corpus, tokenizer, dataset, tp2 x pp2 x dp2 ZeRO-1
training with evaluation and a checkpoint, then a resume by running it again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from helpers import REPO, TINY_CONFIG, make_texts, write_jsonl
from megazero.harness.spawn import free_port

ROOT = str(REPO)


def _run(tmp_path, iters: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DATA_DIR": str(tmp_path / "data"), "RUN_DIR": str(tmp_path / "run"),
           "ITERS": str(iters), "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    return subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--train.log_interval", "2", "--train.eval_interval", "4",
                           "--train.eval_iters", "2", "--checkpoint.interval", "4", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_main_job_trains_evaluates_saves_and_resumes(tmp_path):
    proc = _run(tmp_path, 8)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "tp 2 x pp 2 x dp 2" in proc.stdout
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["iteration"] for r in records] == [2, 4, 6, 8]
    assert records[-1]["loss"] < records[0]["loss"]
    assert all("val_loss" in r and "val_ppl" in r for r in records if r["iteration"] % 4 == 0)
    assert open(tmp_path / "run" / "checkpoints" / "latest").read() == "iter_0000008"
    assert (tmp_path / "data" / "corpus_text_document.bin").exists()

    proc = _run(tmp_path, 10)  # again: resumes from iteration 8
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["iteration"] for r in records][-1] == 10

    # Again with another model over the same run directory: the checkpoint does not fit. The
    # error is printed once, not retried by torchrun (RESTARTS is 3), and the script exits 2.
    proc = _run(tmp_path, 12, "--model.hidden_size", "32")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "model.hidden_size" in errors[0], proc.stderr[-3000:]
    assert "torchrun restart" not in proc.stdout


def test_a_save_directory_of_ones_own_is_where_the_script_resumes_from(tmp_path, bpe_spec):
    """--checkpoint.save DIR on the command line: the run saves there and, run again, resumes
    from there (not from $RUN_DIR/checkpoints). Its metrics go beside DIR, to DIR.metrics.jsonl,
    not to runs/gpt2-cpu-demo/metrics.jsonl, the default run's (issue 46, 1). Short form: one process."""
    save = tmp_path / "mine" / "ck"
    env = {**os.environ, "CONFIG": TINY_CONFIG, "NPROC": "1", "TP": "1", "PP": "1", "ZERO_STAGE": "0",
           "TOKENIZER": bpe_spec, "INPUT": str(write_jsonl(tmp_path / "corpus.jsonl", make_texts(200))),
           "DATA_DIR": str(tmp_path / "data")}
    env.pop("RUN_DIR", None)
    default = REPO / "runs" / "gpt2-cpu-demo" / "metrics.jsonl"
    before = default.stat().st_mtime_ns if default.exists() else None
    for iters in (2, 4):
        proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--train.iters", str(iters), "--checkpoint.save",
                               str(save), "--checkpoint.interval", "2"], cwd=ROOT, capture_output=True, text=True,
                              env={**env, "MASTER_PORT": str(free_port())}, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert open(save / "latest").read() == f"iter_{iters:07d}"
        assert ("resumed from" in proc.stdout) == (iters == 4), proc.stdout
    records = [json.loads(line) for line in open(tmp_path / "mine" / "ck.metrics.jsonl")]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert (default.stat().st_mtime_ns if default.exists() else None) == before
    assert f"checkpoints in {save}, metrics in {save}.metrics.jsonl" in proc.stdout


def test_bad_layout_is_refused_before_anything_is_prepared_or_launched(tmp_path):
    env = {**os.environ, "DATA_DIR": str(tmp_path / "data"), "RUN_DIR": str(tmp_path / "run"), "NPROC": "3",
           "TP": "3", "PP": "1"}
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "error: model.num_heads (4) must be divisible by parallel.tp (3)\n"
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_megatron_flags_reach_the_config_check(tmp_path):
    """The script passes Megatron-LM flags on: its config check (before anything is prepared)
    reads them as megazero.train does, an unknown one included."""
    env = {**os.environ, "DATA_DIR": str(tmp_path / "data"), "RUN_DIR": str(tmp_path / "run"), "NPROC": "3"}
    for args, error in (
            (["--tensor-model-parallel-size", "3", "--pipeline-model-parallel-size", "1"],
             "error: model.num_heads (4) must be divisible by parallel.tp (3)\n"),
            (["--num-layer", "4"], "error: unknown flag --num-layer: neither a megazero key nor a Megatron-LM flag "
                                   "megazero reads; did you mean --num-layers (megazero's model.num_layers)?\n")):
        proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr == error
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_slurm_example_creates_its_log_folder_and_submits_itself(tmp_path):
    """Outside a job, `bash scripts/pretrain_gpt.slurm ARGS` makes runs/ (Slurm opens
    runs/%x-%j.out before the script runs) and hands itself to sbatch (a stand-in here)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "pretrain_gpt.slurm"), tmp_path / "scripts")
    (tmp_path / "bin").mkdir()
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text('#!/usr/bin/env bash\necho "sbatch in $PWD: $*"\n')
    sbatch.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "pretrain_gpt.slurm"), "--train.iters", "5"],
                          cwd=str(tmp_path / "scripts"), env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"sbatch in {tmp_path}: scripts/pretrain_gpt.slurm --train.iters 5\n"
    assert (tmp_path / "runs").is_dir()
