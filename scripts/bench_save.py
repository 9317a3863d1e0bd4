"""Training stall per checkpoint save, synchronous against asynchronous (checkpoint.async_save).

    python scripts/bench_save.py [--config configs/gpt2-124m.yaml] [--interval 4] [--saves 2] [--rounds 2]
                                 [--save-dir DIR] [--section.key value ...]

Each run is one training process (a world of one) in a fresh interpreter, mock data, fp32,
seq 128, micro-batch 1 unless overridden, in three modes: no saves, a synchronous save every
--interval iterations, an asynchronous one. The modes alternate for --rounds rounds, so
that a machine whose load changes treats them alike. Per mode it prints:
  step      median seconds of an iteration without a save in it;
  blocked   seconds per save the training loop spent inside the save (sync: the whole save;
            async: copying the shard to host memory, sealing the checkpoint, and waiting for
            a write still running at the next save), and of that: copy (taking the rank's
            state: sync copies it to fresh host memory too) and wait (async only);
  stall     seconds per save the run took longer than the no-save run over the same
            iterations (what training really lost, including the background writer's use of
            the CPU and disk while training went on);
  peak RSS  of the process (async keeps its host copy of the shard between saves).
The window is iterations 1 to (saves + 1) x interval - 1; the save that ends every run
(waited for in both modes) is outside it, except the wait for an asynchronous write still
running by then, which belongs to the window's last save. A measurement, not a test:
nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Callable

from megazero.checkpoint.background import BackgroundSave
from megazero.harness.configs import CHECKOUT
from megazero.harness.spawn import RankFailed, run_ranks

MODES = ("none", "sync", "async")
DEFAULTS = ["--data.mock", "true", "--train.precision", "fp32", "--model.seq_length", "128",
            "--train.micro_batch_size", "1", "--train.global_batch_size", "1", "--model.dropout", "0.0",
            "--train.recompute", "none", "--train.log_interval", "1000000", "--train.eval_interval", "0",
            "--logging.jsonl", "null", "--checkpoint.load", "null", "--checkpoint.keep_last", "1"]


class SaveClock:
    """Times a trainer's iterations and the seconds its loop spends in saves.

    The measured window runs from the first iteration's start to the last one's; the save
    at the last iteration (waited for in every mode) is outside it, but an asynchronous save
    still being written by then is waited for first, and that wait is counted (`tail_s`):
    it belongs to the window's last save."""

    def __init__(self, trainer, iters: int):
        self.iters, self.starts = iters, []
        self.saving_s = 0.0  # in saves started inside the window
        self.tail_s = 0.0
        self._inside = self._tail = False
        self.copy_s = 0.0  # of saving_s: taking the rank's state (async: into the host snapshot)
        self.wait_s = 0.0  # of saving_s: async, waiting for a background write to end
        manager = trainer.checkpoints
        step, save, finish = trainer.train_step, manager.save, manager.finish
        trainer.rank_state = self._part(trainer.rank_state, "copy_s")
        BackgroundSave.wait = self._part(BackgroundSave.wait, "wait_s")  # this process's own class: a benchmark

        def timed_step():
            self.starts.append(time.perf_counter())
            return step()

        def timed_save(*args, **kwargs):
            return save(*args, **kwargs) if self._last() else self._count(save, *args, **kwargs)

        def timed_finish(*args, **kwargs):
            if self._last():
                if manager.pending.save.iteration >= iters:  # the last save's own finish: not counted
                    return finish(*args, **kwargs)
                self._tail = True
                return _timed(finish, args, kwargs, self._tail_ended)
            return finish(*args, **kwargs) if self._inside else self._count(finish, *args, **kwargs)
        trainer.train_step, manager.save, manager.finish = timed_step, timed_save, timed_finish

    def _part(self, fn: Callable, field: str) -> Callable:
        """fn, its seconds added to `field` when they fall in a counted save."""
        def add(seconds: float) -> None:
            if self._inside or (self._last() and field == "wait_s" and self._tail):
                setattr(self, field, getattr(self, field) + seconds)
        return lambda *args, **kwargs: _timed(fn, args, kwargs, add)

    def _last(self) -> bool:
        return len(self.starts) >= self.iters

    def _count(self, fn: Callable, *args, **kwargs):
        self._inside = True
        return _timed(fn, args, kwargs, self._counted)

    def _counted(self, seconds: float) -> None:
        self._inside = False
        self.saving_s += seconds

    def _tail_ended(self, seconds: float) -> None:
        self._tail = False
        self.tail_s = seconds

    def result(self) -> dict:
        return {"starts": self.starts, "blocked_s": self.saving_s + self.tail_s, "copy_s": self.copy_s,
                "wait_s": self.wait_s,
                "window_s": self.starts[-1] - self.starts[0] + self.tail_s}


