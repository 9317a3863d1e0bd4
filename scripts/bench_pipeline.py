#!/usr/bin/env python
"""Pipeline schedules measured against theory: per-rank busy and idle time per iteration,
and peak activation memory per stage.

    python scripts/bench_pipeline.py [--pp 2 4] [--factors 1 2 4 8] [--iters 2] [--layers 8]

For each pp, each schedule (gpipe, 1f1b, interleaved with vpp 2, zbh1) and m = f x pp micro-batches
(f in --factors), one spawned gloo process per stage runs one untimed iteration, then --iters
timed ones (forward + backward of every micro-batch; no optimizer step). Per rank:

    busy   seconds computing (the iteration's wall time minus the time waiting on neighbours)
    idle   seconds blocked on a neighbour's activation or gradient (p2p.wait_seconds), plus
           the wait at the end for the last rank to finish (as in theory, every rank's
           bubble is counted against the iteration's span, first rank start to last finish)

The measured bubble, idle / (busy + idle) averaged over ranks, is printed beside the theory
for equal stages, (p - 1) / (v m + p - 1) (megazero.plan.formulas.pipeline_bubble; zbh1 with
T_F = T_B = T_W: (p - 1) / (3m + p - 1) for m >= p, whose idle time p - 1 is a third of
1F1B's 3 (p - 1)), and beside the bubble of the very orders the executor runs, replayed in
simulated time (a chunk's backward takes twice its forward, zbh1's B and W one each;
transfers are free; formulas.simulated_bubble). After each pp, zbh1 against 1f1b: the ratio
of bubble fractions and of idle seconds per rank (theory: 1/3 of the idle time). Peak
activation memory per stage is the largest number of bytes held at once by tensors that autograd saved for
backward (counted with torch.autograd.graph.saved_tensors_hooks, each storage once,
parameters excluded; with zbh1 plus what the pending W passes hold), beside the layout
planner's prediction (megazero.plan; for zbh1 the bound that counts a micro-batch's whole
activations until its W).

Measured times are only comparable with theory when every rank has a core of its own and
the machine is otherwise quiet: with more stages than cores, a rank also waits while the
neighbour it needs is descheduled. The simulated and memory columns do not depend on the
machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from megazero.harness.configs import make_config
from megazero.harness.spawn import RankFailed, stream_ranks
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.random import seed_everything
from megazero.pipeline.schedules import forward_backward_pipelining
from megazero.plan.formulas import pipeline_bubble, simulated_bubble
from megazero.plan.measure import ActivationMeter
from megazero.plan.planner import Cluster, ParallelLayout, predict
from megazero.train.parallelize import parallelize


def bench_config(args, pp: int, schedule: str, m: int, world: int):
    vpp = 2 if schedule == "interleaved" else 1
    return make_config(base={"model": {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": 4,
                                       "seq_length": args.seq, "vocab_size": 512},
                             "parallel": {"pp": pp, "vpp": vpp, "schedule": schedule},
                             "train": {"micro_batch_size": args.micro_batch,
                                       "global_batch_size": args.micro_batch * m},
                             "data": {"mock": True}}, world=world)


def run_case(args, grid: ProcessGrid, schedule: str, m: int) -> dict:
    """This rank's mean busy and idle seconds per iteration and its peak activation bytes."""
    cfg = bench_config(args, grid.pp, schedule, m, grid.world_size)
    tracker = seed_everything(cfg.train.seed, grid.pp_rank, grid.tp_rank, grid.device)
    chunks, optimizer = parallelize(cfg, grid, tracker)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 512, (args.micro_batch, args.seq), generator=g),
                torch.randint(0, 512, (args.micro_batch, args.seq), generator=g)) for _ in range(m)]
    num_tokens = m * args.micro_batch * args.seq
    params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    busy = idle = 0.0
    peak = 0
    for it in range(args.iters + 1):  # the first iteration warms up and is not timed
        optimizer.zero_grad()
        meter, stats = ActivationMeter(params, held=lambda: held_for_weight_grads(chunks)), {}
        comm.barrier(grid["world"])
        tic = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            forward_backward_pipelining(chunks, batches, num_tokens, grid, schedule, torch.float32, optimizer,
                                        stats=stats)
        wall = time.perf_counter() - tic
        # The iteration ends when its last rank does: a rank that finished early idles too.
        comm.barrier(grid["world"])
        tail = time.perf_counter() - tic - wall
        optimizer.finish_grad_sync()
        if it:
            busy += wall - stats["wait_s"]
            idle += stats["wait_s"] + tail
        peak = max(peak, meter.peak)
    layout = ParallelLayout(1, grid.pp, 1, len(chunks), 0, args.micro_batch, "none")
    planned = predict(cfg, layout, Cluster(grid.pp, grid.pp, 1.0, None), ranks=[grid.pp_rank], device="cpu")
    return {"busy": busy / args.iters, "idle": idle / args.iters, "peak_bytes": peak,
            "planned_bytes": planned.rank(grid.pp_rank).activations}


