"""Storage faults: kill -9 of a saving job, damaged checkpoint files on every load path,
a disk that fills (or refuses writes) during a save."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, make_trainer, run_distributed
from megazero.checkpoint import base, sharded
from megazero.harness.spawn import free_port

ROOT = str(REPO)
TINY = ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--train.log_interval", "1"]


# ----------------------------------------------------------------------------- kill -9


def _launch(nproc: int, args: list[str]) -> subprocess.Popen:
    """The training job in a process group of its own (so that the whole job can be killed)."""
    cmd = [sys.executable, "-m", "megazero.train", *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "-m", "megazero.train", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _kill_while_saving(nproc: int, save: str, rng: random.Random) -> str:
    """Start (resuming) a job that saves every iteration; once it is saving, SIGKILL its whole
    process group at a random moment. Returns what it printed."""
    proc = _launch(nproc, TINY + ["--train.iters", "100000", "--checkpoint.interval", "1",
                                  "--checkpoint.save", save, "--checkpoint.load", save])
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("saved checkpoint"):
            break
    kill_at = rng.uniform(0.0, 0.6)  # a save takes a sizeable share of each iteration here
    try:
        proc.wait(timeout=kill_at)
    except subprocess.TimeoutExpired:
        pass
    _kill_job(proc)
    out.append(proc.communicate()[0])
    return "".join(out)


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the whole job at once, as a node failure would: the launcher's process group
    and its workers (torchrun starts each worker in a session of its own)."""
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        workers = [int(pid) for pid in f.read().split()]
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)


def _assert_consistent(save: str) -> str:
    """`latest` names a checkpoint whose every file matches its digest, and every directory
    taken for a complete checkpoint is one (iter_*.tmp and the like never are)."""
    ckpt = sharded.resolve(save)
    assert base.is_intact(ckpt), f"latest names {ckpt}, which does not verify"
    for name in base.complete_checkpoints(save):
        assert base.ITER_DIR.match(name) and base.is_intact(os.path.join(save, name)), name
    return os.path.basename(ckpt)


def _kill_trials(tmp_path, nproc: int, trials: int, seed: int) -> None:
    """Each trial after the first resumes from what the previous kill left and trains on to
    a new save before it is killed in turn."""
    save, rng = str(tmp_path / "ck"), random.Random(seed)
    latest = []
    for trial in range(trials):
        out = _kill_while_saving(nproc, save, rng)
        if trial:
            assert f"resumed from {os.path.join(save, latest[-1])}" in out, out[-3000:]
        latest.append(_assert_consistent(save))
    assert latest == sorted(latest), latest  # training only went forward


def test_kill_9_while_saving_never_corrupts(tmp_path):
    _kill_trials(tmp_path, nproc=1, trials=3, seed=0)


@pytest.mark.slow
def test_kill_9_of_a_distributed_job_while_saving_never_corrupts(tmp_path):
    _kill_trials(tmp_path, nproc=4, trials=8, seed=1)


