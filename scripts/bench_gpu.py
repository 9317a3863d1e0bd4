"""Single-GPU training throughput of GPT-2 124M and 355M, a Llama-style 1B (Llama 3.2 1B's
shape) and a Mixtral-style mixture of experts (0.93B, 0.31B active: the grouped GEMM) in bf16: tokens/s, TFLOP/s, MFU, and the same models trained the plain Hugging Face way
in the same run, as peers.

    python scripts/bench_gpu.py [--models gpt2-124m gpt2-355m llama-3.2-1b mixtral-1b] [--iters 30] [--warmup 5]
                                [--micro N] [--accum N] [--megazero eager|compile|both]
                                [--peers none|eager|compile|both]
                                [--peer-iters N] [--profile] [--profile-steps 1] [--trace DIR]
                                [--json OUT.json] [--section.key value ...]

Each model trains from its config (configs/<model>.yaml) on mock data, in this process,
through megazero's own Trainer on a world of one (NCCL, tp = pp = dp = 1, the config's
ZeRO stage), for `--iters` iterations; the first `--warmup` are not timed (CUDA context,
cuBLAS autotuning, allocator growth). Every iteration is a full global batch of
micro x accum sequences of 1024 tokens (the Llama row: 2048, `MODEL_OVERRIDES`). Any further `--section.key value` is a config
override applied to every model (e.g. `--train.recompute none`).

`--megazero` (default both): megazero eager ("megazero") and under train.compile ("megazero
compile"), each with its ratios to the peers; their ratio to each other is train.compile's gain.

Peers (`--peers`, default both): transformers' GPT2LMHeadModel, MixtralForCausalLM for the
MoE row (its load-balancing loss added at the config's coefficient), or LlamaForCausalLM for the
Llama row (grouped K/V, SwiGLU, RMSNorm, rotary with llama3 scaling, tied; the config.json
megazero's own export writes), of the same shape and dropout (SDPA attention) in fp32 weights under bf16 autocast, fused torch AdamW with the config's lr,
betas, eps and weight decay (none on 1-D parameters, as megazero), the config's gradient clip,
the same micro x accum random-token batches with the loss divided by accum: "hf eager", and
"hf compile" (torch.compile of the model and its loss; its compilation falls in the untimed
warm-up). They are timed like megazero's rows, over `--peer-iters` iterations (default
--iters), and each megazero row prints its tokens/s over each peer's of the same model. A
peer that fails (no transformers, out of memory) is a row with its error, not a failed run.
The table's `run s` is a run's whole time (building, compiling, iterations, profile) and
`1st s` its first iteration alone.

`--profile`: after a model's timed iterations, torch.profiler records `--profile-steps` more
steps of megazero and of each peer, and prints CUDA kernel time per step by kind (GEMM,
attention, loss, norm, elementwise, copies, optimizer, communication, other; see
`kernel_kind` below), kernel time against the timed step (GPU idle), host syncs per step
and megazero's 15 longest kernels. `--trace DIR` also writes each profile as a Chrome trace.

TFLOP/s use megazero's model-FLOPs formula (`model_flops_per_token`: 6 x matmul parameters
plus attention; recomputation is not counted) and MFU divides by the device's dense bf16
peak from `device_peak_flops` (shown; an unknown device gets no MFU). This is a
measurement, not a test: nothing is asserted about speed. Exits 1 without a CUDA device,
or when a megazero row failed.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import sys
import time
import traceback
import warnings
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megazero.atomic import publish, write_text
from megazero.checkpoint.hf_names import architecture, hf_config
from megazero.config import Config
from megazero.harness import configs
from megazero.plan.formulas import model_flops_per_token
from megazero.train.metrics import device_peak_flops

# Micro-batch x accumulation per model: 64 sequences (65k tokens) per iteration for both,
# micro-batches large enough that the matmuls fill an H100/H200 (activations stay far below 80 GiB).
# The Llama row: 1.24B parameters at 2048 tokens, 64k tokens per iteration like the GPT-2 rows; its
# peer keeps every activation (no recomputation) and a 128k-wide logit row per token.
SHAPES = {"gpt2-124m": (16, 4), "gpt2-355m": (8, 8), "llama-3.2-1b": (2, 16), "mixtral-1b": (8, 8)}
MODEL_OVERRIDES = {
    "llama-3.2-1b": ["--model.seq_length", "2048"],
    # A Mixtral-style mixture of experts of 0.93B parameters, 0.31B active (8 SwiGLU experts of width
    # 2816 per layer, top-2, 12 layers of h 1024, grouped K/V), from the tiny config's routing and
    # losses; the z-loss off, which transformers' Mixtral has not.
    "mixtral-1b": ["--model.num_layers", "12", "--model.num_experts", "8", "--model.hidden_size", "1024", "--model.num_heads", "16",
                   "--model.num_query_groups", "8", "--model.seq_length", "1024", "--model.vocab_size", "32000",
                   "--model.ffn_hidden_size", "2816", "--model.moe_ffn_hidden_size", "2816",
                   "--model.moe_z_loss_coeff", "0"],
}
"""Per-model config overrides applied before the user's (the shipped Llama config trains at 8192 tokens)."""
MODEL_CONFIGS = {"mixtral-1b": "mixtral-tiny"}
"""The shipped config a row starts from, when not configs/<model>.yaml."""
MEGAZERO, MEGAZERO_COMPILE, HF_EAGER, HF_COMPILE = "megazero", "megazero compile", "hf eager", "hf compile"
OURS = {"eager": (MEGAZERO,), "compile": (MEGAZERO_COMPILE,), "both": (MEGAZERO, MEGAZERO_COMPILE)}
DEVICE = "cuda"  # where the peers train (a CPU smoke run of this script's logic swaps it)
PEERS = {"none": (), "eager": (HF_EAGER,), "compile": (HF_COMPILE,), "both": (HF_EAGER, HF_COMPILE)}