def held_for_weight_grads(chunks) -> int:
    """Bytes zbh1's pending W passes hold (0 for the other schedules)."""
    return sum(c.weight_grads.held_bytes() for c in chunks if c.weight_grads is not None)


def worker(report, pp: int, args) -> None:
    """One stage of a pp world: reports (schedule, m, its figures) case by case."""
    grid = ProcessGrid(tp=1, pp=pp, dp=1, rank=dist.get_rank())
    grid.build_groups()
    for schedule in args.schedules:
        for f in args.factors:
            report((schedule, f * pp, run_case(args, grid, schedule, f * pp)))


def per_rank(ranks: list[dict], key: str, scale: float, fmt: str) -> str:
    return " / ".join(format(r[key] * scale, fmt) for r in ranks)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (default: %(default)s)")
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8], help="m = factor x pp (default: %(default)s)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zbh1"], help="pipeline schedules to compare (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=2, help="timed iterations per case (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="model.num_layers (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="model.hidden_size (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=128, help="model.seq_length (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=2, help="train.micro_batch_size (default: %(default)s)")
    args = parser.parse_args(argv)

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"gloo; GPT-2 {args.layers} layers, h {args.hidden}, s {args.seq}, micro-batch {args.micro_batch}, "
          f"fp32; interleaved: vpp 2; {args.iters} timed iterations")
    print("| schedule | pp | m | bubble theory | simulated | measured | busy ms / rank | idle ms / rank "
          "| peak activations MiB / stage (planner) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pp in args.pp:
        try:
            results = print_cases(pp, stream_ranks(worker, pp, pp, args, timeout=1800))
        except RankFailed as e:
            sys.exit(f"pipeline {e}")
        if {"1f1b", "zbh1"} <= set(args.schedules):
            print_zero_bubble_gain(pp, [f * pp for f in args.factors], results)


def print_cases(pp: int, reports) -> dict[tuple[str, int], dict[int, dict]]:
    """A row per case as soon as all pp ranks reported it; every rank's figures by (schedule, m)."""
    results: dict[tuple[str, int], dict[int, dict]] = {}
    for rank, (schedule, m, res) in reports:
        results.setdefault((schedule, m), {})[rank] = res
        if len(results[(schedule, m)]) == pp:
            ranks = [results[(schedule, m)][r] for r in range(pp)]
            measured = sum(r["idle"] / (r["busy"] + r["idle"]) for r in ranks) / pp
            vpp = 2 if schedule == "interleaved" else 1
            print(f"| {schedule} | {pp} | {m} | {pipeline_bubble(pp, vpp, m, schedule):.3f} | "
                  f"{simulated_bubble(pp, vpp, m, schedule):.3f} | {measured:.3f} | "
                  f"{per_rank(ranks, 'busy', 1e3, '.0f')} | {per_rank(ranks, 'idle', 1e3, '.0f')} | "
                  f"{per_rank(ranks, 'peak_bytes', 2.0 ** -20, '.1f')} "
                  f"({per_rank(ranks, 'planned_bytes', 2.0 ** -20, '.1f')}) |", flush=True)
    return results


def print_zero_bubble_gain(pp: int, ms: list[int], results: dict) -> None:
    """zbh1 against 1f1b at each m: bubble fractions and idle seconds per rank, measured and
    in theory (idle time p - 1 against 3 (p - 1) forward-times: a third, for m >= p)."""
    for m in ms:
        one, zb = ([results[(s, m)][r] for r in range(pp)] for s in ("1f1b", "zbh1"))
        fraction = {k: sum(r["idle"] / (r["busy"] + r["idle"]) for r in v) / pp for k, v in (("1f1b", one), ("zbh1", zb))}
        idle = {k: sum(r["idle"] for r in v) / pp for k, v in (("1f1b", one), ("zbh1", zb))}
        theory = {s: pipeline_bubble(pp, 1, m, s) for s in ("1f1b", "zbh1")}
        idle_theory = {s: b / (1 - b) for s, b in theory.items()}  # idle / busy; busy is 3m either way
        print(f"# pp {pp} m {m}: zbh1 / 1f1b bubble fraction {fraction['zbh1'] / fraction['1f1b']:.2f} "
              f"(theory {theory['zbh1'] / theory['1f1b']:.2f}), idle s / rank {idle['zbh1'] / idle['1f1b']:.2f} "
              f"(theory {idle_theory['zbh1'] / idle_theory['1f1b']:.2f})", flush=True)


if __name__ == "__main__":
    main()
