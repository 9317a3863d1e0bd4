"""Throughput accounting (model FLOPs, MFU) and the run's outputs: one fixed log line per
logged iteration, and the same numbers to the sinks (JSONL, TensorBoard, W&B)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch

from megazero.config.schema import Config
from megazero.plan.formulas import PEAK_FLOPS
from megazero.train.sinks import JsonlSink, Sink, TensorBoardSink, WandbSink, claim, drop_records_after


def device_peak_flops() -> tuple[str, Optional[float]]:
    """(device name, peak FLOP/s or None when the device is not in the table)."""
    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def format_line(rec: dict, total_iters: int) -> str:
    """`iter 120/2000 | loss 3.412 | lr 2.4e-04 | grad 0.91 | 12.3k tok/s | ...`."""
    parts = [f"iter {rec['iteration']}/{total_iters}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}",
             f"grad {rec['grad_norm']:.3f}", f"{rec['tokens_per_sec'] / 1e3:.1f}k tok/s",
             f"{rec['tflops_per_device']:.3g} TFLOP/s"]  # 3 significant digits: non-zero on tiny models
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    parts.append(f"mem {rec['peak_mem_gib']:.2f} GiB")
    if rec.get("loss_scale") is not None:
        parts.append(f"scale {rec['loss_scale']:.0f}")
    if rec.get("skipped_iters"):
        parts.append(f"skipped {rec['skipped_iters']}")
    if "moe_aux_loss" in rec:  # the worst layer's busiest expert over the mean; dropped pairs when any
        parts.append(f"aux {rec['moe_aux_loss']:.4g} | imbalance {rec['moe_imbalance']:.2f}")
        if rec.get("moe_dropped"):
            parts.append(f"dropped {rec['moe_dropped']}")
    if "time_forward_s" in rec:
        parts.append(" ".join(f"{label} {1e3 * rec['time_' + key + '_s']:.1f} ms" for key, label in PHASES.items()
                              if f"time_{key}_s" in rec))
        parts.append("sent " + " ".join(f"{g} {rec['bytes_' + g] / 2**20:.2f} MiB" for g in MOVED if 'bytes_' + g in rec))
    if "val_loss" in rec:
        parts.append(f"val {rec['val_loss']:.4f} (ppl {rec['val_ppl']:.1f})")
    return " | ".join(parts)


PHASES = {"data_wait": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "comm_wait": "wait"}
"""Timed phases (logging.timers); data_wait: building this rank's micro-batches (reading, and for data.stream
waiting on the loader processes)."""
MOVED = ("dp", "tp", "pp", "cp")


class PhaseTimers:
    """Seconds per training phase (logging.timers), summed until `take`. On CUDA every phase
    boundary synchronizes the device, so a phase is charged for its own kernels."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        tic = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] += time.perf_counter() - tic

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def take(self, steps: int) -> dict[str, float]:
        """JSONL fields time_<phase>_s: seconds per iteration over the last `steps`; then reset."""
        out = {f"time_{k}_s": v / max(1, steps) for k, v in self.seconds.items()}
        self.seconds = dict.fromkeys(PHASES, 0.0)
        return out

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def bytes_per_iteration(moved: dict[str, dict[str, int]], steps: int) -> dict[str, float]:
    """JSONL fields bytes_dp/tp/pp (and bytes_cp under context parallelism): bytes this rank
    sent per iteration over each group (dp: ZeRO's dp x cp group; the tied embedding's sum
    counts with pp), from the comm counters."""
    def total(group: str) -> int:
        return sum(v for op, v in moved.get(group, {}).items() if not op.endswith("_calls"))
    counted = {"dp": "dp_cp" if "dp_cp" in moved else "dp", "tp": "tp", "pp": "pp", "cp": "cp"}
    out = {f"bytes_{g}": total(counted[g]) / max(1, steps) for g in MOVED if g != "cp" or total("cp")}
    out["bytes_pp"] += total("embed") / max(1, steps)
    return out


def peak_memory_gib() -> float:
    """Peak accelerator memory, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsWriter:
    """The one place a logged iteration's record is fanned out to its sinks (JSONL,
    TensorBoard, W&B: train/sinks.py), on the logging rank alone."""

    def __init__(self, cfg: Config, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        self.sinks: list[Sink] = []

    def open(self, iteration: int, consumed_samples: int) -> list[str]:
        """Open the sinks for a run that starts after `iteration` (0, or the checkpoint it
        resumed): what an earlier attempt logged past it is dropped. Returns lines to print."""
        self.close()
        if not self.enabled:
            return []
        lg, notes = self.cfg.logging, []
        claim(self.cfg)  # start-up moved another run's outputs aside (sinks.set_aside_other_runs)
        if lg.jsonl:
            dropped = drop_records_after(lg.jsonl, iteration)
            if dropped:
                notes.append(f"logging.jsonl: dropped {dropped} record(s) past iteration {iteration}, where this run "
                             f"starts, from {lg.jsonl} (logged before a restart; they are logged again)")
            self.sinks.append(JsonlSink(lg.jsonl))
        if lg.tensorboard:
            self.sinks.append(TensorBoardSink(lg.tensorboard, iteration, consumed_samples))
        if lg.wandb:
            self.sinks.append(WandbSink(self.cfg))
        return notes

    def write(self, rec: dict) -> None:
        for sink in self.sinks:
            sink.write(rec)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
