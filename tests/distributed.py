"""Shared helpers for distributed tests: spawn N gloo processes on CPU, or run the real
training entry point under torchrun, and hand back what each rank returned (both through
megazero.harness.spawn, which the benchmark scripts use too)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Callable

from megazero.harness.spawn import free_port, run_ranks, torchrun_command

__all__ = ["free_port", "run_distributed", "torchrun", "read_jsonl", "train_records", "logged_by_layout",
           "assert_parity"]


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run fn(*args) on `world_size` spawned gloo ranks (one thread each); return the results in
    rank order. `fn` must be a module-level function (it is pickled into the children)."""
    return run_ranks(fn, world_size, *args, timeout=timeout)


def torchrun(nproc: int, args: list[str], cwd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m megazero.train ARGS` under torchrun with `nproc` CPU processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(torchrun_command(nproc, args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_records(tmp_path, nproc: int, args: list[str], name: str) -> list[dict]:
    """Run megazero.train under torchrun with ARGS, assert it succeeded, return its JSONL records."""
    out = str(tmp_path / f"{name}.jsonl")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = torchrun(nproc, args + ["--logging.jsonl", out], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(out)


def logged_by_layout(records: Callable[[list[str]], list], layouts: dict[str, list[str]]) -> dict[str, list]:
    """In a spawned rank: train each layout (`records(extra args)`, which returns its records on
    the logging rank and nothing elsewhere) in this one world; the logging rank's records of each."""
    import torch.distributed as dist
    out = {}
    for name, extra in layouts.items():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, records(extra))
        out[name] = next(r for r in everyone if r)
    return out


def logged_losses(make: Callable[[], Any]) -> list[tuple[float, float]]:
    """In a spawned rank: run the trainer `make()` builds; (loss, grad norm) of each iteration
    on the logging rank, nothing elsewhere."""
    import contextlib
    import io
    tr = make()
    with contextlib.redirect_stdout(io.StringIO()):
        records = tr.run()
    return [(r["loss"], r["grad_norm"]) for r in records] if tr.is_logger else []


def assert_parity(runs: dict[str, list], reference: list, iters: int, tol: float = 1e-5) -> None:
    """Every layout's per-iteration (loss, grad norm, ...) within `tol` of the single process's."""
    for name, run in runs.items():
        assert len(run) == len(reference) == iters, name
        diffs = [max(abs(a - b) for a, b in zip(r, ref, strict=True)) for r, ref in zip(run, reference, strict=True)]
        print(f"{name}: max |delta loss, grad norm| vs single process {max(diffs):.2e}")  # pytest -s
        assert max(diffs) <= tol, (name, run, reference)
