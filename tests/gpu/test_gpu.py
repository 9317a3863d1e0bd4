"""GPU checks (`pytest -m gpu`, or scripts/gpu_check.sh): megazero on CUDA through NCCL.

Every test is skipped where torch sees no CUDA device. On one GPU: bf16 training at each
ZeRO stage, fp32 parity with the same run on CPU and of offloaded runs (optimizer on the
host or NVMe, parameters on NVMe) with in-memory ones, the gathered 16-bit save, torch/HF
export and generation; with two GPUs also the 16-bit save across a pipeline and a TP
group (the paths where tensors cross ranks by NCCL p2p and all-gather).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, read_jsonl, torchrun
from megazero.parallel.comm import Group

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")]

ROOT = str(REPO)
TINY = ["--config", "configs/gpt2-tiny.yaml", "--data.mock", "true", "--train.log_interval", "1"]
BF16 = TINY + ["--train.precision", "bf16", "--train.iters", "20"]
SOLO = Group("solo", None, [0], 0)
TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(11))
PROMPT_IDS = [5, 17, 33, 2]


def _train(tmp_path, name: str, args: list[str], nproc: int = 1, backend: str = "nccl") -> list[dict]:
    """megazero.train under torchrun; asserts success and the backend it ran on, returns the
    JSONL records. A run hides the GPUs (CUDA_VISIBLE_DEVICES="") to get gloo on CPU."""
    out = str(tmp_path / f"{name}.jsonl")
    proc = torchrun(nproc, args + ["--logging.jsonl", out], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"({backend})" in proc.stdout, proc.stdout[:500]
    return read_jsonl(out)


def _cli(module: str, *args: str) -> str:
    """`python -m megazero.<module> ARGS`; asserts success, returns stdout."""
    proc = subprocess.run([sys.executable, "-m", f"megazero.{module}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def bf16_stage0(tmp_path_factory) -> list[float]:
    return [r["loss"] for r in _train(tmp_path_factory.mktemp("bf16"), "stage0", BF16 + ["--zero.stage", "0"])]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_training_on_one_gpu(tmp_path, bf16_stage0, stage):
    losses = bf16_stage0 if stage == 0 else \
        [r["loss"] for r in _train(tmp_path, f"stage{stage}", BF16 + ["--zero.stage", str(stage)])]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, f"bf16 stage {stage} does not learn: {losses}"
    # At dp 1 the stages differ only in how they hold state; bf16 rounding may reorder a little.
    assert max(abs(a - b) for a, b in zip(losses, bf16_stage0, strict=True)) <= 2e-2, (losses, bf16_stage0)


def test_fp32_gpu_run_matches_cpu_run(tmp_path, monkeypatch):
    args = TINY + ["--train.iters", "10", "--zero.stage", "1"]
    gpu = _train(tmp_path, "gpu", args)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # torchrun's processes inherit it: no GPU, gloo on CPU
    cpu = _train(tmp_path, "cpu", args, backend="gloo")
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(gpu, cpu, strict=True)]
    assert len(diffs) == 10 and max(diffs) <= 1e-3, diffs


# The Llama family's kernels (rotary, RMSNorm, SwiGLU, SDPA with grouped K/V), Muon's
# Newton-Schulz (bf16 on the device in bf16 runs), the MoE layer's grouped GEMM (CUDA's
# torch._grouped_mm in bf16, the loop over experts in fp32) and Qwen3's QK-norm with a head
# size of its own have their own CUDA paths.
NEW_PATHS = {"llama": ["--config", "configs/llama-tiny.yaml"],
             "muon": ["--config", "configs/gpt2-tiny.yaml", "--optim.name", "muon"],
             "mixtral": ["--config", "configs/mixtral-tiny.yaml"],
             "qwen3": ["--config", "configs/llama-tiny.yaml", "--model.qk_layernorm", "true", "--model.kv_channels", "32"]}


def test_grouped_gemm_on_gpu_equals_the_loop_over_experts():
    """bf16 on CUDA runs torch._grouped_mm: within bf16 rounding of the loop, forward and backward."""
    from megazero.model.moe import expert_loop_mm, grouped_mm
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 64, generator=g).cuda().bfloat16().requires_grad_()
    w = torch.randn(4, 128, 64, generator=g).cuda().bfloat16().requires_grad_()
    counts = torch.tensor([40, 0, 32, 24])  # an idle expert too
    y, ref = grouped_mm(x, w, counts), expert_loop_mm(x, w, counts)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    grad = torch.randn(y.shape, generator=g).cuda().bfloat16()
    for a, b in zip(torch.autograd.grad(y, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("name", sorted(NEW_PATHS))
def test_family_and_muon_on_gpu_match_cpu_and_learn_in_bf16(tmp_path, monkeypatch, name):
    base = NEW_PATHS[name] + ["--data.mock", "true", "--train.log_interval", "1", "--zero.stage", "1"]
    bf16 = [r["loss"] for r in _train(tmp_path, "bf16", base + ["--train.precision", "bf16", "--train.iters", "20"])]
    assert all(math.isfinite(x) for x in bf16) and sum(bf16[-5:]) / 5 < sum(bf16[:5]) / 5 - 0.05, bf16
    fp32 = base + ["--train.iters", "6"]
    gpu = _train(tmp_path, "gpu", fp32)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cpu = _train(tmp_path, "cpu", fp32, backend="gloo")
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(gpu, cpu, strict=True)]
    assert len(diffs) == 6 and max(diffs) <= 1e-3, diffs


@pytest.mark.parametrize("stage, offload", [
    (2, ["--zero.offload_optimizer", "cpu"]),  # gradients leave for pinned host memory during backward
    (3, ["--zero.offload_optimizer", "nvme", "--zero.offload_param", "nvme"])])
def test_offloaded_gpu_run_matches_in_memory(tmp_path, stage, offload):
    """ZeRO-Offload / ZeRO-Infinity on a GPU: the step on the CPU (side-stream gradient
    copies, pinned buffers, NVMe swap) gives the in-memory run's fp32 losses."""
    args = TINY + ["--train.iters", "10", "--zero.stage", str(stage)]
    ref = _train(tmp_path, "in_memory", args)
    got = _train(tmp_path, "offloaded", args + offload + ["--zero.nvme_path", str(tmp_path)])
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(ref, got, strict=True)]
    assert len(diffs) == 10 and max(diffs) <= 1e-6, diffs  # issue 11's bound