@dataclass
class Row:
    model: str
    runner: str = MEGAZERO
    params_m: float = 0.0
    micro: int = 0
    accum: int = 0
    tokens_per_iter: int = 0
    run_s: float = 0.0  # the whole run: building, every iteration, the profile
    first_step_s: float = 0.0  # the first iteration alone: CUDA/cuBLAS warm-up, or torch.compile
    step_s: float = 0.0
    tokens_per_sec: float = 0.0
    tflops: float = 0.0
    mfu: Optional[float] = None
    peak_mem_gib: float = 0.0
    last_loss: float = float("nan")
    vs_hf_eager: Optional[float] = None  # megazero rows: tokens/s over the peer's of the same model
    vs_hf_compile: Optional[float] = None
    error: str = ""


def make_config(model: str, micro: int, accum: int, iters: int, overrides: list[str]) -> Config:
    """The model's shipped config with mock data, this batch shape, no checkpoints and no files written."""
    fixed = ["--data.mock", "true", "--train.precision", "bf16", "--parallel.tp", "1", "--parallel.pp", "1",
             "--train.micro_batch_size", str(micro), "--train.global_batch_size", str(micro * accum),
             "--train.iters", str(iters), "--train.eval_interval", "0", "--checkpoint.save", "null",
             "--checkpoint.load", "null", "--logging.jsonl", "null", "--logging.wandb", "false"]
    base = f"configs/{MODEL_CONFIGS.get(model, model)}.yaml"
    return configs.make_config(fixed + MODEL_OVERRIDES.get(model, []) + overrides, base, world=1)


def timed_steps(step: Callable[[], float], iters: int, warmup: int) -> tuple[list[float], float, float]:
    """Seconds of each timed call of `step` (one training iteration returning its loss), the
    last loss, and the seconds of the first call."""
    times, loss, first = [], float("nan"), 0.0
    for i in range(iters):
        torch.cuda.synchronize()
        tic = time.perf_counter()
        loss = step()  # float(loss) inside already waits for the GPU; synchronize anyway
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - tic
        if i == 0:
            first = elapsed
        if i >= warmup:
            times.append(elapsed)
    return times, loss, first


