"""What a run says about itself before it starts, and the planner's check at the first log.

Rank 0 prints a few lines before the full config dump: parameters (total and on this rank),
the layout, the batch, per split and per blend entry the documents, tokens and epochs the
run will see (with a warning when evaluation needs an empty split), and the layout
planner's prediction of memory per GPU and tokens/s. At the first log line the logging rank
prints that prediction beside what it measured, so drift is visible in every run.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np
import torch

from megazero.checkpoint.hf import hf_contents
from megazero.checkpoint.resume import HF, starting_point
from megazero.config.rules import warmup_length
from megazero.config.schema import Config, ModelConfig
from megazero.model.gpt import is_moe_layer
from megazero.model.lora import adapter_shapes
from megazero.parallel.grid import ProcessGrid
from megazero.plan import formulas as F
from megazero.plan.planner import Cluster, Prediction, predict, run_layout
from megazero.plan.ranks import rank_params
from megazero.train.batch_rampup import samples_after


def run_prediction(cfg: Config, grid: ProcessGrid, peak_flops: Optional[float]) -> Prediction:
    """The planner's prediction for this run's own layout on this machine (every pipeline rank)."""
    p = cfg.parallel
    layout = run_layout(cfg, grid.dp, grid.cp)
    memory = torch.cuda.get_device_properties(grid.device).total_memory / F.GiB if grid.device.type == "cuda" else 0.0
    # Bandwidths of the preset with this peak (H100's when none matches).
    gpu = next((g for g in F.GPUS.values() if peak_flops and g.peak_flops == peak_flops), F.GPUS["h100"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size))
    cluster = Cluster(grid.world_size, per_node, memory, peak_flops, gpu.intra_gbps, gpu.inter_gbps)
    return predict(cfg, layout, cluster, pp_layers=p.pp_layers, ranks=list(range(p.pp)), device=grid.device.type)


def startup_summary(cfg: Config, grid: ProcessGrid, rank_params_numel: int, datasets: tuple,
                    plan: Prediction, device_name: str) -> str:
    """The lines rank 0 prints before the config dump."""
    m, p, t, z = cfg.model, cfg.parallel, cfg.train, cfg.zero
    total = rank_params(m, 1, 1, 1, 0, False, z.bucket_size).param_numel
    accumulation = t.global_batch_size // (t.micro_batch_size * grid.dp)
    samples = samples_after(t, grid.dp, t.iters)  # fewer than iters x global batch during a ramp-up
    chunks = f" x vpp {p.vpp}" if p.vpp > 1 else ""
    cp = f" x cp {grid.cp} ({p.cp_impl})" if grid.cp > 1 else ""
    lines = [f"megazero: {family(m)} {total / 1e6:,.1f}M parameters ({architecture(m)}; "
             f"{rank_params_numel / 1e6:,.1f}M on rank 0); "
             f"world {grid.world_size} = tp {grid.tp}{cp} x pp {grid.pp}{chunks} x dp {grid.dp} ({grid.backend}), "
             f"ZeRO-{z.stage}, {t.precision}, recompute {t.recompute}" +
             (f", schedule {p.schedule}" if grid.pp > 1 else ""),
             f"batch: global {t.global_batch_size} = micro-batch {t.micro_batch_size} x accumulation {accumulation} "
             f"x dp {grid.dp}; {t.global_batch_size * m.seq_length:,} tokens/iteration, {t.iters:,} iterations = "
             f"{samples * m.seq_length:,} tokens"]
    if t.rampup_batch_size is not None:  # Megatron's --rampup-batch-size
        start, increment, ramp = t.rampup_batch_size
        lines.append(f"batch ramp-up: global batch {start} growing by {increment} up to {t.global_batch_size} over the "
                     f"first {ramp:,} samples; the LR schedule counts samples")
    f = cfg.finetune
    if f.lora_rank:
        trainable = sum(math.prod(s) for s in adapter_shapes(m, f).values())
        lines.append(f"LoRA: rank {f.lora_rank}, alpha {f.lora_alpha:g} on {', '.join(f.lora_targets)}: "
                     f"{trainable:,} trainable parameters ({100 * trainable / total:.2f}% of the model; the rest "
                     f"frozen; the memory plan below assumes every weight trains)")
    lines.append(optim_line(cfg))
    c = cfg.checkpoint
    if c.init_from_hf and starting_point(c.load, c.iteration, c.init_from_hf) == HF:
        architecture_name, tensors = hf_contents(c.init_from_hf)
        lines.append(f"initialized from Hugging Face {c.init_from_hf} ({architecture_name}, {tensors:,} tensors)")
    lines += data_lines(cfg, datasets[0], datasets[1], samples)
    lines.append(plan_line(plan, device_name, grid.device.type == "cuda", z.offload_optimizer, z.offload_param))
    if cfg.optim.name == "muon":
        lines.append(muon_line(plan, cfg.optim.muon_ns_steps))
    return "\n".join(lines)


def family(m: ModelConfig) -> str:
    """The model family the keys make: GPT-2 (layernorm, learned positions, gelu, biases, tied),
    Llama-style (rmsnorm, rotary, SwiGLU), else a GPT of its own mix."""
    if (m.normalization, m.position_embedding, m.activation) == ("rmsnorm", "rope", "swiglu"):
        return "Llama-style GPT"
    gpt2 = (m.normalization, m.position_embedding, m.activation, m.bias, m.tie_embeddings) == (
        "layernorm", "learned", "gelu", True, True)
    return "GPT-2" if gpt2 and m.query_groups == m.num_heads and not m.zero_centered_norm else "GPT"


def architecture(m: ModelConfig) -> str:
    """The choices that make the family: 'rmsnorm, rope, swiglu, 4 heads / 2 KV groups, untied'."""
    groups = "" if m.query_groups == m.num_heads else \
        f" / {m.query_groups} KV group{'s' if m.query_groups > 1 else ''}"
    position = "rope" if m.position_embedding == "rope" else "learned positions"
    parts = [m.normalization + (" (1 + w)" if m.zero_centered_norm else ""), position, m.activation,
             f"{m.num_heads} heads{groups}", "tied" if m.tie_embeddings else "untied"]
    if m.q_width != m.hidden_size:
        parts.append(f"head size {m.head_dim}")
    if m.qk_layernorm:
        parts.append("qk-norm" + (" over the projections" if m.qk_layernorm_scope == "projection" else ""))
    if m.qkv_bias and not m.bias:
        parts.append("q/k/v biases")
    if m.num_experts:
        moe = sum(is_moe_layer(m, i) for i in range(m.num_layers))
        parts.append(f"{m.num_experts} experts (top-{m.moe_router_topk}) in {moe} of {m.num_layers} layers")
    return ", ".join(parts + ([] if m.bias or m.qkv_bias else ["no biases"]))


def muon_matrices(m: ModelConfig) -> int:
    """The weight matrices optim.name muon steps (a fused q|k|v or gate|up counted once): each
    block's attention projections, and its MLP's, or in an MoE layer each expert's (and the shared
    expert's)."""
    moe = sum(is_moe_layer(m, i) for i in range(m.num_layers))
    per_moe = 2 + 2 * m.num_experts + (2 if m.moe_shared_expert_ffn_hidden_size else 0)
    return 4 * (m.num_layers - moe) + per_moe * moe


