"""`python -m megazero.plan --config C --gpus N [--gpus-per-node G] [--gpu h100 | --gpu-memory GiB ...]`

Predicts, per GPU, model states (ZeRO), saved activations (recompute, sequence parallelism,
in-flight micro-batches), peak memory, bytes moved per step by TP, PP and DP, the pipeline
bubble, step time, tokens/s and MFU, for every layout the model and cluster allow (or the
one you fix with --tp/--pp/--dp/--zero-stage/--ep/..., or training's --parallel.tp/cp/pp/dp/vpp/ep/etp
and --zero.stage), and ranks those that fit. A mixture of experts also gets ep among the candidates
(etp: --etp, else the config's parallel.etp, 0 meaning tp), its experts' memory per GPU and the
tokens' all-to-all bytes. Config keys can be overridden as in training
(--train.global_batch_size 1024).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional

from megazero.config.parse import build_config, load_yaml
from megazero.config.resolve import resolve_vocab_size
from megazero.config.schema import ConfigError
from megazero.config.sharding import sharding
from megazero.errors import report_errors
from megazero.plan import formulas as F
from megazero.plan.planner import RECOMPUTE, Cluster, PlanError, Prediction, explain, nothing_fits, plan


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m megazero.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="training config (YAML): model, batch, precision, ZeRO options")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", choices=sorted(F.GPUS), default="h100",
                    help="preset for memory, peak and bandwidths (default h100); the flags below override it")
    ap.add_argument("--gpu-memory", type=float, help="GiB per GPU")
    ap.add_argument("--tflops", type=float, help="dense 16-bit peak TFLOP/s per GPU")
    ap.add_argument("--intra-bw", type=float, help="GB/s per GPU inside a node (NVLink, one direction)")
    ap.add_argument("--inter-bw", type=float, help="GB/s per GPU between nodes")
    ap.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak the matmuls reach (0.5)")
    ap.add_argument("--dp-overlap", type=float, default=0.5, help="fraction of DP communication hidden (0.5)")
    ap.add_argument("--headroom", type=float, default=0.1, help="fraction of GPU memory kept free (0.1)")
    ap.add_argument("--attention", choices=["flash", "math"], default="flash",
                    help="fused attention (no s x s scores kept) or the unfused math kernel")
    for name in ("tp", "cp", "pp", "dp", "vpp", "zero-stage", "micro-batch", "ep", "etp"):
        ap.add_argument(f"--{name}", type=int, help=f"fix {name.replace('-', ' ')}")
    ap.add_argument("--cp-impl", choices=["ring", "ulysses"], help="context parallelism by ring attention "
                                                                   "(default) or Ulysses")
    ap.add_argument("--recompute", choices=RECOMPUTE, help="fix the recompute policy")
    ap.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism where tp > 1")
    ap.add_argument("--offload-optimizer", action="store_true", help="optimizer states in host memory")
    ap.add_argument("--top", type=int, default=10, help="layouts to show (0: every valid one, fitting or not)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap.parse_known_args(argv)


LAYOUT_KEYS = {"parallel.tp": "tp", "parallel.cp": "cp", "parallel.pp": "pp", "parallel.dp": "dp",
               "parallel.vpp": "vpp", "zero.stage": "zero_stage", "parallel.ep": "ep", "parallel.etp": "etp"}
"""Config overrides that fix the layout, as training reads them: --parallel.tp 2 is --tp 2 here."""


def take_layout_overrides(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """Move --parallel.tp/cp/pp/dp/vpp and --zero.stage (VALUE or =VALUE) from `overrides` into the
    fixed layout of `args`; the other overrides are returned. One given both ways must agree."""
    rest, items = [], iter(overrides)
    for item in items:
        name, has_value, inline = item[2:].partition("=")
        if not item.startswith("--") or name not in LAYOUT_KEYS:
            rest.append(item)
            continue
        raw = inline if has_value else next(items, "")
        attr, flag = LAYOUT_KEYS[name], "--" + LAYOUT_KEYS[name].replace("_", "-")
        if not raw.isdigit():
            raise PlanError(f"--{name} ({raw!r}) must be a whole number, e.g. --{name} 2 (or {flag} 2)")
        if getattr(args, attr) not in (None, int(raw)):
            raise PlanError(f"--{name} {raw} and {flag} {getattr(args, attr)} disagree; pass one of them")
        setattr(args, attr, int(raw))
    return rest


def cluster_from(args: argparse.Namespace) -> Cluster:
    gpu = F.GPUS[args.gpu]
    for key in ("gpus", "gpus_per_node"):
        if getattr(args, key) < 1:
            raise PlanError(f"--{key.replace('_', '-')} ({getattr(args, key)}) must be at least 1")
    memory = args.gpu_memory if args.gpu_memory is not None else gpu.memory_gib
    if memory <= 0:
        raise PlanError(f"--gpu-memory ({memory:g}) must be positive, e.g. 80")
    custom = any(v is not None for v in (args.gpu_memory, args.tflops, args.intra_bw, args.inter_bw))
    return Cluster(args.gpus, min(args.gpus_per_node, args.gpus), memory,
                   args.tflops * 1e12 if args.tflops else gpu.peak_flops,
                   args.intra_bw or gpu.intra_gbps, args.inter_bw or gpu.inter_gbps, args.efficiency,
                   args.dp_overlap, args.headroom, gpu.name + (" (overridden)" if custom else ""))


def fixed_from(args: argparse.Namespace) -> dict:
    fixed = {name: getattr(args, name) for name in ("tp", "cp", "pp", "dp", "vpp", "zero_stage", "micro_batch",
                                                     "recompute", "cp_impl", "ep", "etp") if getattr(args, name) is not None}
    if "zero_stage" in fixed:
        sharding(fixed["zero_stage"], "--zero-stage")  # refuses a number that names no stage
    for key in ("tp", "cp", "pp", "dp", "vpp", "micro_batch", "ep", "etp"):
        if key in fixed and fixed[key] < 1:
            raise PlanError(f"--{key.replace('_', '-')} ({fixed[key]}) must be at least 1")
    return {**fixed, **{switch: True for switch in ("sequence_parallel", "offload_optimizer") if getattr(args, switch)}}


# ---------------------------------------------------------------------------- output


def gib(n: float) -> str:
    return f"{n / F.GiB:.1f}"


HEADER = ("| # | tp | pp | vpp | dp | ZeRO | micro-batch | recompute | cp | params/GPU | states GiB | activations GiB "
          "| peak GiB | fits | TP GiB/step | CP GiB/step | PP GiB/step | DP GiB/step | bubble | step s | tokens/s "
          "| MFU |")


MOE_HEADER = HEADER.replace("| dp |", "| dp | ep |").replace("| params/GPU |", "| params/GPU | experts/GPU |") \
    .replace("| DP GiB/step |", "| DP GiB/step | EP GiB/step |")
"""With experts: ep, the experts' parameters per GPU, and the tokens' exchange (expert-dp's bytes are in DP's)."""


def row(i: int, p: Prediction, variants: int = 1, moe: bool = False) -> str:
    w, lay = p.worst, p.layout
    extra = {"pp": "embed", "dp": "expert_dp"}
    moved = {k: max(r.bytes.get(k, 0) + r.bytes.get(extra.get(k, ""), 0) for r in p.ranks)
             for k in ("tp", "cp", "pp", "dp", "ep")}
    time = (f"{p.step_seconds:.2f} | {p.tokens_per_sec / 1e3:,.1f}k | {100 * p.mfu:.1f}%" if p.step_seconds and p.tokens_per_sec is not None and p.mfu is not None
            else "- | - | -")
    micro = f"{lay.micro_batch}" + (f" (best of {variants})" if variants > 1 else "")
    recompute = lay.recompute + (" + sp" if lay.sequence_parallel else "") + (" + offload" if lay.offload_optimizer else "")
    cp = f"{lay.cp}" + (f" {lay.cp_impl}" if lay.cp > 1 else "")
    ep = f" {lay.ep} |" if moe else ""
    experts = f" {w.expert_params / 1e6:,.1f}M |" if moe else ""
    ep_bytes = f" {gib(moved['ep'])} |" if moe else ""
    return (f"| {i} | {lay.tp} | {lay.pp} | {lay.vpp} | {lay.dp} |{ep} {lay.zero_stage} | {micro} | {recompute} | {cp} "
            f"| {w.params / 1e6:,.1f}M |{experts} {gib(w.states['total'])} | {gib(w.activations)} | {gib(w.peak)} "
            f"| {'yes' if p.fits else 'no'} | {gib(moved['tp'])} | {gib(moved['cp'])} | {gib(moved['pp'])} "
            f"| {gib(moved['dp'])} |{ep_bytes} {100 * p.bubble:.1f}% | {time} |")


def distinct(preds: list[Prediction]) -> list[tuple[Prediction, int]]:
    """One row per layout apart from its micro-batch: the first (fastest) of each, with how many
    micro-batch variants it stands for (they differ only in activation memory, rarely in time)."""
    groups: dict[object, list[Prediction]] = {}
    for p in preds:
        groups.setdefault(dataclasses.replace(p.layout, micro_batch=0), []).append(p)
    return [(group[0], len(group)) for group in groups.values()]


def detail(p: Prediction) -> list[str]:
    """Per distinct pipeline rank: the memory breakdown, bytes and time."""
    lines = [f"layout {p.layout.label()}: schedule {p.schedule}, {p.microbatches} micro-batches/iteration, "
             f"bubble {100 * p.bubble:.1f}%"]
    for r in p.ranks:
        s = r.states
        lines.append(f"  pp rank {r.pp_rank}: {r.params / 1e6:,.1f}M params | params {gib(s['params'])} + grads "
                     f"{gib(s['grads'])} + optimizer {gib(s['optimizer'])} + activations {gib(r.activations)} + "
                     f"buffers {gib(r.buffers)} = {gib(r.peak)} GiB" + (f" (+{gib(r.host)} GiB host)" if r.host else "")
                     + f" | sends TP {gib(r.bytes['tp'])} CP {gib(r.bytes['cp'])} PP {gib(r.bytes['pp'] + r.bytes['embed'])} "
                     f"DP {gib(r.bytes['dp'])} GiB" + (f" | experts {r.expert_params / 1e6:,.1f}M params, sends EP "
                                                      f"{gib(r.bytes['ep'])} expert-DP {gib(r.bytes['expert_dp'])} GiB"
                                                      if "ep" in r.bytes else ""))
        if r.times:
            lines.append("    step " + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in r.times.items()))
    return lines + [f"  note: {n}" for n in p.notes]


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def family(m) -> str:
    """GPT-2, or the Llama family's options the model uses."""
    options = [name for name, on in (("rope", m.position_embedding == "rope"), ("rmsnorm", m.normalization == "rmsnorm"),
                                     (m.activation, m.activation != "gelu"),
                                     (f"{m.query_groups} query groups", m.query_groups != m.num_heads),
                                     ("no bias", not m.bias), ("untied", not m.tie_embeddings)) if on]
    return f"GPT ({', '.join(options)})," if options else "GPT-2"