def measure(row: Row, step: Callable[[], float], cfg: Config, iters: int, warmup: int, peak: Optional[float]) -> None:
    """Time `step` and fill the row's throughput columns (mean step time over the timed iterations)."""
    times, row.last_loss, row.first_step_s = timed_steps(step, iters, warmup)
    row.step_s = sum(times) / len(times)
    row.tokens_per_sec = row.tokens_per_iter / row.step_s
    row.tflops = model_flops_per_token(cfg.model) * row.tokens_per_sec / 1e12
    row.mfu = row.tflops * 1e12 / peak if peak else None
    row.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30


def failure(e: BaseException, micro: int) -> str:
    """One line for a failed row."""
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
        return f"out of memory at micro-batch {micro}; try --micro {max(1, micro // 2)}"
    if isinstance(e, ImportError):
        return f"{e} (the peer needs transformers: pip install transformers)"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def release(compiled: bool) -> None:
    """Free the last run's GPU memory (and its compiled graphs) before the next one is built."""
    gc.collect()
    torch.cuda.empty_cache()
    if compiled:
        torch._dynamo.reset()


def trace_path(args: argparse.Namespace, model: str, runner: str) -> Optional[str]:
    return os.path.join(args.trace, f"{model}-{runner.replace(' ', '-')}.json") if args.trace else None


def ours(row: Row) -> bool:
    """A megazero row (eager or compiled), as opposed to a peer's."""
    return row.runner in (MEGAZERO, MEGAZERO_COMPILE)


def _run_megazero(row: Row, cfg: Config, grid, args: argparse.Namespace, peak: Optional[float]) -> Optional[Profile]:
    from megazero.train.trainer import Trainer

    with redirect_stdout(io.StringIO()):  # the trainer's config banner
        trainer = Trainer(cfg, grid)
    row.params_m = sum(p.numel() for c in trainer.chunks for p in c.parameters()) / 1e6
    measure(row, lambda: trainer.train_step()["loss"], cfg, args.iters, args.warmup, peak)
    if not args.profile:
        return None
    return capture(trainer.train_step, args.profile_steps, trace_path(args, row.model, row.runner))


def bench(model: str, micro: int, accum: int, args: argparse.Namespace, overrides: list[str], grid,
          peak: Optional[float], runner: str = MEGAZERO) -> tuple[Row, Optional[Profile]]:
    """Train `model` with megazero (eager, or under train.compile for MEGAZERO_COMPILE) for
    args.iters iterations on this GPU and measure the timed ones; with --profile, then profile
    a few more."""
    row = Row(model, runner=runner, micro=micro, accum=accum)
    if runner == MEGAZERO_COMPILE:
        overrides = overrides + ["--train.compile", "true"]
    extra = args.profile_steps + 1 if args.profile else 0  # the mock data covers the profiled steps too
    cfg = make_config(model, micro, accum, args.iters + extra, overrides)
    row.tokens_per_iter = cfg.train.global_batch_size * cfg.model.seq_length
    torch.cuda.reset_peak_memory_stats()
    profile, tic = None, time.perf_counter()
    try:
        profile = _run_megazero(row, cfg, grid, args, peak)
    except Exception as e:
        if not isinstance(e, torch.cuda.OutOfMemoryError):
            traceback.print_exc()
        row.error = failure(e, micro)
    release(cfg.train.compile)  # the trainer is gone with _run_megazero's frame
    row.run_s = time.perf_counter() - tic
    return row, profile


# --- the Hugging Face peer -----------------------------------------------------------------------