def optim_line(cfg: Config) -> str:
    """The optimizer that runs and its LRs: AdamW, Muon on the block matrices with AdamW on the
    rest, or SGD; then the schedule they share."""
    o, t = cfg.optim, cfg.train
    adam = f"(betas {o.beta1:g}, {o.beta2:g}, eps {o.eps:g}, weight decay {o.weight_decay:g})"
    if o.name == "muon":
        line = f"optim: muon {o.muon_lr:g} on {muon_matrices(cfg.model)} matrices + adamw {o.lr:g} on the rest {adam}"
    elif o.name == "sgd":
        line = f"optim: sgd lr {o.lr:g} momentum {o.sgd_momentum:g}, weight decay {o.weight_decay:g} (L2)"
    else:
        line = f"optim: adamw lr {o.lr:g} {adam}"
    if o.decoupled_lr is not None:
        line += f"; embedding and output layer lr {o.decoupled_lr:g}"
    warmup = warmup_length(o, t.iters)
    return (line + f"; warm-up {warmup:g} iterations, {o.decay_style} decay to {o.min_lr:g}"
            + (f", clip {o.clip_grad:g}" if o.clip_grad else ", no clipping"))


def muon_line(plan: Prediction, ns_steps: int) -> str:
    """optim.name muon's costs, from the planner: on the pipeline rank with the most Newton-Schulz
    work, its FLOPs per step (busiest owner) and the bytes each rank sends in the exchange; the
    momentum's 4 B per matrix element (Adam's moments 8 B) is in the plan's optimizer states."""
    r = max(plan.ranks, key=lambda r: r.muon_flops)
    line = (f"muon: Newton-Schulz ({ns_steps} steps) {r.muon_flops / 1e9:,.2f} GFLOP per step on the busiest rank, "
            f"exchange {size(r.bytes.get('muon', 0))} sent per rank per step (whole matrices to their owner "
            f"and back; pp rank {r.pp_rank}); momentum 4 B per matrix element instead of Adam's 8")
    if r.times and "muon" in r.times:
        line += f"; about {1e3 * r.times['muon']:,.1f} ms of the step"
    return line


