#!/usr/bin/env python
"""Activation memory per transformer layer per rank, with and without sequence parallelism,
measured against Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4):

    tensor parallelism only           sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallelism     sbh (34 + 5as/h) / t

    python scripts/bench_activation.py [--tp 1 2 4] [--seq 256] [--hidden 256] [--heads 8] [--micro-batch 2]
    python scripts/bench_activation.py --cp 1 2 4 [--tp 1 2] [--seq 1024]     # context parallelism

With --cp, each tp x cp runs in a world of tp x cp processes with both parallel.cp_impl
(ring, Ulysses), dropout 0 and flash-style attention (the CPU flash kernel at cp 1, per block
under ring): activation MiB per layer per rank against the planner's formula, which divides
every term by cp, and the bytes each rank sends over its cp group per layer, forward and
backward, against theory: ring forward (cp-1) K/V blocks of 2 (s/cp) h (= 2 (cp-1)/cp of the
whole K and V), backward as many again plus cp fp32 K/V gradient blocks; Ulysses four
all-to-alls each way of (cp-1)/cp of an (s/cp) h tensor (q, k, v, the output).

    python scripts/bench_activation.py --long [--long-seq 16384] [--cp 1 4] [--layers 12]
                                      [--long-recompute full] [--long-zero 3]

trains GPT-2 124M's shape (configs/gpt2-124m.yaml: h 768, 12 heads, vocab 50257; the position
table sized to --long-seq) on mock data for 2 iterations of one sequence at each cp, in a world of
cp processes (ring attention, fp32, ZeRO over the cp ranks at --long-zero, recomputation
--long-recompute), and prints each world's peak RSS per rank (the largest of its ranks), the
losses and the seconds per iteration. The defaults (full recompute, ZeRO-3) are what lets the
full-size cp 4 world fit a 24 GiB machine: 4 processes each hold a quarter of the model states,
of the logits and of every layer's activations.

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
import contextlib
import io
import os
import resource
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from megazero.harness.configs import make_config
from megazero.harness.spawn import run_ranks
from megazero.parallel.context import shard_sequence
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.random import seed_everything
from megazero.plan.formulas import ActivationShape, layer_activation_bytes
from megazero.plan.measure import ActivationMeter
from megazero.train.parallelize import parallelize

ACT_BYTES, MASK_BYTES = 4, 4  # fp32 activations; torch's CPU dropout keeps an fp32 mask


def bench_config(args, tp: int, sequence_parallel: bool, cp: int = 1, cp_impl: str = "ring", world: int = 1):
    return make_config(base={
        "model": {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
                  "seq_length": args.seq, "vocab_size": 512, "dropout": 0.0 if args.cp else 0.1},
        "parallel": {"tp": tp, "sequence_parallel": sequence_parallel, "cp": cp, "cp_impl": cp_impl},
        "train": {"micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch},
        "data": {"mock": True}}, world=world)


def layer_bytes(args, grid: ProcessGrid, sequence_parallel: bool, cp_impl: str = "ring",
                backward: bool = False) -> tuple[float, float, float]:
    """Bytes one layer saves for backward on this rank, averaged over the layers; and the bytes
    this rank sends over its cp group per layer in forward and (with `backward`) backward."""
    cfg = bench_config(args, grid.tp, sequence_parallel, grid.cp, cp_impl, grid.world_size)
    tracker = seed_everything(cfg.train.seed, grid.pp_rank, grid.tp_rank, grid.device, cp_rank=grid.cp_rank)
    (chunk,), _ = parallelize(cfg, grid, tracker)
    chunk.train()
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in chunk.parameters()})
    starts, ends = [], []
    for block in chunk.transformer.h.values():
        block.register_forward_pre_hook(lambda *_: starts.append(meter.current))
        block.register_forward_hook(lambda *_: ends.append(meter.current))
    tokens = torch.randint(0, 512, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(0))
    tokens = torch.from_numpy(shard_sequence(tokens.numpy(), grid.cp_rank, grid.cp))
    kernel = SDPBackend.FLASH_ATTENTION if args.cp else SDPBackend.MATH
    grid.reset_counters()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack), sdpa_kernel(kernel):
        logits = chunk(tokens)
    per_layer = sum(e - s for s, e in zip(starts, ends)) / len(starts)
    sent = [cp_sent(grid) / len(starts)]
    if backward:
        with sdpa_kernel(kernel):
            logits.float().pow(2).mean().backward()
        sent.append(cp_sent(grid) / len(starts) - sent[0])
    del logits
    return per_layer, *sent, *([0.0] if not backward else [])


def cp_sent(grid: ProcessGrid) -> float:
    """Bytes this rank has sent over its cp group since the counters were reset."""
    counter = grid.cp_group.counter
    return float(counter["send"] + counter["all_to_all"])


def korthikanti(args, t: int, sequence_parallel: bool, e: float = 2, m: float = 1) -> float:
    """The paper's per-layer bytes at e bytes per activation and m per mask element."""
    s, b, h, a = args.seq, args.micro_batch, args.hidden, args.heads
    c = t if sequence_parallel else 1
    return s * b * h * ((4 * e + 2 * m) / c + 12 * e / t) + a * s * s * b * (2 * e + m) / t


