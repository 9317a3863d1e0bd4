"""ZeRO-Inference and batched prompts: generation with the blocks streamed from host memory
or NVMe gives the in-memory tokens, token for token (greedy, fp32), for a batch of prompts
of different lengths, each equal to the prompt generated alone."""

from __future__ import annotations

import collections
import json
import os

import pytest
import torch

from helpers import make_texts
from megazero.checkpoint.export import write_hf
from megazero.checkpoint.load import open_checkpoint
from megazero.config import ModelConfig
from megazero.data.tokenizer import train_gpt2bpe
from megazero.generate import build_model, generate_batch
from megazero.generate import main as generate_main
from megazero.inference.offload import build_offloaded_model
from megazero.model.gpt import GPT
from megazero.parallel.comm import Group

SOLO = Group("solo", None, [0], 0)
# Three blocks: an odd count, so the first block of a step reuses the device buffer the last
# block of the previous step ran in.
CFG = ModelConfig(num_layers=3, hidden_size=32, num_heads=4, seq_length=48, vocab_size=300)
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11], [60, 3, 200, 14]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A Hugging Face GPT-2 directory (weights + its BPE) of a random tiny model whose
    weights are large enough that greedy decoding does not repeat one token."""
    path = tmp_path_factory.mktemp("hf")
    train_gpt2bpe(make_texts(200), 300, path)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(CFG).named_parameters()}
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) * (0.3 if len(s) > 1 else 0.1) + (".ln_" in n and n.endswith("weight"))
             for n, s in shapes.items()}  # LayerNorm weights near 1
    write_hf(str(path), state.items(), shapes, CFG)
    return str(path)


@pytest.fixture(scope="module")
def in_memory(hf_dir) -> dict:
    model = build_model(open_checkpoint(hf_dir), SOLO)
    return {"alone": [generate_batch(model, [p], NEW_TOKENS, temperature=0.0)[0] for p in PROMPTS],
            "batched": generate_batch(model, PROMPTS, NEW_TOKENS, temperature=0.0)}


def test_left_padded_batch_equals_each_prompt_alone(in_memory):
    assert in_memory["batched"] == in_memory["alone"]
    assert all(len(ids) == len(p) + NEW_TOKENS for ids, p in zip(in_memory["alone"], PROMPTS, strict=True))
    assert len({tuple(ids[len(p):]) for ids, p in zip(in_memory["alone"], PROMPTS, strict=True)}) == len(PROMPTS)
    # not one token repeated
    assert all(len(set(ids[len(p):])) > 2 for ids, p in zip(in_memory["alone"], PROMPTS, strict=True))


@pytest.mark.parametrize("offload,prefetch", [("cpu", True), ("nvme", True), ("nvme", False)])
def test_offloaded_generation_equals_in_memory(hf_dir, in_memory, tmp_path, offload, prefetch):
    model, streamer = build_offloaded_model(open_checkpoint(hf_dir), torch.device("cpu"), offload, str(tmp_path),
                                            prefetch)
    try:
        # The blocks hold no weights of their own: only the embeddings and ln_f are resident.
        assert {p.device.type for n, p in model.named_parameters() if ".h." in n} == {"meta"}
        assert generate_batch(model, PROMPTS, NEW_TOKENS, temperature=0.0) == in_memory["alone"]
        assert generate_batch(model, [PROMPTS[1]], NEW_TOKENS, temperature=0.0)[0] == in_memory["alone"][1]
    finally:
        streamer.close()
    steps = 2 * NEW_TOKENS
    # Every step streams every block once; with prefetch the next step's first block is
    # fetched during the last block (the next generate call uses it): one fetch unused.
    assert streamer.fetches == steps * CFG.num_layers + prefetch
    if offload == "nvme":
        assert streamer.store.bytes_read == streamer.fetches * streamer.store.stride
        assert os.listdir(tmp_path) == []  # the weights file is unlinked as soon as it is open


def _write_prompts(path, texts: list[str]) -> str:
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "prompt": text}) + "\n")
    return str(path)


def test_cli_prompts_file_nvme_equals_in_memory_and_single_prompts(hf_dir, tmp_path, capsys):
    texts = ["The quick brown fox jumps over", "Hello", "A model of"]
    prompts = _write_prompts(tmp_path / "prompts.jsonl", texts)
    common = ["--load", hf_dir, "--prompts-file", prompts, "--temperature", "0", "--max-new-tokens", "6"]
    generate_main(common + ["--offload", "nvme", "--nvme-path", str(tmp_path), "--output",
                            str(tmp_path / "out.jsonl")])
    with open(tmp_path / "out.jsonl") as f:
        offloaded = [json.loads(line) for line in f]
    report = capsys.readouterr().err.strip().splitlines()[-1]  # where the blocks came from, how much, how fast
    assert report.startswith("offload: 3 blocks of ") and f"streamed from an unlinked file in {tmp_path}: " in report
    assert " in 19 fetches, " in report and " per new token; 18 tokens in " in report and " tokens/s), " in report
    generate_main(common + ["--batch-size", "2"])
    in_memory = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert offloaded == in_memory
    assert [r["id"] for r in offloaded] == [0, 1, 2] and [r["prompt"] for r in offloaded] == texts
    for text, record in zip(texts, offloaded, strict=True):
        generate_main(["--load", hf_dir, "--prompt", text, "--temperature", "0", "--max-new-tokens", "6"])
        assert capsys.readouterr().out == text + record["completion"] + "\n"
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "prompts.jsonl"]


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        generate_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_bad_offload_input_is_one_clear_line(hf_dir, tmp_path, capsys, monkeypatch):
    base = ["--load", hf_dir, "--prompt", "Hello", "--max-new-tokens", "2"]
    missing = str(tmp_path / "nope")
    assert f"--nvme-path {missing} is not an existing directory" in _error(
        capsys, base + ["--offload", "nvme", "--nvme-path", missing])
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(1 << 30, 1 << 30, 1 << 10))  # 1 KiB free
    err = _error(capsys, base + ["--offload", "nvme", "--nvme-path", str(tmp_path)])
    assert f"--nvme-path {tmp_path} has 0.0 MiB free but the offloaded weights need 0.2 MiB" in err
    monkeypatch.undo()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--offload streams the whole model through one process, but 2 were started" in _error(
        capsys, base + ["--offload", "cpu"])
    monkeypatch.delenv("WORLD_SIZE")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert f'--prompts-file {bad} line 2 has no "prompt" string' in _error(
        capsys, ["--load", hf_dir, "--prompts-file", str(bad)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offloaded_generation_on_cuda_equals_in_memory_on_cuda(hf_dir, tmp_path, offload):
    """The CUDA path: pinned host buffers, copies on a side stream, events between streams."""
    cuda = torch.device("cuda")
    reference = generate_batch(build_model(open_checkpoint(hf_dir), SOLO, cuda), PROMPTS, NEW_TOKENS, temperature=0.0)
    model, streamer = build_offloaded_model(open_checkpoint(hf_dir), cuda, offload, str(tmp_path))
    try:
        assert generate_batch(model, PROMPTS, NEW_TOKENS, temperature=0.0) == reference
    finally:
        streamer.close()
