"""The training loop: data -> schedule (forward/backward) -> optimizer step -> metrics.

Parallel pieces are put together here, in this order: grid and seeds, this rank's model
chunks (layout-independent init), the optimizer (which owns DP gradient reduction and
sharding), the datasets. Every layout sees the same global batch: sample i depends only
on (seed, i), and each DP rank takes a fixed slice of every global batch.
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import numpy as np
import torch

from megazero.config import Config, describe
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.random import seed_everything
from megazero.pipeline.schedules import Microbatch, forward_backward_no_pipelining
from megazero.pipeline.stages import build_model_chunks
from megazero.train.lr import learning_rate
from megazero.train.metrics import (MetricsWriter, device_peak_flops, format_line, model_flops_per_token,
                                    peak_memory_gib)
from megazero.zero.optimizer import ZeroOptimizer


class Trainer:
    def __init__(self, cfg: Config, grid: ProcessGrid):
        self.cfg, self.grid = cfg, grid
        t = cfg.train
        self.tracker = seed_everything(t.seed, grid.pp_rank, grid.tp_rank, grid.device)
        self.chunks = build_model_chunks(cfg, grid, self.tracker)
        self.optimizer = ZeroOptimizer(self.chunks, cfg, grid)
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * grid.dp)
        self.train_ds, self.valid_ds = build_datasets(cfg, grid)
        self.iteration = 0
        self.consumed_samples = 0
        self.skipped_iters = 0
        # The rank that holds the loss and speaks for the run: last stage, first TP/DP rank.
        self.is_logger = grid.rank == grid.rank_of(0, 0, grid.pp - 1)
        self.metrics = MetricsWriter(cfg, self.is_logger)
        self.flops_per_token = model_flops_per_token(cfg.model)
        self.device_name, self.peak_flops = device_peak_flops()
        if grid.rank == 0:
            print(f"megazero: world {grid.world_size} = tp {grid.tp} x pp {grid.pp} x dp {grid.dp} "
                  f"({grid.backend}); {self.num_microbatches} micro-batches/iter\n--- config ---\n"
                  f"{describe(cfg)}--------------", flush=True)
            save_resolved_config(cfg)

    # ------------------------------------------------------------------ data

    def microbatches(self, dataset, first_sample: int) -> list[Microbatch]:
        """This DP rank's micro-batches of the global batch starting at `first_sample`."""
        t, g = self.cfg.train, self.grid
        out = []
        for j in range(self.num_microbatches):
            base = first_sample + j * t.micro_batch_size * g.dp + g.dp_rank * t.micro_batch_size
            rows = np.stack([dataset[(base + k) % len(dataset)] for k in range(t.micro_batch_size)])
            x = torch.from_numpy(rows.astype(np.int64)).to(g.device)
            out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
        return out

    # ------------------------------------------------------------------ steps

    def run_schedule(self, batches: list[Microbatch], forward_only: bool) -> Optional[torch.Tensor]:
        num_tokens = self.cfg.train.global_batch_size * self.cfg.model.seq_length
        return forward_backward_no_pipelining(self.chunks[0], batches, num_tokens, self.optimizer, forward_only)

    def global_loss(self, local: Optional[torch.Tensor]) -> Optional[float]:
        """Sum the per-rank shares over DP (on the last stage, where the loss exists)."""
        if local is None:
            return None
        local = local.clone()
        comm.all_reduce(local, self.grid.dp_group)
        return float(local)

    def train_step(self) -> dict:
        lr = learning_rate(self.iteration, self.cfg.optim, self.cfg.train.iters)
        for c in self.chunks:
            c.train()
        self.optimizer.zero_grad()
        batches = self.microbatches(self.train_ds, self.consumed_samples)
        loss = self.run_schedule(batches, forward_only=False)
        self.optimizer.finish_grad_sync()
        result = self.optimizer.step(lr)
        self.iteration += 1
        self.consumed_samples += self.cfg.train.global_batch_size
        self.skipped_iters += int(result.skipped)
        return {"loss": self.global_loss(loss), "lr": lr, "grad_norm": result.grad_norm,
                "loss_scale": result.loss_scale}

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        for c in self.chunks:
            c.eval()
        total, n = 0.0, self.cfg.train.eval_iters
        for i in range(n):
            batches = self.microbatches(self.valid_ds, i * self.cfg.train.global_batch_size)
            loss = self.global_loss(self.run_schedule(batches, forward_only=True))
            total += loss if loss is not None else 0.0
        return total / n if self.is_logger else None

    def run(self) -> list[dict]:
        t = self.cfg.train
        tokens_per_iter = t.global_batch_size * self.cfg.model.seq_length
        records, tic = [], time.perf_counter()
        while self.iteration < t.iters:
            out = self.train_step()
            if self.iteration % t.log_interval and self.iteration != t.iters:
                continue
            elapsed = (time.perf_counter() - tic) / (self.iteration - (records[-1]["iteration"] if records else 0))
            tic = time.perf_counter()
            rec = self.record(out, tokens_per_iter / elapsed)
            if t.eval_interval and self.iteration % t.eval_interval == 0:
                val = self.evaluate()
                if self.is_logger:
                    rec["val_loss"], rec["val_ppl"] = val, math.exp(min(val, 50.0))
                tic = time.perf_counter()
            records.append(rec)
            if self.is_logger:
                print(format_line(rec, t.iters), flush=True)
                self.metrics.write(rec)
        self.metrics.close()
        return records

    def record(self, out: dict, tokens_per_sec: float) -> dict:
        tflops = self.flops_per_token * tokens_per_sec / self.grid.world_size / 1e12
        rec = {"iteration": self.iteration, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
               "tokens_per_sec": tokens_per_sec, "tflops_per_device": tflops,
               "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
               "peak_mem_gib": peak_memory_gib(), "consumed_samples": self.consumed_samples,
               "skipped_iters": self.skipped_iters}
        if out.get("loss_scale") is not None:
            rec["loss_scale"] = out["loss_scale"]
        return rec


