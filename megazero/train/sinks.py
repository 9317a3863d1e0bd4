"""Where a logged iteration's record goes: the JSONL file, TensorBoard, Weights & Biases.

Each sink opens at the iteration the run starts from (0, or the checkpoint it resumed) and
lets nothing an earlier attempt logged past that iteration stand beside the new records, so
that after a restart each iteration is there once:
- JSONL: the records past it are dropped, the file rewritten atomically, before appending.
- TensorBoard: the writers' purge_step hides the older events from that step on.
- W&B: one run id per save directory, resumed (online); W&B ignores a step the run already
  holds, so an iteration logged before the restart keeps its first values (equal ones: a
  resume at the same layout is bitwise, only the timings differ).

That is for the run's own earlier attempts. A JSONL file or TensorBoard directory written by
another run is never cut or appended to: each records its run's identity beside it (the run
id its save directory keeps, the one its W&B run has too, and when it started), and a run that
starts afresh (it does not resume a checkpoint of its own save directory) takes a new run id and
moves another run's outputs aside, to the same name with that run's id or start time
(`set_aside_other_runs`), so that running a command twice just works and nothing is lost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import uuid
from typing import Optional, Protocol

from megazero.atomic import atomic_write, rename_aside, write_text
from megazero.config.schema import Config


class Sink(Protocol):
    def write(self, rec: dict) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- which run a metrics file is

RUN_FILE = "megazero_run.json"
"""The identity of the run that writes a TensorBoard directory, inside it; a JSONL file's is FILE.run.json."""


def metrics_outputs(cfg: Config) -> list[tuple[str, str, str]]:
    """(config key, path, its identity file) of each metrics output the run writes to a path."""
    lg, out = cfg.logging, []
    if lg.jsonl:
        out.append(("logging.jsonl", lg.jsonl, lg.jsonl + ".run.json"))
    if lg.tensorboard:
        out.append(("logging.tensorboard", lg.tensorboard, os.path.join(lg.tensorboard, RUN_FILE)))
    return out


def run_identity(cfg: Config, run_id: Optional[str]) -> dict:
    """What a metrics output records of its run: the run id (None without a save directory:
    such a run cannot be resumed, each start is a run of its own), where it saves, its model,
    when it started (what names its outputs once moved aside when it has no id)."""
    model = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True)
    return {"run_id": run_id, "save": os.path.abspath(cfg.checkpoint.save) if cfg.checkpoint.save else None,
            "model": hashlib.sha256(model.encode()).hexdigest()[:16], "started": time.strftime("%Y%m%d-%H%M%S")}


def continues_its_run(cfg: Config) -> bool:
    """Whether the run resumes a checkpoint of its own save directory: the same run again (a
    resume, the scripts' re-run), which keeps its run id and appends to its metrics."""
    save, load = cfg.checkpoint.save, cfg.checkpoint.load
    return bool(save and load and os.path.abspath(load) == os.path.abspath(save)
                and os.path.isfile(os.path.join(save, "latest")))


def set_aside_other_runs(cfg: Config) -> list[str]:
    """At the first start of a run (not a torchrun restart: that is the run that claimed its
    outputs), on the logging rank alone, the one that writes them: a run that starts afresh
    takes a new run id, and each metrics output another run wrote is moved aside, to the same
    name with that run's id or start time. An output without an identity (written before
    megazero recorded one) is taken as this run's. Returns one line per output moved."""
    if cfg.checkpoint.save and saved_run_id(cfg.checkpoint.save) and not continues_its_run(cfg):
        # A fresh start in a save directory another run used: a W&B run of its own, not that one's.
        write_text(os.path.join(cfg.checkpoint.save, WANDB_ID_FILE), new_run_id())
    mine = saved_run_id(cfg.checkpoint.save)
    lines = []
    for key, path, identity in metrics_outputs(cfg):
        if not os.path.exists(path) or not os.path.isfile(identity):
            continue
        with open(identity) as f:
            owner = json.load(f)
        if owner.get("run_id") is not None and owner.get("run_id") == mine:
            continue  # this run's own: a resume appends (and drops what it logs again)
        aside = _aside_name(path, owner.get("run_id") or owner.get("started") or
                            time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path))))
        # The records first, their identity second: a crash between leaves the records aside and
        # no file under the old name, never records without an identity (taken as this run's).
        rename_aside(path, aside)
        if os.path.isfile(identity):  # a JSONL's sits beside it; a TensorBoard directory took its own along
            rename_aside(identity, aside + ".run.json")
        lines.append(f"{key}: {path} held the metrics of another run; moved them to {aside}")
    return lines


