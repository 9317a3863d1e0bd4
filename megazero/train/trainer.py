"""The training loop: data -> schedule (forward/backward) -> optimizer step -> metrics.

Parallel pieces are put together here, in this order: grid and seeds, this rank's model
chunks, sharded by ZeRO, with the optimizer on them (train/parallelize.py), the
datasets. Every layout sees the same global batch: sample i depends only
on (seed, i), and each DP rank takes a fixed slice of every global batch.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from typing import Iterator, Optional

import torch

from megazero.atomic import write_text
from megazero.checkpoint.manager import CheckpointManager
from megazero.checkpoint.resume import RESUME, resume_line, resume_state, starting_point
from megazero.checkpoint.tensors import encode_rng
from megazero.config.parse import describe
from megazero.config.schema import Config
from megazero.data import DataError
from megazero.data.gpt_dataset import (
    IGNORE_INDEX,
    build_train_valid_test_datasets,
    check_compatibility,
    inputs_and_labels,
)
from megazero.data.mock import MockGPTDataset
from megazero.data.stream.dataset import StreamDataset, supply_line
from megazero.data.tokenizer import build_tokenizer
from megazero.errors import UserError
from megazero.model.documents import DocumentResets
from megazero.parallel import comm
from megazero.parallel.context import shard_sequence
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.heap import fix_mmap_threshold
from megazero.parallel.host import HostSnapshot
from megazero.parallel.random import get_rng_states, seed_everything, set_rng_states
from megazero.pipeline.schedules import Microbatch, forward_backward_no_pipelining, forward_backward_pipelining, untimed
from megazero.plan.formulas import model_flops_per_token
from megazero.train import moe
from megazero.train.batch_rampup import rampup_batch
from megazero.train.host_memory import fit_host_memory
from megazero.train.inject import FaultInjector
from megazero.train.lifecycle import STOPPED, StopRequest, remember_clean_end
from megazero.train.lr import LRSchedule
from megazero.train.metrics import (
    MetricsWriter,
    PhaseTimers,
    bytes_per_iteration,
    device_peak_flops,
    format_line,
    peak_memory_gib,
)
from megazero.train.parallelize import compile_notes, parallelize
from megazero.train.profiler import StepProfiler
from megazero.train.replicas import ReplicaCheck
from megazero.train.rerun import Execution, RerunGuard, describe_samples, samples_line
from megazero.train.signals import StepSignals
from megazero.train.stragglers import StragglerWatch
from megazero.train.stream_data import stream_datasets
from megazero.train.summary import plan_check, run_prediction, startup_summary


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); the same on every rank."""


