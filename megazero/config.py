"""Typed run configuration: dataclass sections, YAML files, `--section.key value` overrides.

Precedence is CLI > file > defaults. Every key is typed; unknown keys, wrong types and
inconsistent values raise `ConfigError` with one line that names the key, the values and
the fix. `resolve(cfg)` fills in the auto values, then `validate(cfg, world_size)` checks them,
changing nothing, before any process group is built (train/run_config.py adds other modules' checks).

The docstring under each field is its documentation: `--help-config` and README's key table
are generated from it (`reference()`, `markdown_table()`), so they cannot drift.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Literal, Optional, Union

import yaml

from megazero.data import DataError
from megazero.data.tokenizer import build_tokenizer
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
    """Attention heads; must divide hidden_size and be divisible by parallel.tp."""
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

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """K/V heads (num_query_groups, or num_heads when 0)."""
        return self.num_query_groups or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


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


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to biases and LayerNorm)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""
    warmup_iters: int = 0
    """Linear warmup iterations."""
    warmup_fraction: float = 0.0
    """Linear warmup as a fraction of the decay iterations (optim.decay_iters, else train.iters), as Megatron's
    --lr-warmup-fraction; 0: off. Not together with optim.warmup_iters."""
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    """LR decay after warmup."""
    decay_iters: int = 0
    """Iterations over which LR decays to min_lr; 0 means train.iters."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
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
    """Tokenizer spec, e.g. gpt2bpe:DIR or sentencepiece:FILE.model."""
    cache_dir: Optional[str] = None
    """Where sample indices are cached (default: beside the data)."""
    pack_examples: bool = False
    """Fine-tuning datasets (those with a loss mask, from preprocess_data.py --prompt-key/--completion-key):
    false: each sample is one example, truncated or padded to seq_length (padding and prompts count nothing
    in the loss); true: examples packed back to back across their boundaries. Other datasets are always packed."""


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
    init_from_hf: Optional[str] = None
    """Start from a Hugging Face GPT-2 directory (config.json + model.safetensors or
    pytorch_model.bin) at any layout; each rank reads only its slices. The model section must
    match its config.json (model.vocab_size auto takes its vocabulary). Not read when the run
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
    the MLP's), c_fc, mlp.c_proj, attn.c_proj."""


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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


# ---------------------------------------------------------------------------- typing


_UNIONS = (typing.Union, types.UnionType)  # Optional[X] and the `X | None` spelling


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check `value` against a field annotation (given as a string or a type)."""
    origin = typing.get_origin(annotation)
    if origin in _UNIONS:  # Optional[X], str | None, or int | Literal["auto"]
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(annotation)):
            return None
        if len(options) == 1:
            return _coerce(key, value, options[0])
        for option in options:
            try:
                return _coerce(key, value, option)
            except ConfigError:
                pass
        kinds = " or ".join(_TYPE_WORDS.get(o) or type_name(o) for o in options)
        raise ConfigError(f"{key} ({value!r}) must be {kinds}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{key} ({value!r}) must be one of {', '.join(map(str, choices))}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} ({value!r}) must be true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} ({value!r}) must be an integer")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} ({value!r}) must be a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} ({value!r}) must be a string")
        return str(value)
    if annotation is list:
        if isinstance(value, str) and "," in value:  # `a,b,c`, as in --finetune.lora_targets c_attn,c_proj
            value = split_list(value)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single prefix given on the CLI
        if not isinstance(value, list):
            raise ConfigError(f"{key} ({value!r}) must be a list")
        return value
    raise TypeError(f"unsupported annotation {annotation} for {key}")


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


def type_name(annotation: Any) -> str:
    """A field's type as --help-config shows it: int, float, bool, str, list, fp32|bf16, int|auto."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "|".join(map(str, typing.get_args(annotation)))
    if origin in _UNIONS:
        return "|".join(type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    return annotation.__name__


def _section_fields(section: str) -> dict[str, Any]:
    """Field name -> resolved type annotation of one section."""
    return typing.get_type_hints(SECTIONS[section])


def has_key(name: str) -> bool:
    """Is `section.key` a config key (of this version: issues add keys as they land)?"""
    section, _, key = name.partition(".")
    return section in SECTIONS and key in _section_fields(section)


def check_value(name: str, value: Any, label: str) -> Any:
    """`value` typed for config key `name`; a ConfigError names it as `label` (e.g. the
    DeepSpeed key it came from)."""
    section, _, key = name.partition(".")
    return _coerce(label, value, _section_fields(section)[key])


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section '{section}'; sections are {', '.join(SECTIONS)}")
    fields = _section_fields(section)
    if key not in fields:
        raise ConfigError(f"unknown config key '{section}.{key}'; {section} has {', '.join(fields)}")
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, fields[key]))


