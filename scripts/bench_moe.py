"""Benchmark a Mixtral-style mixture of experts: megazero against transformers' MixtralForCausalLM
trained the plain way, in one process, on the same batches.

    python scripts/bench_moe.py [--iters 4] [--warmup 1] [--micro 2] [--accum 2] [--seq 256]
                                [--ep N] [--section.key value ...]

The model is configs/mixtral-tiny.yaml widened to about 100M parameters (8 experts, top-2;
h 512, 6 layers, expert width 1344, vocabulary 8192): issue 45's shape. megazero trains it
through its Trainer on a world of one (gloo on the CPU), fp32, dropless, with its load-balancing
and z-losses; the peer is MixtralForCausalLM of the same shape (megazero's own export config),
fp32, torch.optim.AdamW with the same settings, `output_router_logits` on so that it computes
its load-balancing loss too, fed the very micro-batches megazero's data loader gives. Both are
timed over `--iters` iterations after `--warmup`; printed: tokens/s of each and their ratio.

With `--ep N` it measures expert parallelism instead: the same model and global batch trained
by N processes (ep N over dp N, gloo) and by one (ep 1), each rank with `--threads` torch threads
(default 1), as each rank would have a GPU of its own: ep N has N times ep 1's cores, and the
ratio of their tokens/s is the scaling issue 45 asks >= 1.6x of. ep 1 also runs on all of ep N's
cores (N x threads in one process), the comparison on equal hardware. Each is timed over
`--iters` iterations; printed: tokens/s of each, the ratios, and the share of ep N's step spent in
the tokens' all-to-alls (the counts' and the rows' exchanges, forward and backward, timed around
each call). `--accum` must be a multiple of N.
This is a measurement, not a test: nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time

import torch

SHAPE = ["--model.hidden_size", "512", "--model.num_heads", "8", "--model.num_query_groups", "8",
         "--model.num_layers", "6", "--model.num_experts", "8", "--model.moe_router_topk", "2",
         "--model.moe_ffn_hidden_size", "1344", "--model.ffn_hidden_size", "1344", "--model.vocab_size", "8192"]


def run(args: argparse.Namespace, overrides: list[str]) -> dict:
    """In a spawned rank (world of one): megazero's iterations, then the peer's on the same batches."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megazero.checkpoint.hf_names import hf_config
    from megazero.harness.configs import make_config
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer

    flags = SHAPE + ["--model.seq_length", str(args.seq), "--train.micro_batch_size", str(args.micro),
                     "--train.global_batch_size", str(args.micro * args.accum),
                     "--train.iters", str(args.iters + args.warmup), "--optim.warmup_iters", "0"] + overrides
    cfg = make_config(flags, "configs/mixtral-tiny.yaml", world=1)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg, ProcessGrid.create(1, 1))
    params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    batches = [trainer.microbatches(trainer.train_ds, i * cfg.train.global_batch_size)
               for i in range(args.iters + args.warmup)]
    ours = _timed(lambda i: trainer.train_step()["loss"], args)

    m, o = cfg.model, cfg.optim
    conf = dict(hf_config(m))
    kind = conf.pop("model_type")
    conf.update(output_router_logits=True, router_aux_loss_coef=m.moe_aux_loss_coeff, use_cache=False)
    torch.manual_seed(cfg.train.seed)
    peer = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **conf), attn_implementation="sdpa")
    decay = [p for p in peer.parameters() if p.dim() >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": [p for p in peer.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)

    def peer_step(i: int) -> float:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for inputs, labels in batches[i]:
            out = peer(input_ids=inputs, labels=None)
            lm = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
            loss = (lm + peer.config.router_aux_loss_coef * out.aux_loss) / len(batches[i])
            loss.backward()
            total += float(lm.detach()) / len(batches[i])
        torch.nn.utils.clip_grad_norm_(peer.parameters(), o.clip_grad)
        optimizer.step()
        return total

    theirs = _timed(peer_step, args)
    tokens = cfg.train.global_batch_size * m.seq_length
    return {"params": params, "peer_params": sum(p.numel() for p in peer.parameters()), "tokens": tokens,
            "ours_s": ours, "peer_s": theirs}


def run_ep(args: argparse.Namespace, overrides: list[str]) -> dict:
    """In each spawned rank of a world of ep ranks (ep over dp): seconds per iteration and, of
    them, seconds in the tokens' all-to-alls (each call timed on this rank)."""
    import torch.distributed as dist

    from megazero.harness.configs import make_config
    from megazero.parallel import comm, dispatch
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer

    ep = dist.get_world_size()
    flags = SHAPE + ["--model.seq_length", str(args.seq), "--train.micro_batch_size", str(args.micro),
                     "--train.global_batch_size", str(args.micro * args.accum), "--parallel.ep", str(ep),
                     "--train.iters", str(args.iters + args.warmup), "--optim.warmup_iters", "0"] + overrides
    cfg = make_config(flags, "configs/mixtral-tiny.yaml", world=ep)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg, ProcessGrid.create(1, 1, ep=ep, etp=1))
    spent = [0.0]

    def timed(fn):
        def call(*a, **k):
            tic = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - tic
        return call
    # The rows' exchange (comm's, which the dispatcher's autograd Function calls both ways) and the counts'.
    comm.all_to_all_uneven = timed(comm.all_to_all_uneven)  # type: ignore[assignment]
    dispatch.all_to_all = timed(dispatch.all_to_all)  # type: ignore[assignment]
    start = [0.0]
    seconds = _timed(lambda i: trainer.train_step()["loss"], args, lambda: start.__setitem__(0, spent[0]))
    return {"s": seconds, "all_to_all_s": (spent[0] - start[0]) / args.iters,
            "tokens": cfg.train.global_batch_size * cfg.model.seq_length}


