"""`python -m megazero.generate --load CKPT_OR_EXPORT --prompt TEXT [--max-new-tokens N
--temperature T --top-k K --top-p P --seed S]`: sample text with a KV cache.

CKPT_OR_EXPORT is a megazero save directory / iter_ directory, a `--to torch` export
(FILE with FILE.config.json beside it), a model_16bit.safetensors written during training,
or a Hugging Face GPT-2 directory. Under torchrun
with N processes the model is split tp = N ways; every rank samples the same tokens
(same seed, same gathered logits). Temperature 0 is greedy decoding.

The model, its KV cache, the logits and the sampling generator live on the run's device:
the process's GPU when CUDA is available (one per rank under torchrun), else the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, Optional

import torch

from megazero.config import ModelConfig
from megazero.model.gpt import GPT, KVCache
from megazero.model.layers import shard_of
from megazero.parallel.comm import Group, gather_from_tp


def load_weights(path: str) -> tuple[ModelConfig, Optional[str], Iterator[tuple[str, torch.Tensor]]]:
    """(model config, tokenizer spec, full tensors by megazero name) from any supported source."""
    from safetensors.torch import load_file

    from megazero.checkpoint.hf import from_hf, read_hf
    if os.path.isfile(os.path.join(path, "config.json")):  # Hugging Face directory
        m, tensors = read_hf(path)
        spec = f"gpt2bpe:{path}" if os.path.isfile(os.path.join(path, "vocab.json")) else None
        return m, spec, ((n, from_hf(n, t)) for n, t in tensors)
    if path.endswith(".safetensors"):  # checkpoint.save_model_16bit's gathered model
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            info = json.loads((f.metadata() or {}).get("megazero_model", "null") or "null")
        if info is None:
            raise ValueError(f"'{path}' carries no megazero model config; for an HF model pass its directory")
        _verify_in_checkpoint(path)
        state = load_file(path)
        return ModelConfig(**info), None, iter(state.items())
    if os.path.isfile(path):  # torch export
        sidecar = path + ".config.json"
        if not os.path.isfile(sidecar):
            raise FileNotFoundError(f"'{sidecar}' not found: a torch export needs its config beside it")
        with open(sidecar) as f:
            info = json.load(f)
        if "sha256" in info:  # the sidecar records the weights file's digest (older exports: none)
            _verified(path, info, f"re-export it with python -m megazero.convert --load {info['source']} --to torch")
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return ModelConfig(**info["model"]), info.get("tokenizer"), iter(state.items())
    from megazero.checkpoint.universal import open_reader
    reader = open_reader(path)
    return reader.model_config, reader.config.data.tokenizer, reader.tensors("master")


def _verified(path: str, expected: dict, fix: str) -> None:
    from megazero.checkpoint.digest import DigestError, verify
    from megazero.checkpoint.sharded import CheckpointError
    try:
        verify(path, expected)
    except DigestError as e:
        raise CheckpointError(f"'{path}' is corrupt: {e}; {fix}") from None


def _verify_in_checkpoint(path: str) -> None:
    """A model_16bit.safetensors inside a checkpoint directory is checked against its metadata.json."""
    from megazero.checkpoint import sharded
    ckpt, name = os.path.split(os.path.abspath(path))
    if os.path.isfile(os.path.join(ckpt, "metadata.json")):
        sharded.verify_file(ckpt, sharded.read_metadata(ckpt), name)


def build_model(m: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]], tp: Group,
                device: torch.device | str = "cpu") -> GPT:
    """Plain (pp = 1) GPT-2 split over `tp` on `device`, each rank keeping its shard of every
    tensor. The model is built on the meta device and split over TP there, then only the
    shards are allocated on the device and filled one at a time, so the full model never
    sits in host or device memory."""
    from megazero.checkpoint.export import fit_vocab
    from megazero.train.parallelize import apply_tensor_parallel
    from megazero.zero.materialize import replace_meta_parameters
    with torch.device("meta"):
        model = apply_tensor_parallel(GPT(m), tp)
    replace_meta_parameters([model], torch.device(device))
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, full in tensors:
            if name not in params:
                continue
            p = params[name]
            full = fit_vocab(name, full.float(), p.full_shape)
            p.copy_(shard_of(full, p.tp_dim, p.tp_stride, tp.rank, tp.size))
            seen.add(name)
    missing = set(params) - seen
    if missing:
        raise ValueError(f"the weights lack {len(missing)} parameters, e.g. {sorted(missing)[0]}")
    return model.eval()


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eod: Optional[int] = None) -> list[int]:
    """Prompt + up to max_new_tokens sampled ids (stops early at `eod`)."""
    room = model.cfg.seq_length - len(prompt)
    if room <= 0:
        raise ValueError(f"the prompt has {len(prompt)} tokens; model.seq_length is {model.cfg.seq_length}")
    max_new_tokens = min(max_new_tokens, room)
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

    from megazero.checkpoint.sharded import CheckpointError
    from megazero.data import DataError
    from megazero.data.tokenizer import build_tokenizer
    from megazero.parallel.grid import ProcessGrid

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        m, spec, tensors = load_weights(args.load)
        spec = args.tokenizer or spec
        if not spec:
            raise ValueError(f"'{args.load}' names no tokenizer; pass --tokenizer gpt2bpe:DIR or sentencepiece:FILE")
        tokenizer = build_tokenizer(spec)
        if tokenizer.vocab_size > m.vocab_size:
            raise ValueError(f"tokenizer {spec} has {tokenizer.vocab_size} tokens but the model only "
                             f"{m.vocab_size}; pass the tokenizer the model was trained with")
        if m.num_heads % world:
            raise ValueError(f"model.num_heads ({m.num_heads}) must be divisible by the process count ({world})")
        grid = ProcessGrid.create(tp=world, pp=1)  # sets this rank's CUDA device when there is one
        model = build_model(m, tensors, grid.tp_group, grid.device)
        ids = generate(model, tokenizer.encode(args.prompt), args.max_new_tokens, args.temperature, args.top_k,
                       args.top_p, args.seed, tokenizer.eod)
    except (CheckpointError, DataError, OSError, ValueError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if rank == 0:
        print(tokenizer.decode(ids))
    # NCCL warns (and may hang at exit) when its communicators are left for interpreter teardown.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