def load_yaml(path: str) -> dict:
    return read_mapping(path, "config file", "YAML", yaml.safe_load,
                        "pass --config configs/gpt2-tiny.yaml or another file")


def read_mapping(path: str, what: str, syntax: str, parse: Callable[[IO], Any], hint: str) -> dict:
    """The mapping a YAML/JSON file holds; a missing, unparsable or non-mapping file is a ConfigError."""
    try:
        with open(path) as f:
            data = parse(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' does not exist; {hint}") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: json.JSONDecodeError
        raise ConfigError(f"{what} '{path}' is not valid {syntax}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{path}' must hold a mapping of keys")
    return data


def build_config(file_data: Optional[dict] = None, overrides: Optional[list[str]] = None) -> Config:
    """Defaults, then the file's sections, then CLI overrides (`--section.key value`)."""
    cfg = Config()
    for section, values in (file_data or {}).items():
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section}' must be a mapping of keys, got {values!r}")
        for key, value in values.items():
            _apply(cfg, section, key, value)
    for section, key, value in parse_overrides(overrides or []):
        _apply(cfg, section, key, value)
    return cfg


def parse_overrides(args: list[str]) -> list[tuple[str, str, Any]]:
    """Turn ['--a.b', '1', '--c.d=x'] into [('a', 'b', 1), ('c', 'd', 'x')] (values parsed as YAML).

    A list-typed key takes every value up to the next --flag, like Megatron's nargs='*'
    flags: `--data.prefix 0.3 A 0.7 B` is [0.3, 'A', 0.7, 'B'] (a quoted YAML list works too)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key value")
        if "=" in arg:
            name, raw = arg[2:].split("=", 1)
            raws, i = [raw], i + 1
        else:
            name, end = arg[2:], i + 1
            while end < len(args) and not args[end].startswith("--"):
                end += 1
            if end == i + 1:
                raise ConfigError(f"override '{arg}' has no value; write {arg} VALUE")
            if not _is_list_key(name):
                end = i + 2  # one value; a stray second one is reported as an unexpected argument
            raws, i = args[i + 1:end], end
        section, key = name.split(".", 1)
        if _is_list_key(name):  # `a,b,c` is `a b c` (a YAML list `[a, b]` is parsed as one value)
            values = [v for raw in raws for v in (split_list(raw) if not raw.lstrip().startswith("[") else
                                                  [_parse_value(raw)])]
        else:
            values = [_parse_value(raw) for raw in raws]
        out.append((section, key, values[0] if len(values) == 1 else values))
    return out


def split_list(raw: str) -> list:
    """`a,b,c` as the list [a, b, c], each piece parsed as YAML (empty pieces dropped)."""
    return [_parse_value(piece.strip()) for piece in raw.split(",") if piece.strip()]


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _is_list_key(name: str) -> bool:
    section, _, key = name.partition(".")
    annotation = _section_fields(section).get(key) if section in SECTIONS else None
    return annotation is list or list in typing.get_args(annotation)


# ---------------------------------------------------------------------------- reference


def field_docs(section: str) -> dict[str, str]:
    """Field name -> the docstring written under it in the section's class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(SECTIONS[section])))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    body = cls.body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def show_value(value: Any) -> str:
    """A default as it is written in YAML or on the command line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return f"{value:g}" if isinstance(value, float) else str(value)


def config_keys() -> list[tuple[str, str, str, str]]:
    """(section.key, type, default, doc) for every config key, in declaration order."""
    rows = []
    for section, cls in SECTIONS.items():
        docs, types, defaults = field_docs(section), _section_fields(section), cls()
        for f in dataclasses.fields(cls):
            rows.append((f"{section}.{f.name}", type_name(types[f.name]), show_value(getattr(defaults, f.name)),
                         docs.get(f.name, "")))
    return rows


def reference() -> str:
    """Every key with its type, default and docstring (`megazero-train --help-config`)."""
    lines = []
    for key, kind, default, doc in config_keys():
        lines.append(f"  --{key} {default}  ({kind})")
        lines.extend(textwrap.wrap(doc, 96, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def markdown_table() -> str:
    """README's config-key table (tests/test_config.py checks README against it)."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for row in config_keys():
        key, kind, default, doc = (cell.replace("|", "\\|") for cell in row)
        lines.append(f"| `{key}` | {kind} | `{default}` | {doc} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- resolution and validation


def resolve(cfg: Config) -> None:
    """Fill in what the config leaves to megazero, in place: model.vocab_size auto from data.tokenizer
    (refusing an explicit size the tokenizer does not fit) and the interleaved schedule that 1f1b over
    vpp > 1 chunks per rank is. Without data the vocabulary stays auto: validate says data is missing."""
    if cfg.data.mock or cfg.data.prefix:
        cfg.model.vocab_size = resolve_vocab_size(cfg)
    if cfg.parallel.vpp > 1 and cfg.parallel.schedule == "1f1b":
        cfg.parallel.schedule = "interleaved"


def schedule_warnings(cfg: Config) -> list[str]:
    """Lines about an LR schedule that is valid but almost surely not meant: a warm-up that
    lasts the whole run or leaves no decay phase."""
    t, o = cfg.train, cfg.optim
    warmup = warmup_length(o, t.iters)
    if not warmup or not t.iters:
        return []
    if warmup >= t.iters:
        return [f"warning: optim.warmup_iters ({warmup:g}) >= train.iters ({t.iters}): the whole run warms up "
                f"and the LR never decays; lower optim.warmup_iters or raise train.iters"]
    if o.decay_iters and warmup >= o.decay_iters:
        return [f"warning: optim.warmup_iters ({warmup:g}) >= optim.decay_iters ({o.decay_iters}): the LR "
                f"jumps to min_lr after the warm-up, with no decay; raise optim.decay_iters"]
    return []


def validate(cfg: Config, world_size: int) -> int:
    """Check every value of a resolved config and their consistency; return the inferred
    data-parallel degree. Changes nothing."""
    m, p, t, o, z = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.zero
    value: Any  # a number (model.vocab_size is resolved by now)
    if not cfg.data.mock and not cfg.data.prefix:
        raise ConfigError("no training data: set data.prefix (indexed dataset prefixes) or data.mock true")
    for key, value in [("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
                       ("model.num_heads", m.num_heads), ("model.seq_length", m.seq_length),
                       ("model.vocab_size", m.vocab_size), ("parallel.tp", p.tp), ("parallel.pp", p.pp),
                       ("parallel.vpp", p.vpp), ("train.micro_batch_size", t.micro_batch_size),
                       ("train.global_batch_size", t.global_batch_size), ("train.log_interval", t.log_interval),
                       ("zero.sub_group_size", z.sub_group_size), ("zero.bucket_size", z.bucket_size),
                       ("train.max_skipped_steps", t.max_skipped_steps)]:
        if value < 1:
            raise ConfigError(f"{key} ({value}) must be at least 1")
    for key, value in [("train.iters", t.iters), ("train.eval_interval", t.eval_interval),
                       ("train.eval_iters", t.eval_iters), ("optim.warmup_iters", o.warmup_iters),
                       ("optim.lr", o.lr), ("optim.min_lr", o.min_lr), ("optim.clip_grad", o.clip_grad),
                       ("optim.weight_decay", o.weight_decay), ("model.ffn_hidden_size", m.ffn_hidden_size),
                       ("checkpoint.interval", cfg.checkpoint.interval),
                       ("checkpoint.keep_last", cfg.checkpoint.keep_last),
                       ("train.exit_duration_minutes", t.exit_duration_minutes)]:
        if value < 0:
            raise ConfigError(f"{key} ({value}) must not be negative")
    if t.timeout_minutes <= 0:
        raise ConfigError(f"train.timeout_minutes ({t.timeout_minutes:g}) must be positive, e.g. 10")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout ({m.dropout}) must be in [0, 1)")
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr ({o.min_lr}) must not exceed optim.lr ({o.lr})")
    _validate_warmup(o)
    _validate_zero(cfg)
    _validate_finetune(cfg.finetune)
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads})")
    if m.num_heads % p.tp:
        raise ConfigError(f"model.num_heads ({m.num_heads}) must be divisible by parallel.tp ({p.tp})")
    if m.ffn_size % p.tp:
        raise ConfigError(f"MLP width ({m.ffn_size}) must be divisible by parallel.tp ({p.tp})")
    _validate_model_family(m, p.tp)
    _validate_context_parallel(cfg)
    if world_size % (p.tp * p.pp * p.cp):
        names, sizes = ("parallel.tp x parallel.pp", f"{p.tp} x {p.pp}") if p.cp == 1 else \
            ("parallel.tp x parallel.pp x parallel.cp", f"{p.tp} x {p.pp} x {p.cp}")
        raise ConfigError(f"world size ({world_size}) must be divisible by {names} ({sizes} = {p.tp * p.pp * p.cp}); "
                          f"change --nproc_per_node or the layout")
    dp = world_size // (p.tp * p.pp * p.cp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                          f"micro_batch_size x dp ({t.micro_batch_size} x {dp} = {t.micro_batch_size * dp})")
    if t.rampup_batch_size is not None:
        rampup_steps(t, dp)  # its one-line errors
    _validate_pipeline(cfg, dp)
    if p.sequence_parallel and p.tp > 1:
        _validate_sequence_parallel(cfg)
    return dp


