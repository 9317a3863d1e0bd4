"""`python -m megazero.generate --load CKPT --prompt TEXT [--max-new-tokens N
--temperature T --top-k K --top-p P --seed S]`: sample text with a KV cache.

CKPT is any checkpoint kind: a save directory (its `latest`), an iter_NNNNNNN directory, a
universal checkpoint, a torch export (FILE + FILE.config.json, or model_16bit.safetensors)
or a Hugging Face GPT-2 directory. At most model.seq_length tokens fit, prompt included:
a longer request is cut there with a warning. Under torchrun
with N processes the model is split tp = N ways; every rank samples the same tokens
(same seed, same gathered logits). Temperature 0 is greedy decoding.

The model, its KV cache, the logits and the sampling generator live on the run's device:
the process's GPU when CUDA is available (one per rank under torchrun), else the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

from megazero.checkpoint.load import Checkpoint
from megazero.checkpoint.sharded import CheckpointError
from megazero.errors import UserError, report_errors
from megazero.model.gpt import GPT, KVCache
from megazero.model.layers import shard_of
from megazero.parallel.comm import Group, gather_from_tp


def build_model(ckpt: Checkpoint, tp: Group, device: torch.device | str = "cpu") -> GPT:
    """The checkpoint's model as a plain (pp = 1) GPT-2 split over `tp` on `device`, each
    rank keeping its shard of every tensor. The model is built on the meta device and split
    over TP there, then only the shards are allocated on the device and filled one at a
    time, so the full model never sits in host or device memory."""
    from megazero.checkpoint.export import fit_vocab
    from megazero.train.parallelize import apply_tensor_parallel
    from megazero.zero.materialize import replace_meta_parameters
    with torch.device("meta"):
        model = apply_tensor_parallel(GPT(ckpt.model_config), tp)
    replace_meta_parameters([model], torch.device(device))
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, full in ckpt.tensors():
            if name not in params:
                continue
            p = params[name]
            full = fit_vocab(name, full.float(), p.full_shape)
            p.copy_(shard_of(full, p.tp_dim, p.tp_stride, tp.rank, tp.size))
            seen.add(name)
    missing = set(params) - seen
    if missing:
        raise CheckpointError(f"the weights lack {len(missing)} parameters, e.g. {sorted(missing)[0]}")
    return model.eval()


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eod: Optional[int] = None) -> list[int]:
    """Prompt + up to max_new_tokens sampled ids (stops early at `eod`)."""
    max_new_tokens = min(max_new_tokens, room_for_new_tokens(len(prompt), model.cfg.seq_length))
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)  # multinomial needs a generator on its device
    cache = KVCache(model, 1, len(prompt) + max_new_tokens)  # allocated beside the model's parameters
    ids = list(prompt)
    x = torch.tensor([prompt], device=device)
    for _ in range(max_new_tokens):
        logits = gather_from_tp(model(x, cache)[:, -1], model.tp)[0, : model.cfg.vocab_size].float()
        nxt = sample(logits, temperature, top_k, top_p, g)
        ids.append(nxt)
        if nxt == eod:
            break
        x = torch.tensor([[nxt]], device=device)
    return ids


def room_for_new_tokens(prompt_tokens: int, seq_length: int) -> int:
    """How many tokens fit after the prompt (positions are learned up to seq_length)."""
    room = seq_length - prompt_tokens
    if room <= 0:
        raise UserError(f"the prompt has {prompt_tokens} tokens but model.seq_length is {seq_length}; "
                        f"shorten it to at most {seq_length - 1} tokens")
    return room


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, g: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=g))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="megazero-generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tokenizer", help="tokenizer spec when the checkpoint names none (gpt2bpe:DIR, ...)")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from megazero.checkpoint.adapter import adapters_folded
    from megazero.checkpoint.load import open_checkpoint
    from megazero.data.tokenizer import build_tokenizer
    from megazero.parallel.grid import ProcessGrid

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    with report_errors(OSError):
        ckpt = adapters_folded(open_checkpoint(args.load))  # a LoRA fine-tune generates with its adapters
        m = ckpt.model_config
        spec = args.tokenizer or ckpt.tokenizer
        if not spec:
            raise UserError(f"{ckpt.kind} '{args.load}' names no tokenizer; pass --tokenizer gpt2bpe:DIR "
                            f"or sentencepiece:FILE")
        tokenizer = build_tokenizer(spec)
        if tokenizer.vocab_size > m.vocab_size:
            raise UserError(f"tokenizer {spec} has {tokenizer.vocab_size} tokens but the model only "
                            f"{m.vocab_size}; pass the tokenizer the model was trained with")
        if m.num_heads % world:
            raise UserError(f"model.num_heads ({m.num_heads}) must be divisible by the process count ({world})")
        prompt = tokenizer.encode(args.prompt)
        room = room_for_new_tokens(len(prompt), m.seq_length)
        if args.max_new_tokens > room and rank == 0:
            print(f"warning: --max-new-tokens {args.max_new_tokens} does not fit: the prompt has {len(prompt)} "
                  f"tokens and model.seq_length is {m.seq_length}, so at most {room} new tokens are generated",
                  file=sys.stderr, flush=True)
        grid = ProcessGrid.create(tp=world, pp=1)  # sets this rank's CUDA device when there is one
        model = build_model(ckpt, grid.tp_group, grid.device)
        ids = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                       tokenizer.eod)
    if rank == 0:
        print(tokenizer.decode(ids))
    # NCCL warns (and may hang at exit) when its communicators are left for interpreter teardown.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
