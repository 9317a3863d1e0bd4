"""Single-GPU training throughput of GPT-2 124M and 355M in bf16: tokens/s, TFLOP/s, MFU.

    python scripts/bench_gpu.py [--models gpt2-124m gpt2-355m] [--iters 30] [--warmup 5]
                                [--micro N] [--accum N] [--json OUT.json] [--section.key value ...]

Each model trains from its config (configs/<model>.yaml) on mock data, in this process,
through megazero's own Trainer on a world of one (NCCL, tp = pp = dp = 1, the config's
ZeRO stage), for `--iters` iterations; the first `--warmup` are not timed (CUDA context,
cuBLAS autotuning, allocator growth). Every iteration is a full global batch of
micro x accum sequences of 1024 tokens. Any further `--section.key value` is a config
override applied to every model (e.g. `--train.recompute none`).

TFLOP/s use megazero's model-FLOPs formula (`model_flops_per_token`: 6 x matmul parameters
plus attention; recomputation is not counted) and MFU divides by the device's dense bf16
peak from `device_peak_flops` (shown; an unknown device gets no MFU). This is a
measurement, not a test: nothing is asserted about speed. Exits 1 without a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.config import Config, build_config, load_yaml, validate  # noqa: E402
from megazero.plan.formulas import model_flops_per_token  # noqa: E402
from megazero.train.metrics import device_peak_flops  # noqa: E402

# Micro-batch x accumulation per model: 64 sequences (65k tokens) per iteration for both,
# micro-batches large enough that the matmuls fill an H100/H200 (activations stay far below 80 GiB).
SHAPES = {"gpt2-124m": (16, 4), "gpt2-355m": (8, 8)}


@dataclass
class Row:
    model: str
    params_m: float = 0.0
    micro: int = 0
    accum: int = 0
    tokens_per_iter: int = 0
    step_s: float = 0.0
    tokens_per_sec: float = 0.0
    tflops: float = 0.0
    mfu: Optional[float] = None
    peak_mem_gib: float = 0.0
    last_loss: float = float("nan")
    error: str = ""


def make_config(model: str, micro: int, accum: int, iters: int, overrides: list[str]) -> Config:
    """The model's shipped config with mock data, this batch shape, no checkpoints and no files written."""
    fixed = ["--data.mock", "true", "--train.precision", "bf16", "--parallel.tp", "1", "--parallel.pp", "1",
             "--train.micro_batch_size", str(micro), "--train.global_batch_size", str(micro * accum),
             "--train.iters", str(iters), "--train.eval_interval", "0", "--checkpoint.save", "null",
             "--checkpoint.load", "null", "--logging.jsonl", "null", "--logging.wandb", "false"]
    cfg = build_config(load_yaml(os.path.join(ROOT, "configs", f"{model}.yaml")), fixed + overrides)
    validate(cfg, 1)
    return cfg


def timed_steps(trainer, iters: int, warmup: int) -> tuple[list[float], float]:
    """Seconds of each timed training step, and the last loss."""
    times, loss = [], float("nan")
    for i in range(iters):
        torch.cuda.synchronize()
        tic = time.perf_counter()
        out = trainer.train_step()  # float(loss) inside already waits for the GPU; synchronize anyway
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - tic)
        loss = out["loss"]
    return times, loss


def bench(model: str, micro: int, accum: int, args: argparse.Namespace, overrides: list[str], grid,
          peak: Optional[float]) -> Row:
    """Train `model` for args.iters iterations on this GPU and measure the timed ones."""
    from megazero.train.trainer import Trainer

    row = Row(model, micro=micro, accum=accum)
    cfg = make_config(model, micro, accum, args.iters, overrides)
    row.tokens_per_iter = cfg.train.global_batch_size * cfg.model.seq_length
    torch.cuda.reset_peak_memory_stats()
    trainer = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's config banner
            trainer = Trainer(cfg, grid)
        row.params_m = sum(p.numel() for c in trainer.chunks for p in c.parameters()) / 1e6
        times, row.last_loss = timed_steps(trainer, args.iters, args.warmup)
    except torch.cuda.OutOfMemoryError:
        row.error = f"out of memory at micro-batch {micro}; try --micro {max(1, micro // 2)}"
        return row
    finally:
        del trainer  # free this model's memory before the next one is built
        gc.collect()
        torch.cuda.empty_cache()
    row.step_s = sum(times) / len(times)
    row.tokens_per_sec = row.tokens_per_iter / row.step_s
    row.tflops = model_flops_per_token(cfg.model) * row.tokens_per_sec / 1e12
    row.mfu = row.tflops * 1e12 / peak if peak else None
    row.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
    return row


def table(rows: list[Row]) -> str:
    lines = [f"{'model':<10} {'params':>7} {'micro x acc':>11} {'tok/iter':>8} {'step s':>7} {'tok/s':>9} "
             f"{'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} {'loss':>7}"]
    for r in rows:
        if r.error:
            lines.append(f"{r.model:<10} FAILED: {r.error}")
            continue
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        lines.append(f"{r.model:<10} {r.params_m:>6.0f}M {f'{r.micro} x {r.accum}':>11} {r.tokens_per_iter:>8} "
                     f"{r.step_s:>7.3f} {r.tokens_per_sec / 1e3:>8.1f}k {r.tflops:>8.1f} {mfu:>6} "
                     f"{r.peak_mem_gib:>8.1f} {r.last_loss:>7.3f}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--iters", type=int, default=30, help="iterations per model, warm-up included")
    ap.add_argument("--warmup", type=int, default=5, help="first iterations left out of the timing")
    ap.add_argument("--micro", type=int, default=0, help="micro-batch size for every model (0: per-model default)")
    ap.add_argument("--accum", type=int, default=0, help="micro-batches per iteration (0: per-model default)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args, overrides = ap.parse_known_args(argv)
    if args.iters <= args.warmup:
        ap.error(f"--iters ({args.iters}) must exceed --warmup ({args.warmup}) to leave iterations to time")
    return args, overrides


def main(argv: Optional[list[str]] = None) -> int:
    args, overrides = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine "
              f"with a CUDA build of torch (this one is {torch.__version__})", file=sys.stderr)
        return 1
    from megazero.parallel.grid import ProcessGrid

    grid = ProcessGrid.create(tp=1, pp=1)  # NCCL, a world of one; sets the CUDA device
    name, peak = device_peak_flops()
    peak_text = f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "unknown peak: no MFU"
    print(f"bench_gpu: {name} ({peak_text}) | torch {torch.__version__} | CUDA {torch.version.cuda} | "
          f"{args.iters} iterations per model, first {args.warmup} untimed", flush=True)
    rows = []
    for model in args.models:
        micro, accum = args.micro or SHAPES[model][0], args.accum or SHAPES[model][1]
        rows.append(bench(model, micro, accum, args, overrides, grid, peak))
        print(table(rows[-1:]).splitlines()[-1], flush=True)  # progress, one line per model
    print("\n" + table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "peak_flops": peak, "rows": [asdict(r) for r in rows]}, f, indent=1)
    torch.distributed.destroy_process_group()  # NCCL warns about communicators left to teardown
    failed = [r.model for r in rows if r.error or not math.isfinite(r.last_loss)]
    if failed:
        print(f"bench_gpu: {', '.join(failed)} failed (see the table)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
