"""Does Muon pay? AdamW and Muon train the demo model on the embedded corpus; how many
iterations does Muon need to reach AdamW's final validation loss?

    python scripts/compare_optimizers.py [--iters 120] [--muon-lr 0.02 [0.01 ...]] [--eval-interval 10]

The model, data, batch and schedule are configs/gpt2-cpu-demo.yaml's (the model
scripts/pretrain_gpt.sh trains), in one process (tp 1, pp 1; the layouts train alike). Every run
sees the same tokens in the same order from the same initial weights and follows the same
warm-up and cosine schedule over --iters; AdamW at the config's optim.lr, Muon at each
--muon-lr on the blocks' matrices with AdamW at optim.lr on the rest. The validation loss (the
config's eval_iters batches) is measured every --eval-interval iterations. The tokenizer and
dataset are built as pretrain_gpt.sh builds them when --data-prefix is absent.
This is a measurement, not a test: no assertion depends on it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

CHECKOUT = Path(__file__).resolve().parents[1]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/gpt2-cpu-demo.yaml",
                   help="the model and its AdamW settings (default: %(default)s)")
    p.add_argument("--iters", type=int, default=120,
                   help="iterations of each run (the config has 300; the schedule spans --iters) (default: %(default)s)")
    p.add_argument("--muon-lr", type=float, nargs="+", default=[0.02],
                   help="Muon's peak LR(s), one run each (default: %(default)s)")
    p.add_argument("--muon-adjust-lr", default="original", choices=["original", "match_rms_adamw"],
                   help="optim.muon_adjust_lr of the Muon runs (default: %(default)s)")
    p.add_argument("--eval-interval", type=int, default=10,
                   help="iterations between validation losses (default: %(default)s)")
    p.add_argument("--data-prefix", default="data/corpus_text_document",
                   help="the indexed dataset, made as pretrain_gpt.sh makes it when missing (default: %(default)s)")
    p.add_argument("--tokenizer", default="gpt2bpe:data/tokenizer",
                   help="its tokenizer spec (default: %(default)s)")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace, optim: list[str]) -> list[str]:
    """One process, the demo's data and schedule over --iters, nothing written."""
    return ["--parallel.tp", "1", "--parallel.pp", "1", "--zero.stage", "0", "--train.iters", str(args.iters),
            "--train.eval_interval", str(args.eval_interval), "--data.mock", "false",
            "--data.prefix", args.data_prefix, "--data.tokenizer", args.tokenizer, "--model.vocab_size", "auto",
            "--checkpoint.save", "null", "--checkpoint.load", "null", "--logging.jsonl", "null", *optim]


def train(report: Callable[[Any], None], config: str, argv: list[str], eval_interval: int) -> None:
    """One run in this spawned rank: reports (iteration, validation loss) at iteration 0 and
    every eval_interval iterations (and the last) as they come, then the seconds it took."""
    from megazero.harness.configs import make_config
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    cfg = make_config(argv, config, world=1)
    with contextlib.redirect_stdout(io.StringIO()):  # the start-up summary
        tr = Trainer(cfg, ProcessGrid.create(1, 1))
    report((0, tr.evaluate()))
    tic = time.perf_counter()
    while tr.iteration < cfg.train.iters:
        tr.train_step()
        if tr.iteration % eval_interval == 0 or tr.iteration == cfg.train.iters:
            report((tr.iteration, tr.evaluate()))
    report(time.perf_counter() - tic)


def first_reaching(valid: dict[int, float], target: float) -> Optional[int]:
    """The first measured iteration whose validation loss is at or below target (None: never)."""
    return next((it for it, v in sorted(valid.items()) if v <= target), None)


def prepare_data(args: argparse.Namespace) -> None:
    """The tokenizer and indexed dataset of pretrain_gpt.sh, built the same way when absent."""
    if os.path.exists(CHECKOUT / f"{args.data_prefix}.idx"):
        return
    env = dict(os.environ, PREPARE_ONLY="1", NPROC="1", TP="1", PP="1", DATA_PREFIX=args.data_prefix,
               TOKENIZER=args.tokenizer)
    subprocess.run(["bash", "scripts/pretrain_gpt.sh"], cwd=CHECKOUT, env=env, check=True)


def main(argv: Optional[list[str]] = None) -> int:
    from megazero.harness.spawn import stream_ranks
    args = parse_args(argv)
    os.chdir(CHECKOUT)  # the config's and data's relative paths
    prepare_data(args)
    runs = {"adamw": ["--optim.name", "adamw"]}
    for lr in args.muon_lr:
        runs[f"muon {lr:g}"] = ["--optim.name", "muon", "--optim.muon_lr", str(lr),
                                "--optim.muon_adjust_lr", args.muon_adjust_lr]
    results: dict[str, dict] = {}
    for name, optim in runs.items():
        results[name] = r = {"valid": {}}
        for _, value in stream_ranks(train, 1, args.config, overrides(args, optim), args.eval_interval):
            if isinstance(value, tuple):
                r["valid"][value[0]] = value[1]
                print(f"{name}: iteration {value[0]}: validation loss {value[1]:.4f}", flush=True)
            else:
                r["seconds"] = value
        print(f"{name:>12}: final validation loss {r['valid'][args.iters]:.4f} after {args.iters} iterations "
              f"({r['seconds']:.0f} s of training)", flush=True)
    target = results["adamw"]["valid"][args.iters]
    its = sorted(results["adamw"]["valid"])
    print(f"\nvalidation loss by iteration ({args.config}, tp 1, {args.iters} iterations, same tokens):")
    print(f"{'iteration':>9} " + " ".join(f"{n:>12}" for n in results))
    for it in its:
        print(f"{it:>9} " + " ".join(f"{r['valid'][it]:>12.4f}" for r in results.values()))
    print(f"\nAdamW's final validation loss {target:.4f}; iterations to reach it:")
    for name, r in results.items():
        reached = first_reaching(r["valid"], target)
        share = f"{reached / args.iters:.0%} of AdamW's" if reached else "not reached"
        print(f"{name:>12}: {reached if reached is not None else '-'} ({share})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
