"""Predict one layout on one cluster, enumerate the layouts a model and cluster allow, rank
the ones that fit, and say why the winner wins.

A layout is tp x cp x pp x dp (x vpp chunks), a ZeRO stage, a micro-batch size, a recompute
policy and sequence parallelism; the global batch comes from the config. Predictions are
per pipeline rank (first, middle and last ranks differ: embedding, head, in-flight
micro-batches) and the layout is judged by its worst rank.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

from megazero.config import rules as R
from megazero.config.schema import Config
from megazero.config.sharding import STAGES, sharding
from megazero.errors import UserError
from megazero.model.layers import padded_vocab_size
from megazero.parallel.host import PIECE_BYTES
from megazero.pipeline.schedules import ORDERS, activation_events
from megazero.plan import formulas as F
from megazero.plan.ranks import rank_params
from megazero.zero.partition import bucket_numel

RECOMPUTE = ("none", "selective", "full")


class PlanError(UserError, ValueError):
    """A layout that cannot be formed, or a model that fits nowhere (one line, with the fix)."""


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    memory_gib: float
    peak_flops: Optional[float]
    """Dense 16-bit peak per GPU (None: no time estimate)."""
    intra_gbps: float = 450.0
    inter_gbps: float = 50.0
    efficiency: float = 0.5
    """Fraction of peak the matmuls reach."""
    dp_overlap: float = 0.5
    """Fraction of DP communication hidden behind backward."""
    headroom: float = 0.1
    """Fraction of GPU memory left for the CUDA context, allocator slack and fragmentation."""
    name: str = "GPU"


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    offload_optimizer: bool = False
    cp: int = 1
    cp_impl: str = "ring"
    ep: int = 1
    """Expert-parallel degree (MoE): E / ep experts per rank; experts fold tp x cp x dp as etp x ep x expert-dp."""
    etp: int = 1
    """Expert tensor-parallel degree (MoE)."""

    @property
    def expert_dp(self) -> int:
        """Replicas of one expert shard in a pipeline stage: the group expert gradients reduce over."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def label(self) -> str:
        chunks = f" v{self.vpp}" if self.vpp > 1 else ""
        sp = " sp" if self.sequence_parallel else ""
        off = " offload" if self.offload_optimizer else ""
        cp = f" cp{self.cp}" + (" ulysses" if self.cp_impl == "ulysses" else "") if self.cp > 1 else ""
        experts = (f" ep{self.ep}" if self.ep > 1 else "") + (f" etp{self.etp}" if self.etp > 1 else "")
        return (f"tp{self.tp}{cp} pp{self.pp}{chunks} dp{self.dp}{experts} z{self.zero_stage} mb{self.micro_batch} "
                f"{self.recompute}{sp}{off}")


def run_layout(cfg: Config, dp: int, cp: int) -> ParallelLayout:
    """The layout a run of `cfg` trains at, with its grid's dp and cp degrees."""
    p, z, t = cfg.parallel, cfg.zero, cfg.train
    return ParallelLayout(p.tp, p.pp, dp, p.vpp, z.stage, t.micro_batch_size, t.recompute, p.sequence_parallel,
                          z.offload_optimizer != "none", cp, p.cp_impl, p.ep if cfg.model.num_experts else 1,
                          p.expert_tp if cfg.model.num_experts else 1)


@dataclass
class RankPrediction:
    pp_rank: int
    params: int
    """This rank's parameter elements (unpadded)."""
    states: dict[str, int]
    """Model-state bytes on the device: params, grads, optimizer, total."""
    host_items: dict[str, int]
    """Host-memory bytes of offloading, by item (formulas.host_items)."""
    activations: int
    items: dict[str, int]
    """Transient bytes beside states and activations, by item (formulas.transient_items):
    gathered units, gradients in flight, communication buffers, logits."""
    bytes: dict[str, int]
    """Bytes this rank sends per iteration over its dp (ZeRO's dp x cp), tp, cp, pp and embedding
    groups, under optim.name muon in Muon's exchange over its stage (tp x cp x dp), and with
    experts over its ep group (the tokens' exchange) and expert-dp group (expert gradients, when
    that group is not ZeRO's own)."""
    times: Optional[dict[str, float]] = None
    muon_flops: int = 0
    """Newton-Schulz FLOPs per step on the busiest rank of this stage (optim.name muon)."""
    expert_params: int = 0
    """Of `params`, this rank's routed experts' elements (E / ep experts per MoE layer, / etp wide)."""

    @property
    def host(self) -> int:
        """Bytes offloading keeps in host memory."""
        return sum(self.host_items.values())

    @property
    def buffers(self) -> int:
        return sum(self.items.values())

    @property
    def peak(self) -> int:
        return self.states["total"] + self.activations + self.buffers


