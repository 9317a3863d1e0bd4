"""The cost of the silent-fault checks (issue 48) beside a training step, on gloo ranks.

    python scripts/bench_silent_faults.py [--config configs/gpt2-124m.yaml] [--nproc 2] [--stage 1]
                                          [--steps 3] [--micro 1] [--seq 1024] [--precision fp32]

Each rank builds the trainer (the mock dataset), takes one warm-up step, then times --steps
training steps, and apart from them: one replica check (a digest pass over this rank's replicated
values and one all-gather of the digests), one straggler gather (one all-gather of two numbers per
rank), and the rerun guard's per-step save (the RNG states). The step is measured with the checks
off (train.replica_check_interval 0, train.straggler_interval 0, train.rerun_on none) and then with
the rerun guard and the straggler timing on; the report gives each cost as a share of the step.
Not a test: it takes minutes on CPUs and measures times.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

from megazero.harness.configs import make_config
from megazero.harness.spawn import run_ranks


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def _measure(config: str, args: list[str], steps: int) -> dict:
    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    cfg = make_config([*args, "--train.replica_check_interval", "1", "--train.straggler_interval", "1"], config,
                      world=dist.get_world_size())
    with contextlib.redirect_stdout(io.StringIO()):
        tr = Trainer(cfg, ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp, cp=cfg.parallel.cp))
    guard_on = (tr.rerun.mode, tr.stragglers.interval)
    tr.rerun.mode, tr.stragglers.interval = "none", 0  # the step with every check off
    tr.train_step()  # warm-up
    off = _median_seconds(tr.train_step, steps)
    tr.rerun.mode, tr.stragglers.interval = guard_on  # the default rerun guard, the straggler timing
    on = _median_seconds(tr.train_step, steps)
    check = _median_seconds(lambda: (setattr(tr.replicas, "verified", None), tr.replicas.check(tr.iteration)), 3)
    gather = _median_seconds(lambda: tr.stragglers.after_step(tr.iteration), 3)
    save = _median_seconds(lambda: tr.rerun.save(tr.tracker, tr.optimizer.scaler), 20)
    return {"step_off_s": off, "step_on_s": on, "replica_check_s": check, "straggler_gather_s": gather,
            "rerun_save_s": save, "digests": len(tr.replicas.entries), "params": tr.optimizer.layout.param_numel}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/gpt2-124m.yaml", help="the model (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks, all data-parallel (default: %(default)s)")
    p.add_argument("--stage", type=int, default=1, help="zero.stage (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="timed steps each way (default: %(default)s)")
    p.add_argument("--micro", type=int, default=1, help="train.micro_batch_size (default: %(default)s)")
    p.add_argument("--seq", type=int, default=1024, help="model.seq_length (default: %(default)s)")
    p.add_argument("--precision", default="fp32", help="train.precision (default: %(default)s)")
    a = p.parse_args()
    args = ["--zero.stage", str(a.stage), "--train.micro_batch_size", str(a.micro), "--train.global_batch_size",
            str(a.micro * a.nproc), "--model.seq_length", str(a.seq), "--train.precision", a.precision,
            "--model.dropout", "0.0", "--train.recompute", "none", "--data.mock", "true", "--train.iters", "100",
            "--train.eval_interval", "0"]
    results = run_ranks(_measure, a.nproc, a.config, args, a.steps, threads=None)
    r = {k: max(x[k] for x in results) for k in results[0]}  # the slowest rank sets the pace
    print(f"{a.config} ({r['params'] / 1e6:.1f}M parameters), ZeRO-{a.stage} dp {a.nproc}, micro-batch {a.micro} x "
          f"seq {a.seq}, {a.precision}, gloo; medians of {a.steps} steps")
    print(f"step, checks off:                      {r['step_off_s']:.3f} s")
    print(f"step, rerun guard + straggler timing:  {r['step_on_s']:.3f} s "
          f"({100 * (r['step_on_s'] / r['step_off_s'] - 1):+.2f}%: what the machine's load lets two runs differ by; "
          f"the checks' own costs follow)")
    for name, key in (("replica check (digests + all-gather)", "replica_check_s"),
                      ("straggler gather (one all-gather)", "straggler_gather_s"),
                      ("rerun guard's save (RNG states)", "rerun_save_s")):
        print(f"{name + ':':39s}{1e3 * r[key]:.2f} ms = {100 * r[key] / r['step_off_s']:.3f}% of the step "
              f"(when run every iteration)")


if __name__ == "__main__":
    main()