def experts(m) -> str:
    """' (12.88B active: 8 experts, top-2, in 32 of 32 layers)' for a mixture of experts."""
    if not m.num_experts:
        return ""
    return (f" ({count(F.model_parameters(m, active=True))} active: {m.num_experts} experts, top-{m.moe_router_topk}, "
            f"in {len(F.moe_layer_indices(m))} of {m.num_layers} layers)")


def print_table(cfg, cluster: Cluster, preds: list[Prediction], top: int) -> None:
    m = cfg.model
    print(f"{family(m)} {count(F.model_parameters(m))} parameters{experts(m)}, {m.num_layers} layers, hidden "
          f"{m.hidden_size}, {m.num_heads} heads, seq {m.seq_length}, vocab {m.vocab_size}; global batch {cfg.train.global_batch_size}, {cfg.train.precision}; "
          f"{cluster.gpus} x {cluster.name}: {cluster.memory_gib:g} GiB ({100 * cluster.headroom:.0f}% kept free), "
          + (f"{cluster.peak_flops / 1e12:g} TFLOP/s at {100 * cluster.efficiency:.0f}%, " if cluster.peak_flops
             else "") + f"{cluster.gpus_per_node}/node, NVLink {cluster.intra_gbps:g} GB/s, network "
          f"{cluster.inter_gbps:g} GB/s, DP overlap {100 * cluster.dp_overlap:.0f}%")
    shown = distinct(preds) if top == 0 else distinct([p for p in preds if p.fits])[:top]
    fitting = sum(p.fits for p in preds)
    print(f"{len(preds)} valid layouts, {fitting} fit; " + ("all shown" if top == 0 else
          f"the {len(shown)} fastest distinct ones (micro-batch variants folded into their best)"))
    header = MOE_HEADER if m.num_experts else HEADER
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for i, (p, variants) in enumerate(shown, 1):
        print(row(i, p, variants, bool(m.num_experts)))
    if len(shown) == 1 or len(preds) == 1:
        print("\n".join(detail(shown[0][0])))
    print(explain(preds))


def main(argv: Optional[list[str]] = None) -> None:
    args, overrides = parse_args(argv)
    with report_errors(ConfigError):
        overrides = take_layout_overrides(args, overrides)
        cfg = build_config(load_yaml(args.config), overrides)
        cfg.model.vocab_size = resolve_vocab_size(cfg)
        cluster = cluster_from(args)
        fixed = fixed_from(args)
        preds = plan(cfg, cluster, fixed, args.attention)
        if not any(p.fits for p in preds):
            raise nothing_fits(cfg, cluster, preds, fixed, args.attention)
        if args.json:
            shown = preds if args.top == 0 else [p for p in preds if p.fits][:args.top]
            json.dump({"cluster": cluster.__dict__, "explanation": explain(preds), "valid": len(preds),
                       "fit": sum(p.fits for p in preds), "layouts": [p.to_dict() for p in shown]}, sys.stdout,
                      indent=1)
            print()
        else:
            print_table(cfg, cluster, preds, args.top)


if __name__ == "__main__":
    main()
