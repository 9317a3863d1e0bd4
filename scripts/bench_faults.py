"""Fault-injection benchmark (issue 14): inject N faults of each kind into a small training
job under torchrun and report how many were survived with nothing lost, and the seconds from
the fault to resumed training.

    python scripts/bench_faults.py [--trials 3] [--iters 150] [--nproc 2] [--kinds worker_sigkill ...]

"Survived with nothing lost" means: the job (relaunched the way the fault calls for) finishes
all iterations, its final checkpoint verifies, and its last loss equals, bit for bit, that of
an uninterrupted run of the same job (resume is exact, so any lost or repeated state shows).

Kinds:
  worker_sigkill      SIGKILL one worker; torchrun --max-restarts restarts the job, which resumes
  job_sigkill_save    SIGKILL the whole job (launcher and workers) while it saves every
                      iteration; the job is launched again and resumes
  flipped_byte        flip a byte of the newest checkpoint; the relaunch must refuse it with
                      one line naming the file and the last good checkpoint; the job is then
                      resumed from the checkpoint that line names
  truncated_file      the same with the file cut short
  disk_full           the job runs out of space during a save (RLIMIT_FSIZE, EFBIG: as root an
                      unwritable directory stops nothing); it must stop with one line and
                      leave the previous checkpoint and `latest`; relaunched with space, it resumes
  stuck_rank          SIGSTOP one worker; the process-group timeout (train.timeout_minutes)
                      must end the attempt, and torchrun --max-restarts restarts the job

Not a test: it takes minutes and measures times. Requires Linux (/proc, RLIMIT_FSIZE).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from typing import Callable, Optional

from megazero.atomic import write_text
from megazero.checkpoint import base, sharded
from megazero.harness.spawn import torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KINDS = ("worker_sigkill", "job_sigkill_save", "flipped_byte", "truncated_file", "disk_full", "stuck_rank")


class Job:
    """One launch of `torchrun ... -m megazero.train ARGS` in its own process group, its
    output lines time-stamped as they arrive."""

    def __init__(self, nproc: int, args: list[str], restarts: int = 0, fsize_limit: Optional[int] = None):
        cmd = torchrun_command(nproc, args, restarts)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}

        def limit() -> None:  # in the child, before exec: both survive exec
            if fsize_limit is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, resource.RLIM_INFINITY))

        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, preexec_fn=limit)
        self.lines: list[tuple[float, str]] = []
        self.eof = False
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.changed.notify_all()
        with self.changed:
            self.eof = True
            self.changed.notify_all()

    def wait_for(self, pattern: str, after: float = 0.0, timeout: float = 300) -> float:
        """Time of the first line matching `pattern` that arrived after `after`."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for t, line in self.lines:
                    if t > after and re.search(pattern, line):
                        return t
                if self.eof or time.monotonic() > deadline:
                    raise TimeoutError(f"no line /{pattern}/ (exit {self.proc.poll()}):\n{self.tail()}")
                self.changed.wait(timeout=1.0)

    def resumed_training(self, after: float) -> float:
        """Time of the first iteration logged after the job said it resumed."""
        return self.wait_for(r"^iter \d+/", self.wait_for(r"^resumed from ", after))

    def finish(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            return self.proc.wait()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def workers(self) -> list[int]:
        """The worker processes: children of the torchrun agent (each in a session of its own)."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(pid) for pid in f.read().split()]
        except FileNotFoundError:  # the agent is gone
            return []

    def kill_all(self) -> None:
        """SIGKILL the whole job at once, as a node failure would: workers and launcher."""
        for pid in self.workers():
            os.kill(pid, signal.SIGKILL)
        self.kill()

    def text(self) -> str:
        with self.changed:
            return "\n".join(line for _, line in self.lines)

    def tail(self, n: int = 15) -> str:
        with self.changed:
            return "\n".join(line for _, line in self.lines[-n:])


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: str):
        self.a, self.workdir, self.rng = args, workdir, random.Random(args.seed)
        self.reference: Optional[float] = None

    def job_args(self, run: str, interval: int, extra: tuple[str, ...] = ()) -> list[str]:
        d = os.path.join(self.workdir, run)
        return ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--zero.stage", "1",
                "--train.iters", str(self.a.iters), "--train.log_interval", "1",
                "--train.timeout_minutes", str(self.a.timeout_minutes),
                "--checkpoint.save", f"{d}/ck", "--checkpoint.load", f"{d}/ck",
                "--checkpoint.interval", str(interval), "--checkpoint.keep_last", "3",
                "--logging.jsonl", f"{d}/metrics.jsonl", *extra]

    def nothing_lost(self, run: str) -> tuple[bool, str]:
        """Finished all iterations, final checkpoint intact, last loss equal to the reference."""
        d = os.path.join(self.workdir, run)
        with open(f"{d}/metrics.jsonl") as f:
            last = [r for r in map(json.loads, f) if r["iteration"] == self.a.iters]
        if not last:
            return False, "never reached the last iteration"
        ckpt = sharded.resolve(f"{d}/ck")
        if os.path.basename(ckpt) != base.iter_dir_name(self.a.iters) or not base.is_intact(ckpt):
            return False, f"final checkpoint {ckpt} missing or corrupt"
        if last[-1]["loss"] != self.reference:
            return False, f"final loss {last[-1]['loss']!r} != uninterrupted {self.reference!r}"
        return True, ""

    def measure_reference(self) -> None:
        job = Job(self.a.nproc, self.job_args("reference", 4))
        if job.finish() != 0:
            raise SystemExit(f"the uninterrupted reference run failed:\n{job.tail()}")
        with open(os.path.join(self.workdir, "reference", "metrics.jsonl")) as f:
            self.reference = [json.loads(line) for line in f][-1]["loss"]

    def wait_saved(self, job: Job) -> None:
        """Until the job has saved at least one checkpoint, then a random moment more."""
        job.wait_for(r"^saved checkpoint ")
        time.sleep(self.rng.uniform(0.0, 2.0))

    # ------------------------------------------------------------------ the faults

    def worker_sigkill(self, run: str) -> tuple[bool, Optional[float], str]:
        return self._signal_a_worker(run, signal.SIGKILL)

    def stuck_rank(self, run: str) -> tuple[bool, Optional[float], str]:
        return self._signal_a_worker(run, signal.SIGSTOP)

    def _signal_a_worker(self, run: str, sig: int) -> tuple[bool, Optional[float], str]:
        """Once the job has saved, send `sig` to a random worker; time until training resumes."""
        job = Job(self.a.nproc, self.job_args(run, 2), restarts=self.a.restarts)
        self.wait_saved(job)
        os.kill(self.rng.choice(job.workers()), sig)
        return self._restarted(job, run, time.monotonic())

    def _restarted(self, job: Job, run: str, t0: float) -> tuple[bool, Optional[float], str]:
        """`job` resumes training after the fault at t0 and finishes with nothing lost."""
        try:
            t1 = job.resumed_training(t0)
        except TimeoutError as e:
            job.kill_all()
            return False, None, f"did not resume: {e}"
        rc = job.finish()
        ok, why = self.nothing_lost(run) if rc == 0 else (False, f"job exited {rc}")
        return ok, t1 - t0, why

    def job_sigkill_save(self, run: str) -> tuple[bool, Optional[float], str]:
        job = Job(self.a.nproc, self.job_args(run, 1))
        self.wait_saved(job)
        job.kill_all()
        t0 = time.monotonic()
        job.finish()
        return self._relaunched(run, t0, self.job_args(run, 1))

    def _relaunched(self, run: str, t0: float, args: list[str]) -> tuple[bool, Optional[float], str]:
        return self._restarted(Job(self.a.nproc, args), run, t0)

    def _stopped_after_a_save(self, run: str) -> str:
        """Run until a checkpoint or two exist, then stop with SIGTERM (saves and exits);
        returns the newest checkpoint directory."""
        job = Job(self.a.nproc, self.job_args(run, 2))
        job.wait_for(r"^saved checkpoint .*iter_0000004")
        job.kill(signal.SIGTERM)
        job.finish()
        return sharded.resolve(os.path.join(self.workdir, run, "ck"))

    def flipped_byte(self, run: str) -> tuple[bool, Optional[float], str]:
        return self._damaged(run, "flip")

    def truncated_file(self, run: str) -> tuple[bool, Optional[float], str]:
        return self._damaged(run, "truncate")

    def _damaged(self, run: str, how: str) -> tuple[bool, Optional[float], str]:
        ckpt = self._stopped_after_a_save(run)
        name = self.rng.choice(sorted(n for n in os.listdir(ckpt) if n.endswith(".pt")))
        path = os.path.join(ckpt, name)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            if how == "truncate":
                f.truncate(self.rng.randrange(size))
            else:
                f.seek(self.rng.randrange(size))
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ (1 << self.rng.randrange(8))]))
        t0 = time.monotonic()
        job = Job(self.a.nproc, self.job_args(run, 2))
        rc = job.finish()
        errors = [line for line in job.text().splitlines() if line.startswith("error: ")]
        hint = re.search(r"--checkpoint\.iteration (\d+)", errors[0]) if len(errors) == 1 else None
        if rc == 0 or not hint or name not in errors[0]:
            return False, None, f"not refused with one line naming {name} (exit {rc}): {errors}"
        return self._relaunched(run, t0, self.job_args(run, 2, ("--checkpoint.iteration", hint.group(1))))

    def disk_full(self, run: str) -> tuple[bool, Optional[float], str]:
        ckpt = self._stopped_after_a_save(run)
        rank_file = max(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
        job = Job(self.a.nproc, self.job_args(run, 2), fsize_limit=rank_file // 2)
        rc = job.finish()
        errors = [line for line in job.text().splitlines() if line.startswith("error: ")]
        t0 = job.lines[-1][0] if job.lines else time.monotonic()  # the failed save: the job's end
        if rc == 0 or len(errors) != 1 or "failed on rank" not in errors[0]:
            return False, None, f"not stopped with one line (exit {rc}): {errors}"
        if sharded.resolve(os.path.join(self.workdir, run, "ck")) != ckpt or not base.is_intact(ckpt):
            return False, None, "the previous checkpoint or latest changed"
        return self._relaunched(run, t0, self.job_args(run, 2))

    # ------------------------------------------------------------------ the table

    def run(self) -> list[dict]:
        self.measure_reference()
        rows = []
        for kind in self.a.kinds:
            fault: Callable = getattr(self, kind)
            results = []
            for trial in range(self.a.trials):
                run = f"{kind}_{trial}"
                os.makedirs(os.path.join(self.workdir, run))
                ok, seconds, why = fault(run)
                results.append((ok, seconds, why))
                print(f"  {kind} #{trial}: {'survived' if ok else 'LOST'}"
                      f"{f', {seconds:.1f} s to resumed training' if seconds is not None else ''}"
                      f"{f' ({why})' if why else ''}", flush=True)
            times = [s for ok, s, _ in results if ok and s is not None]
            rows.append({"kind": kind, "faults": len(results), "survived": sum(ok for ok, _, _ in results),
                         "median_s": statistics.median(times) if times else None, "max_s": max(times, default=None),
                         "failures": sorted({why for ok, _, why in results if not ok})})
        return rows


def table(rows: list[dict]) -> str:
    out = ["| fault | injected | survived, nothing lost | fault -> resumed training (median / max s) |",
           "|---|---|---|---|"]
    for r in rows:
        t = "-" if r["median_s"] is None else f"{r['median_s']:.1f} / {r['max_s']:.1f}"
        out.append(f"| {r['kind']} | {r['faults']} | {r['survived']} | {t} |")
    for r in rows:
        for why in r["failures"]:
            out.append(f"\n{r['kind']}: {why}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3, help="faults injected per kind (default: %(default)s)")
    p.add_argument("--iters", type=int, default=150, help="iterations of the job (enough for faults to land mid-run) (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (dp) (default: %(default)s)")
    p.add_argument("--restarts", type=int, default=3, help="torchrun --max-restarts for the kinds that rely on it (default: %(default)s)")
    p.add_argument("--timeout-minutes", type=float, default=0.25, help="train.timeout_minutes (stuck_rank) (default: %(default)s)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="faults to inject (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault times and places (default: %(default)s)")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench_faults_")
    try:
        print(f"{args.trials} faults per kind; job: gpt2-tiny, {args.iters} iterations, torchrun x {args.nproc}",
              flush=True)
        rows = Bench(args, workdir).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(rows))
    if args.json:
        write_text(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