def build_datasets(cfg: Config, grid: ProcessGrid):
    """(train, valid) datasets: the mock stream, or indexed data with cached sample indices."""
    m, t = cfg.model, cfg.train
    needed = (t.iters + 1) * t.global_batch_size
    eval_needed = max(1, t.eval_iters) * t.global_batch_size
    if cfg.data.mock:
        from megazero.data.mock import MockGPTDataset
        return (MockGPTDataset(needed, m.seq_length, m.vocab_size, t.seed),
                MockGPTDataset(eval_needed, m.seq_length, m.vocab_size, t.seed + 1))
    from megazero.data.gpt_dataset import build_train_valid_test_datasets, check_compatibility
    check_compatibility(cfg.data.prefix, cfg.data.tokenizer, m.vocab_size)

    def build(is_builder: bool):
        return build_train_valid_test_datasets(
            [str(p) for p in cfg.data.prefix], cfg.data.split, m.seq_length, t.seed,
            (needed, eval_needed, eval_needed), cfg.data.cache_dir, is_builder)

    # One rank builds and caches the sample indices; the others load them.
    if grid.rank == 0:
        train, valid, _ = build(True)
    comm.barrier(grid["world"])
    if grid.rank != 0:
        train, valid, _ = build(False)
    return train, valid


def save_resolved_config(cfg: Config) -> None:
    """Write the resolved config beside the run's outputs (checkpoint dir, else the JSONL's)."""
    run_dir = cfg.checkpoint.save or (os.path.dirname(os.path.abspath(cfg.logging.jsonl)) if cfg.logging.jsonl else None)
    if not run_dir:
        return
    os.makedirs(run_dir, exist_ok=True)
    tmp = os.path.join(run_dir, "config.yaml.tmp")
    with open(tmp, "w") as f:
        f.write(describe(cfg))
    os.replace(tmp, os.path.join(run_dir, "config.yaml"))