class LossOf(torch.nn.Module):
    """A causal LM and the usual next-token cross-entropy (fp32 logits), one module so that
    torch.compile sees both."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=inputs)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())
        aux = getattr(out, "aux_loss", None)  # a mixture of experts' load-balancing loss, as megazero adds it
        return loss if aux is None else loss + self.lm.config.router_aux_loss_coef * aux


def hf_model(cfg: Config, device: str) -> torch.nn.Module:
    """transformers' GPT-2, LlamaForCausalLM for the Llama family or MixtralForCausalLM for a
    Mixtral-style mixture of experts (its load-balancing loss on, at the config's coefficient), of
    the config's shape and dropout, SDPA attention, fp32, on `device`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    m = cfg.model
    if architecture(m) == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        conf = {k: v for k, v in hf_config(m).items() if k != "model_type"}
        mixtral = MixtralConfig(**{**conf, "use_cache": False, "output_router_logits": m.moe_aux_loss_coeff > 0,
                                   "router_aux_loss_coef": m.moe_aux_loss_coeff}, attn_implementation="sdpa")
        with torch.device(device):
            return MixtralForCausalLM(mixtral)
    if architecture(m) == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaConfig(**{**hf_config(m), "use_cache": False}, attn_implementation="sdpa")
        with torch.device(device):
            return LlamaForCausalLM(llama)
    conf = GPT2Config(n_layer=m.num_layers, n_embd=m.hidden_size, n_head=m.num_heads, n_positions=m.seq_length,
                      vocab_size=m.vocab_size, resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout,
                      layer_norm_epsilon=m.layernorm_eps, use_cache=False, attn_implementation="sdpa")
    with torch.device(device):
        return GPT2LMHeadModel(conf)


def peer_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """Fused AdamW with the config's settings; no weight decay on 1-D parameters (as megazero)."""
    o = cfg.optim
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


def token_batches(cfg: Config, micro: int, accum: int, device: str, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """accum micro-batches of random tokens as (inputs, labels = inputs shifted by one), fresh on
    each call like megazero's mock data (a repeated batch would be memorised and its loss fall)."""
    seq = cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (accum, micro, seq + 1), generator=generator, device=device)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def peer_step(loss_of: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, clip: float,
              device_type: str) -> float:
    """One plain training iteration: bf16 autocast forward, loss / accum, backward per micro-batch;
    clip the gradient norm; step. Returns the iteration's mean loss."""
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=batches[0][0].device)
    for inputs, labels in batches:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = loss_of(inputs, labels) / len(batches)
        loss.backward()
        total += loss.detach()
    if clip > 0:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, clip)
    optimizer.step()
    return float(total)


def _run_peer(row: Row, cfg: Config, args: argparse.Namespace, peak: Optional[float]) -> Optional[Profile]:
    torch.manual_seed(cfg.train.seed)
    lm = hf_model(cfg, DEVICE)
    row.params_m = sum(p.numel() for p in lm.parameters()) / 1e6
    loss_of = LossOf(lm)
    if row.runner == HF_COMPILE:
        loss_of = torch.compile(loss_of)
    optimizer, generator = peer_optimizer(lm, cfg), torch.Generator(DEVICE).manual_seed(cfg.train.seed)

    def step() -> float:
        batches = token_batches(cfg, row.micro, row.accum, DEVICE, generator)
        return peer_step(loss_of, optimizer, batches, cfg.optim.clip_grad, DEVICE)

    measure(row, step, cfg, args.peer_iters, args.warmup, peak)
    if not args.profile:
        return None
    return capture(step, args.profile_steps, trace_path(args, row.model, row.runner))


def peer_bench(model: str, runner: str, micro: int, accum: int, args: argparse.Namespace, overrides: list[str],
               peak: Optional[float]) -> tuple[Row, Optional[Profile]]:
    """Train the Hugging Face GPT-2 of `model`'s shape the plain way (`runner`: hf eager or hf compile)."""
    row = Row(model, runner, micro=micro, accum=accum)
    profile, tic = None, time.perf_counter()
    try:
        cfg = make_config(model, micro, accum, args.peer_iters, overrides)
        row.tokens_per_iter = cfg.train.global_batch_size * cfg.model.seq_length
        torch.cuda.reset_peak_memory_stats()
        profile = _run_peer(row, cfg, args, peak)
    except Exception as e:  # a peer is a comparison: its failure is a row, not the end of the run
        row.error = failure(e, micro)
    release(runner == HF_COMPILE)
    row.run_s = time.perf_counter() - tic
    return row, profile