class Trainer:
    def __init__(self, cfg: Config, grid: ProcessGrid):
        self.cfg, self.grid = cfg, grid
        fix_mmap_threshold()  # before the model's memory is allocated: resident memory = memory held
        self.cfg = cfg = fit_host_memory(cfg, grid)  # offload's host buffers vs the memory available, before any exists
        t = cfg.train
        self.tracker = seed_everything(t.seed, grid.pp_rank, grid.tp_rank, grid.device, cp_rank=grid.cp_rank)
        self.chunks, self.optimizer = parallelize(cfg, grid, self.tracker)
        self.moe = moe.MoESteps(cfg.model, self.chunks, grid, cfg.parallel.sequence_parallel, cfg.logging.moe_per_layer)
        self.train_ds, self.valid_ds = build_datasets(cfg, grid)
        # Fine-tuning data: some labels count nothing, so the loss divides by a count of the rest.
        # Megatron's --eod-mask-loss: the prediction made at an end-of-document token counts nothing.
        d = cfg.data
        eod = build_tokenizer(d.tokenizer).eod if d.tokenizer and (d.eod_mask_loss or d.reset_position_ids or
                                                                   d.reset_attention_mask) else None
        self.eod_masked = eod if d.eod_mask_loss else None
        if eod is not None and (d.reset_position_ids or d.reset_attention_mask):
            for c in self.chunks:  # Megatron's --reset-position-ids / --reset-attention-mask (model/documents.py)
                c.document_resets = DocumentResets(eod, d.reset_position_ids, d.reset_attention_mask)
        self.loss_masked = self.train_ds.loss_masked or self.eod_masked is not None
        self.iteration = 0
        self.consumed_samples = 0
        self.skipped_iters = 0
        self.skipped_in_a_row = 0
        self.schedule = LRSchedule.from_config(cfg.optim, t)
        self.is_logger = grid.rank == grid.logging_rank
        self.metrics = MetricsWriter(cfg, self.is_logger)
        self.flops_per_token = model_flops_per_token(cfg.model)
        self.device_name, self.peak_flops = device_peak_flops()
        self.timers = PhaseTimers(grid.device) if cfg.logging.timers else None
        self.plan = self._announce()
        self.supply_due = True  # data.stream: the loaders' supply against the run's use, at the first log line
        self.stop = StopRequest(t.exit_duration_minutes)
        self.checkpoints = CheckpointManager(cfg, grid, self, self.is_logger)
        self.signals = StepSignals()  # the world's sums from the last step: read alike by every rank
        self.profiler = StepProfiler(cfg, grid.rank, grid.device)
        self._silent_fault_guards()
        if cfg.checkpoint.load:
            self.load_checkpoint(cfg.checkpoint.load, cfg.checkpoint.iteration)

    def _announce(self):
        """Rank 0: the start-up summary (with the planner's prediction), then the full config.
        Returns the prediction on the ranks that print it (rank 0 and the logging rank)."""
        grid = self.grid
        if grid.rank != 0 and not self.is_logger:
            return None
        plan = run_prediction(self.cfg, grid, self.peak_flops)
        if grid.rank == 0:
            summary = startup_summary(self.cfg, grid, self.optimizer.layout.param_numel,
                                      (self.train_ds, self.valid_ds), plan, self.device_name)
            notes = "".join(f"{n}\n" for n in compile_notes(self.cfg))
            # The resolved config is saved beside the run's outputs (checkpoint dir, else the JSONL's).
            lg = self.cfg.logging
            run_dir = self.cfg.checkpoint.save or (os.path.dirname(os.path.abspath(lg.jsonl)) if lg.jsonl else None)
            saved = os.path.join(run_dir, "config.yaml") if run_dir else None
            config = (f"--- config ---\n{describe(self.cfg)}--------------" if lg.print_config else
                      f"config: {saved or 'not saved (no checkpoint.save or logging.jsonl)'} "
                      f"(print it at start-up with --print-config)")
            print(f"{summary}\n{notes}{config}", flush=True)
            if saved:
                write_text(saved, describe(self.cfg))
        return plan

    def _silent_fault_guards(self) -> None:
        """Replica digests, reruns of non-finite or spiking steps, the straggler watch, and an
        injected fault (train/replicas.py, rerun.py, stragglers.py, inject.py); said at start-up."""
        cfg, grid = self.cfg, self.grid
        self.replicas = ReplicaCheck(cfg, grid, self.optimizer)
        self.rerun = RerunGuard(cfg, grid)
        self.stragglers = StragglerWatch(cfg, grid)
        self.injector = FaultInjector.from_config(cfg, grid, self.chunks, self.optimizer)
        self.fault_records: list[dict] = []  # JSONL records of this iteration's reruns and stragglers
        if grid.rank == 0:
            print(self.replicas.coverage(cfg), flush=True)
            if self.injector is not None:
                print(self.injector.announce(), file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ checkpoints

    def rank_state(self, snapshot: Optional[HostSnapshot] = None) -> dict:
        """What this rank owns: its optimizer shard (master weights, moments, partition map,
        loss scaler), its RNG streams, and the loop position. At ZeRO stage 0 the optimizer
        state is replicated over dp x cp, so only its rank 0 writes it. A private host copy: with
        checkpoint.async_save, in the reused `snapshot` tensors."""
        return {"optimizer": self.optimizer.state_dict(snapshot) if self.optimizer.owns_state else None,
                "rng": encode_rng(get_rng_states(self.tracker)),
                "iteration": self.iteration, "consumed_samples": self.consumed_samples,
                "skipped_iters": self.skipped_iters, "lr_schedule": self.schedule.state_dict(),
                "moe_expert_bias": self.moe.state_dict(),
                "data_state": self.train_ds.state_dict() if isinstance(self.train_ds, StreamDataset) else None}

    def full_parameters(self, trainable_only: bool = False) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        """Collective: this rank's parameters, each value full over DP (the 16-bit export, adapters)."""
        return self.optimizer.sharded.full_parameters(trainable_only)

    def check_saveable(self, iteration: int) -> None:
        """Every save's guard: a checkpoint of inf/NaN weights is refused, and replicas must agree
        (else ReplicaMismatch stops the run). Non-finite weights first: their cause is named
        plainly, and they would make the replicas differ too."""
        if not self.optimizer.all_finite():  # every rank agrees: none writes, all stop
            raise TrainingError(f"refusing to save iteration {iteration}: the weights hold inf/NaN; the last "
                                f"saved checkpoint is intact; lower optim.lr or enable optim.clip_grad and resume")
        self.replicas.check(iteration)

    def load_checkpoint(self, load_dir: str, iteration: int) -> None:
        """Resume from `load_dir` (a save directory, iter_ directory or universal checkpoint;
        another layout is resharded: checkpoint/resume.py). A save directory without a
        checkpoint yet is a fresh start. On a bad checkpoint every rank fails alike."""
        if starting_point(load_dir, iteration) != RESUME:
            if self.grid.rank == 0:
                print(f"no checkpoint in {load_dir} yet: starting from scratch", flush=True)
            return
        ckpt, state = resume_state(load_dir, iteration, self.cfg, self.grid, self.optimizer.state_dict)
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration, self.consumed_samples = state["iteration"], state["consumed_samples"]
        self.skipped_iters = state["skipped_iters"]
        self.moe.load_state_dict(state.get("moe_expert_bias"))
        if isinstance(self.train_ds, StreamDataset):
            load_stream_state(self.train_ds, state.get("data_state"), self.cfg.checkpoint.load_data_state,
                              self.consumed_samples, ckpt)
        # A checkpoint from before the schedule was saved advanced it on every iteration.
        saved_schedule = state.get("lr_schedule") or {**self.schedule.state_dict(), "steps": self.iteration}
        schedule_change = self.schedule.resume(saved_schedule, self.cfg.optim.override_schedule)
        if "rng" in state:
            set_rng_states(state["rng"], self.tracker)
        else:  # RNG streams do not map across layouts: reseed them from (seed, iteration)
            seed_everything(self.cfg.train.seed + self.iteration, self.grid.pp_rank, self.grid.tp_rank,
                            self.grid.device, self.tracker, self.grid.cp_rank)
        if self.grid.rank == 0:
            print(resume_line(ckpt, self.iteration, self.cfg, "rng" in state), flush=True)
            if schedule_change:
                print(schedule_change, flush=True)

    # ------------------------------------------------------------------ data

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per DP rank of a full global batch (fewer during a batch-size ramp-up)."""
        t = self.cfg.train
        return t.global_batch_size // (t.micro_batch_size * self.grid.dp)

    def microbatches(self, dataset, first_sample: int, batch: Optional[int] = None) -> list[Microbatch]:
        """This DP rank's micro-batches of the global batch of `batch` samples (default
        train.global_batch_size) starting at `first_sample`."""
        t, g = self.cfg.train, self.grid
        out = []
        count = self.num_microbatches if batch is None else batch // (t.micro_batch_size * g.dp)
        if isinstance(dataset, StreamDataset):  # the whole global batch, on every rank: the same stream position
            dataset.fetch(first_sample, first_sample + count * t.micro_batch_size * g.dp)
        for j in range(count):
            base = first_sample + j * t.micro_batch_size * g.dp + g.dp_rank * t.micro_batch_size
            inputs, labels = inputs_and_labels([dataset[(base + k) % len(dataset)] for k in range(t.micro_batch_size)])
            if self.eod_masked is not None:
                labels[inputs == self.eod_masked] = IGNORE_INDEX
            # Context parallelism: this cp rank's zig-zag positions of the same samples.
            inputs, labels = (shard_sequence(a, g.cp_rank, g.cp) for a in (inputs, labels))
            out.append((_to_device(inputs, g.device), _to_device(labels, g.device)))
        return out

    def counted_tokens(self, batches: list[Microbatch]) -> torch.Tensor:
        """Labels that count in the loss in the whole global batch: all micro-batches of all DP
        ranks, each context-parallel rank its chunks (every pipeline stage holds the labels, so
        every stage can count). The loss is normalised once, by this number, so every layout
        computes the same gradient. It stays on the device: the losses divide by it there, and
        nothing waits for it."""
        count = torch.zeros((), dtype=torch.int64, device=self.grid.device)
        for _, labels in batches:
            count += (labels >= 0).sum()
        comm.all_reduce(count, self.grid.dp_cp_group)
        return count.clamp(min=1)  # a batch of prompts alone: loss 0, not 0 / 0

    # ------------------------------------------------------------------ steps

    def run_schedule(self, batches: list[Microbatch], forward_only: bool) -> Optional[torch.Tensor]:
        """Forward (and backward) of this DP rank's micro-batches; this rank's loss share on
        the last pipeline stage, None elsewhere."""
        # Every DP rank holds as many micro-batches (of the same size) of the global batch.
        samples = len(batches) * self.cfg.train.micro_batch_size * self.grid.dp
        num_tokens: int | torch.Tensor = samples * self.cfg.model.seq_length
        if self.loss_masked:
            num_tokens = self.counted_tokens(batches)
        timers = self.timers if self.timers is not None and not forward_only else untimed
        if self.grid.pp == 1:
            return forward_backward_no_pipelining(self.chunks[0], batches, num_tokens, self.optimizer, forward_only,
                                                  timers)
        stats: dict = {}
        loss = forward_backward_pipelining(self.chunks, batches, num_tokens, self.grid, self.cfg.parallel.schedule,
                                           self.optimizer.compute_dtype, self.optimizer, forward_only, stats, timers)
        if isinstance(timers, PhaseTimers):
            timers.add("comm_wait", stats["wait_s"])  # blocked on pipeline neighbours
        if not forward_only:
            self.stragglers.discount("forward_backward", stats["wait_s"])
        return loss

    def train_step(self) -> dict:
        batch = rampup_batch(self.cfg.train, self.grid.dp, self.consumed_samples)  # global_batch_size without ramp-up
        lr = self.schedule.current(batch)
        decoupled = self.schedule.decoupled(self.cfg.optim)  # the embedding and output layer's own curve
        decoupled_lr = decoupled.current(batch) if decoupled is not None else None
        for c in self.chunks:
            c.train()
        with self._phase("data_wait"):
            batches = self.microbatches(self.train_ds, self.consumed_samples, batch)
        saved = self.rerun.save(self.tracker, self.optimizer.scaler)  # None under train.rerun_on none
        run = self.execute(batches, lr, decoupled_lr)
        if run.fired and saved is not None:  # every rank alike: the verdict comes from world-wide sums
            self.moe.discard()
            self.rerun.restore(saved, self.tracker, self.optimizer.scaler)
            run = self._judge(run, self.execute(batches, lr, decoupled_lr), batch)
        result = run.result
        skipped = result is None or result.skipped
        if not skipped:  # a skipped step leaves the schedule where it was (Megatron)
            self.schedule.step(batch)
            self.rerun.accepted(run.loss)
        self.iteration += 1
        self.consumed_samples += batch
        # The global loss came with the step's sums; it is reported where the loss is computed.
        scaler = self.optimizer.scaler
        out = {"loss": run.loss if run.own_loss is not None else None, "lr": lr,
               "grad_norm": result.grad_norm if result is not None else math.nan,
               "loss_scale": result.loss_scale if result is not None else scaler.scale if scaler is not None else None,
               "batch_size": batch, **self.moe.figures(len(batches))}
        self._count_skip(skipped, out, "the data (rerun)" if run.fired else None)
        return out

    def execute(self, batches: list[Microbatch], lr: float, decoupled_lr: Optional[float]) -> Execution:
        """One execution of an iteration: forward and backward, then the step unless a loss spike
        (train.rerun_on spike) stops it before; the world's verdict on it (train/rerun.py)."""
        self.optimizer.zero_grad()
        scaler = self.optimizer.scaler
        moe.scale_losses(self.chunks, len(batches), self.grid, scaler.scale if scaler is not None else None)
        injected = self.injector.loss(self.iteration + 1) if self.injector is not None else contextlib.nullcontext()
        with self.stragglers.phase("forward_backward"), injected:
            tic = time.perf_counter()
            loss = self.run_schedule(batches, forward_only=False)
            if self.injector is not None:
                self.injector.slow(self.iteration + 1, time.perf_counter() - tic)
        with self._phase("comm_wait"):  # the DP reductions still in flight after the last backward
            self.optimizer.finish_grad_sync()
        mine = StepSignals.of_rank(self.stop.code(), self.checkpoints.votes())
        spike = self.rerun.spike(loss)
        if spike is not None:  # no step: the signals travel on their own
            self.signals = mine.summed(self.grid["world"], self.grid.device)
            return Execution(spike, None, loss, self.rerun.spike_loss)
        with self._phase("optimizer"), self.stragglers.phase("optimizer"):
            # the iteration's one device->host read: norm, loss, step signals
            result = self.optimizer.step(lr, loss, mine.pack(), decoupled_lr)
        self.signals = StepSignals.unpack(result.extra)
        return Execution(self.rerun.non_finite(result), result, loss, result.loss)

    def _judge(self, first: Execution, second: Execution, batch: int) -> Execution:
        """After a rerun: fired again, the data is to blame (the batch is skipped, no weight changed
        in either execution); clean, the ranks whose loss differed are (the rerun's step stands)."""
        ranks = self.rerun.ranks_that_differ(first, second)
        it = self.iteration + 1
        if second.fired:
            samples = describe_samples(self.train_ds, self.consumed_samples, batch)
            line = (f"iteration {it}: {first.fired}, and {second.fired} again when rerun from the same state and "
                    f"batch: the data is the cause; batch skipped: {samples_line(samples)}")
            record = {"iteration": it, "event": "skipped_batch", "why": second.fired, "samples": samples}
        else:
            who = (f"rank(s) {', '.join(map(str, ranks))} (their loss differed)" if ranks else
                   "a rank whose loss agreed (the gradients differed; after their reduction every rank holds them)")
            line = (f"iteration {it}: {first.fired} on the first execution, loss {second.loss:.6g} when rerun from the "
                    f"same state and batch: a transient fault on {who}; training goes on with the rerun's result")
            record = {"iteration": it, "event": "transient_fault", "why": first.fired, "ranks": ranks}
        if self.is_logger:
            print(line, flush=True)
            self.fault_records.append(record)
        return second

    def _phase(self, name: str):
        return self.timers(name) if self.timers is not None else untimed(name)

    def _count_skip(self, skipped: bool, out: dict, why: Optional[str] = None) -> None:
        """Report a skipped step; stop after train.max_skipped_steps in a row (every rank skipped
        the same steps, so every rank stops at the same one)."""
        self.skipped_iters += int(skipped)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if not skipped:
            return
        limit = self.cfg.train.max_skipped_steps
        if self.is_logger:
            why = why or ("fp16 overflow" if self.optimizer.scaler is not None else "non-finite gradient norm or loss")
            print(f"iteration {self.iteration}: step skipped ({why}: loss {out['loss']}, grad norm "
                  f"{out['grad_norm']}); {self.skipped_in_a_row} in a row, limit {limit}", flush=True)
        if self.skipped_in_a_row >= limit:
            raise TrainingError(f"{self.skipped_in_a_row} steps in a row skipped for inf/NaN (train.max_skipped_steps "
                                f"{limit}) at iteration {self.iteration}; no weights were changed by them; lower "
                                f"optim.lr, check the data, or resume from the last checkpoint")

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        for c in self.chunks:
            c.eval()
        total, n = 0.0, self.cfg.train.eval_iters
        for i in range(n):
            batches = self.microbatches(self.valid_ds, i * self.cfg.train.global_batch_size)
            loss = self.run_schedule(batches, forward_only=True)
            if loss is not None:  # the last stage: sum the per-rank shares over dp x cp
                loss = loss.clone()
                comm.all_reduce(loss, self.grid.dp_cp_group)
                total += float(loss)
        return total / n if self.is_logger else None

    def run(self) -> list[dict]:
        """Train until train.iters (or an agreed early stop), logging, evaluating and saving on schedule."""
        iters = self.cfg.train.iters
        if self.iteration >= iters:  # a finished run started again: say so, touch no metrics file
            if self.grid.rank == 0:
                past = "" if self.iteration == iters else \
                    f" (the checkpoint is at iteration {self.iteration}; raise --train.iters to train on)"
                print(f"already at train.iters {iters}; nothing to train{past}", flush=True)
            return []
        for line in self.metrics.open(self.iteration, self.consumed_samples):
            print(line, flush=True)
        try:
            return self._train_loop()
        finally:  # the sinks are flushed and closed however the loop ends (a stop request, an error)
            self.profiler.close()
            self.metrics.close()
            if isinstance(self.train_ds, StreamDataset):
                self.train_ds.close()

    def _train_loop(self) -> list[dict]:
        t = self.cfg.train
        records, step_seconds, steps, tokens = [], 0.0, 0, 0  # throughput counts training steps only
        while self.iteration < t.iters:
            tic = time.perf_counter()
            with self.profiler.step(self.iteration):
                out = self.train_step()
            checked = self._after_step()  # timed with the step: the checks' cost shows in the throughput
            step_seconds, steps = step_seconds + time.perf_counter() - tic, steps + 1
            tokens += out["batch_size"] * self.cfg.model.seq_length  # smaller during a batch-size ramp-up
            if self.iteration % t.log_interval == 0 or self.iteration == t.iters or self.eval_due():
                records.append(self.log(out, tokens / step_seconds, steps, step_seconds / steps, checked))
                step_seconds, steps, tokens = 0.0, 0, 0
            elif checked and self.is_logger:  # a straggler check between log lines: a record of its own
                self.metrics.write({"iteration": self.iteration, **checked})
            for record in self.fault_records:  # reruns: one record each, on the logging rank
                self.metrics.write(record)
            self.fault_records.clear()
            stop = self.signals.stop_code()
            saved = self.checkpoints.after_step(self.iteration, self.signals.write, bool(stop))
            if stop:
                if self.is_logger:
                    print(f"{self.stop.reason(stop)}: {'saved and ' if saved else ''}stopped cleanly at iteration "
                          f"{self.iteration}", flush=True)
                remember_clean_end(STOPPED)
                break
        self.checkpoints.close()
        return records

    def _after_step(self) -> dict:
        """The silent-fault checks at the end of an iteration (collectives, every rank alike): an
        injected bit flip, the replica digests when due, the straggler times when due. Returns the
        fields they add to the JSONL record."""
        if self.injector is not None:
            flipped = self.injector.after_step(self.iteration)
            if flipped:
                print(f"FAULT INJECTION: iteration {self.iteration}: {flipped}", file=sys.stderr, flush=True)
        if self.replicas.due(self.iteration):
            self.replicas.check(self.iteration)
        timed = self.stragglers.after_step(self.iteration)
        if timed is None:
            return {}
        fields, lines = timed
        if self.is_logger:
            for line in lines:
                print(line, flush=True)
        return fields

    def eval_due(self) -> bool:
        """Validation runs every train.eval_interval iterations and after the last one,
        whatever train.log_interval is (an evaluation iteration is always logged)."""
        t = self.cfg.train
        return bool(t.eval_interval) and self.valid_ds is not None and (
            self.iteration % t.eval_interval == 0 or self.iteration == t.iters)

    def log(self, out: dict, tokens_per_sec: float, steps: int = 1, step_seconds: float = 0.0,
            extra: Optional[dict] = None) -> dict:
        """Record one logged iteration (with validation when due) and print/write it; `steps`
        training steps since the last record, `step_seconds` their mean time."""
        rec = {**self.record(out, tokens_per_sec, steps, step_seconds), **(extra or {})}
        if self.eval_due():
            val = self.evaluate()
            if self.is_logger:
                assert val is not None  # the logger is on the last stage
                rec["val_loss"], rec["val_ppl"] = val, math.exp(min(val, 50.0))
        if self.is_logger:
            print(format_line(rec, self.cfg.train.iters), flush=True)
            if self.supply_due and isinstance(self.train_ds, StreamDataset):
                line = supply_line(self.train_ds.supply_tokens_per_s(), tokens_per_sec, self.train_ds.workers)
                if line:
                    print(line, flush=True)
                self.supply_due = False
            # At the first log line: the planner's prediction beside the measured figures (on CPUs
            # RSS is no GPU memory).
            if self.plan is not None and self.grid.device.type == "cuda":
                print(plan_check(self.plan, self.grid.pp_rank, rec["peak_mem_gib"], rec["tokens_per_sec"], True),
                      flush=True)
            self.plan = None
            self.metrics.write(rec)
        self.grid.reset_counters()  # bytes per iteration count training steps only (logging.timers)
        return rec

    def record(self, out: dict, tokens_per_sec: float, steps: int = 1, step_seconds: float = 0.0) -> dict:
        tflops = self.flops_per_token * tokens_per_sec / self.grid.world_size / 1e12
        rec = {"iteration": self.iteration, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
               "tokens_per_sec": tokens_per_sec, "tflops_per_device": tflops,
               "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
               "peak_mem_gib": peak_memory_gib(), "consumed_samples": self.consumed_samples,
               "batch_size": out["batch_size"],  # the global batch of this step (smaller during a ramp-up)
               "iteration_time_s": step_seconds,
               "skipped_iters": self.skipped_iters}
        if out.get("loss_scale") is not None:
            rec["loss_scale"] = out["loss_scale"]
        if isinstance(self.train_ds, StreamDataset):  # what each source gave so far (the mixture's realised share)
            rec["stream_tokens"] = self.train_ds.tokens_per_source()
            skipped = self.train_ds.skipped_documents()
            if skipped:  # not UTF-8: skipped, not fatal
                rec["stream_skipped_docs"] = skipped
        rec.update({k: v for k, v in out.items() if k.startswith("moe_") and (k != "moe_dropped" or v)})
        if self.timers is not None:
            rec.update(self.timers.take(steps))
            rec.update(bytes_per_iteration(self.grid.bytes_moved(), steps))
        return rec