# ----------------------------------------------------------------------------- save, export, generate


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory) -> str:
    """Four bf16 ZeRO-3 iterations on the GPU, saved with the gathered 16-bit model."""
    tmp = tmp_path_factory.mktemp("ckpt")
    save = str(tmp / "ckpt")
    _train(tmp, "save", TINY + ["--train.precision", "bf16", "--zero.stage", "3", "--train.iters", "4",
                                "--checkpoint.save", save, "--checkpoint.save_model_16bit", "true"])
    return save


def _assert_16bit_save_equals_export(save: str, iteration: int, tmp_path) -> None:
    """The model gathered in training equals the fp32 masters consolidated and cast by convert."""
    from safetensors.torch import load_file
    gathered = load_file(os.path.join(save, f"iter_{iteration:07d}", "model_16bit.safetensors"))
    out = str(tmp_path / "m16.pt")
    _cli("convert", "--load", save, "--to", "torch", "--output", out, "--dtype", "bf16")
    consolidated = torch.load(out, weights_only=True)
    assert gathered.keys() == consolidated.keys()
    for name, t in gathered.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, consolidated[name]), name
    assert all(t.abs().sum() > 0 for n, t in gathered.items() if n.endswith("weight"))


def test_16bit_save_on_gpu(tmp_path, gpu_checkpoint):
    _assert_16bit_save_equals_export(gpu_checkpoint, 4, tmp_path)


def _logits(path: str, device: str) -> torch.Tensor:
    from megazero.checkpoint.load import open_checkpoint
    from megazero.generate import build_model
    model = build_model(open_checkpoint(path), SOLO, device)
    assert next(model.parameters()).device.type == torch.device(device).type
    with torch.no_grad():
        return model(TOKENS.to(device))[..., :model.cfg.vocab_size].float().cpu()