def _aside_name(path: str, tag: str) -> str:
    """PATH with `tag` before its extension (metrics.jsonl -> metrics.TAG.jsonl; tb -> tb.TAG),
    numbered when that name is taken (an output of the same run moved aside before)."""
    stem, ext = os.path.splitext(path.rstrip(os.sep)) if os.path.isfile(path) else (path.rstrip(os.sep), "")
    name, n = f"{stem}.{tag}{ext}", 1
    while os.path.exists(name):
        n += 1
        name = f"{stem}.{tag}-{n}{ext}"
    return name


def claim(cfg: Config) -> None:
    """Record this run as the writer of its metrics outputs (on the logging rank, as they open)."""
    mine = run_identity(cfg, wandb_run_id(cfg.checkpoint.save))
    for *_, identity in metrics_outputs(cfg):
        write_text(identity, json.dumps(mine) + "\n")


# ----------------------------------------------------------------------------- JSONL


def drop_records_after(path: str, iteration: int) -> int:
    """Keep the records of iterations <= `iteration` (and drop a line a killed writer left
    unfinished); rewrite the file atomically when anything goes. Returns the lines dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if _iteration_of(line) <= iteration]
    if len(kept) < len(lines):
        with atomic_write(path, "w", encoding="utf-8") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
    return len(lines) - len(kept)


def _iteration_of(line: str) -> float:
    """The record's iteration; infinity for a line that is no record (dropped with the rest)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return math.inf
    iteration = rec.get("iteration") if isinstance(rec, dict) else None
    return iteration if isinstance(iteration, int) else math.inf


class JsonlSink:
    """One JSON object per line, appended and flushed per record."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, rec: dict) -> None:
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


# ----------------------------------------------------------------------------- TensorBoard

# (tag, JSONL field, factor to the tag's unit, also "TAG vs samples"). The tags are
# Megatron's (training_log, evaluate_and_print_results) where it has one: 'throughput' is its
# TFLOP/s per GPU, 'iteration-time' its seconds per iteration (both with --log-timers-to-
# tensorboard), 'mem-max-allocated-bytes' its peak allocated memory (peak RSS on a CPU,
# as in the JSONL). tokens-per-sec, mfu and skipped-iterations are megazero's.
TENSORBOARD_SCALARS = (
    ("lm loss", "loss", 1, True),
    ("learning-rate", "lr", 1, True),
    ("batch-size", "batch_size", 1, True),
    ("loss-scale", "loss_scale", 1, True),
    ("grad-norm", "grad_norm", 1, True),
    ("lm loss validation", "val_loss", 1, True),
    ("lm loss validation ppl", "val_ppl", 1, True),
    ("iteration-time", "iteration_time_s", 1, False),
    ("throughput", "tflops_per_device", 1, False),
    ("tokens-per-sec", "tokens_per_sec", 1, False),
    ("mfu", "mfu", 1, False),
    ("mem-max-allocated-bytes", "peak_mem_gib", 2**30, False),
    ("skipped-iterations", "skipped_iters", 1, False),
    # Mixtures of experts (Megatron's names for the two losses; present only with experts)
    ("load_balancing_loss", "moe_aux_loss", 1, True),
    ("z_loss", "moe_z_loss", 1, True),
    ("moe-imbalance", "moe_imbalance", 1, False),
    ("moe-dropped-tokens", "moe_dropped", 1, False),
)
SAMPLES_RUN = "vs_samples"  # the "vs samples" scalars: a run of their own, purged on their own step axis


PER_LAYER = {"moe_aux_loss_layers": "load_balancing_loss", "moe_z_loss_layers": "z_loss"}
"""logging.moe_per_layer's records (by layer index) and their tags, TAG/layer_INDEX, by iteration."""


