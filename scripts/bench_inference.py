"""ZeRO-Inference (generate --offload nvme) against in-memory generation: peak RSS, tokens/s.

    python scripts/bench_inference.py [--config configs/gpt2-1.5b.yaml] [--dir DIR] [--init-std 0.2]
        [--prompt-tokens 16] [--new-tokens 8] [--batch 1] [--modes memory,nvme,nvme-noprefetch]

The first run writes a randomly initialised model (GPT-2's init, megazero's
layout-independent `initial_value`, with model.init_std --init-std: at GPT-2's 0.02 a random
model repeats one token, which would make the equality check weak) to
DIR/<config>-init<std>.safetensors in bf16, one tensor at a time: the model is never whole
in memory. Each mode then runs in a child process that
loads it and generates greedily, in fp32, from the same random prompts:

    memory            the whole model on the device (build_model)
    cpu               --offload cpu: blocks in host memory, streamed
    nvme              --offload nvme: blocks in a file beside the checkpoint, streamed, the
                      next block read while the current one computes
    nvme-noprefetch   the same, each block read only when it is about to run

Each child reports its own peak RSS (ru_maxrss, loading included), the seconds to build
the model (or the offloaded store), the generation's tokens/s (batch x new tokens over the
generation's wall time, prefill included), the seconds the compute waited for weights and
the bytes streamed; the parent checks that every mode generated the same tokens. On a
machine with CUDA the device is the GPU (RSS is then host memory only). A measurement, not
a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import torch

from megazero.checkpoint.tensors import plain_shapes, save_safetensors_streaming
from megazero.config import ModelConfig
from megazero.harness.configs import CHECKOUT, make_config
from megazero.model.gpt import GPT

GiB = 2 ** 30


def write_random_checkpoint(m: ModelConfig, path: str, seed: int = 1234) -> None:
    """GPT-2 init of every parameter, drawn and written one tensor at a time, in bf16."""
    with torch.device("meta"):
        model = GPT(m)
    shapes = plain_shapes(m)
    tensors = ((name, model.initial_value(name, seed)) for name in shapes)
    save_safetensors_streaming(path, shapes, torch.bfloat16, tensors,
                               metadata={"format": "pt", "megazero_model": json.dumps(m.__dict__)})


def child(args: argparse.Namespace) -> dict:
    """One mode, in this (fresh) process: build, generate, report."""
    from megazero.checkpoint.load import open_checkpoint
    from megazero.generate import build_model, generate_batch
    from megazero.inference.offload import build_offloaded_model
    from megazero.parallel.comm import solo_group

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = open_checkpoint(args.checkpoint)
    tic = time.perf_counter()
    streamer = None
    if args.child == "memory":
        model = build_model(ckpt, solo_group(), device)
    else:
        offload, _, no_prefetch = args.child.partition("-")
        model, streamer = build_offloaded_model(ckpt, device, offload, args.dir, not no_prefetch)
    build_s = time.perf_counter() - tic
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, ckpt.model_config.vocab_size, (args.batch, args.prompt_tokens), generator=g).tolist()
    tic = time.perf_counter()
    ids = generate_batch(model, prompts, args.new_tokens, temperature=0.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - tic
    out = {"mode": args.child, "build_s": build_s, "generate_s": gen_s,
           "tokens_per_s": args.batch * args.new_tokens / gen_s,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB,
           "continuations": [row[args.prompt_tokens:] for row in ids]}
    if streamer is not None:
        streamer.close()
        out["wait_s"] = streamer.wait_s
        out["streamed_gib"] = streamer.fetches * streamer.layout.nbytes / GiB
    return out


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", args.dir, "--checkpoint", args.checkpoint,
           "--batch", str(args.batch),
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mode {mode} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(CHECKOUT, "configs", "gpt2-1.5b.yaml"), help="model config of the checkpoint generated from (default: %(default)s)")
    parser.add_argument("--dir", default="/tmp/megazero-bench-inference", help="folder for the checkpoint and the NVMe swap files (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per prompt (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together (default: %(default)s)")
    parser.add_argument("--modes", default="memory,nvme,nvme-noprefetch", help="comma-separated weight placements to measure (default: %(default)s)")
    parser.add_argument("--init-std", type=float, default=0.2, help="std of the random weights (large enough that the tokens vary) (default: %(default)s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    m = dataclasses.replace(make_config(base=os.path.abspath(args.config)).model, init_std=args.init_std)
    stem = os.path.splitext(os.path.basename(args.config))[0]
    args.checkpoint = path = os.path.join(args.dir, f"{stem}-init{args.init_std}.safetensors")
    os.makedirs(args.dir, exist_ok=True)
    if not os.path.isfile(path):
        tic = time.perf_counter()
        write_random_checkpoint(m, path)
        print(f"wrote {path} ({os.path.getsize(path) / GiB:.2f} GiB, bf16) in {time.perf_counter() - tic:.0f} s")
    params = sum(torch.Size(s).numel() for s in plain_shapes(m).values())
    print(f"model {os.path.basename(args.config)}: {params / 1e9:.2f} B parameters, {params * 4 / GiB:.1f} GiB in "
          f"fp32; batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new, greedy")
    results = [run_mode(mode, args) for mode in args.modes.split(",")]
    print(f"{'mode':<16} {'peak RSS':>9} {'build':>8} {'generate':>9} {'tokens/s':>9} {'wait':>7} {'streamed':>9}")
    for r in results:
        streamed = f"{r['streamed_gib']:.1f} GiB" if "streamed_gib" in r else "-"
        wait = f"{r['wait_s']:.1f} s" if "wait_s" in r else "-"
        print(f"{r['mode']:<16} {r['peak_rss_gib']:>5.2f} GiB {r['build_s']:>6.1f} s {r['generate_s']:>7.1f} s "
              f"{r['tokens_per_s']:>9.3f} {wait:>7} {streamed:>9}")
    same = all(r["continuations"] == results[0]["continuations"] for r in results)
    print(f"outputs token for token equal across modes: {same} ({results[0]['continuations'][0]})")
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()} on {os.cpu_count()} CPUs")
    print(json.dumps({"results": results, "equal": same}))


if __name__ == "__main__":
    main()