def test_torch_and_hf_export_from_gpu_checkpoint(tmp_path, gpu_checkpoint):
    out = str(tmp_path / "model.pt")
    _cli("convert", "--load", gpu_checkpoint, "--to", "torch", "--output", out)
    on_gpu = _logits(out, "cuda")
    assert (on_gpu - _logits(out, "cpu")).abs().max() <= 1e-3
    _cli("convert", "--load", gpu_checkpoint, "--to", "hf", "--output", str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        assert (hf(TOKENS).logits - on_gpu).abs().max() <= 1e-3


def test_generation_on_gpu(tmp_path, gpu_checkpoint):
    from megazero.checkpoint.load import open_checkpoint
    from megazero.data.tokenizer import train_gpt2bpe
    from megazero.generate import build_model, generate_batch
    from megazero.model.gpt import KVCache

    models = {device: build_model(open_checkpoint(gpu_checkpoint), SOLO, device) for device in ("cpu", "cuda")}
    cache = KVCache(models["cuda"], 1, 8)
    assert all(kv.k.is_cuda and kv.v.is_cuda for kv in cache.layers.values())
    greedy = {d: generate_batch(model, [PROMPT_IDS], max_new_tokens=12, temperature=0.0)[0]
              for d, model in models.items()}
    assert len(greedy["cuda"]) == 16 and greedy["cuda"] == greedy["cpu"]
    sampled = [generate_batch(models["cuda"], [PROMPT_IDS], 12, temperature=1.0, top_k=50, top_p=0.9, seed=s)[0]
               for s in (7, 7)]
    assert sampled[0] == sampled[1]

    texts = [f"the model trains on {w} data and the loss falls" for w in ("gpu", "cpu", "tensor", "pipeline")] * 20
    spec = train_gpt2bpe(texts, 300, tmp_path / "tok")
    prompt = "the model trains"
    printed = _cli("generate", "--load", gpu_checkpoint, "--prompt", prompt, "--tokenizer", spec,
                   "--temperature", "0", "--max-new-tokens", "8")
    assert printed.startswith(prompt), printed


def test_host_staging_copies_device_tensors_in_pieces(tmp_path):
    from safetensors.torch import load_file

    from megazero.checkpoint.tensors import save_safetensors_streaming
    from megazero.parallel.host import HostStaging

    t = torch.randn(1000, 3, device="cuda")[:, 1]  # non-contiguous, 4000 bytes
    pieces = [p.clone() for p in HostStaging(piece_bytes=1536).host_bytes(t)]
    assert [p.numel() for p in pieces] == [1536, 1536, 928] and all(p.device.type == "cpu" for p in pieces)
    assert torch.equal(torch.cat(pieces).view(torch.float32), t.cpu())
    tensors = {"a": t, "b": torch.arange(6, device="cuda", dtype=torch.float32).view(2, 3)}
    path = str(tmp_path / "x.safetensors")
    save_safetensors_streaming(path, {n: tuple(v.shape) for n, v in tensors.items()}, torch.bfloat16,
                               iter(tensors.items()))
    assert all(torch.equal(v, tensors[n].to(torch.bfloat16).cpu()) for n, v in load_file(path).items())


def test_snapshot_copies_device_tensors_into_reused_pinned_memory():
    from megazero.parallel.host import HostSnapshot

    t = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.max_memory_allocated()
    snapshot = HostSnapshot()
    host = snapshot.concat("master", [t[:1000], t[1000:]])
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, t.cpu())
    assert torch.cuda.max_memory_allocated() == before  # no staging copy on the device
    t.mul_(2.0)
    assert snapshot.concat("master", [t]).data_ptr() == host.data_ptr() and torch.equal(host, t.cpu())


def test_async_save_on_gpu_resumes_as_the_sync_save(tmp_path):
    for mode in ("false", "true"):
        _train(tmp_path, f"{mode}_a", BF16 + ["--train.iters", "4", "--checkpoint.interval", "2", "--checkpoint.save",
                                            str(tmp_path / mode), "--checkpoint.async_save", mode])
    for it in ("iter_0000002", "iter_0000004"):
        with open(tmp_path / "false" / it / "metadata.json") as a, open(tmp_path / "true" / it / "metadata.json") as b:
            assert json.load(a)["files"] == json.load(b)["files"], it


def test_nccl_grid_binds_its_device_and_can_report_watchdog_errors():
    """ProcessGrid.create under NCCL: LOCAL_RANK's device is chosen before init_process_group
    and bound to it (device_id), every group has the timeout, TORCH_NCCL_ASYNC_ERROR_HANDLING is
    set, and the watchdog's error state that NcclErrorWatch polls is readable (SUCCESS)."""
    code = """
import os, torch, torch.distributed as dist
from megazero.parallel.grid import ProcessGrid
grid = ProcessGrid.create(1, 1, timeout_s=42)
backend = dist.group.WORLD._get_backend(torch.device("cuda"))
t = torch.ones(1, device="cuda")
dist.all_reduce(t)
print(dist.group.WORLD.bound_device_id, torch.cuda.current_device(), os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"],
      backend.options._timeout.total_seconds(), backend.get_error().name, grid.comm_errors(), t.item())
"""
    env = {**os.environ, "LOCAL_RANK": str(torch.cuda.device_count() - 1)}
    env.pop("MASTER_ADDR", None)
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # the default this test checks
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = torch.cuda.device_count() - 1
    assert proc.stdout.split() == [f"cuda:{last}", str(last), "3", "42.0", "SUCCESS", "{}", "1.0"], proc.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("layout", [["--parallel.pp", "2", "--zero.stage", "3"], ["--parallel.tp", "2", "--zero.stage", "1"]],
                         ids=["pp2_zero3", "tp2_zero1"])
def test_16bit_save_across_two_gpus(tmp_path, layout):
    save = str(tmp_path / "ckpt")
    _train(tmp_path, "save", TINY + layout + ["--train.precision", "bf16", "--train.iters", "2",
                                              "--checkpoint.save", save, "--checkpoint.save_model_16bit", "true"], nproc=2)
    _assert_16bit_save_equals_export(save, 2, tmp_path)
