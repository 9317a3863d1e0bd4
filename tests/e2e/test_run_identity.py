"""What a run starts from and writes into, when settings disagree (issue 39, 1 and 6): a config
file's checkpoint.load against the command line's init_from_hf or save directory, a metrics file
another run wrote (moved aside: issue 46, 1), and a finished run started again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from megazero.config import build_config
from megazero.train.preflight import PreflightError, starting_point_line


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "megazero.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)


def test_a_finished_run_says_so_and_another_runs_metrics_are_moved_aside(tmp_path):
    config = tmp_path / "run.yaml"
    jsonl, save = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "ck"
    config.write_text((REPO / "configs" / "gpt2-tiny.yaml").read_text() +
                      f"checkpoint:\n  save: {save}\n  load: {save}\n")
    first = _train("--config", str(config), "--train.iters", "2", "--logging.jsonl", str(jsonl))
    assert first.returncode == 0, first.stderr[-2000:]
    records, run_id = jsonl.read_text(), (save / "wandb_run_id").read_text()
    # (39.6) Started again: nothing to do, said in one line, exit 0, the metrics untouched.
    again = _train("--config", str(config), "--train.iters", "2", "--logging.jsonl", str(jsonl))
    assert again.returncode == 0 and "already at train.iters 2; nothing to train\n" in again.stdout, again.stderr
    assert jsonl.read_text() == records and "moved" not in again.stdout
    # (46.1) Another run (its own save directory, from scratch) was refused, exit 2; now the file
    # moves aside with its identity, under the old run's id, said in one line, and the run runs.
    other = _train("--config", str(config), "--train.iters", "2", "--checkpoint.load", "null",
                   "--checkpoint.save", str(tmp_path / "other"), "--logging.jsonl", str(jsonl))
    assert other.returncode == 0, other.stderr[-2000:]
    aside = tmp_path / "run" / f"metrics.{run_id}.jsonl"
    assert f"logging.jsonl: {jsonl} held the metrics of another run; moved them to {aside}\n" in other.stdout
    assert aside.read_text() == records and json.loads(Path(f"{aside}.run.json").read_text())["run_id"] == run_id
    assert [r["iteration"] for r in map(json.loads, jsonl.read_text().splitlines())] == [1, 2]
    assert json.loads(Path(f"{jsonl}.run.json").read_text())["run_id"] == (tmp_path / "other" / "wandb_run_id").read_text()
    # With a path of its own it runs; the line says where it starts from and where it saves.
    branch = _train("--config", str(config), "--train.iters", "3", "--checkpoint.save", str(tmp_path / "other"),
                    "--logging.jsonl", str(tmp_path / "other.jsonl"))
    assert branch.returncode == 0, branch.stderr[-2000:]
    assert (f"starting from the checkpoint in checkpoint.load {save} (from {config}); saving into checkpoint.save "
            f"{tmp_path / 'other'} (from the command line)\n") in branch.stdout


def test_the_same_command_twice_without_a_save_directory_just_works(tmp_path):
    """The README's example (no checkpoint.save: each start is a run of its own) failed the second
    time with 'holds the metrics of another run', exit 2. Now the first run's metrics move aside,
    named by its start time, and nothing is lost."""
    jsonl = tmp_path / "tiny" / "metrics.jsonl"
    command = ("--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--train.iters", "2",
               "--logging.jsonl", str(jsonl))
    assert _train(*command).returncode == 0
    records, started = jsonl.read_text(), json.loads(Path(f"{jsonl}.run.json").read_text())["started"]
    second = _train(*command)
    assert second.returncode == 0, second.stderr[-2000:]
    aside = tmp_path / "tiny" / f"metrics.{started}.jsonl"
    assert f"held the metrics of another run; moved them to {aside}\n" in second.stdout, second.stdout
    assert aside.read_text() == records and len(jsonl.read_text().splitlines()) == 2


def test_init_from_hf_against_a_checkpoint_in_load(tmp_path):
    """A checkpoint in the file's checkpoint.load and the command line's init_from_hf: refused,
    naming both and where each came from; in the run's own save directory the resume wins, said."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "latest").write_text("iter_0000300")
    cfg = build_config({"checkpoint": {"load": str(ckpt), "save": str(ckpt)}},
                       ["--checkpoint.init_from_hf", "W/hf", "--checkpoint.save", str(tmp_path / "hfinit")])
    with pytest.raises(PreflightError) as refused:
        starting_point_line(cfg, "demo.yaml")
    assert str(refused.value) == (f"checkpoint.load {ckpt} (from demo.yaml) holds a checkpoint, which a run resumes "
                                  f"from in place of checkpoint.init_from_hf W/hf (from the command line); pass "
                                  f"--checkpoint.load null to start from W/hf, or --checkpoint.save {ckpt} to resume "
                                  f"that run in its own save directory")
    own = build_config({"checkpoint": {"load": str(ckpt), "save": str(ckpt), "init_from_hf": "W/hf"}})
    assert starting_point_line(own, "demo.yaml") == (
        f"resuming from the checkpoint in checkpoint.load {ckpt} (from demo.yaml), this run's save directory: "
        f"checkpoint.init_from_hf W/hf (from demo.yaml) is for a fresh start")
    empty = build_config({"checkpoint": {"load": str(tmp_path / "none")}}, ["--checkpoint.init_from_hf", "W/hf"])
    assert starting_point_line(empty) is None  # nothing to resume: the weights are read


@pytest.mark.slow  # suite budget
def test_the_fixes_the_init_from_hf_refusal_names_start_from_the_llama_config(tmp_path):
    """configs/llama-finetune.yaml (no model keys: init_from_hf gives them) with another run's
    checkpoint in checkpoint.load: refused; each fix the line names, followed as written, starts
    (issue 46, 3): --checkpoint.load null from the HF weights, --checkpoint.save LOAD resuming."""
    import re

    from helpers import save_random_hf
    hf = save_random_hf(tmp_path / "hf", "llama", vocab_size=128, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=32)
    other, mine = str(tmp_path / "other"), str(tmp_path / "mine")
    small = ["--config", "configs/llama-finetune.yaml", "--checkpoint.init_from_hf", hf, "--data.mock", "true",
             "--train.global_batch_size", "1", "--train.iters", "1", "--model.seq_length", "16"]
    assert _train(*small, "--checkpoint.save", other).returncode == 0
    refused = _train(*small, "--train.iters", "2", "--checkpoint.load", other, "--checkpoint.save", mine)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    fixes = re.findall(r"(--checkpoint\.\w+) (\S+) to ", refused.stderr)
    assert fixes == [("--checkpoint.load", "null"), ("--checkpoint.save", other)], refused.stderr
    for fix in fixes:
        run = _train(*small, "--train.iters", "2", "--checkpoint.load", other, "--checkpoint.save", mine, *fix)
        assert run.returncode == 0, run.stderr[-2000:]
        assert ("resuming from the checkpoint" in run.stdout) == (fix[0] == "--checkpoint.save"), run.stdout
