"""Offload (zero.offload_optimizer none | cpu | nvme, zero.offload_param): what it costs and buys.

    python scripts/bench_offload.py adamw                 # CPU AdamW elements/s vs this machine's memory bound
    python scripts/bench_offload.py modes [--dp 2]        # GPT-2 124M: tokens/s, peak RSS per mode and stage
    python scripts/bench_offload.py big [--nvme DIR]      # GPT-2 1.5B, ZeRO-3, parameters + optimizer on NVMe

`adamw` times megazero's AdamW (zero/adamw.py, the update the offloaded step runs on the
CPU) against the memory-bandwidth bound: the step reads parameter, gradient and both moments
and writes back three (28 bytes per element in fp32), and the bandwidth is measured here by
a large tensor copy. `modes` trains the 124M model (seq 128, micro-batch 1, mock data) at
dp ranks for each stage and mode. `big` trains configs/gpt2-1.5b.yaml (seq 128, micro 1) for
3 iterations on dp ranks at ZeRO-3 with the 16-bit parameter shards, master weights and Adam
moments in NVMe swap files and reports peak RSS, seconds per iteration, the share of the step spent waiting on
I/O and the swap bandwidth against the disk's raw sequential bandwidth measured in the same
run; beside it, the model state the same run needs without offload. A measurement, not a
test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import tempfile
import time

import torch

from megazero.harness.configs import make_config
from megazero.harness.spawn import run_ranks

GiB, MiB = 2 ** 30, 2 ** 20


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # Linux reports KiB


# ---------------------------------------------------------------------------- adamw


def copy_bandwidth(numel: int = 1 << 26, repeats: int = 5) -> float:
    """Bytes/s of a large fp32 copy (one read and one write per element)."""
    src, dst = torch.rand(numel), torch.empty(numel)
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - tic)
    return 2 * 4 * numel / best


def bench_adamw(args: argparse.Namespace) -> None:
    from megazero.zero.adamw import adamw_
    torch.set_num_threads(args.threads)
    bound = copy_bandwidth() / 28
    print(f"memory bandwidth (copy): {bound * 28 / 1e9:.1f} GB/s -> AdamW bound {bound / 1e6:.0f} M elements/s "
          f"(28 B per element), {args.threads} thread(s)")
    print(f"{'elements':>12} {'M elements/s':>13} {'of bound':>9}")
    for numel in (1 << 20, 1 << 23, 1 << 26):
        p, g, m, v = (torch.rand(numel) for _ in range(4))
        best = float("inf")
        for step in range(1, 6):
            tic = time.perf_counter()
            adamw_([p], [g], [m], [v], lr=1e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, step=step)
            best = min(best, time.perf_counter() - tic)
        print(f"{numel:>12,} {numel / best / 1e6:>13.0f} {numel / best / bound:>8.0%}")


# ---------------------------------------------------------------------------- modes


def config(path: str, stage: int, mode: str, nvme: str, dp: int, iters: int, extra: dict):
    return make_config([
        "--model.seq_length", "128", "--model.vocab_size", "50304", "--data.mock", "true",
        "--train.micro_batch_size", "1", "--train.global_batch_size", str(dp), "--train.iters", str(iters + 1),
        "--zero.stage", str(stage), "--zero.offload_optimizer", mode, "--zero.nvme_path", nvme,
        *[str(x) for kv in extra.items() for x in kv]], path, world=dp)


def launch(fn, args: argparse.Namespace, *fn_args) -> list[dict]:
    """fn(args, *fn_args) on args.dp fresh gloo ranks (so each peak RSS is its own); results in rank order."""
    return run_ranks(fn, args.dp, args, *fn_args, timeout=args.timeout, threads=args.threads,
                     ignore=(FutureWarning,))  # torch's rename notices, once per rank and op


def train(cfg, iters: int) -> dict:
    """Build, take one warm-up step, time `iters` steps; what the store measured."""
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    with contextlib.redirect_stdout(io.StringIO()):  # the config banner
        tr = Trainer(cfg, ProcessGrid.create(1, 1))
    tr.train_step()
    store = tr.optimizer.state
    wait0 = getattr(store, "io_wait_s", 0.0)
    tic = time.perf_counter()
    steps = [tr.train_step() for _ in range(iters)]
    elapsed = (time.perf_counter() - tic) / iters
    out = {"s_per_iter": elapsed, "tokens_per_sec": cfg.train.global_batch_size * cfg.model.seq_length / elapsed,
           "rss_gib": peak_rss_gib(), "loss": steps[-1]["loss"], "state_bytes": tr.optimizer.model_state_bytes()}
    home = getattr(tr.optimizer.params, "home", None)
    if hasattr(home, "file"):  # zero.offload_param nvme
        out.update(param_read_gib=home.file.bytes_read / GiB, param_written_gib=home.file.bytes_written / GiB)
    if hasattr(store, "io_wait_s"):
        out.update(io_wait_share=(store.io_wait_s - wait0) / (elapsed * iters),
                   read_gbs=store.bytes_read / max(store.read_s, 1e-9) / 1e9,
                   write_gbs=store.bytes_written / max(store.write_s, 1e-9) / 1e9)
    return out


def _modes_rank(args: argparse.Namespace, stage: int, mode: str) -> dict:
    return train(config("configs/gpt2-124m.yaml", stage, mode, args.nvme, args.dp, args.iters,
                        {"--zero.sub_group_size": 10_000_000}), args.iters)


def bench_modes(args: argparse.Namespace) -> None:
    print(f"GPT-2 124M, seq 128, micro-batch 1, dp {args.dp}, fp32, {args.iters} timed iterations; per rank")
    print(f"{'stage':>5} {'offload':>8} {'tokens/s':>9} {'vs none':>8} {'peak RSS GiB':>13} {'loss':>9}")
    for stage in args.stages:
        base = None
        for mode in ("none", "cpu", "nvme"):
            out = launch(_modes_rank, args, stage, mode)
            tps = sum(o["tokens_per_sec"] for o in out) / len(out)
            base = base or tps
            print(f"{stage:>5} {mode:>8} {tps:>9.0f} {tps / base:>7.2f}x {max(o['rss_gib'] for o in out):>13.2f} "
                  f"{out[0]['loss']:>9.5f}", flush=True)


# ---------------------------------------------------------------------------- big


def disk_bandwidth(path: str, nbytes: int = GiB) -> tuple[float, float]:
    """Raw sequential write and read GB/s of `path`'s disk: 64 MiB O_DIRECT writes/reads
    (buffered where the filesystem refuses O_DIRECT), synced."""
    import mmap
    block = 64 * MiB
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    name = os.path.join(path, f".megazero-bench-{os.getpid()}")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(name, flags | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(name, flags)
    os.unlink(name)
    try:
        tic = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - tic) / 1e9
        tic = time.perf_counter()
        for off in range(0, nbytes, block):
            os.preadv(fd, [buf], off)
        read = nbytes / (time.perf_counter() - tic) / 1e9
    finally:
        os.close(fd)
    return write, read


def _big_rank(args: argparse.Namespace) -> dict:
    cfg = config("configs/gpt2-1.5b.yaml", 3, "nvme", args.nvme, args.dp, args.iters,
                 {"--zero.sub_group_size": args.sub_group, "--zero.buffer_count": 4,
                  "--zero.offload_param": "nvme", "--train.precision": args.precision})
    return train(cfg, args.iters)


def bench_big(args: argparse.Namespace) -> None:
    write, read = disk_bandwidth(args.nvme)
    out = launch(_big_rank, args)
    sb = out[0]["state_bytes"]
    without = sb["total"] + sb["offloaded_nvme"]  # the same state per rank, all of it in memory
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    worst = max(out, key=lambda o: o["rss_gib"])
    print(f"GPT-2 1.5B, seq 128, micro-batch 1, {args.precision}, ZeRO-3, dp {args.dp}, parameters and optimizer "
          f"state on NVMe ({args.nvme}), sub_group_size {args.sub_group:,}, buffer_count 4; "
          f"{args.iters} timed iterations")
    rss = ", ".join(f"{o['rss_gib']:.2f}" for o in out)
    print(f"  peak RSS per rank        {rss} GiB (goal <= 8 GiB)")
    print(f"  seconds per iteration    {worst['s_per_iter']:.1f}")
    print(f"  waiting on swap I/O      {max(o['io_wait_share'] for o in out):.0%} of each iteration (the optimizer "
          f"step's reads and writes that the overlap did not hide)")
    print(f"  swap read / write        {worst['read_gbs']:.2f} / {worst['write_gbs']:.2f} GB/s per rank "
          f"(disk raw sequential: read {read:.2f}, write {write:.2f} GB/s)")
    print(f"  parameter swap           {worst['param_read_gib']:.1f} GiB read, {worst['param_written_gib']:.1f} GiB "
          f"written per rank over the run")
    print(f"  loss after the last step {out[0]['loss']:.4f}")
    print(f"  model state per rank on device {sb['total'] / GiB:.1f} GiB + swap files {sb['offloaded_nvme'] / GiB:.1f} "
          f"GiB; without offload the {args.dp} ranks need {args.dp * without / GiB:.1f} GiB of model state alone, "
          f"this machine has {memory / GiB:.1f} GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["adamw", "modes", "big"], help="what to measure: adamw (the CPU optimizer step), modes (offload modes at each stage) or big (a model larger than memory)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (default: %(default)s)")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], help="ZeRO stages to measure (default: %(default)s)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per run (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: %(default)s)")
    p.add_argument("--nvme", default=tempfile.gettempdir(), help="directory for the swap files (default: %(default)s)")
    p.add_argument("--sub-group", type=int, default=25_000_000, help="zero.sub_group_size for `big` (default: %(default)s)")
    p.add_argument("--precision", default="bf16", help="train.precision for `big` (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait for a run's ranks (default: %(default)s)")
    args = p.parse_args()
    {"adamw": bench_adamw, "modes": bench_modes, "big": bench_big}[args.part](args)


if __name__ == "__main__":
    main()