def _wait_for_a_background_write(save: str, proc: subprocess.Popen, timeout: float = 240) -> str:
    """The iter_ directory whose rank file is being written, once `save` also holds a sealed
    checkpoint (polled: the write lasts a sizeable share of an iteration here)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isfile(os.path.join(save, "latest")):
            writing = glob.glob(os.path.join(save, "iter_*.tmp", "rank_*.pt.tmp*"))
            if writing:
                return os.path.basename(os.path.dirname(writing[0])).removesuffix(".tmp")
        time.sleep(0.002)
    _kill_job(proc)
    raise AssertionError(f"no background write seen: {proc.communicate()[0][-3000:]}")


def test_kill_9_during_a_background_write_leaves_latest_complete(tmp_path):
    """checkpoint.async_save: SIGKILL while a rank file is being written behind training; the
    checkpoint being written never becomes `latest`, the one before it is complete, and the
    run resumes from it."""
    save = str(tmp_path / "ck")
    args = TINY + ["--model.hidden_size", "256", "--checkpoint.async_save", "true", "--checkpoint.interval", "1",
                   "--checkpoint.save", save, "--checkpoint.load", save]
    proc = _launch(1, args + ["--train.iters", "100000"])
    in_flight = _wait_for_a_background_write(save, proc)
    _kill_job(proc)
    proc.communicate()
    latest = _assert_consistent(save)
    assert latest < in_flight and not os.path.exists(os.path.join(save, in_flight)), (latest, in_flight)
    resume_to = int(latest.split("_")[1]) + 2
    done = subprocess.run([sys.executable, "-m", "megazero.train", *args, "--train.iters", str(resume_to)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {os.path.join(save, latest)} at iteration" in done.stdout
    assert _assert_consistent(save) == f"iter_{resume_to:07d}"
    assert not [n for n in os.listdir(save) if n.endswith(".tmp")]  # the killed save's leftovers are gone


# ----------------------------------------------------------------------------- damaged files


ZERO1 = ["--data.mock", "true", "--zero.stage", "1"]  # the spawned ranks' trainers: gpt2-tiny at ZeRO-1


def _damage(path: str, how: str) -> None:
    """Flip one byte in the middle of the file, or cut it in half."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if how == "truncate":
            f.truncate(size // 2)
            return
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0xFF]))


HOWS = ("flip", "truncate")
BAD_SHARD = "rank_tp00_pp000_dp001.pt"  # read by rank 1 alone at the same layout


def _resume_errors(root: str) -> dict:
    """Save iterations 1 and 2 at dp 2; damage copies of them (and of their universal
    export); every trainer load path must refuse each copy, on every rank alike."""
    import torch.distributed as dist

    from megazero.checkpoint.export import write_universal
    from megazero.checkpoint.load import open_checkpoint
    from megazero.errors import UserError

    save = os.path.join(root, "ck")
    make_trainer(ZERO1 + ["--checkpoint.save", save, "--train.iters", "2", "--checkpoint.interval", "1"]).run()
    if dist.get_rank() == 0:
        for how in HOWS:
            shutil.copytree(save, os.path.join(root, how))
            _damage(os.path.join(root, how, "iter_0000002", BAD_SHARD), how)
            write_universal(open_checkpoint(os.path.join(save, "iter_0000002")), os.path.join(root, f"uni_{how}"))
            _damage(os.path.join(root, f"uni_{how}", "exp_avg.safetensors"), how)
    dist.barrier()
    errors = {}
    for how in HOWS:
        for path, load, args in [("same_layout", how, []), ("resharded", how, ["--parallel.tp", "2"]),
                                 ("universal", f"uni_{how}", [])]:
            try:
                make_trainer(ZERO1 + ["--checkpoint.save", os.path.join(root, "unused"),
                                      "--checkpoint.load", os.path.join(root, load)] + args)
                errors[path, how] = None
            except UserError as e:
                errors[path, how] = str(e)
    return errors


def test_damaged_files_are_refused_on_every_load_path(tmp_path, capsys):
    from megazero.checkpoint.load import open_checkpoint
    from megazero.convert import main as convert_main
    from megazero.generate import build_model
    from megazero.parallel.comm import Group

    root = str(tmp_path)
    per_rank = run_distributed(_resume_errors, 2, root)
    assert per_rank[0] == per_rank[1]  # every rank stops with the same line
    errors = per_rank[0]
    for how in HOWS:
        ckpt = os.path.join(root, how)
        # Convert and generate (single process) read the same damaged checkpoint.
        with pytest.raises(SystemExit) as exit_info:
            convert_main(["--load", ckpt, "--to", "torch", "--output", os.path.join(root, f"{how}.pt")])
        assert exit_info.value.code == 2 and not os.path.exists(os.path.join(root, f"{how}.pt"))
        errors["convert", how] = capsys.readouterr().err.strip().removeprefix("error: ")
        with pytest.raises(sharded.CheckpointError) as e:
            build_model(open_checkpoint(ckpt), Group("solo", None, [0], 0))
        errors["generate", how] = str(e.value)
        # A torch export records its digest beside it; generate checks it.
        export = os.path.join(root, f"good_{how}.pt")
        convert_main(["--load", ckpt, "--iteration", "1", "--to", "torch", "--output", export])
        _damage(export, how)
        with pytest.raises(sharded.CheckpointError) as e:
            open_checkpoint(export)
        errors["torch_export", how] = str(e.value)
    what = {"flip": "fails its sha256 check", "truncate": "is truncated or overwritten"}
    for (path, how), message in errors.items():
        assert message is not None and "\n" not in message, (path, how, message)
        assert what[how] in message, (path, how, message)
        if path == "universal":
            assert "exp_avg.safetensors" in message and "re-create it with" in message, message
        elif path == "torch_export":
            assert f"good_{how}.pt" in message and "re-export it" in message, message
        else:
            assert f"{BAD_SHARD} {what[how]}" in message, (path, how, message)
            assert message.endswith("the last good checkpoint is iter_0000001: resume from it with "
                                    "--checkpoint.iteration 1"), (path, how, message)


