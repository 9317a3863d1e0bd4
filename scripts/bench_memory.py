"""Peak memory per rank, measured, beside the layout planner's itemized prediction.

    python scripts/bench_memory.py [--dp 1,2,4] [--stage 0,1,2,3] [--tp 1 --pp 1] [--iters 2]
        [--offload-optimizer cpu] [--layers 12 --hidden 768 --heads 12 --seq 128 --vocab 50257]
        [--deepspeed]

Every layout (each --dp x --stage) trains GPT-2 (124M by default, fp32, micro-batch 1, mock
data) for a few iterations in fresh processes (gloo on CPU, NCCL on GPUs), and each rank reports
  measured   peak resident memory (VmHWM) on CPU; max_memory_allocated and reserved on CUDA,
             while building the model and optimizer, and while training;
  predicted  the runtime baseline, measured once per process after torch, megazero and the
             process group are loaded, plus the planner's items (megazero/plan/planner.py's
             `predict`, from megazero/plan/formulas.py): parameters, fp32 gradient buffers,
             master weights, Adam moments, saved activations, gathered units (stage 3),
             gradients in flight, communication buffers, logits.
The ratio measured / predicted is over the training peak. --deepspeed adds a peer row per dp:
Hugging Face GPT-2 at the same shapes under DeepSpeed ZeRO-3 (fp32, torch AdamW), same run.
This is a measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

import torch
import torch.distributed as dist

from megazero.harness.configs import add_shape_flags, make_config, model_section
from megazero.harness.spawn import run_ranks

MiB = 2 ** 20
ITEMS = ("runtime", "params", "grads", "master", "moments", "activations", "gathered_units", "grads_in_flight",
         "comm_buffers", "logits")


# ---------------------------------------------------------------------------- measuring


def resident() -> dict[str, int]:
    """This process's resident memory now (VmRSS) and its high-water mark (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def reset_peak(device: torch.device) -> None:
    """Start a new high-water mark: the kernel's (clear_refs 5) or CUDA's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak(device: torch.device) -> dict[str, int]:
    """The peak since reset_peak: resident memory on CPU; allocated and reserved on CUDA."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.max_memory_allocated(device), "reserved": torch.cuda.max_memory_reserved(device)}
    return {"resident": resident()["VmHWM"]}


def baseline(device: torch.device) -> int:
    """The runtime's own memory before the model: resident on CPU; the CUDA context's share of
    the device (driver-reported use minus what torch allocated) on CUDA."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free - torch.cuda.memory_allocated(device)
    return resident()["VmRSS"]


# ---------------------------------------------------------------------------- megazero


def bench_config(opts: argparse.Namespace, world: int):
    return make_config(base={
        "model": {**model_section(opts), "dropout": 0.1},
        "parallel": {"tp": opts.tp, "pp": opts.pp},
        "zero": {"stage": opts.stage_now, "offload_optimizer": opts.offload_optimizer,
                 "offload_param": opts.offload_param, "nvme_path": opts.nvme_path},
        "train": {"iters": opts.iters, "micro_batch_size": opts.micro,
                  "global_batch_size": opts.micro * world // (opts.tp * opts.pp), "precision": opts.precision},
        "data": {"mock": True},
    }, world=world)


def predicted_items(cfg, grid, runtime: int) -> dict[str, int]:
    """The planner's prediction for this rank, item by item, with the measured runtime."""
    from megazero.plan.planner import Cluster, predict, run_layout
    t = cfg.train
    layout = run_layout(cfg, grid.dp, grid.cp)
    rank = predict(cfg, layout, Cluster(grid.world_size, grid.world_size, 1.0, None), ranks=[grid.pp_rank],
                   device=grid.device.type).rank(grid.pp_rank)
    # fp32 master weights are a third of 16-bit training's 12 optimizer bytes (formulas.STATE_BYTES);
    # an fp32 run steps its parameters themselves.
    master = rank.states["optimizer"] // 3 if t.precision != "fp32" else 0
    return {"runtime": runtime, "params": rank.states["params"], "grads": rank.states["grads"], "master": master,
            "moments": rank.states["optimizer"] - master, "activations": rank.activations, **rank.items}


def megazero_rank(opts: argparse.Namespace) -> dict:
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    runtime = baseline(device)
    cfg = bench_config(opts, dist.get_world_size())
    reset_peak(device)
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's start-up summary
        tr = Trainer(cfg, ProcessGrid.create(opts.tp, opts.pp))
    built = peak(device)
    reset_peak(device)
    for _ in range(opts.iters):
        tr.train_step()
    return {"built": built, "trained": peak(device), "items": predicted_items(cfg, tr.grid, runtime),
            "pp_rank": tr.grid.pp_rank}


# ---------------------------------------------------------------------------- DeepSpeed ZeRO-3 peer


