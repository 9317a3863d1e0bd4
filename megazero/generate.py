"""`python -m megazero.generate --load CKPT --prompt TEXT [--max-new-tokens N
--temperature T --top-k K --top-p P --seed S]`: sample text with a KV cache.

CKPT is any checkpoint kind: a save directory (its `latest`), an iter_NNNNNNN directory, a
universal checkpoint, a torch export (FILE + FILE.config.json, or model_16bit.safetensors)
or a Hugging Face GPT-2 or Llama directory. The tokenizer is --tokenizer's (a spec or a
Hugging Face directory), else the one the checkpoint names, else that of the Hugging Face
directory its run started from (tokenizer.json, Llama 3 style, or tokenizer.model, Llama 2
style). At most model.seq_length tokens fit, prompt included: a longer request is cut there
with a warning. Under torchrun with N processes the model is split tp = N ways; every rank
samples the same tokens (same seed, same gathered logits). Temperature 0 is greedy decoding.

`--prompts-file F` (one JSON object with a "prompt" per line) decodes --batch-size prompts
together and writes one JSON line per prompt with its "completion" (stdout or --output).

`--offload cpu|nvme` (ZeRO-Inference, one process) keeps the transformer blocks in host
memory or in a file under --nvme-path and streams them through the device one block at a
time, the next one fetched while the current one computes (megazero/inference/).

The model, its KV cache, the logits and the sampling generator live on the run's device:
the process's GPU when CUDA is available (one per rank under torchrun), else the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

from megazero.checkpoint.adapter import adapters_folded
from megazero.checkpoint.base import Checkpoint, CheckpointError
from megazero.checkpoint.load import open_checkpoint
from megazero.checkpoint.tensors import fit_vocab
from megazero.data.tokenizer import Tokenizer, build_tokenizer, spec_of_directory
from megazero.errors import UserError, report_errors
from megazero.inference.offload import BlockStreamer, build_offloaded_model
from megazero.inference.prompts import read_prompts, write_completions
from megazero.model.gpt import GPT, KVCache, apply_tensor_parallel
from megazero.parallel.comm import Group, gather_from_tp
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.placement import placement
from megazero.zero.materialize import replace_meta_parameters


def build_model(ckpt: Checkpoint, tp: Group, device: torch.device | str = "cpu") -> GPT:
    """The checkpoint's model as a plain (pp = 1) GPT-2 split over `tp` on `device`, each
    rank keeping its shard of every tensor. The model is built on the meta device and split
    over TP there, then only the shards are allocated on the device and filled one at a
    time, so the full model never sits in host or device memory."""
    with torch.device("meta"):
        model = apply_tensor_parallel(GPT(ckpt.model_config), tp)
    replace_meta_parameters([model], torch.device(device))
    params = dict(model.named_parameters())
    missing = set(params)
    with torch.no_grad():
        for name, full in ckpt.tensors():
            if name in params:
                where = placement(params[name])
                params[name].copy_(where.shard(fit_vocab(name, full.float(), where.full_shape), tp.rank, tp.size))
                missing.discard(name)
    if missing:
        raise CheckpointError(f"the weights lack {len(missing)} parameters, e.g. {sorted(missing)[0]}")
    return model.eval()


@torch.no_grad()
def generate_batch(model: GPT, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, seed: int = 0, eod: Optional[int] = None) -> list[list[int]]:
    """Each prompt + up to max_new_tokens sampled ids, decoded together (a row stops at
    `eod`). Shorter prompts are left-padded (see KVCache), so greedy rows equal each prompt
    generated alone; sampled rows draw from one generator, row after row."""
    longest = max(map(len, prompts))
    max_new_tokens = min(max_new_tokens, room_for_new_tokens(longest, model.cfg.seq_length))
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)  # multinomial needs a generator on its device
    pad = [longest - len(p) for p in prompts]
    cache = KVCache(model, len(prompts), longest + max_new_tokens,  # allocated beside the model's parameters
                    torch.tensor(pad) if any(pad) else None)
    ids = [list(p) for p in prompts]
    running = [True] * len(prompts)
    x = torch.tensor([[0] * n + p for n, p in zip(pad, prompts)], device=device)
    for _ in range(max_new_tokens):
        logits = gather_from_tp(model(x, cache)[:, -1], model.tp)[:, : model.cfg.vocab_size].float()
        nxt = [sample(row, temperature, top_k, top_p, g) for row in logits]
        for row, token in enumerate(nxt):
            if running[row]:
                ids[row].append(token)
                running[row] = token != eod
        if not any(running):
            break
        x = torch.tensor(nxt, device=device).view(-1, 1)
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
    args = _parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    with report_errors(OSError):
        _check_args(args, world)
        ckpt = adapters_folded(open_checkpoint(args.load))  # a LoRA fine-tune generates with its adapters
        m = ckpt.model_config
        spec = args.tokenizer or ckpt.tokenizer or started_from_tokenizer(ckpt)
        if not spec:
            raise UserError(f"{ckpt.kind} '{args.load}' names no tokenizer; pass --tokenizer gpt2bpe:DIR, "
                            f"sentencepiece:FILE or a Hugging Face directory")
        tokenizer = build_tokenizer(spec)
        assert isinstance(m.vocab_size, int)
        if tokenizer.vocab_size > m.vocab_size:
            raise UserError(f"tokenizer {spec} has {tokenizer.vocab_size} tokens but the model only "
                            f"{m.vocab_size}; pass the tokenizer the model was trained with")
        if m.num_heads % world:
            raise UserError(f"model.num_heads ({m.num_heads}) must be divisible by the process count ({world})")
        records = read_prompts(args.prompts_file) if args.prompts_file else [{"prompt": args.prompt}]
        prompts = [_encode(tokenizer, r["prompt"], n) for n, r in enumerate(records, 1)]
        longest = max(map(len, prompts))
        room = room_for_new_tokens(longest, m.seq_length)
        if args.max_new_tokens > room and rank == 0:
            print(f"warning: --max-new-tokens {args.max_new_tokens} does not fit: the longest prompt has {longest} "
                  f"tokens and model.seq_length is {m.seq_length}, so at most {room} new tokens are generated",
                  file=sys.stderr, flush=True)
        grid = ProcessGrid.create(tp=world, pp=1)  # sets this rank's CUDA device when there is one
        outputs = _run(args, ckpt, grid, prompts, tokenizer.eod)
    if rank == 0 and args.prompts_file:
        write_completions(records, [tokenizer.decode(ids[len(p):]) for p, ids in zip(prompts, outputs)], args.output)
    elif rank == 0:
        print(tokenizer.decode(outputs[0]))
    # NCCL warns (and may hang at exit) when its communicators are left for interpreter teardown.
    dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megazero-generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="the checkpoint: a save directory, an iter_ directory, a "
                                                      "universal checkpoint, a torch export or a Hugging Face directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt; its completion is printed")
    source.add_argument("--prompts-file", help='JSONL, one {"prompt": ...} per line (other fields are kept)')
    parser.add_argument("--output", help="where --prompts-file's completions go (JSONL; default stdout)")
    parser.add_argument("--batch-size", type=int, default=8, help="--prompts-file's prompts decoded together "
                                                                  "(default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens generated after each prompt, at most up to model.seq_length in all "
                             "(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="softmax temperature; 0 is greedy decoding (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the K most likely tokens; 0: all (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: among the most likely tokens holding P of the probability; 1: all "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1234,
                        help="the sampling generator's seed; the same seed samples the same text "
                             "(default: %(default)s)")
    parser.add_argument("--tokenizer", help="tokenizer spec when the checkpoint names none (gpt2bpe:DIR, hf:DIR, a Hugging Face "
                                             "directory, ...)")
    parser.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none",
                        help="keep the transformer blocks in host memory or on NVMe and stream them (ZeRO-Inference)")
    parser.add_argument("--nvme-path", help="directory for --offload nvme's weights file (default: beside the "
                                            "checkpoint, else the temp directory)")
    parser.add_argument("--no-prefetch", action="store_true", help="with --offload: fetch each block only when it runs")
    return parser


def _check_args(args: argparse.Namespace, world: int) -> None:
    if args.output and not args.prompts_file:
        raise UserError("--output writes the completions of --prompts-file; with --prompt the text is printed")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} must be at least 1")
    if args.offload != "none" and world > 1:
        raise UserError(f"--offload streams the whole model through one process, but {world} were started; "
                        f"run python -m megazero.generate without torchrun")
    if args.nvme_path and args.offload != "nvme":
        raise UserError("--nvme-path is where --offload nvme keeps the weights; add --offload nvme or drop it")


def started_from_tokenizer(ckpt: Checkpoint) -> Optional[str]:
    """The tokenizer of the Hugging Face directory a run without data.tokenizer started from
    (checkpoint.init_from_hf: tokenizer.json, tokenizer.model, ...), if it has one."""
    start = ckpt.started_from_hf()
    return spec_of_directory(start) if start else None


def _encode(tokenizer: Tokenizer, text: str, n: int) -> list[int]:
    ids = tokenizer.encode(text)
    if not ids:
        raise UserError(f"prompt {n} is empty; give every prompt some text")
    return ids


def _run(args: argparse.Namespace, ckpt: Checkpoint, grid: ProcessGrid, prompts: list[list[int]],
         eod: Optional[int]) -> list[list[int]]:
    """Every prompt's ids and continuation, --batch-size prompts at a time."""
    streamer = None
    if args.offload == "none":
        model = build_model(ckpt, grid.tp_group, grid.device)
    else:
        # Beside the checkpoint when that directory is writable, else the temp directory (the weights file is
        # unlinked as soon as it is open, so nothing is left behind either way).
        beside = os.path.dirname(os.path.abspath(ckpt.ckpt))
        nvme_path = args.nvme_path or (beside if os.access(beside, os.W_OK | os.X_OK) else tempfile.gettempdir())
        model, streamer = build_offloaded_model(ckpt, grid.device, args.offload, nvme_path, not args.no_prefetch)
    tic = time.perf_counter()
    try:
        outputs = [ids for i in range(0, len(prompts), args.batch_size)
                   for ids in generate_batch(model, prompts[i: i + args.batch_size], args.max_new_tokens,
                                             args.temperature, args.top_k, args.top_p, args.seed, eod)]
    finally:
        if streamer is not None:
            streamer.close()
    if streamer is not None:
        new_tokens = sum(len(ids) - len(p) for ids, p in zip(outputs, prompts, strict=True))
        where = "host memory" if args.offload == "cpu" else f"an unlinked file in {nvme_path}"
        print(streaming_report(streamer, where, new_tokens, time.perf_counter() - tic), file=sys.stderr, flush=True)
    return outputs


def streaming_report(streamer: BlockStreamer, where: str, new_tokens: int, seconds: float) -> str:
    """One line on what --offload streamed: from where, how much per generated token, how fast."""
    block = streamer.layout.numel * streamer.layout.dtype.itemsize
    moved = streamer.fetches * block
    return (f"offload: {len(streamer.blocks)} blocks of {_size(block)} streamed from {where}: {_size(moved)} in "
            f"{streamer.fetches} fetches, {_size(moved / max(new_tokens, 1))} per new token; {new_tokens} tokens in "
            f"{seconds:.2f} s ({new_tokens / max(seconds, 1e-9):.1f} tokens/s), {streamer.wait_s:.2f} s waiting "
            f"for blocks")


def _size(nbytes: float) -> str:
    shift, unit = next(((s, u) for s, u in ((30, "GiB"), (20, "MiB"), (10, "KiB")) if nbytes >= 2 ** s), (0, "B"))
    return f"{nbytes / 2 ** shift:.1f} {unit}"


if __name__ == "__main__":
    main()
