"""Start N ranks on this machine, run one function in each, collect what each returned.

    results = run_ranks(fn, 2, x, y)             # fn(x, y) on ranks 0 and 1 of a gloo world
    for rank, value in stream_ranks(fn, 4, x):   # fn(report, x); report(value) arrives at once
        ...

Every rank is a new process, so its memory peak and threads are its own; `fn` must be a
module-level function (it is pickled into the children). Ranks are forked from a server process
that has imported torch and megazero once (multiprocessing's forkserver), not started afresh
(spawn): a world's start-up costs milliseconds instead of an import of torch per rank. Each rank
takes the caller's environment variables and working directory of the moment, as a spawned one
would, not the server's. A rank that raises
sends its traceback, and one that dies (killed, out of memory) is noticed, instead of leaving the
parent waiting: either ends the call with RankFailed, and the other ranks are stopped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that is free on this machine now: a rendezvous port for spawned ranks or torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, args: list[str], restarts: Optional[int] = None) -> list[str]:
    """`python -m torch.distributed.run ... -m megazero.train ARGS` with `nproc` local workers
    on a free port (and torchrun's --max-restarts when `restarts` is given)."""
    restart = [] if restarts is None else [f"--max-restarts={restarts}"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *restart,
            f"--master_port={free_port()}", "-m", "megazero.train", *args]


class RankFailed(RuntimeError):
    """A spawned rank raised (the message holds its traceback), died without answering
    (`exitcode` is its exit code), or no rank answered in time."""

    def __init__(self, message: str, exitcode: Optional[int] = None):
        super().__init__(message)
        self.exitcode = exitcode


@dataclass(frozen=True)
class _Setup:
    """How a rank prepares before it runs the function (see run_ranks)."""

    world: int
    port: int
    threads: Optional[int]
    backend: Optional[str]
    env: dict[str, str] = field(default_factory=dict)
    ignore: tuple[type[Warning], ...] = ()
    streaming: bool = False
    caller_env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: str = field(default_factory=os.getcwd)


def _report(queue: Any, rank: int, value: Any) -> None:
    """A rank's report(value) for stream_ranks: the value reaches the parent while the rank runs on."""
    queue.put((rank, "report", pickle.dumps(value)))


def _rank_main(rank: int, setup: _Setup, fn: Callable, args: tuple, queue: Any) -> None:
    """The body of one spawned rank: environment, threads, process group, then fn."""
    os.environ.clear()  # the caller's, not the fork server's (started with an earlier one)
    os.environ.update(setup.caller_env)
    os.chdir(setup.cwd)
    if setup.backend is not None:  # torchrun's variables, so that code reading them sees this world
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(setup.world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(setup.port))
    if setup.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(setup.threads)
        torch.set_num_threads(setup.threads)
    os.environ.update(setup.env)
    for category in setup.ignore:  # notices every rank would print once
        warnings.simplefilter("ignore", category)
    try:
        if setup.backend == "nccl":
            torch.cuda.set_device(rank)
        if setup.backend is not None:
            dist.init_process_group(setup.backend, rank=rank, world_size=setup.world)
        fn_args = (functools.partial(_report, queue, rank), *args) if setup.streaming else args
        # Plain pickle copies tensors into the message; the queue's own pickler would share
        # them through file descriptors that die with this process.
        queue.put((rank, "done", pickle.dumps(fn(*fn_args))))
    except BaseException:  # report every failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _next_message(queue: Any, procs: list, done: set[int], timeout: Optional[float]) -> tuple[int, str, Any]:
    """The next (rank, kind, payload) from any rank; RankFailed when a rank died without
    answering or none answered within `timeout` seconds (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    dead_before = False
    while True:
        with contextlib.suppress(queue_module.Empty):
            return queue.get(timeout=1.0)
        dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
        if dead and dead_before:  # a second look: its last message may have been on its way
            code = procs[dead[0]].exitcode
            raise RankFailed(f"rank {dead[0]} died without an answer (exit code {code})", code)
        dead_before = bool(dead)
        if deadline is not None and time.monotonic() > deadline:
            raise RankFailed(f"no answer from some rank within {timeout} s (crashed or deadlocked)")


PRELOAD = ["torch", "torch.distributed", "megazero.train.trainer", "megazero.harness.spawn", "transformers"]
"""What the fork server imports once for every rank after it (one that cannot be imported is skipped)."""


def _context() -> Any:
    """multiprocessing's forkserver context, its server importing PRELOAD when it starts (the
    first world of this process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _ranks(fn: Callable, world: int, args: tuple, setup: _Setup,
           timeout: Optional[float]) -> Iterator[tuple[int, str, Any]]:
    """Every (rank, "report" | "done", value) of `world` spawned ranks as it arrives; the ranks
    are joined (or, after a failure, killed) when the last has answered."""
    ctx = _context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, setup, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    failed = True
    try:
        done: set[int] = set()
        while len(done) < world:
            rank, kind, payload = _next_message(queue, procs, done, timeout)
            if kind == "error":
                raise RankFailed(f"rank {rank} failed:\n{payload}")
            if kind == "done":
                done.add(rank)
            yield rank, kind, pickle.loads(payload)
        failed = False
    finally:
        for p in procs:
            p.join(timeout=5 if failed else timeout)
            if p.is_alive():
                p.kill()


def run_ranks(fn: Callable, world: int, *args: Any, timeout: Optional[float] = None, threads: Optional[int] = 1,
              backend: Optional[str] = "gloo", env: Optional[dict[str, str]] = None,
              ignore: tuple[type[Warning], ...] = ()) -> list[Any]:
    """fn(*args) on `world` spawned ranks; what each returned, in rank order.

    Each rank has torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and has
    joined a `backend` world (gloo, or nccl with one GPU per rank) before fn runs; backend None:
    no process group and no such variables (a fresh process, no more). `threads`: torch's threads
    per rank (None: torch's default); `env`: further variables; `ignore`: warning categories the
    ranks do not print. `timeout`: seconds to wait for the next rank's answer (None: no limit; a
    dead rank is noticed either way)."""
    setup = _Setup(world, free_port(), threads, backend, dict(env or {}), ignore)
    results = {rank: value for rank, _, value in _ranks(fn, world, args, setup, timeout)}
    return [results[r] for r in range(world)]


def stream_ranks(fn: Callable, world: int, *args: Any, timeout: Optional[float] = None,
                 threads: Optional[int] = 1, backend: Optional[str] = "gloo", env: Optional[dict[str, str]] = None,
                 ignore: tuple[type[Warning], ...] = ()) -> Iterator[tuple[int, Any]]:
    """fn(report, *args) on `world` spawned ranks (set up as run_ranks does): (rank, value) for
    each report(value) a rank makes, as it arrives; fn's return values are dropped."""
    setup = _Setup(world, free_port(), threads, backend, dict(env or {}), ignore, streaming=True)
    for rank, kind, value in _ranks(fn, world, args, setup, timeout):
        if kind == "report":
            yield rank, value