MOCK_VOCAB_SIZE = 512
"""model.vocab_size auto for mock data without a tokenizer."""


def resolve_vocab_size(cfg: Config) -> int:
    """model.vocab_size as a number: auto becomes the tokenizer's size; an explicit size must
    hold every token of the tokenizer. (Padding to 128 x tp happens in the model.)"""
    m, d = cfg.model, cfg.data
    tokens = tokenizer_size(d.tokenizer) if d.tokenizer else None
    if m.vocab_size == "auto":
        if tokens is not None:
            return tokens
        if d.mock:
            return MOCK_VOCAB_SIZE
        raise ConfigError("model.vocab_size auto needs data.tokenizer to read the size from; set data.tokenizer "
                          "(e.g. gpt2bpe:DIR) or a number, e.g. --model.vocab_size 50257")
    if tokens is not None and m.vocab_size < tokens:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than data.tokenizer {d.tokenizer!r} "
                          f"({tokens} tokens); set --model.vocab_size auto (or at least {tokens})")
    return m.vocab_size


def tokenizer_size(spec: str) -> int:
    """data.tokenizer's vocabulary size (read before any process group exists: a mismatch stops every rank at once)."""
    try:
        return build_tokenizer(spec).vocab_size
    except DataError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None


def _validate_warmup(o: OptimConfig) -> None:
    if not 0.0 <= o.warmup_fraction <= 1.0:
        raise ConfigError(f"optim.warmup_fraction ({o.warmup_fraction:g}) must be in [0, 1], e.g. 0.01")
    if o.warmup_fraction and o.warmup_iters:
        raise ConfigError(f"optim.warmup_iters ({o.warmup_iters}) and optim.warmup_fraction ({o.warmup_fraction:g}) "
                          f"both set the warm-up (--lr-warmup-iters, --lr-warmup-fraction); keep one, set the other to 0")