def planner(args, t: int, sequence_parallel: bool, cp: int = 1, cp_impl: str = "ring") -> int:
    return layer_activation_bytes(ActivationShape(
        args.micro_batch, args.seq // cp, args.hidden, args.heads, 4 * args.hidden, 512, tp=t,
        sequence_parallel=sequence_parallel, act_bytes=ACT_BYTES, mask_bytes=MASK_BYTES, stats_bytes=ACT_BYTES,
        attention="flash" if args.cp else "math", dropout=not args.cp, cp=cp, cp_impl=cp_impl))


def cp_theory(args, t: int, cp: int, cp_impl: str) -> tuple[float, float]:
    """Bytes one rank sends over its cp group per layer, forward and backward (see above)."""
    local = args.micro_batch * (args.seq // cp) * args.hidden // t * ACT_BYTES  # one (s/cp) x h/t tensor
    if cp_impl == "ring":
        return 2 * (cp - 1) * local, 2 * (cp - 1) * local + 2 * cp * local * 4 // ACT_BYTES
    return 4 * (cp - 1) / cp * local, 4 * (cp - 1) / cp * local


def cases(args, tp: int, cp: int) -> list[tuple[bool, str]]:
    """(sequence parallel, cp_impl) measured in one world: with --cp both impls (one at cp 1),
    sequence parallelism on at tp > 1; otherwise without and with it."""
    if args.cp:
        return [(tp > 1, impl) for impl in (["ring", "ulysses"] if cp > 1 else ["ring"])]
    return [(sp, "ring") for sp in ([False, True] if tp > 1 else [False])]


def worker(tp: int, cp: int, args) -> list[tuple]:
    """One rank of tp x cp: each case's (sequence parallel, cp_impl, figures); every rank holds the same."""
    grid = ProcessGrid(tp=tp, pp=1, dp=1, cp=cp, rank=dist.get_rank())
    grid.build_groups()
    return [(sp, impl, layer_bytes(args, grid, sp, impl, backward=cp > 1)) for sp, impl in cases(args, tp, cp)]


def main_cp(args) -> None:
    table_head(f"# torch {torch.__version__}, gloo, fp32; GPT-2 h {args.hidden}, a {args.heads}, s {args.seq}, "
               f"b {args.micro_batch}, dropout 0, flash attention (CPU kernel), no recompute; per layer per rank "
               f"(sequence parallelism on at tp > 1)",
               ["tp", "cp", "impl", "measured MiB", "planner MiB", "measured / planner", "cp 1 / measured",
                "fwd KiB sent", "theory", "bwd KiB sent", "theory"])
    kib = 2.0 ** -10
    for tp in args.tp:
        base = None
        for cp in args.cp:
            for _, impl, (got, fwd, bwd) in measured(args, tp, cp):
                base = got if cp == 1 else base
                plan = planner(args, tp, tp > 1, cp, impl)
                fwd_t, bwd_t = cp_theory(args, tp, cp, impl) if cp > 1 else (0, 0)
                ratio = f"{base / got:.2f}" if base else "-"
                print(f"| {tp} | {cp} | {impl if cp > 1 else '-'} | {got / 2**20:.3f} | {plan / 2**20:.3f} | "
                      f"{got / plan:.3f} | {ratio} | {fwd * kib:.1f} | {fwd_t * kib:.1f} | {bwd * kib:.1f} | "
                      f"{bwd_t * kib:.1f} |", flush=True)


def measured(args, tp: int, cp: int) -> list[tuple]:
    """Every case's figures from a world of tp x cp spawned ranks (rank 0's)."""
    return run_ranks(worker, tp * cp, tp, cp, args)[0]


def table_head(title: str, columns: list[str]) -> None:
    print(title)
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def worker_long(cp: int, args) -> tuple:
    """One rank of a cp world training the long-context config: its rank, peak RSS, losses and
    seconds per iteration."""
    from megazero.train.trainer import Trainer
    cfg = make_config([
        "--model.seq_length", str(args.long_seq), "--model.num_layers", str(args.layers), "--model.dropout", "0",
        "--parallel.cp", str(cp), "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
        "--train.iters", "2", "--train.precision", "fp32", "--train.recompute", args.long_recompute,
        "--zero.stage", str(args.long_zero), "--train.eval_interval", "0",
        "--train.log_interval", "1", "--data.mock", "true", "--data.prefix", "null", "--data.tokenizer", "null",
        "--checkpoint.save", "null", "--checkpoint.load", "null", "--logging.jsonl", "null"],
        "configs/gpt2-124m.yaml", world=cp)
    # Rank 0's start-up and per-iteration lines go to stderr as progress (a world takes minutes).
    progress = Progress(f"cp {cp}") if dist.get_rank() == 0 else io.StringIO()
    with contextlib.redirect_stdout(progress):
        tic = time.perf_counter()
        records = Trainer(cfg, ProcessGrid.create(1, 1, cp=cp)).run()
        seconds = (time.perf_counter() - tic) / len(records)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return dist.get_rank(), peak_gib, [r["loss"] for r in records], seconds


class Progress(io.StringIO):
    """A stdout that passes each complete line to stderr, prefixed with its world and the time."""

    def __init__(self, world: str):
        super().__init__()
        self.world, self.start = world, time.perf_counter()

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                print(f"[{self.world}, {time.perf_counter() - self.start:.0f} s] {line}", file=sys.stderr, flush=True)
        return len(text)


def main_long(args) -> None:
    table_head(f"# GPT-2 124M shape (h 768, 12 heads, vocab 50257), {args.layers} layers, seq {args.long_seq}, "
               f"micro-batch 1, fp32, recompute {args.long_recompute}, ZeRO-{args.long_zero}, ring attention; "
               f"2 iterations; gloo, torch {torch.__version__}",
               ["cp", "processes", "peak RSS per rank GiB (largest)", "cp 1 / this", "losses", "s per iteration (start-up included)"])
    first = None
    for cp in args.cp or [1, 4]:
        threads = max(1, (os.cpu_count() or 1) // cp)  # the machine's cores shared by the world
        print(f"[cp {cp}] starting a world of {cp} process(es), {threads} thread(s) each; 2 iterations follow",
              file=sys.stderr, flush=True)
        reports = run_ranks(worker_long, cp, cp, args, threads=threads)
        peak = max(r[1] for r in reports)
        first = first or peak
        losses = next(r[2] for r in reports if r[0] == 0)
        seconds = max(r[3] for r in reports)
        print(f"| {cp} | {cp} | {peak:.2f} | {first / peak:.2f} | {', '.join(f'{x:.4f}' for x in losses)} "
              f"| {seconds:.0f} |", flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel degrees (default: 1 2 4)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default: 2; 12 with --long)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=2, help="micro-batch size (default: %(default)s)")
    parser.add_argument("--cp", type=int, nargs="+",
                        help="context-parallel degrees to measure, 1 first (with --long: default 1 4)")
    parser.add_argument("--long", action="store_true",
                        help="the long-context run: GPT-2 124M's shape at --long-seq, 2 iterations per cp world; "
                             "about 22 minutes on 2 cores at the defaults, a few at --long-seq 4096 --layers 2")
    parser.add_argument("--long-seq", type=int, default=16384, help="--long's sequence length (default: %(default)s)")
    parser.add_argument("--long-recompute", choices=["none", "selective", "full"], default="full",
                        help="--long's recomputation (default: %(default)s)")
    parser.add_argument("--long-zero", type=int, choices=[0, 1, 2, 3], default=3,
                        help="--long's ZeRO stage over the cp ranks (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.long:
        args.layers = args.layers if "--layers" in (argv or sys.argv) else 12
        main_long(args)
        return
    if args.cp:
        main_cp(args)
        return
    table_head(f"# torch {torch.__version__}, gloo, fp32; GPT-2 h {args.hidden}, a {args.heads}, s {args.seq}, "
               f"b {args.micro_batch}, dropout 0.1, math attention, no recompute; bytes per layer per rank",
               ["tp", "sequence parallel", "measured MiB", "Korthikanti 16-bit MiB", "Korthikanti at e=4, m=4 MiB",
                "measured / Korthikanti (e=4, m=4)", "planner MiB", "measured / planner"])
    mib = 2.0 ** -20
    for tp in args.tp:
        for sp, _, (got, _, _) in measured(args, tp, 1):
            at_run = korthikanti(args, tp, sp, ACT_BYTES, MASK_BYTES)
            plan = planner(args, tp, sp)
            print(f"| {tp} | {'yes' if sp else 'no'} | {got * mib:.2f} | {korthikanti(args, tp, sp) * mib:.2f} | "
                  f"{at_run * mib:.2f} | {got / at_run:.3f} | {plan * mib:.2f} | {got / plan:.3f} |", flush=True)

if __name__ == "__main__":
    main()