# --- where a step's GPU time goes (--profile) ---------------------------------------------------
# CUDA kernel time by kind, and host syncs per step.
#
#     profile = capture(step, steps=1)           # torch.profiler around `steps` calls of step()
#     kinds = breakdown(profile.kernels, profile.steps)
#     print("\n".join(format_profiles("gpt2-124m", {"megazero": (profile, step_s)})))
#
# A kernel's kind is read off its name alone (`kernel_kind`): GEMM, attention, loss, norm,
# elementwise (pointwise work and reductions), copies, optimizer, communication, other. Names are
# matched in that priority order (attention before GEMM, since cutlass attention kernels name
# cutlass; loss before elementwise, since Inductor names its fused log-softmax kernels
# `triton_*_fused__log_softmax_*`). A host sync is a CPU-side CUDA runtime or driver call that
# waits for the GPU (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`,
# a blocking `cudaMemcpy`). Everything but `capture` is pure (`collect` reads the profiler's
# averaged entries), so it is tested on CPU.

# (kind, name fragments), matched in this order against the lower-cased kernel name.
KIND_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lpnorm")),  # with the gradient-norm clip
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("loss", ("cross_entropy", "crossentropy", "log_softmax", "logsoftmax", "nll_loss", "logsumexp", "loss")),
    ("GEMM", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "splitkreduce", "triton_tem_fused_mm")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "gammabeta")),
    ("elementwise", ("triton_",)),  # Inductor's fused kernels: a "_to_copy" in one is a cast, not a copy
    ("copies", ("copy", "memcpy", "memset", "concat", "transpose")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "fused", "gelu", "dropout", "add", "mul",
                     "fill", "reduce")),
)
KINDS = tuple(dict.fromkeys(kind for kind, _ in KIND_PATTERNS)) + ("other",)

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH")


def kernel_kind(name: str) -> str:
    """The kind of the CUDA kernel (or Memcpy/Memset activity) called `name`."""
    low = name.lower()
    for kind, fragments in KIND_PATTERNS:
        if any(f in low for f in fragments):
            return kind
    return "other"


def is_host_sync(name: str) -> bool:
    """Whether the CPU-side runtime/driver call `name` blocks the host until the GPU is done
    (cudaMemcpyAsync does not by itself; the stream synchronize after it is counted)."""
    return name in SYNC_CALLS or (name.startswith(("cudaMemcpy2D", "cuMemcpyDtoH_")) and "Async" not in name)


@dataclass
class Profile:
    """What one capture saw: kernels as (name, total device us, launches) and host sync calls."""
    steps: int
    kernels: list[tuple[str, float, int]] = field(default_factory=list)
    syncs: int = 0
    error: str = ""


@dataclass
class KindTime:
    kind: str
    ms_per_step: float
    share: float  # of all kernel time
    count_per_step: float


def breakdown(kernels: list[tuple[str, float, int]], steps: int) -> list[KindTime]:
    """Kernel time per kind (every kind of KINDS, in that order), per step, from (name, us, count)."""
    us = dict.fromkeys(KINDS, 0.0)
    counts = dict.fromkeys(KINDS, 0)
    for name, time_us, count in kernels:
        kind = kernel_kind(name)
        us[kind] += time_us
        counts[kind] += count
    total = sum(us.values())
    return [KindTime(k, us[k] / 1e3 / steps, us[k] / total if total else 0.0, counts[k] / steps) for k in KINDS]


def top_kernels(kernels: list[tuple[str, float, int]], n: int = 15) -> list[tuple[str, float, int]]:
    """The n kernels with the most total time (same-named entries merged), longest first."""
    merged: dict[str, list] = {}
    for name, time_us, count in kernels:
        entry = merged.setdefault(name, [0.0, 0])
        entry[0] += time_us
        entry[1] += count
    return sorted(((name, t, c) for name, (t, c) in merged.items()), key=lambda k: -k[1])[:n]


def short_name(name: str, width: int = 72) -> str:
    """A kernel name cut to `width` characters (template arguments are the long part)."""
    name = " ".join(name.split())
    if name.startswith("void "):
        name = name[5:]
    return name if len(name) <= width else name[:width - 3] + "..."