PER_RANK = {"rank_compute_s": "compute-time"}
"""The straggler watch's records (phase -> seconds by rank) and their tag, TAG/PHASE/rank_RANK, by iteration."""


def tensorboard_scalars(rec: dict) -> list[tuple[str, float, bool]]:
    """(tag, value, also vs samples) for every scalar of `rec` TensorBoard gets."""
    scalars = [(tag, rec[field] * unit, vs_samples) for tag, field, unit, vs_samples in TENSORBOARD_SCALARS
               if rec.get(field) is not None]
    per_rank = [(f"{tag}/{phase}/rank_{r}", value, False) for field, tag in PER_RANK.items()
                for phase, values in (rec.get(field) or {}).items() for r, value in enumerate(values)]
    per_layer = [(f"{tag}/layer_{i}", value, False) for field, tag in PER_LAYER.items()
                 for i, value in (rec.get(field) or {}).items()]
    per_source = [(f"stream_tokens/{source}", tokens, True) for source, tokens in (rec.get("stream_tokens") or {}).items()]
    return scalars + per_rank + per_layer + per_source


class TensorBoardSink:
    """Scalars by iteration in DIR, and by consumed samples in DIR/vs_samples (Megatron writes
    both into one run; apart, each has its own purge step: a purge hides every event from its
    step on, whatever the tag, and sample counts are not iterations)."""

    def __init__(self, log_dir: str, iteration: int, consumed_samples: int):
        from torch.utils.tensorboard import SummaryWriter  # presence checked at start-up

        self.by_iteration = SummaryWriter(log_dir, purge_step=iteration + 1)
        self.by_samples = SummaryWriter(os.path.join(log_dir, SAMPLES_RUN), purge_step=consumed_samples + 1)

    def write(self, rec: dict) -> None:
        for tag, value, vs_samples in tensorboard_scalars(rec):
            self.by_iteration.add_scalar(tag, value, rec["iteration"])
            if vs_samples:
                self.by_samples.add_scalar(f"{tag} vs samples", value, rec["consumed_samples"])
        self.by_iteration.flush()  # flushed at every log interval, as the JSONL is
        self.by_samples.flush()

    def close(self) -> None:
        self.by_iteration.close()
        self.by_samples.close()


# ----------------------------------------------------------------------------- W&B

WANDB_ID_FILE = "wandb_run_id"


def saved_run_id(save_dir: Optional[str]) -> Optional[str]:
    """The run id `save_dir` keeps (see wandb_run_id), or None when it has none yet."""
    path = os.path.join(save_dir, WANDB_ID_FILE) if save_dir else ""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def wandb_run_id(save_dir: Optional[str]) -> Optional[str]:
    """The id of the run saving to `save_dir` (its W&B run id, and the owner its metrics
    outputs record), kept there so that a restart or a resume is the same run; None without
    a save directory (nothing to resume)."""
    if not save_dir:
        return None
    run_id = saved_run_id(save_dir)
    if not run_id:
        run_id = new_run_id()
        write_text(os.path.join(save_dir, WANDB_ID_FILE), run_id)
    return run_id


class WandbSink:
    """One W&B run per save directory, resumed on a restart when online (its steps are iterations)."""

    def __init__(self, cfg: Config):
        import wandb  # presence checked at start-up, before any process group exists

        mode = os.environ.setdefault("WANDB_MODE", "offline")  # no network here: sync later with `wandb sync`
        run_id = wandb_run_id(cfg.checkpoint.save)
        # Offline, W&B cannot resume (it would warn at every start): each attempt is an offline
        # run of its own under the same id.
        online = mode not in ("offline", "dryrun", "disabled")
        self.run = wandb.init(project=cfg.logging.wandb_project, config=cfg.to_dict(), id=run_id,
                              resume="allow" if run_id and online else None)

    def write(self, rec: dict) -> None:
        self.run.log({k: v for k, v in rec.items() if k != "iteration"}, step=rec["iteration"])

    def close(self) -> None:
        self.run.finish()
