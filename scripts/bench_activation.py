#!/usr/bin/env python
"""Activation memory per transformer layer per rank, with and without sequence parallelism,
measured against Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4):

    tensor parallelism only           sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallelism     sbh (34 + 5as/h) / t

    python scripts/bench_activation.py [--tp 1 2 4] [--seq 256] [--hidden 256] [--heads 8] [--micro-batch 2]

For each tp, a world of tp spawned gloo processes builds the model through the training
path (megazero.train.parallelize: TP, then parallel.sequence_parallel) with dropout 0.1 and
no recomputation, and runs one forward of one micro-batch under
torch.autograd.graph.saved_tensors_hooks (megazero.plan.measure.ActivationMeter: each
storage once, parameters excluded). A layer's figure is what the bytes saved for backward
grow by across its forward, averaged over the layers (rank 0; every TP rank holds the same).

The paper counts 16-bit activations with 1-byte dropout masks; this run is fp32 on the CPU,
where dropout keeps an fp32 mask. So beside the paper's figure the formula is evaluated at
this run's element sizes (e bytes per activation, m per mask element): from the paper's own
terms, sbh [(4e + 2m)/c + 12e/t] + a s^2 b (2e + m)/t with c = t under sequence parallelism
(1 otherwise), which is the paper's at e = 2, m = 1. Attention runs torch's math kernel, the
one the paper's 5as/h term describes (the fused kernels keep no s x s tensors). Beyond the
paper's terms LayerNorm keeps its mean and rstd (4 bs elements, 0.1% here). The layout
planner's figure (megazero.plan.formulas) is printed too.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megazero.config import build_config  # noqa: E402
from megazero.parallel.grid import ProcessGrid  # noqa: E402
from megazero.parallel.random import seed_everything  # noqa: E402
from megazero.plan.formulas import ActivationShape, layer_activation_bytes  # noqa: E402
from megazero.plan.measure import ActivationMeter  # noqa: E402
from megazero.train.parallelize import parallelize  # noqa: E402
from megazero.train.run_config import resolve_and_validate  # noqa: E402

ACT_BYTES, MASK_BYTES = 4, 4  # fp32 activations; torch's CPU dropout keeps an fp32 mask


def bench_config(args, tp: int, sequence_parallel: bool):
    return build_config({"model": {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
                                   "seq_length": args.seq, "vocab_size": 512, "dropout": 0.1},
                         "parallel": {"tp": tp, "sequence_parallel": sequence_parallel},
                         "train": {"micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch},
                         "data": {"mock": True}})


def layer_bytes(args, grid: ProcessGrid, sequence_parallel: bool) -> float:
    """Bytes one layer saves for backward on this rank, averaged over the layers."""
    cfg = bench_config(args, grid.tp, sequence_parallel)
    resolve_and_validate(cfg, grid.world_size)
    tracker = seed_everything(cfg.train.seed, grid.pp_rank, grid.tp_rank, grid.device)
    (chunk,), _ = parallelize(cfg, grid, tracker)
    chunk.train()
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in chunk.parameters()})
    starts, ends = [], []
    for block in chunk.transformer.h.values():
        block.register_forward_pre_hook(lambda *_: starts.append(meter.current))
        block.register_forward_hook(lambda *_: ends.append(meter.current))
    tokens = torch.randint(0, 512, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack), sdpa_kernel(SDPBackend.MATH):
        logits = chunk(tokens)
    per_layer = sum(e - s for s, e in zip(starts, ends)) / len(starts)
    del logits
    return per_layer


def korthikanti(args, t: int, sequence_parallel: bool, e: float = 2, m: float = 1) -> float:
    """The paper's per-layer bytes at e bytes per activation and m per mask element."""
    s, b, h, a = args.seq, args.micro_batch, args.hidden, args.heads
    c = t if sequence_parallel else 1
    return s * b * h * ((4 * e + 2 * m) / c + 12 * e / t) + a * s * s * b * (2 * e + m) / t


def planner(args, t: int, sequence_parallel: bool) -> int:
    return layer_activation_bytes(ActivationShape(
        args.micro_batch, args.seq, args.hidden, args.heads, 4 * args.hidden, 512, tp=t,
        sequence_parallel=sequence_parallel, act_bytes=ACT_BYTES, mask_bytes=MASK_BYTES, stats_bytes=ACT_BYTES,
        attention="math"))


def worker(rank: int, tp: int, port: int, args, queue) -> None:
    """One TP rank: both figures of this tp (rank 0 reports them; every rank holds the same)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    grid = ProcessGrid(tp=tp, pp=1, dp=1, rank=rank)
    grid.build_groups()
    try:
        for sp in ([False, True] if tp > 1 else [False]):
            per_layer = layer_bytes(args, grid, sp)
            if rank == 0:
                queue.put((sp, per_layer))
    finally:
        dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"# torch {torch.__version__}, gloo, fp32; GPT-2 h {args.hidden}, a {args.heads}, s {args.seq}, "
          f"b {args.micro_batch}, dropout 0.1, math attention, no recompute; bytes per layer per rank")
    print("| tp | sequence parallel | measured MiB | Korthikanti 16-bit MiB | Korthikanti at e=4, m=4 MiB "
          "| measured / Korthikanti (e=4, m=4) | planner MiB | measured / planner |")
    print("|---|---|---|---|---|---|---|---|")
    mib = 2.0 ** -20
    for tp in args.tp:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(worker, args=(tp, port, args, queue), nprocs=tp)  # raises with the traceback of a failed rank
        while not queue.empty():
            sp, got = queue.get()
            at_run = korthikanti(args, tp, sp, ACT_BYTES, MASK_BYTES)
            plan = planner(args, tp, sp)
            print(f"| {tp} | {'yes' if sp else 'no'} | {got * mib:.2f} | {korthikanti(args, tp, sp) * mib:.2f} | "
                  f"{at_run * mib:.2f} | {got / at_run:.3f} | {plan * mib:.2f} | {got / plan:.3f} |", flush=True)

if __name__ == "__main__":
    main()