def format_profiles(model: str, runs: dict[str, tuple[Profile, float]], top: int = 15) -> list[str]:
    """Compact lines for one model: a kind x runner table of kernel ms per step, share and kernels
    per step; kernel time against the timed step (GPU busy); host syncs per step; and the `top`
    longest kernels of the first runner. `runs` maps a runner name to (its profile, its timed
    step seconds); an errored profile gets one line."""
    ok = {r: (p, s) for r, (p, s) in runs.items() if not p.error}
    steps = {r: p.steps for r, (p, _) in ok.items()}
    lines = [f"profile {model}: kernel ms per step | % of kernel time | kernels per step "
             f"({', '.join(f'{r} {n} steps' for r, n in steps.items())})"]
    lines += [f"  {runner}: profile failed: {p.error}" for runner, (p, _) in runs.items() if p.error]
    if not ok:
        return lines
    kinds = {r: breakdown(p.kernels, p.steps) for r, (p, _) in ok.items()}
    lines.append(f"  {'kind':<13}" + "".join(f" {r:>24}" for r in ok))
    for i, kind in enumerate(KINDS):
        cells = [kinds[r][i] for r in ok]
        if all(c.ms_per_step == 0 for c in cells):
            continue
        lines.append(f"  {kind:<13}" + "".join(
            f" {c.ms_per_step:>9.2f} {100 * c.share:>5.1f}% {c.count_per_step:>7.0f}" for c in cells))
    busy = []
    for r, (_, step_s) in ok.items():
        kernel_ms = sum(k.ms_per_step for k in kinds[r])
        idle = max(0.0, 1 - kernel_ms / (1e3 * step_s)) if step_s > 0 else float("nan")
        busy.append(f"{kernel_ms:.1f}/{1e3 * step_s:.1f} ms idle {100 * idle:.0f}%")
    lines.append(f"  {'GPU (step)':<13}" + "".join(f" {b:>24}" for b in busy))
    lines.append(f"  {'host syncs':<13}" + "".join(f" {p.syncs / p.steps:>24.1f}" for p, _ in ok.values()))
    first, (profile, _) = next(iter(ok.items()))
    total_us = sum(t for _, t, _ in profile.kernels) or 1.0
    lines.append(f"  top {top} kernels of {first} (ms per step, % of kernel time, launches per step, kind, name):")
    for name, time_us, count in top_kernels(profile.kernels, top):
        lines.append(f"  {time_us / 1e3 / profile.steps:>8.2f} {100 * time_us / total_us:>5.1f}% "
                     f"{count / profile.steps:>5.0f} {kernel_kind(name):<13} {short_name(name)}")
    return lines


def _device_us(entry) -> float:
    """An averaged profiler entry's total device time in us (torch >= 2.4 names it device_time_total)."""
    value = getattr(entry, "device_time_total", None)
    return float(value if value is not None else entry.cuda_time_total)


def _is_kernel(entry) -> bool:
    """A device-side entry that is a kernel or a copy: not a CPU op, and not a user range projected
    onto the GPU timeline (`ProfilerStep#N`, record_function ranges), which would count its
    kernels twice."""
    device_type = getattr(entry, "device_type", None)
    if device_type is None or "CPU" in str(device_type):
        return False
    return not getattr(entry, "is_user_annotation", False) and not entry.key.startswith("ProfilerStep")


def collect(entries, steps: int) -> Profile:
    """The kernels and host syncs among torch.profiler's averaged entries (`prof.key_averages()`:
    objects with key, count, device_type, device_time_total and is_user_annotation)."""
    result = Profile(steps)
    for entry in entries:
        if _is_kernel(entry):
            result.kernels.append((entry.key, _device_us(entry), int(entry.count)))
        elif is_host_sync(entry.key):
            result.syncs += int(entry.count)
    if not result.kernels:
        result.error = "the profiler recorded no CUDA kernels (is CUPTI available?)"
    return result