def warmup_length(o: OptimConfig, train_iters: int) -> float:
    """The warm-up in iterations: optim.warmup_iters, or optim.warmup_fraction of the decay
    iterations (as Megatron, possibly fractional)."""
    return o.warmup_fraction * (o.decay_iters or train_iters) if o.warmup_fraction else float(o.warmup_iters)


def rampup_steps(t: TrainConfig, dp: int) -> tuple[int, int, float]:
    """train.rampup_batch_size checked for `dp` ranks, as (START, INCREMENT, samples per increment):
    Megatron's ramp-up, where the global batch is START + INCREMENT x floor(consumed / samples
    per increment) until SAMPLES samples are consumed, then global_batch_size."""
    r, unit = t.rampup_batch_size or [], t.micro_batch_size * dp
    if len(r) != 3 or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0 for v in r):
        raise ConfigError(f"train.rampup_batch_size ({r}) must be three non-negative integers START INCREMENT "
                          f"SAMPLES, e.g. --train.rampup_batch_size 16 16 5859375")
    start, increment, samples = (int(v) for v in r)
    if not 0 < start <= t.global_batch_size or increment < 1:
        raise ConfigError(f"train.rampup_batch_size START ({start}) must be in 1..global_batch_size "
                          f"({t.global_batch_size}) and INCREMENT ({increment}) at least 1")
    if (t.global_batch_size - start) % increment:
        raise ConfigError(f"train.rampup_batch_size: global_batch_size - START ({t.global_batch_size} - {start}) must "
                          f"be a multiple of INCREMENT ({increment})")
    for name, value in (("START", start), ("INCREMENT", increment)):
        if value % unit:
            raise ConfigError(f"train.rampup_batch_size {name} ({value}) must be a multiple of micro_batch_size x dp "
                              f"({t.micro_batch_size} x {dp} = {unit}), so every step's batch splits over the ranks")
    increments = (t.global_batch_size - start) // increment
    return start, increment, samples / increments if increments else 0.0


