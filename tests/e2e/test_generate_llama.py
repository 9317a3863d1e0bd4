"""Generation for the Llama family (grouped K/V in the cache, rotary positions at each step, left
padding): greedy ids equal transformers' LlamaForCausalLM.generate on the same Hugging Face
directory, in memory and with the blocks streamed from host memory (ZeRO-Inference); the
directory's tokenizer.json (Llama 3 style) serves the command line."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megazero.checkpoint.load import open_checkpoint
from megazero.generate import build_model, generate_batch
from megazero.generate import main as generate_main
from megazero.inference.offload import build_offloaded_model
from megazero.parallel.comm import Group

transformers = pytest.importorskip("transformers")

SOLO = Group("solo", None, [0], 0)
# Grouped K/V (2 groups of 2 heads), untied, no biases, Llama 3 rotary base and scaling.
HF = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=48, rms_norm_eps=1e-5, rope_theta=500000.0,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16},
          tie_word_embeddings=False, initializer_range=0.2, bos_token_id=298, eos_token_id=299)
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11], [60, 3, 200, 14]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, llama3_tokenizer_dir) -> str:
    """A random LlamaForCausalLM saved by transformers, with weights large enough that greedy
    decoding does not repeat one token, and a Llama 3 style tokenizer.json."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF))
    path = str(tmp_path_factory.mktemp("llama"))
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(llama3_tokenizer_dir, name), path)
    return path


def _transformers_greedy(path: str, prompt: list[int], new_tokens: int) -> list[int]:
    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[0].tolist()


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[list[int]]:
    return [_transformers_greedy(llama_dir, p, NEW_TOKENS) for p in PROMPTS]


def test_greedy_equals_transformers_in_memory_and_offloaded(llama_dir, expected, tmp_path):
    """A left-padded batch, in memory and streamed from host memory: each row is transformers'."""
    assert len({tuple(ids[len(p):]) for ids, p in zip(expected, PROMPTS, strict=True)}) == len(PROMPTS)
    assert all(len(set(ids[len(p):])) > 2 for ids, p in zip(expected, PROMPTS, strict=True))
    ckpt = open_checkpoint(llama_dir)
    model = build_model(ckpt, SOLO)
    cache_heads = {tuple(layer.k.shape) for layer in _cache_of(model).layers.values()}
    assert cache_heads == {(len(PROMPTS), HF["num_key_value_heads"], 7 + NEW_TOKENS, 16)}  # K/V heads, not query heads
    assert generate_batch(model, PROMPTS, NEW_TOKENS, temperature=0.0) == expected
    offloaded, streamer = build_offloaded_model(ckpt, torch.device("cpu"), "cpu", str(tmp_path), True)
    try:
        assert generate_batch(offloaded, PROMPTS, NEW_TOKENS, temperature=0.0) == expected
    finally:
        streamer.close()


def _cache_of(model):
    from megazero.model.gpt import KVCache
    return KVCache(model, len(PROMPTS), 7 + NEW_TOKENS)


def test_cli_uses_the_directorys_tokenizer_json(llama_dir, tmp_path, capsys):
    """python -m megazero.generate --load DIR: prompts encoded and completions decoded by its
    tokenizer.json, the tokens transformers generates, in memory and offloaded."""
    from megazero.data.tokenizer import build_tokenizer
    tok = build_tokenizer(llama_dir)
    texts = ["the model of", "Hello"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    common = ["--load", llama_dir, "--prompts-file", str(prompts), "--temperature", "0", "--max-new-tokens", "5"]
    generate_main(common)
    in_memory = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    generate_main(common + ["--offload", "cpu"])
    offloaded = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    ids = [tok.encode(t) for t in texts]
    assert in_memory == offloaded == [tok.decode(_transformers_greedy(llama_dir, p, 5)[len(p):]) for p in ids]