def capture(step: Callable[[], object], steps: int = 1, trace: Optional[str] = None) -> Profile:
    """Run `step` once to let the profiler settle, then `steps` more times under torch.profiler
    (CPU + CUDA), and return the kernels and host syncs of those `steps`. `trace`: also write a
    Chrome trace to that path. Any profiler failure is returned as Profile.error."""
    from torch.profiler import ProfilerActivity, profile, schedule

    result = Profile(steps)
    try:
        with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one cycle here
            warnings.filterwarnings("ignore", message=".*clears events")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                         schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
                for _ in range(steps + 1):
                    step()
                    prof.step()
        torch.cuda.synchronize()
        result = collect(prof.key_averages(), steps)
    except Exception as e:  # a profile is extra: report it in one line and keep benchmarking
        result.error = _one_line(e)
        return result
    if trace:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
            tmp = f"{trace}.tmp{os.getpid()}"
            prof.export_chrome_trace(tmp)
            publish(tmp, trace)
        except Exception as e:  # the breakdown stands without its trace
            print(f"profile: no trace written to {trace}: {_one_line(e)}", file=sys.stderr)
    return result


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


# --- reporting -----------------------------------------------------------------------------------

def add_ratios(rows: list[Row]) -> None:
    """Set each megazero row's tokens/s over each peer's of the same model (None: no such peer row,
    or it failed)."""
    peers = {(r.model, r.runner): r.tokens_per_sec for r in rows
             if not ours(r) and not r.error and r.tokens_per_sec > 0}
    for r in rows:
        if ours(r) and not r.error:
            eager, compiled = peers.get((r.model, HF_EAGER)), peers.get((r.model, HF_COMPILE))
            r.vs_hf_eager = r.tokens_per_sec / eager if eager else None
            r.vs_hf_compile = r.tokens_per_sec / compiled if compiled else None


def _ratio(r: Row, value: Optional[float]) -> str:
    if not ours(r):
        return "-"
    return f"{value:.2f}x" if value is not None else "n/a"


def table(rows: list[Row], ratios: bool = True) -> str:
    """The rows as a table; `ratios` adds the vs-peer columns (set by add_ratios)."""
    head = (f"{'model':<10} {'runner':<16} {'params':>7} {'micro x acc':>11} {'tok/iter':>8} {'run s':>6} {'1st s':>6} "
            f"{'step s':>7} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} {'loss':>7}")
    lines = [head + (f" {'vs hf eager':>11} {'vs hf compile':>13}" if ratios else "")]
    for r in rows:
        if r.error:
            lines.append(f"{r.model:<10} {r.runner:<16} FAILED: {r.error}")
            continue
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        line = (f"{r.model:<10} {r.runner:<16} {r.params_m:>6.0f}M {f'{r.micro} x {r.accum}':>11} "
                f"{r.tokens_per_iter:>8} {r.run_s:>6.1f} {r.first_step_s:>6.1f} {r.step_s:>7.3f} {r.tokens_per_sec / 1e3:>8.1f}k "
                f"{r.tflops:>8.1f} {mfu:>6} {r.peak_mem_gib:>8.1f} {r.last_loss:>7.3f}")
        if ratios:
            line += f" {_ratio(r, r.vs_hf_eager):>11} {_ratio(r, r.vs_hf_compile):>13}"
        lines.append(line)
    return "\n".join(lines)


