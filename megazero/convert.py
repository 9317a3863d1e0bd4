"""`python -m megazero.convert --load CKPT --to torch|hf|universal --output OUT [--dtype ...]`

  torch      one plain state_dict of the non-parallel GPT-2 (+ OUT.config.json), streamed
  hf         a Hugging Face GPT-2 or Llama directory: config.json, model.safetensors and the
             run's tokenizer: the tokenizer files of the Hugging Face directory it started
             from (checkpoint.init_from_hf), else data.tokenizer's as tokenizer.json +
             tokenizer_config.json (for transformers' AutoTokenizer) beside megazero's own files;
             generate --load OUT and AutoTokenizer.from_pretrained(OUT) need no --tokenizer
  universal  a parallelism-agnostic checkpoint that resumes at any layout (needs the
             optimizer state: from a save, iter_ or universal checkpoint)

A LoRA fine-tune (finetune.lora_rank > 0) exports to torch/hf as its base model alone, the
model its PEFT adapter directory (SAVE/iter_N/adapter) applies to; --merge-lora folds the
adapters in instead (W + alpha/r B A), giving a plain GPT-2.

CKPT is any checkpoint kind: a save directory (its `latest`, or --iteration N), an
iter_NNNNNNN directory, a universal checkpoint, a torch export (FILE + FILE.config.json, or
model_16bit.safetensors), a Hugging Face GPT-2 directory, or a DeepSpeed checkpoint of one
(DIR whose `latest` names global_stepN/, a global_stepN/ folder, or a ds_to_universal folder).
A checkpoint that does not record its model (DeepSpeed's without a config.json beside it) is
read with the model section given as --config FILE and/or --model.KEY VALUE (e.g. the run's
own config): every shape the checkpoint records is checked against it, and what shapes cannot
tell (the number of heads) is taken from it; data.tokenizer there names the export's tokenizer.
Every output is written under a temporary name and renamed when complete; missing parent
folders are created.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from megazero.atomic import atomic_dir
from megazero.checkpoint.adapter import base_only, describe_adapters, has_adapters, merge_lora
from megazero.checkpoint.base import Checkpoint
from megazero.checkpoint.export import write_hf, write_run_tokenizer, write_torch, write_universal
from megazero.checkpoint.load import open_checkpoint
from megazero.config import Config, ConfigError, build_config, load_yaml, parse_overrides
from megazero.data import DataError
from megazero.errors import UserError, report_errors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="megazero-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="any checkpoint kind (see above)")
    parser.add_argument("--to", required=True, choices=["torch", "hf", "universal"])
    parser.add_argument("--output", required=True, help="output file (torch) or directory (hf, universal)")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="weights dtype (torch, hf)")
    parser.add_argument("--iteration", type=int, default=0, help="convert SAVE/iter_N instead of latest")
    parser.add_argument("--merge-lora", action="store_true",
                        help="torch, hf: fold LoRA adapters into their base weights (default: base model only)")
    parser.add_argument("--config", help="YAML config with the model section of a checkpoint that does not record "
                                         "its model (a DeepSpeed one without config.json); also --model.KEY VALUE")
    args, model_args = parser.parse_known_args(argv)

    merged = ""
    with report_errors(OSError):
        stated = stated_config(args.config, model_args)
        ckpt = open_checkpoint(args.load, args.iteration, stated)
        if stated and not getattr(ckpt.training, "model_stated", False):
            print(f"note: {ckpt.kind} '{ckpt.ckpt}' records its model; --config and --model.KEY are not used",
                  file=sys.stderr)
        if args.merge_lora and has_adapters(ckpt):
            merged = f", LoRA adapters merged in ({describe_adapters(ckpt)})"
        if args.to != "universal":
            ckpt = with_adapters_handled(ckpt, args.merge_lora)
        elif args.merge_lora:
            raise UserError("--merge-lora applies to --to torch or hf; a universal checkpoint keeps the adapters")
        if args.to == "torch":
            write_torch(ckpt, args.output, DTYPES[args.dtype])
        elif args.to == "universal":
            ckpt.trainer_state()  # a weights-only source is refused before any folder is made
            atomic_dir(args.output, lambda tmp: write_universal(ckpt, tmp))
        else:
            atomic_dir(args.output, lambda tmp: write_hf_export(ckpt, tmp, DTYPES[args.dtype]))
    at = "" if ckpt.iteration is None else f" (iteration {ckpt.iteration})"
    print(f"wrote {args.to} export of {ckpt.kind} {ckpt.ckpt}{at} to {args.output}{merged}")


def stated_config(path: Optional[str], model_args: list[str]) -> Optional[Config]:
    """The config --config FILE and --model.KEY VALUE state; None when neither is given."""
    for section, key, _ in parse_overrides(model_args):
        if section != "model":
            raise ConfigError(f"--{section}.{key}: convert takes the model section's keys alone (--model.KEY VALUE)")
    if path is None and not model_args:
        return None
    return build_config(load_yaml(path) if path else None, model_args)


def with_adapters_handled(ckpt: Checkpoint, merge: bool) -> Checkpoint:
    """A LoRA checkpoint for a plain export: adapters folded in (`merge`) or left out."""
    if merge:
        return merge_lora(ckpt)
    if has_adapters(ckpt):
        print(f"note: {ckpt.kind} '{ckpt.ckpt}' holds LoRA adapters; exporting the base model alone (the adapters are "
              f"in its adapter/ directory, for PEFT); pass --merge-lora to fold them in", file=sys.stderr)
        return base_only(ckpt)
    return ckpt


def write_hf_export(ckpt: Checkpoint, output: str, dtype: torch.dtype) -> None:
    """HF GPT-2 or Llama directory: weights, config and the tokenizer the run was trained with."""
    eos = None
    try:
        tokenizer = write_run_tokenizer(ckpt, output)
        if tokenizer is None:
            print(f"warning: {ckpt.kind} '{ckpt.ckpt}' names no tokenizer (data.tokenizer) and did not start from a "
                  f"Hugging Face directory with one; the export has none", file=sys.stderr)
        else:
            eos = tokenizer.eod
    except DataError as e:  # the weights are still worth having; say what is missing
        print(f"warning: {e}; exported without a tokenizer for transformers", file=sys.stderr)
    write_hf(output, ckpt.tensors("master"), ckpt.shapes, ckpt.model_config, dtype, eos_token_id=eos)

if __name__ == "__main__":
    main()