def deepspeed_rank(opts: argparse.Namespace) -> dict:
    """Hugging Face GPT-2 at the same shapes under DeepSpeed ZeRO-3, fp32, torch's AdamW."""
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    runtime = baseline(device)
    reset_peak(device)
    config = {"train_micro_batch_size_per_gpu": opts.micro, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = GPT2LMHeadModel(GPT2Config(n_layer=opts.layers, n_embd=opts.hidden, n_head=opts.heads,
                                           n_positions=opts.seq, vocab_size=opts.vocab))
    adam = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=adam, config=config)
    built = peak(device)
    reset_peak(device)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(opts.iters):
        ids = torch.randint(0, opts.vocab, (opts.micro, opts.seq), generator=gen).to(device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return {"built": built, "trained": peak(device), "runtime": runtime}


# ---------------------------------------------------------------------------- launching


def launch(fn, opts: argparse.Namespace, world: int) -> list[dict]:
    """fn(opts) on `world` fresh processes (so each peak is its own), NCCL on GPUs and gloo on
    CPU, with megazero's trainer loaded before fn takes the runtime baseline; results in rank order."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return run_ranks(_loaded, world, fn, opts, timeout=opts.timeout, backend=backend,
                     env={"LOCAL_WORLD_SIZE": str(world)}, ignore=(Warning,))  # torch's and DeepSpeed's notices


def _loaded(fn, opts: argparse.Namespace) -> dict:
    import megazero.train.trainer  # noqa: F401  (loaded before the baseline is taken)
    return fn(opts)


# ---------------------------------------------------------------------------- tables


def measured(out: dict, key: str) -> int:
    """The peak the ratio is taken on: resident memory on CPU, allocated on CUDA."""
    return out[key].get("resident", out[key].get("allocated", 0))


def print_rank_rows(label: str, outs: list[dict]) -> None:
    for rank, out in enumerate(outs):
        items = out["items"]
        total = sum(items.values())
        cells = " | ".join(f"{items[k] / MiB:.0f}" for k in ITEMS)
        extra = f" (reserved {out['trained']['reserved'] / MiB:.0f})" if "reserved" in out["trained"] else ""
        print(f"| {label} | {rank} | {measured(out, 'built') / MiB:.0f} | {measured(out, 'trained') / MiB:.0f}{extra} "
              f"| {total / MiB:.0f} | {measured(out, 'trained') / total:.2f} | {cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", default="2", help="comma-separated data-parallel degrees (default 2)")
    ap.add_argument("--stage", default="3", help="comma-separated ZeRO stages (default 3)")
    ap.add_argument("--tp", type=int, default=1, help="parallel.tp of each layout (default: %(default)s)")
    ap.add_argument("--pp", type=int, default=1, help="parallel.pp of each layout (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=2, help="training iterations per layout (the first is included) (default: %(default)s)")
    add_shape_flags(ap, layers=12, hidden=768, heads=12, seq=128, vocab=50257, micro=1)
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="train.precision (default: %(default)s)")
    ap.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none", help="zero.offload_optimizer (default: %(default)s)")
    ap.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none", help="zero.offload_param (default: %(default)s)")
    ap.add_argument("--nvme-path", default="", help="zero.nvme_path for nvme offload (default: %(default)s)")
    ap.add_argument("--deepspeed", action="store_true", help="add DeepSpeed ZeRO-3 rows (HF GPT-2, same shapes)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for a layout's ranks (default: %(default)s)")
    opts = ap.parse_args()
    dps, stages = [int(d) for d in opts.dp.split(",")], [int(s) for s in opts.stage.split(",")]
    unit = "peak allocated" if torch.cuda.is_available() else "peak RSS"
    print(f"GPT-2 {opts.layers} layers, hidden {opts.hidden}, {opts.heads} heads, seq {opts.seq}, vocab {opts.vocab}; "
          f"micro-batch {opts.micro}, {opts.precision}, tp {opts.tp}, pp {opts.pp}, offload optimizer "
          f"{opts.offload_optimizer} / param {opts.offload_param}; {opts.iters} iterations; MiB per rank\n")
    print(f"| layout | rank | build {unit} | train {unit} | predicted | measured / predicted | "
          + " | ".join(ITEMS) + " |")
    print("|---|---:|" + "---:|" * (4 + len(ITEMS)))
    for dp in dps:
        world = dp * opts.tp * opts.pp
        for stage in stages:
            opts.stage_now = stage
            print_rank_rows(f"dp {dp} ZeRO-{stage}", launch(megazero_rank, opts, world))
            sys.stdout.flush()
        if opts.deepspeed:
            for rank, out in enumerate(launch(deepspeed_rank, opts, world)):
                print(f"| dp {dp} DeepSpeed ZeRO-3 | {rank} | {measured(out, 'built') / MiB:.0f} | "
                      f"{measured(out, 'trained') / MiB:.0f} | - | - | {out['runtime'] / MiB:.0f} |" + " - |" * 9)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
