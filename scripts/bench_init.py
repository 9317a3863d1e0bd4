"""Peak memory per rank while building a GPT-2 at ZeRO-3: sharded (meta-device) init against
materializing the whole model first, and against the ZeRO-3 formula 16Ψ/N (fp32).

    python scripts/bench_init.py [--models 774m 1.5b] [--dp 4] [--precision fp32]

Each rank's build runs in a fresh process of its own, one rank after another: building
needs no communication, and the ranks of a 1.5B model together hold 16Ψ ≈ 25 GB, more than
this machine has, while one rank holds 16Ψ/N. The process plays rank r of a tp 1 × pp 1 ×
dp N grid whose groups have no communicators (building touches none). Peak RSS is the
process's high-water mark (ru_maxrss) minus its RSS after importing torch (the
interpreter's own share, printed). Above the model state it holds for good, a sharded
build should need only transients of about one parameter (the init draws each full
parameter, fp32, keeps this rank's piece and drops it): the table shows both.
This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GiB = 2 ** 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def dry_grid(dp: int, rank: int):
    """Rank `rank` of a tp 1 x pp 1 x dp grid whose groups have no communicators."""
    from megazero.parallel.comm import Group
    from megazero.parallel.grid import ProcessGrid
    grid = ProcessGrid(tp=1, pp=1, dp=dp, rank=rank)
    for kind in ("tp", "dp", "pp", "embed"):
        ranks = next(r for r in grid.group_ranks(kind) if rank in r)
        grid.groups[kind] = Group(kind, None, ranks, ranks.index(rank))
    # Every rank is built alone: agreements (comm.agreed) over the world are this rank's own.
    grid.groups["world"] = Group("world", None, [rank], 0)
    grid.complete_cp_groups()
    return grid


def build_rank(model: str, dp: int, rank: int, precision: str, sharded: bool) -> dict:
    """Build rank `rank`'s share of configs/gpt2-MODEL.yaml at ZeRO-3 and report its memory."""
    import torch

    from megazero.harness.configs import make_config
    from megazero.model.gpt import GPT
    from megazero.parallel.placement import placement
    from megazero.parallel.random import seed_everything
    from megazero.train.parallelize import parallelize
    from megazero.zero.optimizer import ZeroOptimizer
    from megazero.zero.shard import ShardedParameters
    torch.set_num_threads(1)
    base = rss_bytes()
    cfg = make_config(["--zero.stage", "3", "--train.precision", precision, "--data.mock", "true",
                       "--train.global_batch_size", str(dp), "--train.micro_batch_size", "1"],
                      f"configs/gpt2-{model}.yaml", world=dp)
    grid = dry_grid(dp, rank)
    tracker = seed_everything(cfg.train.seed, 0, 0, grid.device)
    if sharded:
        _, opt = parallelize(cfg, grid, tracker)
    else:  # the way before sharded init: every rank builds and initializes the whole model
        model = GPT(cfg.model, tracker)
        model.init_weights(cfg.train.seed)
        opt = ZeroOptimizer(ShardedParameters([model], cfg, grid), cfg, grid)
        del model
    largest = max(math.prod(placement(s.param).full_shape) for _, s in opt.layout.slots())
    return {"psi": opt.layout.numel, "state": opt.model_state_bytes()["total"],
            "peak": peak_rss_bytes() - base, "base": base, "largest": 4 * largest}


def run_child(model: str, dp: int, rank: int, precision: str, sharded: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, str(dp), str(rank), precision,
           "1" if sharded else "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["killed (out of memory?)"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, dp, rank, precision, sharded = sys.argv[2:7]
        print(json.dumps(build_rank(model, int(dp), int(rank), precision, sharded == "1")))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["774m", "1.5b"], help="GPT-2 sizes to initialise (default: %(default)s)")
    ap.add_argument("--dp", type=int, default=4, help="ranks the ZeRO-3 init shards over (default: %(default)s)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="train.precision of the model (default: %(default)s)")
    ap.add_argument("--skip-materialized", action="store_true", help="only the sharded init")
    args = ap.parse_args()
    per_elem = {"fp32": 16, "bf16": 18}[args.precision]  # bf16 with fp32 gradient accumulation
    print(f"ZeRO-3, dp {args.dp}, {args.precision}: peak RSS per rank while building (GiB); formula "
          f"{per_elem}Ψ/N; a full fp32 model copy is 4Ψ\n")
    print(f"| model | Ψ | init | rank | peak RSS | model state | {per_elem}Ψ/N | peak / ({per_elem}Ψ/N) | "
          f"peak − state | largest parameter (fp32) | full model (4Ψ) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    modes = [True] if args.skip_materialized else [True, False]
    for model in args.models:
        for sharded in modes:
            for rank in range(args.dp):
                out = run_child(model, args.dp, rank, args.precision, sharded)
                name = "sharded (meta)" if sharded else "materialized first"
                if "error" in out:
                    print(f"| {model} | | {name} | {rank} | failed: {out['error']} | | | | |", flush=True)
                    break
                formula = per_elem * out["psi"] / args.dp
                print(f"| {model} | {out['psi'] / 1e9:.3f} B | {name} | {rank} | {out['peak'] / GiB:.2f} | "
                      f"{out['state'] / GiB:.2f} | {formula / GiB:.2f} | {out['peak'] / formula:.3f} | "
                      f"{(out['peak'] - out['state']) / GiB:.2f} | {out['largest'] / GiB:.2f} | "
                      f"{4 * out['psi'] / GiB:.2f} |", flush=True)
                if not sharded:
                    break  # every rank of the old way builds the same whole model: one is enough
    print(f"\n(interpreter + torch RSS before building, not counted: {out.get('base', 0) / GiB:.2f} GiB)")


if __name__ == "__main__":
    main()
