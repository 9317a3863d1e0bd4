"""Throughput accounting (model FLOPs, MFU) and the run's outputs: one fixed log line per
logged iteration, the same numbers as JSONL, and optionally Weights & Biases."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megazero.config import Config
from megazero.plan.formulas import PEAK_FLOPS


def device_peak_flops() -> tuple[str, Optional[float]]:
    """(device name, peak FLOP/s or None when the device is not in the table)."""
    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name()
    for key, peak in PEAK_FLOPS.items():
        if key in name:
            return name, peak
    return name, None


def format_line(rec: dict, total_iters: int) -> str:
    """`iter 120/2000 | loss 3.412 | lr 2.4e-04 | grad 0.91 | 12.3k tok/s | ...`."""
    parts = [f"iter {rec['iteration']}/{total_iters}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}",
             f"grad {rec['grad_norm']:.3f}", f"{rec['tokens_per_sec'] / 1e3:.1f}k tok/s",
             f"{rec['tflops_per_device']:.2f} TFLOP/s"]
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    parts.append(f"mem {rec['peak_mem_gib']:.2f} GiB")
    if rec.get("loss_scale") is not None:
        parts.append(f"scale {rec['loss_scale']:.0f}")
    if rec.get("skipped_iters"):
        parts.append(f"skipped {rec['skipped_iters']}")
    if "val_loss" in rec:
        parts.append(f"val {rec['val_loss']:.4f} (ppl {rec['val_ppl']:.1f})")
    return " | ".join(parts)


def peak_memory_gib() -> float:
    """Peak accelerator memory, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsWriter:
    """JSONL records (appended, one object per line) and optional W&B, on the logging rank."""

    def __init__(self, cfg: Config, enabled: bool):
        self.enabled = enabled
        self.jsonl = None
        self.wandb = None
        if not enabled:
            return
        if cfg.logging.jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.logging.jsonl)), exist_ok=True)
            self.jsonl = open(cfg.logging.jsonl, "a")
        if cfg.logging.wandb:
            self.wandb = _start_wandb(cfg)

    def write(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()
        if self.wandb:
            self.wandb.log({k: v for k, v in rec.items() if k != "iteration"}, step=rec["iteration"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.wandb:
            self.wandb.finish()


def _start_wandb(cfg: Config):
    import wandb  # presence checked at start-up, before any process group exists

    os.environ.setdefault("WANDB_MODE", "offline")  # no network here: sync later with `wandb sync`
    return wandb.init(project=cfg.logging.wandb_project, config=cfg.to_dict())