def _validate_model_family(m: ModelConfig, tp: int) -> None:
    """The Llama-family options: grouped K/V heads that split over tp, an even rotary head."""
    if m.num_query_groups < 0 or m.num_heads % m.query_groups:
        raise ConfigError(f"model.num_query_groups ({m.num_query_groups}) must divide model.num_heads "
                          f"({m.num_heads}); 1 is multi-query, 0 means num_heads")
    if m.query_groups % tp:
        raise ConfigError(f"model.num_query_groups ({m.query_groups}) must be divisible by parallel.tp ({tp}): "
                          f"each rank holds whole K/V groups; lower parallel.tp or raise model.num_query_groups")
    if m.position_embedding == "rope" and m.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head dimension: model.hidden_size / model.num_heads is "
                          f"{m.head_dim}")
    if m.rope_scaling == "llama3" and not (m.rope_scaling_factor > 0 and
                                           m.rope_high_freq_factor > m.rope_low_freq_factor > 0):
        raise ConfigError(f"model.rope_scaling llama3 needs rope_scaling_factor > 0 and rope_high_freq_factor "
                          f"({m.rope_high_freq_factor}) > rope_low_freq_factor ({m.rope_low_freq_factor}) > 0")


def _validate_zero(cfg: Config) -> None:
    z, precision = cfg.zero, cfg.train.precision
    if z.stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero.stage ({z.stage}) must be 0, 1, 2 or 3")
    if z.prefetch < 0:
        raise ConfigError(f"zero.prefetch ({z.prefetch}) must not be negative")
    if z.loss_scale_window < 1 or z.hysteresis < 1:
        raise ConfigError(f"zero.loss_scale_window ({z.loss_scale_window}) and zero.hysteresis ({z.hysteresis}) "
                          f"must be at least 1")
    if not 0 < z.min_loss_scale <= z.initial_loss_scale:
        raise ConfigError(f"zero.min_loss_scale ({z.min_loss_scale:g}) must be positive and at most "
                          f"zero.initial_loss_scale ({z.initial_loss_scale:g})")
    if z.initial_loss_scale != 2.0 ** round(math.log2(z.initial_loss_scale)):
        raise ConfigError(f"zero.initial_loss_scale ({z.initial_loss_scale:g}) must be a power of two, "
                          f"e.g. {2.0 ** round(math.log2(z.initial_loss_scale)):g}, so scaling is exact")
    _validate_offload(z)
    defaults = ZeroConfig()
    changed = [k for k in ("initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale")
               if getattr(z, k) != getattr(defaults, k)]
    if changed and precision != "fp16":
        raise ConfigError(f"zero.{changed[0]} configures the fp16 loss scaler, but train.precision is {precision}; "
                          f"drop it or use --train.precision fp16")