@dataclass
class Prediction:
    layout: ParallelLayout
    schedule: str
    microbatches: int
    bubble: float
    ranks: list[RankPrediction]
    memory_limit: int
    step_seconds: Optional[float] = None
    tokens_per_sec: Optional[float] = None
    mfu: Optional[float] = None
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> RankPrediction:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def slowest(self) -> RankPrediction:
        return max(self.ranks, key=lambda r: r.times["total"] if r.times else 0.0)

    @property
    def fits(self) -> bool:
        return self.worst.peak <= self.memory_limit

    def rank(self, pp_rank: int) -> RankPrediction:
        return next(r for r in self.ranks if r.pp_rank == pp_rank)

    def to_dict(self) -> dict:
        return {"layout": dataclasses.asdict(self.layout), "label": self.layout.label(), "schedule": self.schedule,
                "microbatches": self.microbatches, "bubble": self.bubble, "fits": self.fits,
                "peak_bytes": self.worst.peak, "memory_limit_bytes": self.memory_limit,
                "step_seconds": self.step_seconds, "tokens_per_sec": self.tokens_per_sec, "mfu": self.mfu,
                "ranks": [{**dataclasses.asdict(r), "host": r.host, "buffers": r.buffers, "peak": r.peak}
                          for r in self.ranks], "notes": self.notes}


# ---------------------------------------------------------------------------- one layout


def activation_shape(cfg: Config, layout: ParallelLayout, attention: str = "flash", device: str = "cuda") -> \
        F.ActivationShape:
    """The formulas' view of one micro-batch; `device` "cpu" for torch's CPU kernels, which keep
    dropout masks and LayerNorm statistics in the activation dtype."""
    m = cfg.model
    assert isinstance(m.vocab_size, int)
    act = 4 if cfg.train.precision == "fp32" else 2
    return F.ActivationShape(micro_batch=layout.micro_batch, seq=m.seq_length // layout.cp, hidden=m.hidden_size,
                             heads=m.num_heads, ffn=m.ffn_size, vocab=padded_vocab_size(m.vocab_size, layout.tp),
                             tp=layout.tp, sequence_parallel=layout.sequence_parallel and layout.tp > 1,
                             recompute=layout.recompute, act_bytes=act, dropout=m.dropout > 0, attention=attention,
                             mask_bytes=act if device == "cpu" else 1, stats_bytes=act if device == "cpu" else 4,
                             cp=layout.cp, cp_impl=layout.cp_impl, kv_hidden=m.kv_width, q_hidden=m.q_width,
                             qk_norm=m.qk_layernorm,
                             gated=m.activation == "swiglu", rmsnorm=m.normalization == "rmsnorm",
                             fused_norm=device != "cpu", rope=m.position_embedding == "rope",
                             experts=m.num_experts, topk=m.moe_router_topk if m.num_experts else 0,
                             expert_ffn=m.moe_ffn_size if m.num_experts else 0,
                             shared_ffn=m.moe_shared_expert_ffn_hidden_size, etp=layout.etp)


def distinct_ranks(pp: int) -> list[int]:
    """The first, one middle and the last pipeline rank: the others repeat the middle one."""
    return sorted({0, min(1, pp - 1), pp - 1})


