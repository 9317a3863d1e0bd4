"""Shared helpers for distributed tests: spawn N gloo processes on CPU, or run the real
training entry point under torchrun, and hand back what each rank returned."""

from __future__ import annotations

import json
import os
import pickle
import queue as queue_module
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle copies tensors into the message; the queue's own pickler would share
        # them through file descriptors that die with this process.
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # report every failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run fn(*args) on `world_size` spawned gloo ranks; return the results in rank order.
    `fn` must be a module-level function (it is pickled into the children)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world_size):
        try:
            rank, status, value = queue.get(timeout=timeout)
        except queue_module.Empty:
            errors.append(f"no answer from some rank within {timeout} s (crashed or deadlocked)")
            break
        if status == "error":
            errors.append(f"rank {rank}:\n{value}")
            break
        results[rank] = pickle.loads(value)
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def torchrun(nproc: int, args: list[str], cwd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m megazero.train ARGS` under torchrun with `nproc` CPU processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "-m", "megazero.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


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


def assert_parity(runs: dict[str, list], reference: list, iters: int, tol: float = 1e-5) -> None:
    """Every layout's per-iteration (loss, grad norm, ...) within `tol` of the single process's."""
    for name, run in runs.items():
        assert len(run) == len(reference) == iters, name
        diffs = [max(abs(a - b) for a, b in zip(r, ref, strict=True)) for r, ref in zip(run, reference, strict=True)]
        print(f"{name}: max |delta loss, grad norm| vs single process {max(diffs):.2e}")  # pytest -s
        assert max(diffs) <= tol, (name, run, reference)
