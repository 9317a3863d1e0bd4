"""Megatron-LM's --profile: the training steps profile_start to profile_end - 1 under
torch.profiler (a Chrome trace per profiling rank, beside the TensorBoard logs) or inside a
CUDA profiler range for Nsight Systems."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megazero.config.schema import Config


def trace_dir(cfg: Config) -> str:
    """Where the traces go: the TensorBoard directory (Megatron's choice), else the run directory."""
    lg = cfg.logging
    if lg.tensorboard:
        return lg.tensorboard
    if cfg.checkpoint.save:
        return cfg.checkpoint.save
    assert lg.jsonl, "rules.validate requires a directory for the trace"
    return os.path.dirname(os.path.abspath(lg.jsonl))


class StepProfiler:
    """Call `step(done)` around each training step (`done`: the steps already done); `close()`
    at the end writes a trace cut short by an early stop."""

    def __init__(self, cfg: Config, rank: int, device: torch.device) -> None:
        lg = cfg.logging
        self.kind = lg.profiler if rank in lg.profile_ranks else "none"
        self.start, self.end, self.rank, self.device = lg.profile_start, lg.profile_end, rank, device
        self.path = ""
        if self.kind == "torch":
            self.path = os.path.join(trace_dir(cfg), f"rank{rank}.iterations_{self.start + 1}-{self.end}.pt.trace.json")
        self.torch_profile: Optional[profile] = None
        self.nsys_open = False
        self.steps: list[int] = []  # the iterations profiled (a resumed or stopped run may cover part of the window)
        if lg.profiler == "nsys" and rank in lg.profile_ranks and device.type != "cuda":
            print(f"rank {rank}: logging.profiler nsys marks a CUDA profiler range; there is no GPU here, so none",
                  flush=True)

    @contextlib.contextmanager
    def step(self, done: int) -> Iterator[None]:
        inside = self.kind != "none" and self.start <= done < self.end
        if not inside:
            self.close()
            yield
            return
        self._begin()
        with record_function(f"iteration {done + 1}"):  # the step's ops under the number it is logged with
            yield
        self.steps.append(done + 1)
        if done + 1 == self.end:
            self.close()

    def _begin(self) -> None:
        if self.torch_profile is not None or self.nsys_open:
            return
        if self.kind == "torch":
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.torch_profile = profile(activities=activities, record_shapes=True)
            self.torch_profile.start()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.start()
            self.nsys_open = True

    def close(self) -> None:
        if self.torch_profile is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.torch_profile.stop()
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.torch_profile.export_chrome_trace(self.path)
            self.torch_profile = None
            print(f"rank {self.rank}: torch.profiler trace of iterations {self.steps[0]} to {self.steps[-1]} written "
                  f"to {self.path}", flush=True)
        if self.nsys_open:
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.stop()
            self.nsys_open = False