def _validate_finetune(f: FinetuneConfig) -> None:
    if f.lora_rank < 0:
        raise ConfigError(f"finetune.lora_rank ({f.lora_rank}) must not be negative (0 turns LoRA off), e.g. 8")
    if f.lora_rank == 0:
        return
    if f.lora_alpha <= 0:
        raise ConfigError(f"finetune.lora_alpha ({f.lora_alpha:g}) must be positive, e.g. {2 * f.lora_rank}")
    if not 0.0 <= f.lora_dropout < 1.0:
        raise ConfigError(f"finetune.lora_dropout ({f.lora_dropout:g}) must be in [0, 1)")
    if not f.lora_targets:
        raise ConfigError("finetune.lora_targets is empty; name the modules to adapt, e.g. --finetune.lora_targets "
                          "c_attn c_proj")


def _validate_offload(z: ZeroConfig) -> None:
    if z.offload_param != "none" and z.stage != 3:
        raise ConfigError(f"zero.offload_param {z.offload_param} offloads stage 3's parameter shards, which needs "
                          f"zero.stage 3 (got {z.stage}); set --zero.stage 3 or --zero.offload_param none")
    if z.offload_optimizer != "none" and z.stage == 0:
        raise ConfigError(f"zero.offload_optimizer {z.offload_optimizer} offloads the sharded optimizer state, "
                          f"which needs zero.stage 1, 2 or 3 (got 0); set --zero.stage 1")
    nvme = [f"{key} nvme" for key, value in (("zero.offload_optimizer", z.offload_optimizer),
                                              ("zero.offload_param", z.offload_param)) if value == "nvme"]
    if not nvme:
        return
    if z.offload_optimizer == "nvme" and z.buffer_count < 2:
        raise ConfigError(f"zero.buffer_count ({z.buffer_count}) must be at least 2 with offload_optimizer nvme "
                          f"(one sub-group is read while the previous one is written back)")
    if not z.nvme_path:
        raise ConfigError(f"{nvme[0]} needs zero.nvme_path: a directory on a local disk, "
                          "e.g. --zero.nvme_path /local_nvme")
    why = nvme_path_problem(z.nvme_path)
    if why:
        raise ConfigError(why)


def nvme_path_problem(path: str) -> Optional[str]:
    """Why zero.nvme_path cannot hold swap files (None when it can). A missing directory is
    fine when it can be created (the run creates it, as DeepSpeed does its swap folders)."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        what = "is not a directory" if parent == os.path.abspath(path) else f"cannot be created: {parent} is a file"
        return f"zero.nvme_path {path} {what}; point --zero.nvme_path at a directory on a local disk"
    if not os.access(parent, os.W_OK | os.X_OK):
        what = "is" if parent == os.path.abspath(path) else f"cannot be created: {parent} is"
        return f"zero.nvme_path {path} {what} not writable by this user; choose another directory"
    return None


def _validate_sequence_parallel(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if m.seq_length % (p.tp * p.cp):
        what = "model.seq_length" + (f" / parallel.cp ({p.cp})" if p.cp > 1 else "")
        raise ConfigError(f"parallel.sequence_parallel splits {what} ({m.seq_length}) over parallel.tp ({p.tp}): "
                          f"make it a multiple of {p.tp * p.cp} or turn sequence_parallel off")
    if cfg.finetune.lora_rank:
        raise ConfigError(f"parallel.sequence_parallel cannot be combined with finetune.lora_rank "
                          f"({cfg.finetune.lora_rank}): the LoRA adapters read replicated activations; turn one off")


def _validate_context_parallel(cfg: Config) -> None:
    """parallel.cp: the sequence cut into 2 x cp equal chunks; Ulysses' heads; what cannot compose yet."""
    m, p = cfg.model, cfg.parallel
    if p.cp < 1:
        raise ConfigError(f"parallel.cp ({p.cp}) must be at least 1 (1 turns context parallelism off)")
    if p.cp == 1:
        return
    if m.seq_length % (2 * p.cp):
        raise ConfigError(f"parallel.cp ({p.cp}) cuts model.seq_length ({m.seq_length}) into 2 x cp = {2 * p.cp} "
                          f"equal chunks: make seq_length a multiple of {2 * p.cp} or change parallel.cp")
    if p.cp_impl == "ulysses" and m.num_heads % (p.tp * p.cp):
        raise ConfigError(f"parallel.cp_impl ulysses gives each rank num_heads / (tp x cp) heads, but model.num_heads "
                          f"({m.num_heads}) is not divisible by {p.tp} x {p.cp} = {p.tp * p.cp}; change parallel.cp "
                          f"or use parallel.cp_impl ring")


