"""Where a training step's GPU time goes: CUDA kernel time by kind, and host syncs per step.

    profile = capture(step, steps=1)           # torch.profiler around `steps` calls of step()
    kinds = breakdown(profile.kernels, profile.steps)
    print("\\n".join(format_profiles("gpt2-124m", {"megazero": (profile, step_s)})))

A kernel's kind is read off its name alone (`kernel_kind`): GEMM, attention, loss, norm,
elementwise (pointwise work and reductions), copies, optimizer, communication, other. Names are
matched in that priority order (attention before GEMM, since cutlass attention kernels name
cutlass; loss before elementwise, since Inductor names its fused log-softmax kernels
`triton_*_fused__log_softmax_*`). A host sync is a CPU-side CUDA runtime or driver call that
waits for the GPU (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`,
a blocking `cudaMemcpy`). Everything but `capture` is pure (`collect` reads the profiler's
averaged entries), so it is tested on CPU.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

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
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from megazero.atomic import publish

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
            print(f"gpu_profile: no trace written to {trace}: {_one_line(e)}", file=sys.stderr)
    return result


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]