def _to_device(batch, device: torch.device) -> torch.Tensor:
    """A numpy micro-batch on `device`: on a GPU through pinned memory, without blocking (the
    copy queues behind the work already issued instead of waiting for it)."""
    t = torch.from_numpy(batch)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_datasets(cfg: Config, grid: ProcessGrid):
    """(train, valid) datasets: the mock stream, or indexed data with cached sample indices."""
    m, t = cfg.model, cfg.train
    assert isinstance(m.vocab_size, int)
    needed = (t.iters + 1) * t.global_batch_size
    eval_needed = max(1, t.eval_iters) * t.global_batch_size
    if cfg.data.mock:
        return (MockGPTDataset(needed, m.seq_length, m.vocab_size, t.seed),
                MockGPTDataset(eval_needed, m.seq_length, m.vocab_size, t.seed + 1))
    if cfg.data.stream:  # the tokenizer fits model.vocab_size: checked at resolution (config/resolve.py)
        # Every rank reads the same sources (the same error, if any, on every rank at once).
        return stream_datasets(cfg, lambda line: print(line, flush=True) if grid.rank == 0 else None)
    check_compatibility(cfg.data.prefix, cfg.data.tokenizer, m.vocab_size)
    assert cfg.data.prefix is not None
    build = functools.partial(build_train_valid_test_datasets, [str(p) for p in cfg.data.prefix], cfg.data.split,
                              m.seq_length, t.seed, (needed, eval_needed, eval_needed), cfg.data.cache_dir,
                              vocab_size=m.vocab_size, pack_examples=cfg.data.pack_examples)
    # One rank builds and caches the sample indices; the others load them. A failure on the
    # builder reaches every rank (instead of leaving them waiting at a barrier).
    built = comm.agreed(lambda: build(is_builder=True) if grid.rank == 0 else None, grid["world"], (DataError,),
                        lambda rank, message: DataError(message))
    train, valid, _ = built if grid.rank == 0 else build(is_builder=False)
    return train, valid


def load_stream_state(ds: StreamDataset, saved: Optional[dict], load: bool, consumed_samples: int, ckpt: str) -> None:
    """Continue the checkpoint's data stream, or (checkpoint.load_data_state false) start it
    anew at the checkpoint's sample count. Another stream's state is refused (stream.py)."""
    if not load:
        ds.load_state_dict(None, consumed_samples)
        return
    if saved is None:
        raise DataError(f"checkpoint '{ckpt}' holds no data.stream state (it was trained on other data); start "
                        f"the stream anew with --checkpoint.load_data_state false")
    ds.load_state_dict(saved)