def predict(cfg: Config, layout: ParallelLayout, cluster: Cluster, attention: str = "flash",
            pp_layers: Optional[list[int]] = None, ranks: Optional[list[int]] = None,
            device: str = "cuda") -> Prediction:
    """Memory, bytes moved and time of pipeline ranks `ranks` of `layout` (default: the
    first, the last, and rank 1, which keeps the most micro-batches of the middle ones)."""
    if ranks is None:
        ranks = list(range(layout.pp)) if pp_layers else distinct_ranks(layout.pp)
    m = cfg.train.global_batch_size // (layout.micro_batch * layout.dp)
    shape = activation_shape(cfg, layout, attention, device)
    schedule = "none" if layout.pp == 1 else "interleaved" if layout.vpp > 1 else cfg.parallel.schedule
    out = Prediction(layout, schedule, m, F.pipeline_bubble(layout.pp, layout.vpp, m, schedule),
                     [rank_prediction(cfg, layout, r, m, shape, schedule, pp_layers, device != "cpu") for r in ranks],
                     int(cluster.memory_gib * F.GiB * (1 - cluster.headroom)))
    if cluster.peak_flops:
        add_times(out, cfg, cluster)
    if layout.offload_optimizer:
        out.notes.append("optimizer states in host memory (stepped there)")
    if sharding(layout.zero_stage).parameters and layout.pp > 1:
        out.notes.append("ZeRO-3 with pp > 1 gathers every stage's parameters per micro-batch")
    return out