def _validate_pipeline(cfg: Config, dp: int) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.pp_layers is not None:
        if p.vpp > 1:
            raise ConfigError("parallel.pp_layers (uneven split) cannot be combined with parallel.vpp > 1")
        if len(p.pp_layers) != p.pp or sum(p.pp_layers) != m.num_layers or min(p.pp_layers) < 1:
            raise ConfigError(f"parallel.pp_layers ({p.pp_layers}) must list pp ({p.pp}) positive counts "
                              f"summing to model.num_layers ({m.num_layers})")
    elif m.num_layers % p.pp:
        divisors = [d for d in range(1, m.num_layers + 1) if m.num_layers % d == 0]
        raise ConfigError(f"model.num_layers ({m.num_layers}) must be divisible by parallel.pp ({p.pp}); try pp "
                          f"{', '.join(map(str, divisors[:-1]))} or {divisors[-1]}, or set parallel.pp_layers "
                          f"for an uneven split")
    elif m.num_layers % (p.pp * p.vpp):
        per_stage = m.num_layers / p.pp
        hint = [v for v in range(1, m.num_layers + 1) if m.num_layers % (p.pp * v) == 0]
        raise ConfigError(f"parallel.vpp ({p.vpp}) must divide num_layers / pp ({m.num_layers} / {p.pp} = "
                          f"{per_stage:g}); try vpp {' or '.join(map(str, hint))}")
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    if p.schedule == "zbh1" and p.pp > 1:
        _validate_zbh1(cfg)
    if p.vpp > 1:
        if p.pp == 1:
            raise ConfigError(f"parallel.vpp ({p.vpp}) needs parallel.pp > 1")
        if p.schedule == "gpipe":
            raise ConfigError(f"parallel.schedule gpipe runs one model chunk per rank, but parallel.vpp is {p.vpp}; "
                              f"use --parallel.schedule interleaved or --parallel.vpp 1")
        if microbatches % p.pp:
            raise ConfigError(f"interleaved schedule needs micro-batches per iteration ({microbatches}) to be a "
                              f"multiple of parallel.pp ({p.pp}); change train.global_batch_size")
        if t.rampup_batch_size is not None:  # every batch of the ramp too: START and INCREMENT in micro-batches
            unit = t.micro_batch_size * dp * p.pp
            if any(int(v) % unit for v in t.rampup_batch_size[:2]):
                raise ConfigError(f"interleaved schedule needs every ramp-up batch in whole rounds of parallel.pp "
                                  f"micro-batches: train.rampup_batch_size START and INCREMENT "
                                  f"({t.rampup_batch_size[0]}, {t.rampup_batch_size[1]}) must be multiples of "
                                  f"micro_batch_size x dp x pp ({t.micro_batch_size} x {dp} x {p.pp} = {unit})")
    elif p.schedule == "interleaved":
        raise ConfigError("parallel.schedule interleaved needs parallel.vpp > 1")


def _validate_zbh1(cfg: Config) -> None:
    """What the zero-bubble schedule's deferred weight gradients cannot run with yet."""
    if cfg.parallel.vpp > 1:
        raise ConfigError(f"parallel.schedule zbh1 runs one model chunk per rank, but parallel.vpp is "
                          f"{cfg.parallel.vpp}; use --parallel.vpp 1, or --parallel.schedule interleaved")
    if cfg.train.compile:
        raise ConfigError("parallel.schedule zbh1 cannot defer weight gradients inside compiled blocks; "
                          "use --train.compile false or --parallel.schedule 1f1b")


def describe(cfg: Config) -> str:
    """The resolved config as YAML (printed once, saved with the run)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
