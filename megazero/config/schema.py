"""The run configuration's schema: one dataclass per section, a docstring under each field.

The docstring under each field is its documentation: `--help-config` and README's key table
are generated from it (config/help.py), so they cannot drift. Parsing (config/parse.py), the
rules (config/rules.py) and resolution (config/resolve.py) live beside it; this module imports
nothing from megazero but the error type.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from megazero.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value is missing, mistyped or inconsistent (one-line message)."""


@dataclass
class ModelConfig:
    num_layers: int = 2
    """Transformer blocks."""
    hidden_size: int = 64
    """Model width h."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size (unless kv_channels sets the head size) and be divisible by
    parallel.tp."""
    seq_length: int = 64
    """Tokens per sample (context length); also the number of learned positions."""
    vocab_size: Union[int, Literal["auto"]] = "auto"
    """Real vocabulary size, or auto: the size of data.tokenizer (512 for mock data without a tokenizer).
    Padded internally to a multiple of 128 x tp (loss unchanged)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    ffn_hidden_size: int = 0
    """MLP width; 0 means 4 x hidden_size (GPT-2)."""
    layernorm_eps: float = 1e-5
    """LayerNorm epsilon (GPT-2 uses 1e-5)."""
    init_std: float = 0.02
    """Std of the normal init; residual output projections use init_std / sqrt(2 L)."""

    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Block and final norms: layernorm (GPT-2) or rmsnorm (Llama); epsilon model.layernorm_eps."""
    position_embedding: Literal["learned", "rope"] = "learned"
    """learned (GPT-2: a table of seq_length positions) or rope (rotary, Llama: q and k rotated per position)."""
    rope_base: float = 10000.0
    """Rotary base theta (Llama 2: 10000, Llama 3: 500000)."""
    rope_scaling: Literal["none", "llama3"] = "none"
    """Rotary frequency scaling: none, or llama3 (Llama 3.1/3.2: the rope_* factors below, as Hugging Face's)."""
    rope_scaling_factor: float = 8.0
    """llama3 scaling: factor by which long wavelengths are stretched (HF rope_scaling.factor)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: HF rope_scaling.low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: HF rope_scaling.high_freq_factor."""
    rope_original_max_position: int = 8192
    """llama3 scaling: the context length of pretraining (HF rope_scaling.original_max_position_embeddings)."""
    activation: Literal["gelu", "swiglu", "squared_relu"] = "gelu"
    """MLP: gelu (GPT-2, tanh form), swiglu (Llama: silu(gate) x up, each ffn_size wide) or squared_relu."""
    num_query_groups: int = 0
    """Grouped-query attention: K/V heads, each shared by num_heads / num_query_groups query heads
    (1 = multi-query); 0 means num_heads (plain multi-head attention). Divisible by parallel.tp."""
    bias: bool = True
    """Biases of the linear layers (Llama: false)."""
    tie_embeddings: bool = True
    """The output layer shares the token embedding's weight (GPT-2) or has its own (false: Llama)."""
    zero_centered_norm: bool = False
    """Norm weights stored as w and applied as 1 + w (initialised to 0), for LayerNorm and RMSNorm alike, so
    weight decay pulls them toward 1, not 0 (Megatron's --apply-layernorm-1p)."""

    num_experts: int = 0
    """Mixture of experts: routed experts per MoE layer (Megatron's --num-experts); 0 means a dense model.
    MoE layers are not built yet: a value above 0 is refused at start-up."""
    moe_router_topk: int = 2
    """MoE: experts each token is routed to (at most num_experts)."""
    moe_ffn_hidden_size: int = 0
    """MoE: each routed expert's MLP width (fine-grained experts); 0 means the MLP width of dense layers."""
    moe_layer_freq: Union[int, list] = 1
    """MoE: which layers are MoE: an integer k (layers 0, k, 2k, ... are MoE) or a 0/1 list with one entry
    per layer, e.g. [0, 1, 1, 1] for DeepSeek-style first layers dense; dense layers use ffn_hidden_size."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """MoE: MLP width of the shared expert every token also passes through (Qwen2-MoE, DeepSeek); 0: none."""
    moe_shared_expert_gate: bool = False
    """MoE: scale the shared expert's output by a sigmoid gate of the token (Qwen2-MoE)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """MoE: router scores from the logits: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """MoE: softmax over all experts before the top-k (OLMoE, Qwen2-MoE); false: top-k of the logits, then
    softmax over the k chosen (Mixtral, Qwen3-MoE)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """MoE: multiply the chosen experts' weights by this factor (DeepSeek-V3: 2.5); null: unscaled."""
    moe_router_num_groups: int = 0
    """MoE: group-limited routing (DeepSeek-V3): experts split into this many equal groups, each token
    choosing its top-k among the experts of moe_router_group_topk groups; 0: off."""
    moe_router_group_topk: int = 0
    """MoE: groups each token may route to under moe_router_num_groups (at most num_groups)."""
    moe_router_enable_expert_bias: bool = False
    """MoE: aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing the
    top-k, updated after each global batch by moe_router_bias_update_rate x sign(mean count - count), with
    counts summed over every data rank; checkpointed. Needs moe_router_score_function sigmoid."""
    moe_router_bias_update_rate: float = 1e-3
    """MoE: step size of the expert-bias update (DeepSeek-V3: 1e-3)."""
    moe_load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    """MoE: load-balancing loss: aux_loss (per micro-batch, counts over tp x cp), seq_aux_loss (per sequence,
    DeepSeek-V2), global_aux_loss (counts also over dp) or none; scaled by moe_aux_loss_coeff."""
    moe_aux_loss_coeff: float = 0.0
    """MoE: coefficient of the load-balancing loss (0: off; 1e-2 is a usual start)."""
    moe_z_loss_coeff: float = 0.0
    """MoE: coefficient of the router z-loss, mean(logsumexp(logits)^2) (0: off; 1e-3 is a usual start)."""
    moe_capacity_factor: Optional[float] = None
    """MoE: expert capacity as a multiple of the tokens an expert gets under perfect balance; tokens beyond it
    are dropped (they pass through the residual); null: dropless."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """MoE with moe_capacity_factor: which tokens an over-full expert drops: probs (lowest routing weight) or
    position (latest in the batch)."""
    moe_pad_to_capacity: bool = False
    """MoE with moe_capacity_factor: pad every expert's input to its full capacity (fixed shapes)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm of q and k after their projection, before rotary embeddings (Qwen3): one weight of
    head size shared by all heads, epsilon layernorm_eps."""
    qk_layernorm_scope: Literal["head", "projection"] = "head"
    """With qk_layernorm: head normalises each head's width (Qwen3, Megatron's --qk-layernorm); projection the
    whole q and k projections, with weights as wide (OLMoE); tensor parallelism (tp > 1) splits those, so it
    needs tp 1."""
    kv_channels: int = 0
    """Head size when it is not hidden_size / num_heads (Qwen3: 128 with h 2048 and 32 heads): q is
    num_heads x kv_channels wide, k and v query groups x kv_channels; 0 means hidden_size / num_heads."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections even when model.bias is false (Qwen2); the output projection
    and the MLP keep model.bias."""

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """K/V heads (num_query_groups, or num_heads when 0)."""
        return self.num_query_groups or self.num_heads

    @property
    def head_dim(self) -> int:
        """Each attention head's width: kv_channels, or hidden_size / num_heads when 0."""
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def q_width(self) -> int:
        """The query projection's width (and the output projection's input): num_heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """The key (and the value) projection's width: query groups x head_dim."""
        return self.query_groups * self.head_dim

    @property
    def moe_ffn_size(self) -> int:
        """Each routed expert's MLP width (moe_ffn_hidden_size, or the dense layers' width when 0)."""
        return self.moe_ffn_hidden_size or self.ffn_size


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree (ranks that split each layer)."""
    pp: int = 1
    """Pipeline-parallel degree (stages of contiguous layers)."""
    vpp: int = 1
    """Model chunks per pipeline rank (interleaved schedule when > 1)."""
    schedule: Literal["gpipe", "1f1b", "interleaved", "zbh1"] = "1f1b"
    """Pipeline schedule, used when pp > 1. zbh1: zero-bubble ZB-H1 (1F1B's memory, weight
    gradients deferred into the cool-down; vpp 1, no train.compile)."""
    pp_layers: Optional[list] = None
    """Optional uneven split: layers per pipeline stage, e.g. [3, 5]; sums to num_layers."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: LayerNorm, dropout and the residual stream split along
    the sequence over the TP ranks (activation memory / tp); TP all-reduces become
    all-gather / reduce-scatter pairs. A no-op at tp 1; seq_length divisible by tp; no LoRA."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence (each holds 2 of 2 x cp chunks,
    zig-zag, so causal work is even); world = tp x cp x pp x dp; ZeRO shards over dp x cp.
    Megatron's --context-parallel-size; DeepSpeed's Ulysses sequence-parallel size."""
    cp_impl: Literal["ring", "ulysses"] = "ring"
    """How attention sees the whole sequence under cp > 1: ring (K/V blocks passed around the
    cp ranks, merged by log-sum-exp) or ulysses (all-to-all to whole sequences of heads / cp;
    num_heads divisible by tp x cp)."""
    ep: int = 1
    """Expert-parallel degree: ranks that split the routed experts (num_experts / ep each), tokens reaching
    them by an all-to-all. Experts fold the tp x cp x dp ranks of each pipeline stage as etp x ep x expert-dp,
    so ep can span data- and context-parallel ranks (Megatron's --expert-model-parallel-size)."""
    etp: int = 0
    """Expert tensor-parallel degree: ranks that split each expert's MLP; 0 means parallel.tp (the TP group
    splits each expert as it splits the dense MLP), 1 keeps experts whole (the TP ranks fold into ep x
    expert-dp); other values are refused (Megatron's --expert-tensor-parallel-size)."""
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts under ep > 1: alltoall (each rank sends only the routed tokens to the
    ranks holding their experts) or allgather (every EP rank gathers all tokens, keeps those for its experts,
    and the outputs return by a reduce-scatter); Megatron's --moe-token-dispatcher-type."""

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel degree: etp, or tp when 0."""
        return self.etp or self.tp


@dataclass
class ZeroConfig:
    stage: int = 0
    """0: DP all-reduce; 1: + sharded optimizer states; 2: + sharded gradients; 3: + sharded parameters."""
    sub_group_size: int = 1_000_000_000
    """Largest number of elements one optimizer sub-group step touches. With offload_optimizer nvme
    the step holds buffer_count x sub_group_size x 12 bytes of host memory: left at this default,
    it is lowered at start-up to what the memory available allows (one line says so); a value set
    that cannot fit is refused, naming the largest that does."""
    bucket_size: int = 25_000_000
    """Elements per gradient-communication bucket (stages 0-2; stage 3 communicates per module)."""
    prefetch: int = 1
    """Stage 3: modules whose parameters are gathered ahead of the one running (0: none)."""
    initial_loss_scale: float = 65536.0
    """fp16: starting loss scale (a power of two)."""
    loss_scale_window: int = 1000
    """fp16: clean steps in a row before the loss scale doubles."""
    hysteresis: int = 2
    """fp16: overflows in a row tolerated before the loss scale halves."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never drops below this."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Data-parallel gradient communication dtype. Gradients always accumulate in fp32 over
    micro-batches (Megatron's main_grad); bf16 halves the bytes reduced over DP."""
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    """Where the fp32 master weights and Adam moments live (stages 1-3): none (the device),
    cpu (host memory, stepped on the CPU: ZeRO-Offload) or nvme (swap files under
    zero.nvme_path, streamed one sub-group at a time: ZeRO-Infinity)."""
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    """Stage 3: where each rank's 16-bit parameter shard lives between uses: none (the
    device), cpu (host memory) or nvme (a swap file under zero.nvme_path). A unit's slice
    is read one unit before its all-gather is due (in the prefetch order), all-gathered at
    that fixed point and dropped after."""
    nvme_path: str = ""
    """offload_optimizer / offload_param nvme: a directory on a fast local disk (created when
    missing)."""
    pin_memory: bool = True
    """Page-lock offloaded host buffers when a GPU is present (faster device<->host copies)."""
    buffer_count: int = 4
    """offload_optimizer nvme: sub-group buffers in host memory (>= 2: one is read while the
    previous one is written back); the step holds buffer_count x sub_group_size x 12 bytes."""


@dataclass
class TrainConfig:
    iters: int = 100
    """Iterations (optimizer steps) to train."""
    micro_batch_size: int = 4
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int = 16
    """Samples per iteration over all DP ranks: micro_batch_size x accumulation x dp."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision; 16-bit keeps fp32 master weights."""
    seed: int = 1234
    """Seeds weights, data order, dropout."""
    log_interval: int = 1
    """Iterations between log lines / JSONL records."""
    eval_interval: int = 0
    """Iterations between validation runs (0: never)."""
    eval_iters: int = 10
    """Batches per validation run."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation."""
    rampup_batch_size: Optional[list] = None
    """Batch-size ramp-up as Megatron's --rampup-batch-size: START INCREMENT SAMPLES. The global batch starts
    at START and grows by INCREMENT in equal steps over the first SAMPLES samples, up to global_batch_size
    (START and INCREMENT multiples of micro_batch_size x dp); the LR schedule then counts samples."""
    compile: bool = False
    """torch.compile each transformer block (fuses its elementwise work; the first steps compile)."""
    max_skipped_steps: int = 10
    """Stop the run after this many consecutive steps skipped for a non-finite gradient norm or loss."""
    timeout_minutes: float = 10.0
    """Timeout of every process group (tp, dp, pp, ..., gloo's communication thread's too): a collective or
    p2p op waiting longer on a stopped or dead peer fails, with one line per rank."""
    exit_duration_minutes: float = 0.0
    """Save and exit cleanly once this many minutes have passed since start-up (0: never), like
    Megatron's --exit-duration-in-mins: set it a little under a job's time limit."""
    replica_check_interval: Optional[int] = None
    """Iterations between replica checks (and before every checkpoint save): ranks that should hold equal
    values (DP replicas of the parameters at ZeRO 0-2, TP-replicated parameters at every stage, ZeRO 0's
    replicated optimizer state) compare a digest; a mismatch stops the run naming the ranks and the
    parameter, with no checkpoint written from that state. Unset: train.log_interval; 0: off."""
    rerun_on: Literal["nan", "spike", "none"] = "nan"
    """Rerun an iteration from the same state and batch when its loss or gradient norm is non-finite (nan),
    or also when the loss exceeds train.spike_factor x the largest of the recent losses (spike; one more
    scalar all-reduce per step). The rerun firing again blames the data (the batch is skipped and named);
    a clean rerun blames the hardware (the rank is named, the rerun's result kept). none: no rerun."""
    spike_factor: float = 10.0
    """train.rerun_on spike: a loss above this x the largest of the last 100 iterations' losses is a spike."""
    straggler_interval: Optional[int] = None
    """Iterations between straggler checks: the ranks gather their compute times (forward and backward,
    optimizer; collective waits left out) and a rank above train.straggler_factor x the median is named.
    Unset: train.log_interval; 0: off."""
    straggler_factor: float = 1.5
    """A rank whose compute time of a phase exceeds this x the ranks' median is named as a straggler."""
    inject_fault: Optional[str] = None
    """Testing only: KIND:RANK:ITER injects a silent fault on global rank RANK at iteration ITER: bitflip
    (an exponent bit of one replicated parameter element, after that iteration's step), transient_nan (a
    NaN loss on the iteration's first execution only), persistent_nan (on every execution), slow (a
    compute-sized sleep each iteration from ITER on). Only in a first attempt (not after a restart)."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon", "sgd"] = "adamw"
    """The optimizer: adamw; muon: Muon (momentum orthogonalised by Newton-Schulz) on each block's
    weight matrices (attention q, k, v and output, MLP up, gate and down; in an MoE layer each expert's
    apart), AdamW (the other optim.* keys) on embeddings, the output layer, norms, biases and MoE
    routers; sgd: torch.optim.SGD's update on every parameter
    (momentum optim.sgd_momentum, weight decay as L2 added to the gradient, no Nesterov)."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to biases and LayerNorm); under optim.name sgd, SGD's L2
    term (weight_decay x weight added to the gradient)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""
    warmup_iters: int = 0
    """Linear warmup iterations."""
    warmup_fraction: float = 0.0
    """Linear warmup as a fraction of the decay iterations (optim.decay_iters, else train.iters), as Megatron's
    --lr-warmup-fraction; 0: off. Not together with optim.warmup_iters."""
    warmup_style: Literal["linear", "log"] = "linear"
    """Warm-up shape: linear, or log (DeepSpeed WarmupLR's default: lr x ln(1 + i) / ln(1 + warm-up iterations)
    after i iterations)."""
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    """LR decay after warmup."""
    decay_iters: int = 0
    """Iterations over which LR decays to min_lr; 0 means train.iters."""
    warmup_samples: int = 0
    """Linear warmup in samples instead of iterations (Megatron's --lr-warmup-samples); 0: off."""
    decay_samples: int = 0
    """Decay length in samples instead of iterations (Megatron's --lr-decay-samples); 0: off. With either
    samples key the schedule counts samples (each applied step adds its global batch, ramp-up included)."""
    decoupled_lr: Optional[float] = None
    """Peak LR of the input embedding and the output layer (Megatron's --decoupled-lr); None: optim.lr.
    They follow the same warmup and decay, to optim.decoupled_min_lr."""
    decoupled_min_lr: Optional[float] = None
    """Their LR at the end of decay (Megatron's --decoupled-min-lr); None: optim.min_lr."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    muon_lr: float = 0.02
    """optim.name muon: Muon's peak learning rate (the schedule scales it as it scales optim.lr)."""
    muon_momentum: float = 0.95
    """optim.name muon: momentum of Muon's buffer (lerp toward each gradient by 1 - momentum)."""
    muon_nesterov: bool = True
    """optim.name muon: Nesterov momentum (orthogonalise the gradient lerped toward the buffer)."""
    muon_ns_steps: int = 5
    """optim.name muon: Newton-Schulz iterations per matrix and step."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    """optim.name muon: how a matrix's (out, in) shape scales muon_lr, as torch.optim.Muon's adjust_lr_fn:
    original sqrt(max(1, out/in)); match_rms_adamw 0.2 sqrt(max(out, in)) (then AdamW's LR and decay fit)."""
    sgd_momentum: float = 0.9
    """optim.name sgd: momentum of SGD's buffer (buffer = momentum x buffer + gradient; the first step's
    buffer is the gradient), as Megatron's --sgd-momentum."""
    override_schedule: bool = False
    """On resume, use this config's LR schedule (lr, min_lr, warmup_iters, decay_iters, decay_style)
    instead of the checkpoint's (Megatron's --override-opt_param-scheduler)."""


@dataclass
class DataConfig:
    mock: bool = False
    """Synthetic deterministic token stream (tests, benchmarks)."""
    prefix: Optional[list] = None
    """Indexed-dataset prefixes, optionally weighted: [P1, P2] or [0.3, P1, 0.7, P2]; on the command line
    --data.prefix 0.3 P1 0.7 P2."""
    split: str = "969,30,1"
    """Train/valid/test proportions."""
    tokenizer: Optional[str] = None
    """Tokenizer spec KIND:PATH: gpt2bpe:DIR (vocab.json + merges.txt) or gpt2bpe:VOCAB.json,MERGES.txt;
    sentencepiece:FILE.model or sentencepiece:DIR (tokenizer.model, Llama 2 style); hf:DIR or hf:FILE.json (a
    Hugging Face tokenizer.json, Llama 3 style); or a bare DIR, a Hugging Face model directory whose tokenizer
    files decide (vocab.json + merges.txt, else tokenizer.model, else tokenizer.json)."""
    cache_dir: Optional[str] = None
    """Where sample indices are cached (default: beside the data)."""
    pack_examples: bool = False
    """Fine-tuning datasets (those with a loss mask, from preprocess_data.py --prompt-key/--completion-key):
    false: each sample is one example, truncated or padded to seq_length (padding and prompts count nothing
    in the loss); true: examples packed back to back across their boundaries. Other datasets are always packed."""
    eod_mask_loss: bool = False
    """Megatron's --eod-mask-loss: the loss leaves out the prediction made at each end-of-document token (the next
    document's first token), for indexed and streamed data alike; needs data.tokenizer (its end-of-document id)."""
    reset_position_ids: bool = False
    """Megatron's --reset-position-ids: position ids restart at 0 after each end-of-document token of a sample, for
    indexed and streamed data alike; needs data.tokenizer (its end-of-document id) and parallel.cp 1."""
    reset_attention_mask: bool = False
    """Megatron's --reset-attention-mask: a token attends only to the earlier tokens of its own document (the
    end-of-document token ends it); needs data.tokenizer and parallel.cp 1. Attention then takes an explicit mask
    (no flash kernel: SDPA's memory-efficient or math one)."""
    stream: Optional[list] = None
    """Train straight from raw text, tokenized on the fly (docs/data.md): one source, or weighted [W1, SRC1, W2,
    SRC2, ...] (weights count tokens). A source is a path, folder or glob of .jsonl, .jsonl.gz, .parquet or .txt files
    (one document a line, a row, a file) or hf:NAME[:CONFIG][:SPLIT] (datasets.load_dataset streaming; a local folder
    of data files loads offline). Excludes data.prefix and data.mock."""
    stream_key: str = "text"
    """data.stream: the field holding a document's text (JSONL key, Parquet column, dataset field)."""
    stream_valid: Optional[str] = None
    """data.stream: a source whose first documents are the validation samples."""
    stream_valid_docs: int = 0
    """data.stream: hold the first N documents of each source out of training, as the validation samples
    (without data.stream_valid)."""
    loader_workers: int = -1
    """data.stream: loader processes tokenizing per rank (0: in the trainer's process; -1: the cores left over
    after the ranks of this node, at most 16)."""


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to save sharded checkpoints into."""
    load: Optional[str] = None
    """Directory to resume from (its `latest`)."""
    interval: int = 0
    """Iterations between saves (0: only at the end)."""
    keep_last: int = 0
    """Keep only this many newest checkpoints (0: keep all)."""
    iteration: int = 0
    """Resume from iter_{iteration} instead of `latest` (0: latest)."""
    save_model_16bit: bool = False
    """With each checkpoint also write model_16bit.safetensors: the whole model gathered in 16 bits, by rank 0."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """A save that fails (disk full, unwritable directory): stop the run, or keep training and retry at the next
    interval (the last save of a run always stops it). Either way the previous checkpoint stays intact."""
    async_save: bool = False
    """Write checkpoints in the background: at a save each rank copies its shard to host memory
    (kept for the next save: 12 bytes per parameter of its shard more) and a thread writes it
    while training goes on; the checkpoint is sealed and `latest` advanced at the first
    iteration after every rank finished. The next save, a signal's save and the end of the run
    wait for it."""
    save_optimizer: bool = True
    """Checkpoints hold the optimizer state (Adam's moments). false (Megatron's --no-save-optim): about
    a third of the size, the weights alone; such a checkpoint can be fine-tuned from (loaded with
    checkpoint.load_optimizer false), not resumed bitwise."""
    save_rng: bool = True
    """Checkpoints hold every rank's RNG streams (dropout). false (Megatron's --no-save-rng): loaded with
    checkpoint.load_rng false, the streams are reseeded from train.seed and the iteration."""
    load_optimizer: bool = True
    """Load the checkpoint's optimizer state. false (Megatron's --no-load-optim): its weights, loop position
    and LR schedule, with Adam's moments, step count and loss scale started afresh (needed for a
    checkpoint saved with checkpoint.save_optimizer false)."""
    load_data_state: bool = True
    """data.stream: continue the checkpoint's data stream where it stopped. false: start the stream anew (needed
    after a change of data.stream's sources or weights); the weights, optimizer and loop position still load."""
    load_rng: bool = True
    """Load the checkpoint's RNG streams. false (Megatron's --no-load-rng): reseed them from train.seed and
    the iteration (needed for a checkpoint saved with checkpoint.save_rng false)."""
    init_from_hf: Optional[str] = None
    """Start from a Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE directory
    (config.json + model.safetensors, its index or pytorch_model.bin) at any layout; each rank reads
    only its slices. The model section must match its config.json (model.vocab_size auto takes its vocabulary). Not read when the run
    resumes from checkpoint.load (or restarts): the checkpoint's values win."""