def _timed(step, args: argparse.Namespace, started=lambda: None) -> float:
    """Mean seconds per iteration after the warm-up ones (`started()` when the timing starts)."""
    for i in range(args.warmup):
        step(i)
    started()
    tic = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.iters):
        step(i)
    return (time.perf_counter() - tic) / args.iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=4, help="timed iterations of each (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default: %(default)s)")
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch (default: %(default)s)")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per iteration (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's; with --ep, per rank: 1)")
    parser.add_argument("--ep", type=int, default=1,
                        help="measure ep N (N processes) against ep 1 instead of the HF peer (default: %(default)s)")
    args, overrides = parser.parse_known_args()
    from megazero.harness.spawn import run_ranks

    if args.ep > 1:
        return compare_ep(args, overrides)
    r = run_ranks(run, 1, args, overrides, threads=args.threads)[0]
    ours, theirs = r["tokens"] / r["ours_s"], r["tokens"] / r["peer_s"]
    print(f"Mixtral-style MoE, {r['params'] / 1e6:.1f}M parameters (peer {r['peer_params'] / 1e6:.1f}M), "
          f"{r['tokens']} tokens/iteration, one process, fp32 on {torch.get_num_threads()} threads")
    print(f"{'runner':<28}{'s/iter':>10}{'tokens/s':>12}")
    print(f"{'megazero':<28}{r['ours_s']:>10.3f}{ours:>12.1f}")
    print(f"{'MixtralForCausalLM (eager)':<28}{r['peer_s']:>10.3f}{theirs:>12.1f}")
    print(f"megazero / Hugging Face: {ours / theirs:.2f}x")


def compare_ep(args: argparse.Namespace, overrides: list[str]) -> None:
    """ep N in N processes against ep 1 in one with a rank's threads, and in one with all N ranks'
    threads; the same global batch."""
    from megazero.harness.spawn import run_ranks
    if args.accum % args.ep:
        raise SystemExit(f"error: --accum ({args.accum}) must be a multiple of --ep ({args.ep}): the global batch is "
                         f"split over the ep x dp ranks; try --accum {args.ep * max(1, args.accum // args.ep)}")
    n, threads = args.ep, args.threads or 1
    many = run_ranks(run_ep, n, args, overrides, threads=threads)
    one = run_ranks(run_ep, 1, args, overrides, threads=threads)[0]
    same_cores = run_ranks(run_ep, 1, args, overrides, threads=n * threads)[0]
    slowest = max(many, key=lambda r: r["s"])  # a step ends when its last rank's does
    share = max(r["all_to_all_s"] / r["s"] for r in many)
    print(f"Mixtral-style MoE, {one['tokens']} tokens/iteration, fp32 on gloo")
    print(f"{'runner':<40}{'s/iter':>10}{'tokens/s':>12}")
    for name, s in ((f"ep 1: 1 process x {threads} thread(s)", one["s"]),
                    (f"ep 1: 1 process x {n * threads} thread(s)", same_cores["s"]),
                    (f"ep {n}: {n} processes x {threads} thread(s)", slowest["s"])):
        print(f"{name:<40}{s:>10.3f}{one['tokens'] / s:>12.1f}")
    print(f"ep {n} / ep 1, a rank each with {threads} thread(s) (as one GPU each): {one['s'] / slowest['s']:.2f}x "
          f"tokens/s; on the same {n * threads} threads: {same_cores['s'] / slowest['s']:.2f}x; all-to-all "
          f"{100 * share:.1f}% of ep {n}'s step (the rank spending most)")


if __name__ == "__main__":
    main()
