"""Benchmark a Mixtral-style mixture of experts: megazero against transformers' MixtralForCausalLM
trained the plain way, in one process, on the same batches.

    python scripts/bench_moe.py [--iters 4] [--warmup 1] [--micro 2] [--accum 2] [--seq 256]
                                [--section.key value ...]

The model is configs/mixtral-tiny.yaml widened to about 100M parameters (8 experts, top-2;
h 512, 6 layers, expert width 1344, vocabulary 8192): issue 45's shape. megazero trains it
through its Trainer on a world of one (gloo on the CPU), fp32, dropless, with its load-balancing
and z-losses; the peer is MixtralForCausalLM of the same shape (megazero's own export config),
fp32, torch.optim.AdamW with the same settings, `output_router_logits` on so that it computes
its load-balancing loss too, fed the very micro-batches megazero's data loader gives. Both are
timed over `--iters` iterations after `--warmup`; printed: tokens/s of each and their ratio.

Expert parallelism (ep > 1) does not train yet (issue 45: ZeRO over the expert-data-parallel
group comes next), so the ep 2 / ep 1 ratio and the all-to-all share of the step are not
measured here. This is a measurement, not a test: nothing is asserted about speed.
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
            loss = (lm + out.aux_loss) / len(batches[i])
            loss.backward()
            total += float(lm.detach()) / len(batches[i])
        torch.nn.utils.clip_grad_norm_(peer.parameters(), o.clip_grad)
        optimizer.step()
        return total

    theirs = _timed(peer_step, args)
    tokens = cfg.train.global_batch_size * m.seq_length
    return {"params": params, "peer_params": sum(p.numel() for p in peer.parameters()), "tokens": tokens,
            "ours_s": ours, "peer_s": theirs}


def _timed(step, args: argparse.Namespace) -> float:
    """Mean seconds per iteration after the warm-up ones."""
    for i in range(args.warmup):
        step(i)
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
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args, overrides = parser.parse_known_args()
    from megazero.harness.spawn import run_ranks

    r = run_ranks(run, 1, args, overrides, threads=args.threads)[0]
    ours, theirs = r["tokens"] / r["ours_s"], r["tokens"] / r["peer_s"]
    print(f"Mixtral-style MoE, {r['params'] / 1e6:.1f}M parameters (peer {r['peer_params'] / 1e6:.1f}M), "
          f"{r['tokens']} tokens/iteration, one process, fp32 on {torch.get_num_threads()} threads")
    print(f"{'runner':<28}{'s/iter':>10}{'tokens/s':>12}")
    print(f"{'megazero':<28}{r['ours_s']:>10.3f}{ours:>12.1f}")
    print(f"{'MixtralForCausalLM (eager)':<28}{r['peer_s']:>10.3f}{theirs:>12.1f}")
    print(f"megazero / Hugging Face: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