def rank_prediction(cfg: Config, layout: ParallelLayout, r: int, m: int, shape: F.ActivationShape, schedule: str,
                    pp_layers: Optional[list[int]], accelerator: bool = True) -> RankPrediction:
    zs, pp, vpp = sharding(layout.zero_stage), layout.pp, layout.vpp
    dp = layout.dp * layout.cp  # ZeRO shards and reduces over dp x cp
    elem = F.STATE_BYTES[cfg.train.precision]
    rp = rank_params(cfg.model, layout.tp, pp, vpp, r, zs.parameters, cfg.zero.bucket_size, pp_layers, layout.ep,
                     layout.etp)
    shards = dp if zs.optimizer else 1
    # Expert gradients and optimizer states are sharded over expert-dp (Megatron's distributed
    # optimizer): ZeRO lays the experts out in buckets of their own (zero/partition.split_frozen).
    apart = rp.expert_numel > 0
    buckets, tied, expert_buckets = rp.split_experts() if apart else (list(rp.buckets), rp.tied, [])
    padded = [bucket_numel(list(b), shards) for b in buckets]
    expert_shards = layout.expert_dp if zs.optimizer else 1
    expert_padded = [bucket_numel(list(b), expert_shards) for b in expert_buckets]
    states = zs.model_state_bytes(sum(padded), dp, elem)  # a new dict, adjusted in place here
    if expert_padded:
        for k, v in zs.model_state_bytes(sum(expert_padded), layout.expert_dp, elem).items():
            states[k] += v
    # Elements with one fp32 buffer, not Adam's two moments: Muon's matrices, SGD's every element.
    shard_numel = sum(padded) // shards + sum(expert_padded) // expert_shards
    muon = rp.muon_shard_numel(shards) if cfg.optim.name == "muon" else shard_numel if cfg.optim.name == "sgd" else 0
    states["optimizer"] -= F.MUON_SAVED_BYTES * muon
    host = host_shape(cfg, layout, padded + expert_padded, shards, accelerator, muon, shard_numel)
    off_device = (states["optimizer"] if host.offload_optimizer != "none" else 0) + \
        (states["params"] if host.offload_param != "none" else 0)
    states["total"] -= F.MUON_SAVED_BYTES * muon + off_device
    sizes = [F.chunk_activation_bytes(c, shape) for c in rp.chunks]
    order = activation_order(schedule, pp, vpp, r, m)
    wire = 2 if cfg.zero.reduce_dtype == "bf16" else 4
    moved = {"dp": F.dp_bytes(zs, padded, dp, m, wire, elem[0]),
             # Partial LayerNorm/bias gradients are all-reduced on this rank's ZeRO shard (about 1/dp of them).
             "tp": F.tp_bytes(list(rp.chunks), shape, m, rp.replicated_numel // shards),
             "pp": F.pp_bytes(pp, vpp, r, m, shape),
             "cp": F.cp_bytes(shape, sum(c.layers for c in rp.chunks), m),
             "embed": F.embed_bytes(sum(padded[i] // shards for i in tied), pp)}
    if cfg.model.num_experts:
        moved["ep"] = m * sum(c.moe_layers for c in rp.chunks) * expert_exchange_bytes(cfg, layout, shape)
        moved["expert_dp"] = F.dp_bytes(zs, expert_padded, layout.expert_dp, m, wire, elem[0])
    ns = 0
    if cfg.optim.name == "muon":  # one owner per matrix among the stage's tp x cp x dp ranks
        stage_ranks = layout.tp * layout.cp * layout.dp
        moved["muon"] = F.muon_exchange_bytes(rp.muon_shapes, stage_ranks, 4 if cfg.train.precision == "fp32" else 2)
        ns = F.muon_ns_flops(rp.muon_shapes, cfg.optim.muon_ns_steps, stage_ranks)
    tied_twice = any(c.pre and c.post for c in rp.chunks)
    buffers = F.BufferShape(tuple(padded + expert_padded), tied, tied_twice, zs, dp, cfg.zero.prefetch, elem[0], wire,
                            gloo=not accelerator, shard_on_device=host.offload_param == "none" or (host.offload_param == "cpu" and not accelerator))
    return RankPrediction(r, rp.param_numel, states, F.host_items(host), F.peak_in_flight_bytes(order, sizes),
                          F.transient_items(buffers, shape, rp.chunks[-1].post), moved, muon_flops=ns,
                          expert_params=rp.expert_numel)


@functools.lru_cache(maxsize=4096)
def activation_order(schedule: str, pp: int, vpp: int, r: int, m: int) -> tuple[tuple[bool, int], ...]:
    """Pipeline rank r's (forward?, chunk) actions in its schedule's order (one forward and its
    backward without a pipeline); cached, as every candidate of one pipeline shape shares it."""
    return tuple(activation_events(ORDERS[schedule](pp, vpp, r, m))) if pp > 1 else ((True, 0), (False, 0))


def expert_exchange_bytes(cfg: Config, layout: ParallelLayout, shape: F.ActivationShape) -> int:
    """Bytes one rank sends over its EP group per MoE layer and micro-batch (formulas.expert_dispatch_bytes)
    for the tokens it routes: b s / cp, / tp at etp 1 below tp (under sequence parallelism its
    positions; without it the TP ranks hold the same tokens and each sends its share,
    dispatch.token_share); at etp = tp all of them (gathered over tp under sequence parallelism)."""
    shared = layout.etp < layout.tp
    tokens = -(-shape.micro_batch * shape.seq // shape.tp) if shared else shape.micro_batch * shape.seq
    return F.expert_dispatch_bytes(tokens, shape.topk, shape.hidden, shape.act_bytes, shape.experts, layout.ep,
                                   cfg.parallel.moe_dispatcher, layout.recompute == "full")


def host_shape(cfg: Config, layout: ParallelLayout, padded: list[int], shards: int, accelerator: bool,
               muon: int = 0, shard: int = 0) -> F.HostShape:
    """What offloading keeps in host memory for one rank of `layout`: the config's offload
    modes (the planner's --offload-optimizer alone means cpu), its buffers and sub-groups;
    `muon` of the shard's elements keep no second moment (Muon's matrices, or all under SGD);
    `shard`: the rank's elements when not sum(padded) / shards (experts sharded over expert-dp)."""
    z = cfg.zero
    optimizer = (z.offload_optimizer if z.offload_optimizer != "none" else "cpu") if layout.offload_optimizer else "none"
    shard = shard or sum(padded) // shards
    return F.HostShape(shard=shard, largest_slice=max(padded) // shards, offload_optimizer=optimizer,
                       offload_param=z.offload_param if sharding(layout.zero_stage).parameters else "none", accelerator=accelerator,
                       param_bytes=F.STATE_BYTES[cfg.train.precision][0], sub_group_size=z.sub_group_size,
                       buffer_count=z.buffer_count, prefetch=z.prefetch, muon=muon,
                       staging=PIECE_BYTES if cfg.checkpoint.save else 0,
                       snapshot=F.NVME_STEP_BYTES * shard if cfg.checkpoint.save and cfg.checkpoint.async_save
                       and optimizer != "nvme" else 0)


def add_times(out: Prediction, cfg: Config, cluster: Cluster) -> None:
    lay = out.layout
    assert cluster.peak_flops is not None  # times are estimated only with a peak
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    flops = F.executed_flops_per_token(cfg.model, lay.recompute) * tokens / cluster.gpus
    # A group whose ranks lie within `span` consecutive ranks (TP innermost, then CP, DP, PP
    # outermost) talks over NVLink when they share a node, over the network otherwise.
    # Experts fold a stage's ranks etp fastest, then ep: an EP group lies within etp x ep ranks.
    spans = {"tp": lay.tp, "cp": lay.tp * lay.cp, "dp": lay.tp * lay.cp * lay.dp,
             "pp": lay.tp * lay.cp * lay.dp * lay.pp, "muon": lay.tp * lay.cp * lay.dp, "ep": lay.etp * lay.ep}
    gbps = {k: cluster.intra_gbps if span <= cluster.gpus_per_node else cluster.inter_gbps for k, span in spans.items()}
    for r in out.ranks:
        # Expert gradients reduce over expert-dp, which spans the stage like dp: hidden alike.
        extra = {"pp": r.bytes["embed"], "dp": r.bytes.get("expert_dp", 0)}
        secs = {k: (r.bytes.get(k, 0) + extra.get(k, 0)) / (gbps[k] * 1e9) for k in spans}
        r.times = F.step_seconds(flops, cluster.peak_flops, cluster.efficiency, out.bubble, secs["tp"], secs["pp"],
                                 secs["dp"], cluster.dp_overlap, secs["cp"], r.muon_flops, secs["muon"], secs["ep"])
    times = out.slowest.times
    assert times is not None
    out.step_seconds = times["total"]
    out.tokens_per_sec = tokens / out.step_seconds
    out.mfu = F.mfu(out.tokens_per_sec, F.model_flops_per_token(cfg.model), cluster.gpus, cluster.peak_flops)


# ---------------------------------------------------------------------------- every layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(cfg: Config, gpus: int, tp: int, pp: int, vpp: int = 1, micro_batch: Optional[int] = None,
                   cp: int = 1, cp_impl: str = "ring", sequence_parallel: bool = False) -> Optional[str]:
    """Why tp x cp x pp (x vpp, micro-batch) cannot be formed for this model on `gpus` GPUs, or
    None: the first of config/rules.py's layout rules that it breaks (validation's own rules)."""
    m, gbs = cfg.model, cfg.train.global_batch_size
    problem = (R.tp_problem(m.num_heads, m.ffn_size, tp, m.query_groups) or R.qk_norm_tp_problem(m, tp)
               or R.ulysses_problem(m.num_heads, tp, cp, cp_impl)
               or R.world_problem(gpus, tp, pp, cp) or R.cp_problem(m.seq_length, cp)
               or R.pp_problem(m.num_layers, pp, vpp)
               or (R.sequence_parallel_problem(m.seq_length, tp, cp) if sequence_parallel else None))
    if problem or micro_batch is None:
        return problem or R.interleaved_problem(pp, vpp, None)
    dp = gpus // (tp * pp * cp)
    return R.batch_problem(gbs, micro_batch, dp) or R.interleaved_problem(pp, vpp, gbs // (micro_batch * dp))


def candidates(cfg: Config, cluster: Cluster, fixed: dict) -> list[ParallelLayout]:
    """Every layout the model, batch and cluster allow, within the `fixed` choices (ParallelLayout
    field -> value). TP stays inside a node unless tp is fixed; so does tp x cp unless cp is."""
    gpus = cluster.gpus
    out = []
    for tp in _options(fixed, "tp", [d for d in divisors(gpus) if d <= cluster.gpus_per_node]):
        # cp's ring or all-to-all is on the critical path, like TP's all-reduces: inside a node.
        for cp in _options(fixed, "cp", [d for d in divisors(gpus // tp) if tp * d <= cluster.gpus_per_node]
                           if gpus % tp == 0 else []):
            for pp in _options(fixed, "pp", divisors(gpus // (tp * cp)) if gpus % (tp * cp) == 0 else []):
                out += _layouts_of(cfg, cluster, fixed, tp, cp, pp)
    return out


def _options(fixed: dict, key: str, default) -> list:
    return [fixed[key]] if key in fixed else list(default)


def _layouts_of(cfg: Config, cluster: Cluster, fixed: dict, tp: int, cp: int, pp: int) -> list[ParallelLayout]:
    """candidates() of one tp x cp x pp."""
    gpus, gbs = cluster.gpus, cfg.train.global_batch_size
    dp = gpus // (tp * pp * cp) if gpus % (tp * pp * cp) == 0 else 0
    impl = fixed.get("cp_impl", "ring")
    if not dp or fixed.get("dp", dp) != dp:
        return []
    # With one ZeRO rank (dp x cp) every ZeRO stage holds the same: keep stage 0.
    rest = itertools.product(_options(fixed, "micro_batch", [b for b in (1, 2, 4, 8, 16, 32) if b * dp <= gbs]),
                             _options(fixed, "vpp", [1] if pp == 1 else [1, 2, 4]),
                             _options(fixed, "zero_stage", list(STAGES) if dp * cp > 1 else [0]),
                             _options(fixed, "recompute", RECOMPUTE))
    sp = fixed.get("sequence_parallel", False) and tp > 1
    return [ParallelLayout(tp, pp, dp, vpp, stage, mb, rc, sp, fixed.get("offload_optimizer", False), cp, impl, ep, etp)
            for mb, vpp, stage, rc in rest if not layout_problem(cfg, gpus, tp, pp, vpp, mb, cp, impl, sp)
            for ep, etp in expert_options(cfg, fixed, tp, cp, dp)]


def expert_options(cfg: Config, fixed: dict, tp: int, cp: int, dp: int) -> list[tuple[int, int]]:
    """The (ep, etp) a stage of tp x cp x dp ranks allows (config/rules.py's expert rules): ep
    dividing num_experts and tp x cp x dp / etp; etp fixed, or the config's (0: tp). A dense
    model: (1, 1)."""
    m = cfg.model
    if not m.num_experts:
        return [(1, 1)]
    etp = fixed.get("etp", cfg.parallel.etp or tp)
    if R.expert_width_problem(m.moe_ffn_size, m.moe_shared_expert_ffn_hidden_size, etp, tp) or \
            R.expert_tp_problem(tp, etp, m.num_experts):
        return []
    return [(ep, etp) for ep in _options(fixed, "ep", divisors(m.num_experts))
            if not R.expert_grid_problem(tp, cp, dp, ep, etp, m.num_experts)]


def check_fixed(cfg: Config, cluster: Cluster, fixed: dict) -> None:
    """Refuse fixed choices that cannot be formed (config/rules.py's rules), naming the closest that can."""
    gpus, m = cluster.gpus, cfg.model
    tp, pp, vpp = fixed.get("tp", 1), fixed.get("pp", 1), fixed.get("vpp", 1)
    if "tp" in fixed and (R.tp_problem(m.num_heads, m.ffn_size, tp, m.query_groups) or gpus % tp):
        ok = [d for d in divisors(gpus) if not R.tp_problem(m.num_heads, m.ffn_size, d, m.query_groups)]
        raise PlanError(f"--tp {tp} must divide model.num_heads ({m.num_heads}), the MLP width ({m.ffn_size}) and "
                        f"--gpus ({gpus}); closest that fits: tp {closest(ok, tp)}")
    if "pp" in fixed and (R.pp_problem(m.num_layers, pp, vpp) or R.world_problem(gpus, tp, pp)):
        ok = [d for d in divisors(gpus // tp) if not R.pp_problem(m.num_layers, d, vpp)] if gpus % tp == 0 else [1]
        raise PlanError(f"--pp {pp} (x vpp {vpp}) must divide model.num_layers ({m.num_layers}) and tp x pp must "
                        f"divide --gpus ({gpus}); closest that fits: pp {closest(ok, pp)}")
    cp = fixed.get("cp", 1)
    if "cp" in fixed and (R.cp_problem(m.seq_length, cp) or R.world_problem(gpus, tp, pp, cp)):
        ok = [d for d in divisors(gpus // (tp * pp)) if not R.cp_problem(m.seq_length, d)] \
            if gpus % (tp * pp) == 0 else [1]
        raise PlanError(f"--cp {cp} must cut model.seq_length ({m.seq_length}) into 2 x cp chunks and tp x cp x pp "
                        f"must divide --gpus ({gpus}); closest that fits: cp {closest(ok, cp)}")
    if "cp" in fixed and R.ulysses_problem(m.num_heads, tp, cp, fixed.get("cp_impl", "ring")):
        ok = [d for d in divisors(m.num_heads // tp) if not R.cp_problem(m.seq_length, d)
              and not R.world_problem(gpus, tp, pp, d)] if m.num_heads % tp == 0 else [1]
        raise PlanError(f"--cp-impl ulysses gives each rank num_heads / (tp x cp) heads: tp x cp ({tp} x {cp}) must "
                        f"divide model.num_heads ({m.num_heads}); closest that fits: cp {closest(ok, cp)}, or "
                        f"--cp-impl ring")
    if "dp" in fixed and "tp" in fixed and "pp" in fixed and fixed["dp"] * tp * pp * cp != gpus:
        raise PlanError(f"tp x cp x pp x dp ({tp} x {cp} x {pp} x {fixed['dp']} = {tp * cp * pp * fixed['dp']}) "
                        f"must equal --gpus ({gpus}); closest that fits: dp {gpus // (tp * cp * pp)}")
    if ("ep" in fixed or "etp" in fixed) and not m.num_experts:
        raise PlanError("--ep / --etp split experts, but model.num_experts is 0 (a dense model); drop them")
    if "etp" in fixed and "tp" in fixed and R.expert_tp_problem(tp, fixed["etp"], m.num_experts):
        raise PlanError(f"--etp {fixed['etp']} must be 1 or --tp ({tp}): experts split over other ranks than the TP "
                        f"group's are not built; closest that fits: etp {closest([1, tp], fixed['etp'])}")
    if "ep" in fixed and m.num_experts % fixed["ep"]:
        ok = divisors(m.num_experts)
        raise PlanError(f"--ep {fixed['ep']} must divide model.num_experts ({m.num_experts}): each EP rank holds whole "
                        f"experts; closest that fits: ep {closest(ok, fixed['ep'])}")
    if "micro_batch" in fixed or "vpp" in fixed:
        dp = fixed.get("dp", gpus // (tp * pp * cp))
        problem = layout_problem(cfg, gpus, tp, pp, vpp, fixed.get("micro_batch", cfg.train.micro_batch_size), cp)
        if problem:
            gbs = cfg.train.global_batch_size
            ok = [b for b in divisors(gbs // dp) if gbs % (b * dp) == 0] if gbs % dp == 0 else [1]
            raise PlanError(f"{problem}; closest that fits: micro-batch {closest(ok, fixed.get('micro_batch', 1))}"
                            + (", vpp 1" if vpp > 1 else ""))


def closest(options: list[int], want: int) -> int:
    return min(options, key=lambda o: (abs(o - want), o)) if options else 1


def plan(cfg: Config, cluster: Cluster, fixed: dict, attention: str = "flash") -> list[Prediction]:
    """Every candidate layout, predicted; those that fit first, fastest first."""
    check_fixed(cfg, cluster, fixed)
    layouts = candidates(cfg, cluster, fixed)
    if not layouts:
        raise PlanError(f"no layout of {cfg.model.num_layers} layers x {cfg.model.num_heads} heads with global batch "
                        f"{cfg.train.global_batch_size} can be formed on {cluster.gpus} GPUs within "
                        f"{describe_fixed(fixed) or 'the options'}; drop a fixed choice or change --gpus")
    preds = [predict(cfg, lay, cluster, attention) for lay in layouts]
    return sorted(preds, key=order_key)


def order_key(p: Prediction) -> tuple:
    """Fitting first, then fastest; on equal time (to 0.1%) the larger micro-batch (fewer,
    larger kernels, which the constant-efficiency model does not reward), then less memory."""
    step = round(p.step_seconds, 3 - int(math.floor(math.log10(p.step_seconds)))) if p.step_seconds else 0.0
    return not p.fits, step, -p.layout.micro_batch, p.worst.peak


def describe_fixed(fixed: dict) -> str:
    return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in fixed.items())


def nothing_fits(cfg: Config, cluster: Cluster, preds: list[Prediction], fixed: dict, attention: str) -> PlanError:
    """The error when no layout fits: the smallest one, and how many GPUs (doubling) would fit it."""
    best = min(preds, key=lambda p: p.worst.peak)
    more = cluster.gpus * 2
    while more <= 4096:
        bigger = dataclasses.replace(cluster, gpus=more)
        try:
            if any(p.fits for p in plan(cfg, bigger, fixed, attention)):
                break
        except PlanError:
            pass
        more *= 2
    hint = f"or {more} GPUs" if more <= 4096 else "or a smaller model"
    return PlanError(f"no layout fits {cluster.gpus} x {cluster.memory_gib:g} GiB: the smallest, "
                     f"{best.layout.label()}, needs {best.worst.peak / F.GiB:.1f} GiB per GPU of "
                     f"{best.memory_limit / F.GiB:.1f} usable; use GPUs with at least "
                     f"{best.worst.peak / F.GiB / (1 - cluster.headroom):.0f} GiB {hint}")


def explain(preds: list[Prediction]) -> str:
    """One line: why the first (fitting, fastest) layout wins over the runner-up."""
    win = preds[0]
    head = (f"winner {win.layout.label()}: fits in {win.worst.peak / F.GiB:.1f} of "
            f"{win.memory_limit / F.GiB:.1f} GiB usable")
    if win.step_seconds is None:
        return head + " (no time estimate: give --tflops or --gpu)"
    assert win.tokens_per_sec is not None and win.mfu is not None  # set with step_seconds
    head += f", {win.tokens_per_sec / 1e3:,.1f}k tokens/s, MFU {100 * win.mfu:.1f}%"
    rivals = [p for p in preds[1:] if p.fits]
    if not rivals:
        return head + "; the only layout that fits"
    second = rivals[0]
    if order_key(second)[1] == order_key(win)[1]:
        why = ("its larger micro-batch" if second.layout.micro_batch < win.layout.micro_batch
               else "its smaller memory")
        return f"{head}; as fast as {second.layout.label()} by this model, chosen for {why}"
    a, b = win.slowest.times, second.slowest.times
    assert a is not None and b is not None and second.step_seconds is not None
    part = max(("compute", "bubble", "tp", "pp", "dp", "cp", "ep"), key=lambda k: b.get(k, 0.0) - a.get(k, 0.0))
    words = {"compute": "computes more (recomputation)", "bubble": "idles longer in the pipeline bubble",
             "tp": "waits longer on TP all-reduces", "pp": "waits longer on pipeline transfers",
             "dp": "waits longer on DP communication", "cp": "waits longer on context-parallel attention",
             "ep": "waits longer on the experts' all-to-all"}[part]
    return (f"{head}; {100 * (second.step_seconds / win.step_seconds - 1):.1f}% faster than "
            f"{second.layout.label()}, which {words} (+{1e3 * (b.get(part, 0.0) - a.get(part, 0.0)):.0f} ms/step)")