def _timed(fn: Callable, args: tuple, kwargs: dict, ended: Callable[[float], None]):
    """fn(*args, **kwargs); then, even when it raised, ended(the seconds it took)."""
    tic = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        ended(time.perf_counter() - tic)


def _run_mode(mode: str, config: str, overrides: list[str], iters: int, interval: int, save_dir: str) -> dict:
    """One training run in this (fresh) process: its SaveClock's figures and peak RSS."""
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.__main__ import load_config
    from megazero.train.trainer import Trainer

    saving = [] if mode == "none" else ["--checkpoint.save", save_dir, "--checkpoint.interval", str(interval),
                                        "--checkpoint.async_save", str(mode == "async").lower()]
    cfg = load_config(config, None, DEFAULTS + ["--train.iters", str(iters)] + saving + overrides, world_size=1)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg, ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp))
    clock = SaveClock(trainer, iters)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.run()
    return {**clock.result(), "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def run_fresh(*args) -> dict:
    """_run_mode(*args) in a fresh process, so that each mode's memory and threads are its own."""
    try:
        return run_ranks(_run_mode, 1, *args, threads=None, backend=None)[0]
    except RankFailed as e:
        if e.exitcode is None:  # it raised: its traceback says why
            raise
        # killed from outside (the OOM killer): say so instead of a traceback
        raise SystemExit(f"error: the benchmark process died (exit code {e.exitcode}); on a shared "
                         f"machine, check the free memory and run it again") from None


def summarize(runs: dict[str, list[dict]], interval: int, iters: int) -> list[str]:
    """The table: per mode, medians over rounds."""
    saves = (iters - 1) // interval  # the saves started before the last iteration
    none = statistics.median(r["window_s"] for r in runs["none"])
    lines = [f"{'mode':<6} {'step s':>7} {'blocked s/save':>15} {'(copy':>7} {'wait)':>7} {'stall s/save':>13} "
             f"{'window s':>9} {'peak RSS GiB':>13}"]
    for mode, rs in runs.items():
        # Iteration i's interval (its start to the next one's) holds a save when interval divides i.
        plain = [b - a for r in rs for i, (a, b) in enumerate(zip(r["starts"], r["starts"][1:]), start=1)
                 if mode == "none" or i % interval]
        window = statistics.median(r["window_s"] for r in rs)
        blocked, copy, wait = (statistics.median(r[k] for r in rs) / saves for k in ("blocked_s", "copy_s", "wait_s"))
        stall = (window - none) / saves if mode != "none" else 0.0
        lines.append(f"{mode:<6} {statistics.median(plain):>7.2f} {blocked:>15.2f} {copy:>7.2f} {wait:>7.2f} "
                     f"{stall:>13.2f} {window:>9.1f} {max(r['peak_rss_gib'] for r in rs):>13.2f}")
    lines.append(f"({saves} saves, every {interval} iterations, in a window of iterations 1..{iters - 1}; medians "
                 f"over {len(runs['none'])} round(s))")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpt2-124m.yaml", help="model config of the saved run (default: %(default)s)")
    parser.add_argument("--interval", type=int, default=4, help="iterations between saves (default: %(default)s)")
    parser.add_argument("--saves", type=int, default=2, help="saves inside the measured window (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three modes (default: %(default)s)")
    parser.add_argument("--save-dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args, overrides = parser.parse_known_args()
    if args.interval < 2 or args.saves < 1 or args.rounds < 1:
        parser.error(f"--interval ({args.interval}) must be at least 2, --saves ({args.saves}) and --rounds "
                     f"({args.rounds}) at least 1")
    iters = args.interval * (args.saves + 1)  # the measured saves, then the last iteration's (unmeasured)
    root = tempfile.mkdtemp(prefix="bench_save_", dir=args.save_dir)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for r in range(args.rounds):
            for mode in MODES:
                save_dir = os.path.join(root, f"{mode}{r}")
                runs[mode].append(run_fresh(mode, os.path.join(CHECKOUT, args.config), overrides, iters, args.interval,
                                            save_dir))
                shutil.rmtree(save_dir, ignore_errors=True)
                done = runs[mode][-1]
                print(f"round {r + 1}/{args.rounds} {mode}: window {done['window_s']:.1f} s, in saves "
                      f"{done['blocked_s']:.1f} s (copy {done['copy_s']:.1f} s, wait {done['wait_s']:.1f} s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(summarize(runs, args.interval, iters)))


if __name__ == "__main__":
    main()