# ----------------------------------------------------------------------------- disk full


def _limit_file_size(nbytes: int) -> None:
    """Make writes past `nbytes` fail with EFBIG, like a full disk (works as root, where an
    unwritable directory does not stop writes): RLIMIT_FSIZE with SIGXFSZ ignored."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))


def _save_failures(root: str) -> dict:
    """Rank 1 alone runs out of space during saves: every rank must fail (or, with
    on_save_error continue, go on) together, leaving the previous checkpoint and latest."""
    import torch.distributed as dist

    from megazero.checkpoint.base import CheckpointSaveError

    out = {}
    stop = os.path.join(root, "stop")
    trainer = make_trainer(ZERO1 + ["--checkpoint.save", stop, "--train.iters", "2", "--checkpoint.interval", "1"])
    trainer.run()  # saves iterations 1 and 2
    if dist.get_rank() == 1:
        _limit_file_size(4096)  # smaller than a rank file
    trainer.cfg.train.iters = 3
    try:
        trainer.run()
        out["stop"] = None
    except CheckpointSaveError as e:
        out["stop"] = str(e)
    out["stop_latest"] = open(os.path.join(stop, "latest")).read()
    out["stop_intact"] = base.is_intact(os.path.join(stop, "iter_0000002"))
    out["stop_listing"] = sorted(os.listdir(stop))

    cont = os.path.join(root, "continue")
    trainer = make_trainer(ZERO1 + ["--checkpoint.save", cont, "--train.iters", "6", "--checkpoint.interval", "2",
                                    "--checkpoint.on_save_error", "continue"])
    trainer.cfg.train.iters = 2
    if dist.get_rank() == 1:
        _limit_file_size(resource.RLIM_INFINITY)
    trainer.run()  # iteration 2 saved
    if dist.get_rank() == 1:
        _limit_file_size(4096)
    trainer.cfg.train.iters = 5
    try:  # the save at 4 fails and training goes on; the run's last save (5) fails and stops it
        trainer.run()
        out["continue_last"] = None
    except CheckpointSaveError as e:
        out["continue_last"] = str(e)
    out["continue_iteration"] = trainer.iteration
    out["continue_latest"] = open(os.path.join(cont, "latest")).read()
    if dist.get_rank() == 1:
        _limit_file_size(resource.RLIM_INFINITY)  # space again: the next interval's save works
    trainer.cfg.train.iters = 6
    trainer.run()
    out["continue_listing"] = sorted(os.listdir(cont))
    return out


def test_full_disk_during_a_save(tmp_path):
    per_rank = run_distributed(_save_failures, 2, str(tmp_path))
    for out in per_rank:
        stop = out["stop"]
        assert stop is not None and "\n" not in stop, stop
        assert stop.startswith(f"saving iteration 3 to {tmp_path}/stop failed on rank 1: [Errno 27] File too large")
        assert stop.endswith("the previous checkpoint and 'latest' are untouched; free disk space or fix the "
                             "directory (checkpoint.save) and resume with --checkpoint.load")
        assert out["stop_latest"] == "iter_0000002" and out["stop_intact"]
        assert out["stop_listing"] == ["config.yaml", "iter_0000001", "iter_0000002", "latest",
                                       "latest_checkpointed_iteration.txt", "wandb_run_id"]
        assert out["continue_last"].startswith(f"saving iteration 5 to {tmp_path}/continue failed on rank 1")
        assert out["continue_iteration"] == 5 and out["continue_latest"] == "iter_0000002"
        assert out["continue_listing"] == ["config.yaml", "iter_0000002", "iter_0000006", "latest",
                                           "latest_checkpointed_iteration.txt", "wandb_run_id"]


def _background_save_failures(root: str) -> dict:
    """checkpoint.async_save: rank 1 alone runs out of space while its file is written in the
    background. At the first iteration after that, every rank stops with the synchronous
    save's error (or, with on_save_error continue, all go on), and the previous checkpoint and
    latest stay as they were."""
    import torch.distributed as dist

    from megazero.checkpoint.background import BackgroundSave
    from megazero.checkpoint.base import CheckpointSaveError

    rank = dist.get_rank()
    if rank == 1:  # its write has surely failed by its next vote (on a busy machine it could take longer)
        votes = BackgroundSave.votes
        BackgroundSave.votes = lambda self: (self.wait(), votes(self))[1]
    out = {}
    for mode in ("stop", "continue"):
        directory = os.path.join(root, mode)
        trainer = make_trainer(ZERO1 + ["--checkpoint.save", directory, "--train.iters", "2", "--checkpoint.interval",
                                        "2", "--checkpoint.async_save", "true", "--checkpoint.on_save_error", mode])
        trainer.run()  # iteration 2 saved: the run's last save is waited for
        if rank == 1:
            _limit_file_size(4096)  # smaller than a rank file
        trainer.cfg.train.iters = 6 if mode == "stop" else 5  # the save at 4 fails in the background
        with contextlib.redirect_stderr(io.StringIO()) as warned:
            try:
                trainer.run()  # continue: the warning at 5, then the run's last save (5) fails and stops it
                out[mode] = None
            except CheckpointSaveError as e:
                out[mode] = str(e)
        out[f"{mode}_warned"] = warned.getvalue()
        out[f"{mode}_iteration"] = trainer.iteration
        out[f"{mode}_latest"] = open(os.path.join(directory, "latest")).read()
        out[f"{mode}_intact"] = base.is_intact(os.path.join(directory, "iter_0000002"))
        if rank == 1:
            _limit_file_size(resource.RLIM_INFINITY)  # space again: the next save works
        if mode == "continue":
            trainer.cfg.train.iters = 6
            trainer.run()
        out[f"{mode}_listing"] = sorted(os.listdir(directory))
    return out


def test_full_disk_during_a_background_save(tmp_path):
    per_rank = run_distributed(_background_save_failures, 2, str(tmp_path))
    failed = "failed on rank 1: [Errno 27] File too large"
    untouched = ("the previous checkpoint and 'latest' are untouched; free disk space or fix the directory "
                 "(checkpoint.save) and resume with --checkpoint.load")
    for rank, out in enumerate(per_rank):
        assert out["stop"] == f"saving iteration 4 to {tmp_path}/stop {failed}; {untouched}", out["stop"]
        assert out["stop_iteration"] == 5  # the first iteration after the failed write
        assert out["stop_latest"] == "iter_0000002" and out["stop_intact"]
        assert out["stop_listing"] == ["config.yaml", "iter_0000002", "latest", "latest_checkpointed_iteration.txt",
                                         "wandb_run_id"]
        assert out["continue"] == f"saving iteration 5 to {tmp_path}/continue {failed}; {untouched}"
        assert out["continue_iteration"] == 5 and out["continue_latest"] == "iter_0000002" and out["continue_intact"]
        warning = (f"warning: saving iteration 4 to {tmp_path}/continue {failed}; {untouched} "
                   "(checkpoint.on_save_error continue: training on, retrying at the next interval)\n")
        assert out["continue_warned"] == (warning if rank == 0 else "")  # rank 0 logs
        assert out["continue_listing"] == ["config.yaml", "iter_0000002", "iter_0000006", "latest",
                                           "latest_checkpointed_iteration.txt", "wandb_run_id"]