def profile_json(profile: Profile, step_s: float) -> dict:
    """A profile's summary for --json: kernel ms, share and count per step by kind; host syncs per step."""
    if profile.error:
        return {"error": profile.error}
    kinds = breakdown(profile.kernels, profile.steps)
    return {"steps": profile.steps, "step_s": step_s, "host_syncs_per_step": profile.syncs / profile.steps,
            "kernel_ms_per_step": sum(k.ms_per_step for k in kinds),
            "kinds": {k.kind: {"ms_per_step": k.ms_per_step, "share": k.share, "count_per_step": k.count_per_step}
                      for k in kinds if k.count_per_step}}


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="model shapes to train (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=30, help="iterations per model, warm-up included (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="first iterations left out of the timing (default: %(default)s)")
    ap.add_argument("--micro", type=int, default=0, help="micro-batch size for every model (0: per-model default)")
    ap.add_argument("--accum", type=int, default=0, help="micro-batches per iteration (0: per-model default)")
    ap.add_argument("--megazero", choices=list(OURS), default="both",
                    help="megazero rows: eager, under train.compile (\"megazero compile\"), or both (default: %(default)s)")
    ap.add_argument("--peers", choices=list(PEERS), default="both",
                    help="Hugging Face GPT-2 peers trained in the same run: eager, torch.compile, both or none (default: %(default)s)")
    ap.add_argument("--peer-iters", type=int, default=0, help="iterations per peer, warm-up included (0: --iters) (default: %(default)s)")
    ap.add_argument("--profile", action="store_true",
                    help="after each run's timed iterations, print its CUDA kernel time by kind and host syncs")
    ap.add_argument("--profile-steps", type=int, default=1, help="iterations recorded by --profile (after one more "
                    "to let the profiler settle) (default: %(default)s)")
    ap.add_argument("--trace", help="with --profile, also write Chrome traces (MODEL-RUNNER.json) to this folder")
    ap.add_argument("--json", help="also write the rows (and profile summaries) to this JSON file")
    args, overrides = ap.parse_known_args(argv)
    args.peer_iters = args.peer_iters or args.iters
    for flag, iters in (("--iters", args.iters), ("--peer-iters", args.peer_iters)):
        if iters <= args.warmup:
            ap.error(f"{flag} ({iters}) must exceed --warmup ({args.warmup}) to leave iterations to time")
    if args.profile_steps < 1:
        ap.error(f"--profile-steps ({args.profile_steps}) must be at least 1")
    if args.trace and not args.profile:
        ap.error("--trace writes the --profile traces; add --profile")
    return args, overrides


def run_model(model: str, args: argparse.Namespace, overrides: list[str], grid, peak: Optional[float],
              profiles: dict) -> list[Row]:
    """megazero and the chosen peers on one model, each printed as it finishes; --profile prints after them."""
    micro, accum = args.micro or SHAPES[model][0], args.accum or SHAPES[model][1]
    rows, runs = [], {}
    for runner in OURS[args.megazero] + PEERS[args.peers]:
        if runner in OURS["both"]:
            row, profile = bench(model, micro, accum, args, overrides, grid, peak, runner)
        else:
            row, profile = peer_bench(model, runner, micro, accum, args, overrides, peak)
        rows.append(row)
        print(table([row], ratios=False).splitlines()[-1], flush=True)  # progress, one line per run
        if profile is not None:
            runs[runner] = (profile, row.step_s)
    if runs:
        print("\n".join(format_profiles(model, runs)), flush=True)
        profiles[model] = {runner: profile_json(p, s) for runner, (p, s) in runs.items()}
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args, overrides = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine "
              f"with a CUDA build of torch (this one is {torch.__version__})", file=sys.stderr)
        return 1
    from megazero.parallel.grid import ProcessGrid

    grid = ProcessGrid.create(tp=1, pp=1)  # NCCL, a world of one; sets the CUDA device
    name, peak = device_peak_flops()
    peak_text = f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "unknown peak: no MFU"
    peers = f"peers {', '.join(PEERS[args.peers])} ({args.peer_iters} iterations)" if PEERS[args.peers] else "no peers"
    print(f"bench_gpu: {name} ({peak_text}) | torch {torch.__version__} | CUDA {torch.version.cuda} | "
          f"{args.iters} iterations per model, first {args.warmup} untimed | {peers}", flush=True)
    rows, profiles = [], {}
    for model in args.models:
        rows += run_model(model, args, overrides, grid, peak, profiles)
    add_ratios(rows)
    print("\n" + table(rows, ratios=bool(PEERS[args.peers])))
    if args.json:
        write_text(args.json, json.dumps({"device": name, "peak_flops": peak, "rows": [asdict(r) for r in rows],
                                          "profiles": profiles}, indent=1))
    torch.distributed.destroy_process_group()  # NCCL warns about communicators left to teardown
    failed = [f"{r.model} {r.runner}" for r in rows if ours(r) and (r.error or not math.isfinite(r.last_loss))]
    peer_failed = [f"{r.model} {r.runner}" for r in rows if not ours(r) and r.error]
    if peer_failed:
        print(f"bench_gpu: peer rows failed: {', '.join(peer_failed)} (no ratio to them)", file=sys.stderr)
    if failed:
        print(f"bench_gpu: {', '.join(failed)} failed (see the table)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