@dataclass
class FinetuneConfig:
    lora_rank: int = 0
    """LoRA rank r (0: off, every weight trains). With r > 0 the base weights are frozen and
    only the adapters of finetune.lora_targets train."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter's output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input (as PEFT's lora_dropout)."""
    lora_targets: list = field(default_factory=lambda: ["c_attn"])
    """HF GPT-2 module names adapted, matched as PEFT's target_modules: c_attn, c_proj (attention's and
    the MLP's), c_fc, mlp.c_proj, attn.c_proj; the Llama family's q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj (Mixtral's w1, w3, w2). In an MoE layer the MLP's targets adapt each
    expert."""


@dataclass
class LoggingConfig:
    jsonl: Optional[str] = None
    """Path of the metrics JSONL file (one object per logged iteration)."""
    wandb: bool = False
    """Log to Weights & Biases (offline when there is no network)."""
    wandb_project: str = "megazero"
    """Weights & Biases project name."""
    timers: bool = False
    """Per-phase times (forward, backward, optimizer, waiting on communication) and bytes sent
    per iteration over DP/TP/PP on the log line and in the JSONL (on GPUs each phase boundary
    synchronizes the device, a small cost)."""
    print_config: bool = False
    """Print the full resolved config at start-up (`--print-config`); it is always written to
    the run directory as config.yaml."""
    tensorboard: str | None = None
    """TensorBoard log directory: Megatron-LM's scalars under its tag names (`pip install tensorboard`)."""
    profiler: Literal["none", "torch", "nsys"] = "none"
    """Profile the training steps that begin with logging.profile_start to profile_end - 1 steps done
    (the iterations logged as profile_start + 1 to profile_end), as Megatron-LM's --profile. torch: a
    torch.profiler trace (CPU ops, and CUDA kernels on a GPU) on each rank of logging.profile_ranks,
    written as rank{R}.iterations_{A}-{B}.pt.trace.json beside the TensorBoard logs (logging.tensorboard,
    else the run directory: checkpoint.save or the JSONL's), for Perfetto, chrome://tracing or
    TensorBoard's profiler plugin; nsys: a CUDA profiler range for `nsys profile --capture-range=cudaProfilerApi`."""
    profile_start: int = 10
    """The first profiled step (the steps already done when it begins)."""
    profile_end: int = 12
    """The step at which profiling stops (not profiled)."""
    profile_ranks: list = field(default_factory=lambda: [0])
    """The global ranks that profile."""
    moe_per_layer: bool = False
    """MoE: log each MoE layer's load-balancing and z-loss besides their sums (Megatron's --moe-per-layer-logging)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    set_keys: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)
    """The `section.key`s a file or the command line set (config/parse.py records them): a rule
    that depends on whether the user chose a value reads this, never a comparison with the default."""
    cli_keys: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)
    """Of set_keys, those the command line set (its overrides and Megatron flags); the rest came from a file."""

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


SECTIONS: dict[str, type] = {name: kind for name, kind in typing.get_type_hints(Config).items()
                             if name not in ("set_keys", "cli_keys")}
