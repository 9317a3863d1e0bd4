"""`python -m megazero.convert --load CKPT --to torch|hf|universal --output OUT [--dtype ...]`

  torch      one plain state_dict of the non-parallel GPT-2 (+ OUT.config.json), streamed
  hf         a Hugging Face GPT-2 directory: config.json, model.safetensors, tokenizer files
  universal  a parallelism-agnostic checkpoint that resumes at any layout

CKPT is a save directory (its `latest`), or one iter_NNNNNNN directory in it.
Every output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="megazero-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint save directory or iter_ directory")
    parser.add_argument("--to", required=True, choices=["torch", "hf", "universal"])
    parser.add_argument("--output", required=True, help="output file (torch) or directory (hf, universal)")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="weights dtype (torch, hf)")
    parser.add_argument("--iteration", type=int, default=0, help="convert iter_N instead of latest")
    args = parser.parse_args(argv)

    from megazero.atomic import atomic_dir
    from megazero.checkpoint import sharded
    from megazero.checkpoint.export import ShardedReader, write_torch
    from megazero.checkpoint.universal import write_universal

    try:
        ckpt = args.load
        if args.iteration or not os.path.isfile(os.path.join(ckpt, "metadata.json")):
            ckpt = sharded.resolve(args.load, args.iteration)
        reader = ShardedReader(ckpt)
        if args.to == "torch":
            write_torch(reader, args.output, DTYPES[args.dtype])
        elif args.to == "universal":
            atomic_dir(args.output, lambda tmp: write_universal(reader, tmp))
        else:
            atomic_dir(args.output, lambda tmp: write_hf_export(reader, tmp, DTYPES[args.dtype]))
    except (sharded.CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.to} export of {ckpt} (iteration {reader.iteration}) to {args.output}")


def write_hf_export(reader, output: str, dtype: torch.dtype) -> None:
    """HF GPT-2 directory; a GPT-2 BPE tokenizer's files are copied beside the weights."""
    from megazero.checkpoint.hf import write_hf

    spec = reader.meta["config"]["data"].get("tokenizer")
    eos = None
    if spec:
        from megazero.data.tokenizer import build_tokenizer
        tokenizer = build_tokenizer(spec)
        eos = tokenizer.eod
        kind, _, path = spec.partition(":")
        if kind == "gpt2bpe" and os.path.isdir(path):
            os.makedirs(output, exist_ok=True)
            for name in ("vocab.json", "merges.txt"):
                shutil.copy(os.path.join(path, name), os.path.join(output, name))
    shapes = {n: reader.full_shape(n) for n in reader.names()}
    write_hf(output, reader.tensors("master"), shapes, reader.model_config, dtype, eos_token_id=eos)


if __name__ == "__main__":
    main()