def data_lines(cfg: Config, train, valid, samples: int) -> list[str]:
    """Per split and blend entry: documents and tokens in the split, and the samples, tokens and
    epochs the run draws from it (`samples` in all for training); a warning when evaluation
    needs an empty split."""
    t, seq = cfg.train, cfg.model.seq_length
    if cfg.data.mock:
        return [f"data: mock, {samples:,} training samples"]
    if cfg.data.stream:
        if valid:
            return [train.describe(samples), f"data valid: {len(valid):,} samples, each evaluation"]
        skipped = (f"warning: train.eval_interval is {t.eval_interval} but data.stream has no validation samples: "
                   f"validation will be skipped; hold some out with --data.stream_valid_docs 100, or name a source "
                   f"with --data.stream_valid") if t.eval_interval else None
        return [train.describe(samples), *([skipped] if skipped else [])]
    evaluated = t.eval_iters * t.global_batch_size if t.eval_interval else 0
    lines = []
    for name, ds, drawn in (("train", train, samples), ("valid", valid, evaluated)):
        if ds is None:
            if drawn:
                lines.append(f"warning: data.split {cfg.data.split!r} leaves the {name} split without documents, "
                             f"but train.eval_interval is {t.eval_interval}: validation will be skipped; give it a "
                             f"share, e.g. --data.split 98,2,0")
            continue
        for prefix, docs, tokens, n in blend_entries(ds, drawn):
            lines.append(f"data {name}: {prefix}: {docs:,} documents, {tokens:,} tokens; the run reads {n:,} "
                         f"samples = {n * seq:,} tokens = {n * seq / tokens:.2f} epochs"
                         + (" (each evaluation)" if name == "valid" else ""))
    return lines


def blend_entries(ds, samples: int) -> list[tuple[str, int, int, int]]:
    """(prefix, documents, tokens per epoch, samples drawn of the first `samples`) per dataset."""
    if hasattr(ds, "dataset_index"):  # a blend: count what the schedule draws from each
        counts = np.bincount(np.asarray(ds.dataset_index[:samples]), minlength=len(ds.datasets))
        return [e for sub, n in zip(ds.datasets, counts) if sub is not None for e in blend_entries(sub, int(n))]
    return [(ds.indexed.prefix, len(ds.doc_lengths), ds.tokens_per_epoch, min(samples, len(ds)))]


def size(n: float) -> str:
    """Bytes in the largest binary unit that keeps them >= 1 (tiny test models show KiB)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


_WHERE = {"none": "on the device", "cpu": "in host memory", "nvme": "on NVMe"}


def plan_line(plan: Prediction, device_name: str, cuda: bool = True, offload_optimizer: str = "none",
              offload_param: str = "none") -> str:
    """The planner's prediction in one line: model states grouped by where they live (the
    device; host memory or NVMe under zero.offload_optimizer / zero.offload_param), and on GPUs
    the peak memory per GPU and tokens/s. On CPUs there is no GPU to predict for: the states alone."""
    worst = plan.worst
    s = worst.states
    if offload_optimizer != "none" or offload_param != "none":
        where = {"params": _WHERE[offload_param], "grads": _WHERE["none"], "optimizer": _WHERE[offload_optimizer]}
        groups = [(place, [k for k in where if where[k] == place]) for place in _WHERE.values()]
        states = "model states " + ", ".join(
            f"{size(sum(s[k] for k in keys))} {place} = " + " + ".join(f"{k} {size(s[k])}" for k in keys)
            for place, keys in groups if keys)
        keys = ", ".join(f"zero.offload_{k} {v}" for k, v in (("optimizer", offload_optimizer), ("param", offload_param))
                         if v != "none")
        states += f" ({keys}" + (": the device holds only the gathered units in flight)" if offload_param != "none" else ")")
        states += f"; host memory for offloading {size(worst.host)}"
    else:
        states = (f"model states {size(s['total'])} = params {size(s['params'])} + grads {size(s['grads'])} + "
                  f"optimizer {size(s['optimizer'])}")
    if not cuda:
        return f"plan: {states} per rank (pp rank {worst.pp_rank}) [python -m megazero.plan predicts GPUs]"
    line = (f"plan: peak memory per GPU {size(worst.peak)} on pp rank {worst.pp_rank} ({states}; activations "
            f"{size(worst.activations)}; buffers {size(worst.buffers)})")
    if plan.tokens_per_sec and plan.mfu is not None:
        line += f"; {plan.tokens_per_sec / 1e3:,.1f}k tokens/s on {device_name} (MFU {100 * plan.mfu:.0f}%)"
    else:
        line += f"; no tokens/s estimate on {device_name} (peak unknown)"
    return line + " [python -m megazero.plan]"


def plan_check(plan: Prediction, pp_rank: int, measured_gib: float, tokens_per_sec: float, cuda: bool) -> str:
    """Predicted beside measured for the logging rank, printed with the first log line."""
    predicted = plan.rank(pp_rank).peak
    measured = measured_gib * F.GiB
    line = f"plan check, pp rank {pp_rank}: memory predicted {size(predicted)}, measured {size(measured)} "
    line += (f"peak allocated ({_ratio(measured, predicted)})" if cuda
             else "peak RSS (on CPU it includes the Python and torch runtime: not comparable)")
    if plan.tokens_per_sec:
        line += (f"; tokens/s predicted {plan.tokens_per_sec / 1e3:,.1f}k, measured {tokens_per_sec / 1e3:,.1f}k "
                 f"({_ratio(tokens_per_sec, plan.tokens_per_sec)})")
    return line


def _ratio(measured: float, predicted: float) -> str:
    return f"{100 * (measured / predicted - 1):+.0f}%" if predicted else "n/a"
