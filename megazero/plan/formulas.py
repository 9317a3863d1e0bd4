"""The one set of formulas behind the layout planner, the benchmarks and the trainer's metrics.

Everything here is arithmetic on shapes and degrees; tests/e2e/test_plan.py checks each formula
against what megazero allocates and sends (model-state bytes and DP/TP/PP bytes exactly,
saved activations within 10%, the bubble against the executor's simulated orders) and against
the published anchors (ZeRO paper, Korthikanti et al. 2022).

Units: bytes, elements, seconds, FLOP. Symbols: b micro-batch size, s sequence length,
h hidden size, a heads, q query width (heads x head size: h unless model.kv_channels sets the
head size), g K/V width (query groups x head size; q without grouped-query attention), f MLP width, V padded vocabulary, t tensor-parallel degree, m micro-batches per
iteration, p pipeline degree, v model chunks per pipeline rank, N data-parallel degree,
Ψ padded parameter elements of one rank.

The model is GPT-2 (learned positions, LayerNorm, GELU, biases, tied head) or any of the
Llama family's options (config/schema.py ModelConfig: rotary positions, RMSNorm, SwiGLU,
grouped K/V, no biases, an untied output layer); each formula says where they change it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Sequence

from megazero.config.schema import ModelConfig
from megazero.config.sharding import Sharding
from megazero.model.gpt import is_moe_layer
from megazero.parallel.comm import all_gather_volume, all_reduce_volume, all_to_all_volume, reduce_scatter_volume
from megazero.pipeline.schedules import ORDERS, message_target
from megazero.zero import ALIGN
from megazero.zero.grads import IN_FLIGHT_BYTES, MIN_IN_FLIGHT
from megazero.zero.muon import assign_owners, ns_flops
from megazero.zero.partition import bucket_numel

GiB = 2 ** 30

# ---------------------------------------------------------------------------- devices

# Dense bf16/fp16 tensor-core peak per device, FLOP/s. Unknown devices get no MFU.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L40S": 362e12,
    "L4": 121e12, "V100": 125e12, "MI300X": 1307e12, "MI250X": 383e12,
}


@dataclass(frozen=True)
class GPU:
    """A planner preset: memory, peak (PEAK_FLOPS) and per-GPU bandwidth inside a node
    (NVLink, one direction) and between nodes (the GPU's network share)."""

    name: str
    memory_gib: float
    peak_flops: float
    intra_gbps: float
    inter_gbps: float


GPUS = {
    "h100": GPU("H100 SXM 80GB", 80, PEAK_FLOPS["H100"], 450, 50),
    "h200": GPU("H200 SXM 141GB", 140, PEAK_FLOPS["H200"], 450, 50),
    "a100": GPU("A100 SXM 80GB", 80, PEAK_FLOPS["A100"], 300, 25),
    "v100": GPU("V100 SXM2 32GB", 32, PEAK_FLOPS["V100"], 150, 12.5),
}

# ---------------------------------------------------------------------------- parameters and FLOPs
# A mixture of experts (model.num_experts > 0) counts two ways: total parameters (every expert:
# memory) and active ones (what one token multiplies: the router, its k experts and the shared
# expert: FLOPs and MFU). Head sizes other than h / heads (model.kv_channels), q/k norms
# (model.qk_layernorm) and q/k/v-only biases (model.qkv_bias) are read from the config alone.


def head_size(m: ModelConfig) -> int:
    """model.kv_channels, or h / heads when 0."""
    return m.kv_channels or m.hidden_size // m.num_heads


def mlp_matrices(m: ModelConfig) -> int:
    """An MLP's matrices: two (GELU, squared ReLU) or three (SwiGLU: gate, up, down)."""
    return 3 if m.activation == "swiglu" else 2


def model_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token: 6 x (active matmul parameters, incl. the head) plus attention
    scores and weighted values (forward 4 s x heads x head size per layer, x3 with backward).
    Grouped K/V, SwiGLU, the experts a token reaches and the output layer enter through
    `matmul_parameters`; the scores are q k^T over all heads whatever the K/V groups (4 s h
    when head size x heads = h). Rotary positions, norms, activations and the experts'
    weighting are elementwise: no matmul FLOPs (Megatron-LM's and PaLM's convention)."""
    return 6 * matmul_parameters(m) + 12 * m.num_layers * m.num_heads * head_size(m) * m.seq_length


def moe_layer_indices(m: ModelConfig) -> list[int]:
    """The blocks whose MLP is a mixture of experts (model.moe_layer_freq)."""
    return [i for i in range(m.num_layers) if is_moe_layer(m, i)]


def block_matmul_parameters(m: ModelConfig, layer: int = 0, active: bool = True) -> int:
    """Weights block `layer` multiplies by each token: q and the output projection h x (heads x
    head size) each, k and v h x g each (g = query groups x head size), and the MLP's matrices
    h x f (`mlp_matrices`). GPT-2: 4 h^2 + 2 h f. An MoE block's MLP is the router E x h, k
    experts (all E with `active` False) of `mlp_matrices` x h x F each, the shared expert's
    matrices h x F_shared and its gate's h."""
    h, q, kv = m.hidden_size, m.num_heads * head_size(m), m.query_groups * head_size(m)
    attention = 2 * h * q + 2 * h * kv
    if not is_moe_layer(m, layer):
        return attention + mlp_matrices(m) * h * m.ffn_size
    experts = m.moe_router_topk if active else m.num_experts
    shared = mlp_matrices(m) * h * m.moe_shared_expert_ffn_hidden_size + (h if m.moe_shared_expert_gate else 0)
    return attention + m.num_experts * h + experts * mlp_matrices(m) * h * m.moe_ffn_size + shared


def matmul_parameters(m: ModelConfig, active: bool = True) -> int:
    """The blocks' matmul weights (those a token multiplies, or with `active` False every
    expert's) plus the output layer's V x h (tied or not, the head multiplies every token by
    it; V the real vocabulary, not its TP padding)."""
    assert isinstance(m.vocab_size, int)
    blocks = sum(block_matmul_parameters(m, i, active) for i in range(m.num_layers))
    return blocks + m.vocab_size * m.hidden_size


def block_parameters(m: ModelConfig, layer: int = 0, active: bool = False) -> int:
    """Every parameter of block `layer` (only the k routed experts a token reaches with
    `active`): the matmul weights; biases when model.bias (q, k, v: q + 2 g wide, the output
    projection h, a dense MLP's or shared expert's first layer f (2 f for SwiGLU's fused gate
    and up) and second h; the experts have none) or q, k, v's alone with model.qkv_bias; two
    norms (LayerNorm: weight and bias; RMSNorm: a weight); with model.qk_layernorm an RMSNorm
    weight of one head's size for q and one for k (shared by the heads), or of q's and k's widths
    (qk_layernorm_scope projection)."""
    h, q, kv = m.hidden_size, m.num_heads * head_size(m), m.query_groups * head_size(m)
    gates = 2 if m.activation == "swiglu" else 1
    width = m.moe_shared_expert_ffn_hidden_size if is_moe_layer(m, layer) else m.ffn_size
    biases = (q + 2 * kv if m.bias or m.qkv_bias else 0) + (h + (gates * width + h if width else 0) if m.bias else 0)
    qk_norms = (q + kv if m.qk_layernorm_scope == "projection" else 2 * head_size(m)) if m.qk_layernorm else 0
    return block_matmul_parameters(m, layer, active) + biases + 2 * norm_parameters(m) + qk_norms


def norm_parameters(m: ModelConfig) -> int:
    return m.hidden_size * (1 if m.normalization == "rmsnorm" else 2)


def model_parameters(m: ModelConfig, vocab: int = 0, active: bool = False) -> int:
    """The model's parameters with a `vocab`-row embedding (default: the real vocabulary, as
    published counts are): the token embedding, a learned position table (none with rotary
    positions), the blocks, the final norm, and the output layer when it is untied. With
    `active`, an MoE block counts the k experts a token reaches, not all E (the published
    "active parameters": Mixtral 8x7B 12.9B of 46.7B)."""
    assert isinstance(m.vocab_size, int)
    v, h = vocab or m.vocab_size, m.hidden_size
    positions = m.seq_length * h if m.position_embedding == "learned" else 0
    head = 0 if m.tie_embeddings else v * h
    blocks = sum(block_parameters(m, i, active) for i in range(m.num_layers))
    return v * h + positions + blocks + norm_parameters(m) + head


def executed_flops_per_token(m: ModelConfig, recompute: str) -> float:
    """What the hardware runs: the model FLOPs plus the recomputed forward (full: every block,
    2 x active matmul parameters of the blocks + attention; selective: the attention core alone)."""
    L, s, q = m.num_layers, m.seq_length, m.num_heads * head_size(m)
    blocks = sum(block_matmul_parameters(m, i) for i in range(L))
    extra = {"none": 0.0, "selective": 4 * L * q * s, "full": 2 * blocks + 4 * L * q * s}[recompute]
    return model_flops_per_token(m) + extra


# ---------------------------------------------------------------------------- model states

# Bytes per parameter element held as (parameters, gradients, optimizer states). megazero keeps
# fp32 gradient buffers at every precision (Megatron's main_grad) and fp32 master weights in
# 16-bit runs; the ZeRO paper's mixed precision keeps 16-bit gradients (K = 12). A rank holding
# Ψ (padded) elements over N = dp ranks (config/sharding.py's model_state_bytes: stage 1 shards
# the optimizer states, 2 also the gradients, 3 also the parameters) then keeps at stages 0-3,
# with megazero's bf16 bytes: 18Ψ, 6Ψ + 12Ψ/N, 2Ψ + 16Ψ/N, 18Ψ/N; with the paper's: 16Ψ,
# 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 4, 12), "fp16": (2, 4, 12)}
ZERO_PAPER_BYTES = (2, 2, 12)


MUON_SAVED_BYTES = 4
"""Bytes per element Muon (optim.name muon) saves on its matrices: one fp32 momentum buffer
instead of Adam's two moments (zero/state.py stores no second moment for them)."""


def muon_shard_numels(numels: list[int], muon: list[bool], shards: int) -> list[int]:
    """Muon's elements in each DP rank's slice of one bucket holding parameters of `numels`
    elements (laid as zero/partition.py lays them, each at a multiple of ALIGN), `muon` saying
    which are Muon's matrices: the optimizer's Muon ranges, which take in the alignment
    padding between two consecutive Muon parameters (zero/partition.py's FlatLayout.ranges)."""
    runs: list[list[int]] = []
    offset, after_muon = 0, False
    for n, is_muon in zip(numels, muon):
        if is_muon and after_muon:
            runs[-1][1] = offset + n
        elif is_muon:
            runs.append([offset, offset + n])
        after_muon = is_muon
        offset = -(-(offset + n) // ALIGN) * ALIGN
    slice_numel = bucket_numel(numels, shards) // shards
    return [sum(max(0, min(hi, (k + 1) * slice_numel) - max(lo, k * slice_numel)) for lo, hi in runs)
            for k in range(shards)]


def muon_exchange_bytes(shapes: Iterable[tuple[int, int]], group: int, elem_bytes: int) -> int:
    """Bytes one rank sends per step in Muon's exchange (zero/muon.py) over its stage group
    (tp x cp x dp ranks): per owner, a reduce of that owner's whole matrices and a broadcast
    of their orthogonalised updates, each counted at the buffer's size (comm.py's counters),
    in Newton-Schulz's dtype (`elem_bytes`); nothing on one rank."""
    return 0 if group == 1 else 2 * elem_bytes * sum(r * c for r, c in shapes)


def muon_ns_flops(shapes: Sequence[tuple[int, int]], steps: int, owners: int) -> int:
    """Newton-Schulz FLOPs per step on the busiest of `owners` ranks, the matrices assigned as
    the exchange assigns them (balanced by FLOPs, each orthogonalised once)."""
    costs = [ns_flops(s, steps) for s in shapes]
    load = [0] * owners
    for cost, owner in zip(costs, assign_owners(costs, owners)):
        load[owner] += cost
    return max(load, default=0)


# ---------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActivationShape:
    """One micro-batch through one rank's share of a layer."""

    micro_batch: int
    seq: int
    """Positions this rank holds: seq_length / cp."""
    hidden: int
    heads: int
    ffn: int
    vocab: int
    """Padded vocabulary (all TP ranks together)."""
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    act_bytes: int = 2
    """Bytes per activation element: 2 in bf16/fp16, 4 in fp32."""
    dropout: bool = True
    """Dropout masks are kept only when dropout > 0."""
    mask_bytes: int = 1
    """Bytes per dropout-mask element: 1 on CUDA (bool); torch's CPU kernel keeps the input dtype."""
    stats_bytes: int = 4
    """Bytes of each LayerNorm mean / rstd element: fp32 on CUDA, the input dtype on CPU."""
    attention: str = "flash"
    """flash: fused attention keeps only its log-sum-exp beyond q, k, v and its output; math:
    the s x s scores, their dropout mask and the dropped-out scores (Korthikanti et al.'s
    5 a s^2 b)."""
    cp: int = 1
    """Context-parallel degree (`seq` is already this rank's share)."""
    cp_impl: str = "ring"
    """ring: the ring keeps q, k, v, its output and log-sum-exp, the same tensors as flash
    attention; ulysses: also the head-sharded output of its whole-sequence attention and two
    int64 orderings of the whole sequence."""
    kv_hidden: int = 0
    """K/V width g (query groups x head size, all TP ranks together); 0: `q` (no grouping)."""
    q_hidden: int = 0
    """Query width q (heads x head size, all TP ranks together); 0: hidden (model.kv_channels unset)."""
    qk_norm: bool = False
    """QK-norm: RMSNorm of each q and k head (model.qk_layernorm)."""
    gated: bool = False
    """SwiGLU: the MLP keeps its fused gate | up output (2 f), silu(gate) and the product."""
    rmsnorm: bool = False
    """RMSNorm instead of LayerNorm: one fp32 statistic per token (rstd) instead of two."""
    fused_norm: bool = True
    """RMSNorm runs as one kernel (CUDA) rather than torch's decomposition (CPU), which keeps
    an fp32 copy of its input and the normalized x * rstd beside its output."""
    rope: bool = False
    """Rotary positions: no position ids or table; attention keeps the rotated q and k and the
    cos / sin tables."""
    experts: int = 0
    """Mixture of experts: routed experts E of an MoE layer (0: a dense model)."""
    topk: int = 0
    """Experts each token reaches."""
    expert_ffn: int = 0
    """Each routed expert's MLP width F (whole; split over `etp` ranks)."""
    shared_ffn: int = 0
    """The shared expert's MLP width (0: none); a dense MLP split over tp."""
    etp: int = 1
    """Expert tensor-parallel degree."""

    @property
    def q(self) -> int:
        return self.q_hidden or self.hidden

    @property
    def kv(self) -> int:
        return self.kv_hidden or self.q

    @property
    def head_size(self) -> int:
        return self.q // self.heads


def norm_bytes(x: ActivationShape) -> tuple[int, int]:
    """What one norm keeps beside its output: bytes per element of its [s, b, h] input and per
    token. LayerNorm: its input, mean and rstd (stats_bytes each); RMSNorm: its input and an
    fp32 rstd, or decomposed (CPU) its fp32 input (the input itself in fp32) and x * rstd."""
    if not x.rmsnorm:
        return x.act_bytes, 2 * x.stats_bytes
    return (x.act_bytes if x.fused_norm else 8), 4


def rope_table_bytes(x: ActivationShape, layers: int) -> int:
    """The cos and sin tables [s, head size] rotary attention keeps: in fp32 one pair per
    chunk, shared by its layers; in 16-bit each layer casts them for q and again for k."""
    if not x.rope or x.recompute != "none":
        return 0
    sd = x.seq * x.head_size
    return 2 * 4 * sd if x.act_bytes == 4 else layers * 4 * x.act_bytes * sd


def layer_activation_bytes(x: ActivationShape) -> int:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Sec. 4):

      replicated over TP  both LayerNorm inputs and outputs 4 sbh x bytes, two dropout masks
                          2 sbh (1 byte each), LayerNorm mean and rstd 4 bs (fp32: 16 bs bytes)
      split over TP       q, k, v 3 sbh, attention output 1 sbh, MLP input of GeLU and of the
                          second linear 2 sbf (x bytes), over t
      attention core      flash: its fp32 log-sum-exp 4 abs (its output, laid out [b, s, a, d],
                          is the output projection's input); math: (2 x bytes + mask bytes) a s^2 b
                          with dropout, a s^2 b x bytes without; over t (heads are split)

    16-bit with dropout, math attention: sbh (34 + 5 as/h) + 16 bs (the paper omits the
    LayerNorm statistics); with TP: sbh (10 + 24/t + 5 as/(ht)). Sequence parallelism also
    divides the replicated part by t; selective recomputation drops the attention core;
    full recomputation keeps only the layer input (sbh x bytes, over t with SP). Context
    parallelism divides s by cp everywhere (`seq` is this rank's share); Ulysses adds its
    attention's output and the sequence orderings.

    The Llama family: q, k, v are q + 2 g wide (grouped K/V; q = h unless kv_channels), the
    attention output q; SwiGLU keeps 4 sbf (gate | up, silu(gate), the product); rotary attention
    keeps the rotated q and k, sb (q + g), unless recomputed; the norms keep `norm_bytes` (QK-norm's
    input is q | k | v's, kept already: only its statistics per head, and on the CPU its x * rstd)."""
    b, s, h, t, e = x.micro_batch, x.seq, x.hidden, x.tp, x.act_bytes
    sbh = s * b * h
    seq_split = t if x.sequence_parallel else 1
    if x.recompute == "full":
        return e * sbh // seq_split
    mask = x.mask_bytes if x.dropout else 0
    per_element, per_token = norm_bytes(x)
    replicated = 2 * (per_element + e) * sbh + mask * 2 * sbh + 2 * b * s * per_token
    split = e * s * b * (2 * x.q + 2 * x.kv + (4 if x.gated else 2) * x.ffn)
    core = orderings = 0
    if x.recompute == "none":
        if x.rope:
            split += e * s * b * (x.q + x.kv)
        if x.qk_norm:  # its input is a view of q | k | v, already kept: what the norm keeps beyond it
            split += (per_element - e) * s * b * (x.q + x.kv) + per_token * s * b * (x.q + x.kv) // x.head_size
        if x.attention == "flash" or x.cp > 1:  # context parallelism attends by flash-style blocks
            core = 4 * x.heads * s * b
        else:
            core = (2 * e + mask if x.dropout else e) * x.heads * s * s * b
        if x.cp > 1 and x.cp_impl == "ulysses":
            core += e * s * b * x.q  # its attention's own output (the all-to-all back copies it)
            orderings = 2 * 8 * s * x.cp  # int64 gathered <-> natural order of the whole sequence
    return replicated // seq_split + (split + core) // t + orderings


def embedding_activation_bytes(x: ActivationShape) -> int:
    """The first stage: token ids (int64; with TP the rank-local ids and the out-of-range
    mask), position ids (learned positions only), and the embedding dropout mask."""
    b, s = x.micro_batch, x.seq
    ids = 8 * b * s + (b * s if x.tp > 1 else 0)
    mask = x.mask_bytes * b * s * x.hidden // (x.tp if x.sequence_parallel else 1) if x.dropout else 0
    return ids + (0 if x.rope else 8 * s) + mask


def head_activation_bytes(x: ActivationShape) -> int:
    """The last stage: final norm input and statistics (`norm_bytes`), the head's input (its
    sequence shard under sequence parallelism), and the vocab-parallel cross entropy's fp32
    softmax over this rank's V/t logits with its targets."""
    b, s, h = x.micro_batch, x.seq, x.hidden
    seq_split = x.tp if x.sequence_parallel else 1
    per_element, per_token = norm_bytes(x)
    norm = (per_element * s * b * h + b * s * per_token) // seq_split
    return norm + x.act_bytes * s * b * h // seq_split + 4 * b * s * x.vocab // x.tp + 9 * b * s


@dataclass(frozen=True)
class ChunkShape:
    """A model chunk as the formulas see it: its layers, how many of them are MoE layers, and
    whether it holds the embedding (pre) or the final norm and head (post)."""

    layers: int
    pre: bool
    post: bool
    moe_layers: int = 0


def moe_layer_activation_bytes(x: ActivationShape) -> int:
    """An MoE layer's saved bytes, an estimate (the dense layers' formula is measured; this one
    is not yet): attention and norms as a dense layer's, the shared expert as a dense MLP of its
    width, and for the T tokens this rank routes (b s, / t under sequence parallelism) the router's
    fp32 input (a copy in 16-bit runs), logits and probabilities [T, E], and for the T k (token,
    expert) pairs it computes (as many as it sends, under even routing; at etp = tp those of all
    b s tokens, gathered under sequence parallelism) the experts' input and output rows (h each)
    and their MLP's (`layer_activation_bytes`'s SwiGLU 4 F or 2 F, / etp). Full recomputation
    keeps only the layer input, as a dense layer."""
    dense = layer_activation_bytes(dataclasses.replace(x, ffn=x.shared_ffn))
    if x.recompute == "full":
        return dense
    tokens = x.micro_batch * x.seq // (x.tp if x.sequence_parallel else 1)
    router = tokens * ((4 * x.hidden if x.act_bytes != 4 else 0) + 2 * 4 * x.experts)
    routed = x.micro_batch * x.seq if x.etp > 1 else tokens
    pairs = routed * x.topk * x.act_bytes * (2 * x.hidden + (4 if x.gated else 2) * x.expert_ffn // x.etp)
    return dense + router + pairs


def chunk_activation_bytes(chunk: ChunkShape, x: ActivationShape) -> int:
    layers = (chunk.layers - chunk.moe_layers) * layer_activation_bytes(x) + \
        (chunk.moe_layers * moe_layer_activation_bytes(x) if chunk.moe_layers else 0)
    return (layers + (embedding_activation_bytes(x) if chunk.pre else 0)
            + (head_activation_bytes(x) if chunk.post else 0) + rope_table_bytes(x, chunk.layers))


def peak_in_flight_bytes(order: Iterable[tuple[bool, int]], sizes: list[int]) -> int:
    """Peak of saved activations along one rank's order of (forward?, chunk) actions: a
    forward adds its chunk's activations, the matching backward frees them (1F1B's bound of
    p - r micro-batches on rank r, GPipe's m, the interleaved warm-up)."""
    alive = peak = 0
    for forward, chunk in order:
        alive += sizes[chunk] if forward else -sizes[chunk]
        peak = max(peak, alive)
    return peak


# ---------------------------------------------------------------------------- transient memory
# What a rank holds beside its model states and saved activations, item by item; the planner
# sums them (planner.rank_prediction) and scripts/bench_memory.py prints them beside the
# measured peak. Each is the item's size at the iteration's peak, the start of backward: the
# activations are all alive, the logits' gradient is made and the head's backward has run.


@dataclass(frozen=True)
class BufferShape:
    """One rank's buckets as the transient items see them."""

    padded: tuple[int, ...]
    """Padded elements per bucket (zero.bucket_size groups at stages 0-2, fetch units at 3)."""
    tied: tuple[int, ...]
    """Buckets holding the tied embedding."""
    tied_twice: bool
    """The embedding and the head are both on this rank: the tied weight's gradient from the
    head waits inside autograd for the embedding's backward."""
    sharding: Sharding
    dp: int
    prefetch: int
    param_bytes: int
    wire_bytes: int
    """Bytes per gradient element on the wire (zero.reduce_dtype)."""
    gloo: bool = False
    """CPU ranks: gloo's reduce-scatter is megazero's ring, which sums a stage-1 bucket in a copy."""
    shard_on_device: bool = True
    """Stage 3: the parameter shard lives in memory where the model computes (not on NVMe, nor
    on a host beside an accelerator), so at dp 1 the parameters view it and nothing is gathered."""

    def largest_unit(self) -> int:
        """The largest bucket apart from a tied weight held on its own (see `tied_twice`)."""
        return max((n for i, n in enumerate(self.padded) if not (self.tied_twice and i in self.tied)), default=0)


def gathered_units_bytes(x: BufferShape) -> int:
    """Stage 3: the unit running and the `prefetch` next ones gathered whole, beside the tied
    weight, gathered from the embedding's forward to its backward (zero/stage3.py). Alone (dp 1)
    a bucket is the rank's slice, viewed where it lies: nothing beside the shard in place."""
    if not x.sharding.parameters or (x.dp == 1 and x.shard_on_device):
        return 0
    tied = sum(x.padded[i] for i in x.tied) if x.tied_twice else 0
    return (tied + (1 + x.prefetch) * x.largest_unit()) * x.param_bytes


def grads_in_flight_bytes(x: BufferShape) -> int:
    """fp32 gradients beside the persistent buffers: the tied weight's gradient from the head,
    held until the embedding's backward adds its rows into it, in place (4 V h / t); at stages
    2/3 also the bucket being filled and the launched ones, full size until reduced, unless one
    rank alone adds fp32 gradients straight into its shard (zero/grads.py)."""
    tied = 4 * sum(x.padded[i] for i in x.tied) if x.tied_twice else 0
    direct = x.dp == 1 and x.wire_bytes == 4
    filling = (1 + launched_in_flight(x)) * 4 * x.largest_unit() if x.sharding.gradients and not direct else 0
    return tied + filling


def launched_in_flight(x: BufferShape) -> int:
    """Stages 2/3: the most of the largest bucket's reductions in flight at once, each holding
    its bucket on the wire and its reduced slice: as many as IN_FLIGHT_BYTES holds, never fewer
    than MIN_IN_FLIGHT, never more than there are buckets (zero/grads.py); none at one rank,
    which reduces at once."""
    if x.dp == 1 or not x.sharding.gradients or not x.largest_unit():
        return 0
    held = x.largest_unit() * x.wire_bytes * (x.dp + 1) // x.dp
    return min(len(x.padded), max(MIN_IN_FLIGHT, IN_FLIGHT_BYTES // held))


def comm_buffer_bytes(x: BufferShape) -> int:
    """Stages 2/3: each launched reduce-scatter's output slice and the ring's incoming slice.
    Stage 1 on gloo: the ring's incoming slice (it sums in the persistent fp32 bucket itself,
    whose other slices are not read again before zero_grad; zero/grads.py)."""
    if x.dp == 1 or x.sharding.replicated:
        return 0
    if not x.sharding.gradients:
        return x.wire_bytes * x.largest_unit() // x.dp if x.gloo else 0
    return (launched_in_flight(x) + 1) * x.largest_unit() // x.dp * x.wire_bytes


def transient_items(x: BufferShape, shape: ActivationShape, last: bool) -> dict[str, int]:
    """Every transient item of one rank at the peak (bytes): gathered units, gradients in
    flight, communication buffers, and on the last stage the head's fp32 logits (this rank's
    V/t of them) with, in backward, their gradient. The optimizer step comes after that peak
    and adds little to the model states (its fused AdamW updates in place, its norm keeps one
    fp32 norm per 256 elements: zero/clip.py's row_norms)."""
    logits = 2 * 4 * shape.micro_batch * shape.seq * shape.vocab // shape.tp
    return {"gathered_units": gathered_units_bytes(x), "grads_in_flight": grads_in_flight_bytes(x),
            "comm_buffers": comm_buffer_bytes(x), "logits": logits if last else 0}


# ---------------------------------------------------------------------------- host memory
# What offloading puts in host memory, item by item: the planner's host figure, and what
# train/host_memory.py weighs against the memory available at start-up.

NVME_STEP_BYTES = 12
"""Host bytes per sub-group element in one NVMe step buffer: fp32 master, exp_avg, exp_avg_sq."""


@dataclass(frozen=True)
class HostShape:
    """One rank's share of what offloading keeps in host memory."""

    shard: int
    """Elements of this rank's parameter shard (padded; Ψ/N at stage 3), all trainable."""
    largest_slice: int
    """This rank's slice of its largest bucket (a stage-3 fetch unit)."""
    offload_optimizer: str
    offload_param: str
    accelerator: bool
    """The compute device is not the host (gradients are copied out for an offloaded step)."""
    param_bytes: int
    sub_group_size: int
    buffer_count: int
    prefetch: int
    staging: int
    """Bytes of the checkpoint writer's host staging buffer (0 when nothing is saved)."""
    snapshot: int = 0
    """Bytes of checkpoint.async_save's host snapshot of the optimizer shard (master weights
    and moments, 12 B per element; none for NVMe state, whose reads are host copies already)."""
    muon: int = 0
    """Of the shard's elements, Muon's (optim.name muon): no second moment."""


def host_items(x: HostShape) -> dict[str, int]:
    """Host bytes by item: optimizer states (offload_optimizer cpu: master and moments, 12 B
    per element), NVMe step buffers (offload_optimizer nvme: buffer_count sub-group buffers of
    master and moments, a sub-group at most zero.sub_group_size elements and never more than
    the shard), the fp32 gradient shard copied out of an accelerator, the parameter shard
    (offload_param cpu) or its fetch window (nvme: `prefetch` + 2 slices read ahead and in use,
    at least the step's 3: staged, read ahead, written back), staging, the asynchronous save's
    snapshot."""
    window = max(x.prefetch + 2, 3) * x.largest_slice * x.param_bytes
    params = {"cpu": x.param_bytes * x.shard, "nvme": window}.get(x.offload_param, 0)
    states = NVME_STEP_BYTES * x.shard - MUON_SAVED_BYTES * x.muon
    step_buffers = x.buffer_count * NVME_STEP_BYTES * min(x.sub_group_size, x.shard)
    return {"optimizer_states": states if x.offload_optimizer == "cpu" else 0,
            "nvme_step_buffers": step_buffers if x.offload_optimizer == "nvme" else 0,
            "grad_shard": 4 * x.shard if x.accelerator and x.offload_optimizer != "none" else 0,
            "param_shard": params, "staging": x.staging, "async_snapshot": x.snapshot}


# ---------------------------------------------------------------------------- communication


def dp_bytes(zs: Sharding, buckets: list[int], dp: int, m: int, wire_bytes: int, param_bytes: int) -> int:
    """Bytes one rank sends over its DP group in one iteration, bucket by bucket as the
    optimizer communicates (`buckets`: padded elements): stage 0 all-reduces each gradient
    bucket once (2Ψ (N-1)/N), stage 1 reduce-scatters once and all-gathers the updated
    parameters (2Ψ (N-1)/N), stage 2 reduce-scatters every micro-batch (m + 1), stage 3
    gathers every bucket once per forward and once per backward as well (3 m; the tied
    embedding too, see zero/stage3.py). The loss is not on it: it is summed over the world with
    the optimizer step's gradient norm (zero/clip.py)."""
    if zs.replicated:
        return sum(all_reduce_volume(n * wire_bytes, dp) for n in buckets)
    reduce = sum(reduce_scatter_volume(n // dp * wire_bytes, dp) for n in buckets)
    gather = sum(all_gather_volume(n // dp * param_bytes, dp) for n in buckets)
    if zs.parameters:
        return m * (reduce + 2 * gather)
    return (m if zs.gradients else 1) * reduce + gather


def tp_bytes(chunks: list[ChunkShape], x: ActivationShape, m: int, sequence_parallel_grads: int = 0) -> int:
    """Bytes one rank sends over its TP group in one iteration. Per layer and micro-batch
    four all-reduces of sbh activations (two forward after the row-parallel linears, two
    backward before the column-parallel ones); the embedding's forward and the head's
    backward one each; the cross entropy three fp32 [b, s]. Full recomputation replays one
    more: the attention's (the replay stops early, once the MLP's last saved input exists,
    before the MLP's own all-reduce).

    With sequence parallelism each all-reduce becomes an all-gather and a reduce-scatter of
    the sequence-split stream (half the volume each), and each column-parallel matmul (two
    per layer, and the head) gathers its saved input shard once more in backward: per layer
    10 halves (full recompute: 13, its replay gathers twice and reduce-scatters once), the
    embedding 2, the head 3; plus, once per iteration, the all-reduce of the
    `sequence_parallel_grads` fp32 elements of partial LayerNorm/bias gradients."""
    t = x.tp
    # An MoE layer without a shared expert has no dense MLP on the TP group, so that layer drops
    # the MLP's calls: 2 all-reduces, or under SP 5 halves (6 with full recompute's replayed
    # gather); its routed experts' own calls are `moe_tp_bytes`.
    mlp_free = 0 if x.shared_ffn else 1
    if x.sequence_parallel:
        per_call = all_gather_volume(x.micro_batch * x.seq // t * x.hidden * x.act_bytes, t)
        calls = sum(c.layers * (13 if x.recompute == "full" else 10) + 2 * c.pre + 3 * c.post
                    - mlp_free * c.moe_layers * (6 if x.recompute == "full" else 5) for c in chunks)
    else:
        per_call = all_reduce_volume(x.micro_batch * x.seq * x.hidden * x.act_bytes, t)
        calls = sum(c.layers * (5 if x.recompute == "full" else 4) + c.pre + c.post - mlp_free * c.moe_layers * 2
                    for c in chunks)
    loss = sum(3 * all_reduce_volume(4 * x.micro_batch * x.seq, t) for c in chunks if c.post)
    grads = all_reduce_volume(4 * sequence_parallel_grads, t) if x.sequence_parallel else 0
    experts = sum(c.moe_layers for c in chunks) * moe_tp_bytes(x, x.recompute == "full")
    return m * (calls * per_call + loss + experts) + grads


def moe_tp_bytes(x: ActivationShape, replayed: bool = False) -> int:
    """Bytes one rank sends over its TP group per MoE layer and micro-batch for the routed experts
    (model/moe.py, parallel/dispatch.py), dropless; the shared expert is a dense MLP (tp_bytes).
    Under sequence parallelism the tokens per expert are summed over tp (fp32 [E], all-reduced). At
    etp = tp the experts are a TP region: without sequence parallelism the output [T, h] is
    all-reduced forward, the tokens' gradient [T, h] and the probabilities' [T, k] (fp32)
    backward; with it each rank's T / t rows of the tokens, of their chosen experts (int64) and
    probabilities are all-gathered and the output reduce-scattered forward, and backward the
    transposes (the output's gradient gathered, the tokens' and probabilities' reduce-scattered).
    `replayed`: full recomputation runs the forward's calls again (the layer's losses, computed
    after them, keep the replay going)."""
    t = x.tp
    if t == 1:
        return 0
    tokens = x.micro_batch * x.seq
    counts = all_reduce_volume(4 * x.experts, t) if x.sequence_parallel else 0
    if x.etp == 1:
        return counts * (2 if replayed else 1)
    rows, probs = tokens * x.hidden * x.act_bytes, tokens * x.topk * 4
    if x.sequence_parallel:
        gathered = all_gather_volume((rows + tokens * x.topk * 8 + probs) // t, t)
        forward = counts + gathered + reduce_scatter_volume(rows // t, t)
        backward = all_gather_volume(rows // t, t) + reduce_scatter_volume((rows + probs) // t, t)
    else:
        forward = all_reduce_volume(rows, t)
        backward = all_reduce_volume(rows, t) + all_reduce_volume(probs, t)
    return forward * (2 if replayed else 1) + backward


def pp_bytes(pp: int, vpp: int, pp_rank: int, m: int, x: ActivationShape) -> int:
    """Bytes one pipeline rank sends in one iteration: each micro-batch's activation [b, s, h]
    forward out of every chunk but the last virtual stage, its gradient back out of every
    chunk but the first."""
    stages = [c * pp + pp_rank for c in range(vpp)]
    sends = sum(st < pp * vpp - 1 for st in stages) + sum(st > 0 for st in stages)
    seq_split = x.tp if x.sequence_parallel else 1
    return m * sends * x.micro_batch * x.seq * x.hidden * x.act_bytes // seq_split


def cp_bytes(x: ActivationShape, layers: int, m: int) -> int:
    """Bytes one rank sends over its context-parallel group per iteration: per layer and
    micro-batch, of one (s/cp) x h/t tensor L (K and V: L_g, g/t wide), ring: forward
    2 (cp-1) L_g (the K/V blocks), backward as many plus 2 cp L_g of fp32 K/V gradients;
    Ulysses: (cp-1)/cp of 2 L + 2 L_g each way (q, k, v, the output; K/V groups that do not
    split over cp travel widened to one per head). Recomputation runs the forward's again:
    full all of it; selective the ring, or Ulysses' q, k, v (its replay stops at the core's
    last saved tensor, before the output's all-to-all)."""
    if x.cp == 1:
        return 0
    per_width = x.micro_batch * x.seq * x.act_bytes
    local, local_kv = per_width * x.q // x.tp, per_width * x.kv // x.tp
    if x.cp_impl == "ring":
        forward = replay = 2 * (x.cp - 1) * local_kv
        backward = forward + 2 * x.cp * local_kv * 4 // x.act_bytes
    else:
        groups = x.kv // x.head_size // x.tp
        widened = local if groups % x.cp else local_kv
        forward = backward = (x.cp - 1) * (2 * local + 2 * widened) // x.cp
        replay = forward if x.recompute == "full" else (x.cp - 1) * (local + 2 * widened) // x.cp
    return m * layers * (forward + (replay if x.recompute != "none" else 0) + backward)


def expert_dispatch_bytes(tokens: int, topk: int, hidden: int, act_bytes: int, experts: int, ep: int,
                          dispatcher: str = "alltoall", replayed: bool = False) -> int:
    """Bytes one rank sends over its expert-parallel group per MoE layer and micro-batch, for the
    `tokens` it routes (T: b s / cp, / tp under sequence parallelism), dropless
    (parallel/dispatch.py; the byte counters count what leaves a rank).

    alltoall: forward, the counts [ep, E/ep] int64 (all but its own row leave: 8 E (ep-1)/ep),
    then the T k pairs bound for other ranks' experts, and the same rows back to combine;
    backward, the two exchanges reversed. Which pairs leave depends on the routing: this is
    the expectation under even routing, T k (ep-1)/ep rows of h x act_bytes each way, and exact
    whenever each rank's pairs reach every EP rank's experts equally (the test's routing).
    allgather: every rank's T k pairs (the longest rank's, padded; dropless all have T k) are
    gathered, (ep-1) T k h x act_bytes, with the counts, (ep-1) 8 E, and their outputs
    reduce-scattered back as much; backward the transposes: exact for any routing.
    `replayed`: full recomputation runs the forward's exchanges again."""
    if ep == 1:
        return 0
    if dispatcher == "allgather":
        counts, rows = all_gather_volume(8 * experts, ep), (ep - 1) * tokens * topk * hidden * act_bytes
    else:
        counts, rows = all_to_all_volume(8 * experts, ep), tokens * topk * (ep - 1) * hidden * act_bytes // ep
    forward = counts + 2 * rows
    return forward * (2 if replayed else 1) + 2 * rows


def embed_bytes(tied_numel: int, pp: int) -> int:
    """The tied embedding's fp32 gradient (this rank's part of it) summed over the first and
    last pipeline stage."""
    return all_reduce_volume(4 * tied_numel, 2) if pp > 1 else 0


# ---------------------------------------------------------------------------- time


def pipeline_bubble(pp: int, vpp: int, m: int, schedule: str = "1f1b") -> float:
    """Idle fraction of a pipeline rank: (p - 1) / (v m + p - 1) for GPipe, 1F1B (v = 1) and
    the interleaved schedule (backward = 2 x forward; equals the executor's simulated orders).
    zbh1, with T_F = T_B = T_W: each rank idles (p - 1)(T_F + T_B - T_W) = p - 1 forward-times
    of 3m + p - 1 (Qi et al., 2023), a third of 1F1B's idle time 3(p - 1); with m < p there
    are too few W passes to fill the cool-down and it idles p - m more (the executor's
    simulated orders, exactly)."""
    if pp == 1:
        return 0.0
    if schedule == "zbh1":
        idle = pp - 1 + max(0, pp - m)
        return idle / (3 * m + idle)
    return (pp - 1) / (vpp * m + pp - 1)


def simulated_bubble(pp: int, vpp: int, m: int, schedule: str) -> float:
    """The idle fraction of the executor's own orders, replayed in simulated time: every rank
    runs its next action as soon as its input exists, a chunk's forward taking 1 / v and its
    backward 2 / v time units (zbh1: B and W 1 each), transfers free (the check on
    `pipeline_bubble`)."""
    orders = {r: ORDERS[schedule](pp, vpp, r, m) for r in range(pp)}
    split = any(a.weight for a in orders[0])
    feeder_of = {message_target(a, pp, vpp, r): (r, a) for r in range(pp) for a in orders[r]}
    finished: dict = {}
    clock, position = [0.0] * pp, [0] * pp
    while any(position[r] < len(orders[r]) for r in range(pp)):
        for r in range(pp):
            while position[r] < len(orders[r]):
                a = orders[r][position[r]]
                feeder = feeder_of.get((r, a))
                if feeder is not None and feeder not in finished:
                    break  # wait for the neighbour's tensor
                start = max(clock[r], finished.get(feeder, 0.0))
                clock[r] = finished[(r, a)] = start + (1 if a.forward or split else 2) / vpp
                position[r] += 1
    return 1 - 3 * m / max(clock)


def step_seconds(flops: float, peak_flops: float, efficiency: float, bubble: float, tp_s: float, pp_s: float,
                 dp_s: float, dp_overlap: float, cp_s: float = 0.0, muon_flops: float = 0.0,
                 muon_s: float = 0.0, ep_s: float = 0.0) -> dict[str, float]:
    """One iteration of one rank: compute at `efficiency` x peak stretched by the bubble, TP,
    PP, context-parallel and expert-parallel transfers on the critical path (a bound: ring
    attention overlaps its transfers with the blocks), DP communication hidden behind backward except
    (1 - dp_overlap) of it; under optim.name muon, its Newton-Schulz FLOPs and exchange after
    the backward, exposed."""
    compute = flops / (peak_flops * efficiency)
    parts = {"compute": compute, "bubble": compute * bubble / (1 - bubble), "tp": tp_s, "pp": pp_s,
             "dp": dp_s * (1 - dp_overlap), "cp": cp_s}
    if ep_s:  # the experts' token exchange: the next matmul waits for it
        parts["ep"] = ep_s
    if muon_flops or muon_s:
        parts["muon"] = muon_flops / (peak_flops * efficiency) + muon_s
    parts["total"] = sum(parts.values())
    return parts


def mfu(tokens_per_sec: float, flops_per_token: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization: model FLOPs per second over all GPUs' peak."""
    return tokens_per_sec * flops_per_token / (gpus * peak_flops)
