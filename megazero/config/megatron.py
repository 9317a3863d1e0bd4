"""Megatron-LM's GPT pretraining flags as aliases of megazero's config keys.

`FLAGS` is the one table: `translate(args)` turns the flags of a Megatron launch line
(`--num-layers 24 --fp16 --data-path 0.3 A 0.7 B ...`) into `--section.key value` overrides,
and the same rows generate README's migration table (`markdown_table()`). A flag that
changes nothing here (a kernel or implementation choice megazero makes itself) is accepted
and named in one warning line; an unknown flag is an error naming the closest megazero key
or Megatron flag. A few flags need the whole config (the virtual pipeline size is layers per
stage over N, the distributed optimizer means ZeRO 1 unless a stage is set); they are checked
or applied once the config is built (`Translation.apply`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, Optional

from megazero.config.help import config_keys, show_value
from megazero.config.schema import Config, ConfigError
from megazero.config.sharding import STAGES, sharding
from megazero.data import DataError
from megazero.data.tokenizer import spec_from_megatron_args

LIST = -1
"""nargs of a flag taking every value up to the next --flag (Megatron's nargs='*')."""


@dataclass(frozen=True)
class Flag:
    """One Megatron flag: how many values it takes and what it becomes."""

    name: str
    nargs: int
    """0: a switch (store_true), 1: one value, 3: three values, LIST: up to the next --flag."""
    sets: tuple[tuple[str, Optional[str]], ...] = ()
    """(megazero key, value): the value None means the flag's own value(s)."""
    note: str = ""
    """README's cell when `sets` does not say it all (or for a flag resolved after the config is built)."""
    after: Optional[Callable[[Config, list[str]], None]] = None
    """Applied to the built config with the flag's values (needs other keys' final values)."""
    collect: str = ""
    """Gathered into one value with its group's other flags (the tokenizer's four)."""


def _key(name: str, key: str, note: str = "") -> Flag:
    return Flag(name, 1, ((key, None),), note)


def _switch(name: str, key: str, value: str) -> Flag:
    return Flag(name, 0, ((key, value),))


def _ignored(name: str, nargs: int = 0) -> Flag:
    return Flag(name, nargs, note="accepted, no effect")


# ---------------------------------------------------------------------------- the flags that need the whole config


def _set(cfg: Config, name: str, value: object) -> None:
    """Set `section.key` on the built config, recorded as set by the user (cfg.set_keys)."""
    section, key = name.split(".")
    setattr(getattr(cfg, section), key, value)
    cfg.set_keys |= {name}


def _distributed_optimizer(cfg: Config, values: list[str]) -> None:
    """Megatron's distributed optimizer shards the optimizer states over DP: ZeRO stage 1,
    unless a stage was set (2 and 3 shard more)."""
    if not sharding(cfg.zero.stage).optimizer:
        _set(cfg, "zero.stage", next(s.stage for s in STAGES.values() if s.optimizer))


def _virtual_stage_layers(cfg: Config, values: list[str]) -> None:
    """--num-layers-per-virtual-pipeline-stage N: vpp = layers per pipeline stage / N."""
    n, m, p = _int("--num-layers-per-virtual-pipeline-stage", values[0]), cfg.model, cfg.parallel
    per_stage, rest = divmod(m.num_layers, p.pp)
    if n < 1 or rest or per_stage % n:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage ({n}) must divide the layers per pipeline stage "
                          f"(num_layers / pp = {m.num_layers} / {p.pp}); pick a divisor of {m.num_layers // p.pp}")
    if p.vpp not in (1, per_stage // n):
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {n} means parallel.vpp {per_stage // n}, but "
                          f"parallel.vpp is {p.vpp}; pass one of the two")
    _set(cfg, "parallel.vpp", per_stage // n)


def _max_positions(cfg: Config, values: list[str]) -> None:
    """megazero learns exactly seq_length positions (GPT-2), so the two must agree."""
    n = _int("--max-position-embeddings", values[0])
    if n != cfg.model.seq_length:
        raise ConfigError(f"--max-position-embeddings ({n}) must equal --seq-length (model.seq_length "
                          f"{cfg.model.seq_length}): megazero learns one position per token of a sample; "
                          f"set both to the same value")


_CP_COMM = {"p2p": "ring", "a2a": "ulysses"}


def _cp_comm_type(cfg: Config, values: list[str]) -> None:
    """--cp-comm-type: Megatron's p2p ring is parallel.cp_impl ring; its a2a (all-to-all over
    heads, DeepSpeed-Ulysses' scheme) is ulysses; the hybrids have no equivalent here."""
    if values[0] not in _CP_COMM:
        raise ConfigError(f"--cp-comm-type {values[0]} has no megazero equivalent; use p2p (parallel.cp_impl ring) "
                          f"or a2a (parallel.cp_impl ulysses)")
    _set(cfg, "parallel.cp_impl", _CP_COMM[values[0]])


def _int(flag: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{flag} ({raw!r}) must be an integer") from None


# ---------------------------------------------------------------------------- the table

_ONE_DROPOUT = "`model.dropout` (one value for both; they must agree)"

FLAGS: tuple[Flag, ...] = (
    # model
    _key("--num-layers", "model.num_layers"),
    _key("--hidden-size", "model.hidden_size"),
    _key("--num-attention-heads", "model.num_heads"),
    _key("--ffn-hidden-size", "model.ffn_hidden_size"),
    _key("--seq-length", "model.seq_length"),
    Flag("--max-position-embeddings", 1, note="must equal `model.seq_length` (checked)", after=_max_positions),
    _key("--hidden-dropout", "model.dropout", _ONE_DROPOUT),
    _key("--attention-dropout", "model.dropout", _ONE_DROPOUT),
    _key("--init-method-std", "model.init_std"),
    _key("--layernorm-epsilon", "model.layernorm_eps"),
    _key("--vocab-size", "model.vocab_size"),
    # parallelism
    _key("--tensor-model-parallel-size", "parallel.tp"),
    _key("--pipeline-model-parallel-size", "parallel.pp"),
    Flag("--num-layers-per-virtual-pipeline-stage", 1, note="`parallel.vpp` = layers per pipeline stage / N",
         after=_virtual_stage_layers),
    _switch("--sequence-parallel", "parallel.sequence_parallel", "true"),
    Flag("--use-distributed-optimizer", 0, note="`zero.stage 1` when `zero.stage` is 0 (2 and 3 shard further)",
         after=_distributed_optimizer),
    _key("--context-parallel-size", "parallel.cp", "`parallel.cp X` (ring attention in Megatron's load-balanced "
         "order by default)"),
    Flag("--cp-comm-type", 1, note="`parallel.cp_impl`: p2p is `ring`, a2a is `ulysses`", after=_cp_comm_type),
    # batch and iterations
    _key("--micro-batch-size", "train.micro_batch_size"),
    _key("--global-batch-size", "train.global_batch_size"),
    Flag("--rampup-batch-size", 3, (("train.rampup_batch_size", None),),
         "`train.rampup_batch_size START INCREMENT SAMPLES` (the LR schedule then counts samples)"),
    _key("--train-iters", "train.iters"),
    _key("--seed", "train.seed"),
    # precision and the fp16 loss scale
    _switch("--fp16", "train.precision", "fp16"),
    _switch("--bf16", "train.precision", "bf16"),
    _key("--initial-loss-scale", "zero.initial_loss_scale"),
    _key("--loss-scale-window", "zero.loss_scale_window"),
    _key("--hysteresis", "zero.hysteresis"),
    _key("--min-loss-scale", "zero.min_loss_scale"),
    # activation recomputation
    _switch("--recompute-activations", "train.recompute", "selective"),
    _key("--recompute-granularity", "train.recompute"),
    _switch("--checkpoint-activations", "train.recompute", "full"),
    # optimizer and LR schedule
    _key("--lr", "optim.lr"),
    _key("--min-lr", "optim.min_lr"),
    _key("--lr-decay-style", "optim.decay_style"),
    _key("--lr-decay-iters", "optim.decay_iters"),
    _key("--lr-warmup-iters", "optim.warmup_iters"),
    _key("--lr-warmup-fraction", "optim.warmup_fraction"),
    _switch("--override-opt_param-scheduler", "optim.override_schedule", "true"),
    _key("--weight-decay", "optim.weight_decay"),
    _key("--clip-grad", "optim.clip_grad"),
    _key("--adam-beta1", "optim.beta1"),
    _key("--adam-beta2", "optim.beta2"),
    _key("--adam-eps", "optim.eps"),
    # data
    Flag("--data-path", LIST, (("data.prefix", None),), "`data.prefix` (weights too: `0.3 A 0.7 B`)"),
    _key("--split", "data.split"),
    _switch("--mock-data", "data.mock", "true"),
    _key("--data-cache-path", "data.cache_dir"),
    Flag("--tokenizer-type", 1, note="`data.tokenizer`: GPT2BPETokenizer `gpt2bpe:V,M`, SentencePieceTokenizer "
                                     "`sentencepiece:F` (GPT2BPETokenizer when left out)", collect="tokenizer"),
    Flag("--vocab-file", 1, note="`data.tokenizer gpt2bpe:V,M` with --merge-file", collect="tokenizer"),
    Flag("--merge-file", 1, note="`data.tokenizer gpt2bpe:V,M` with --vocab-file", collect="tokenizer"),
    Flag("--tokenizer-model", 1, note="`data.tokenizer sentencepiece:F`", collect="tokenizer"),
    # checkpoints
    _key("--save", "checkpoint.save"),
    _key("--load", "checkpoint.load", "`checkpoint.load` (also a Megatron save directory: its "
                                      "`latest_checkpointed_iteration.txt`)"),
    _key("--save-interval", "checkpoint.interval"),
    _switch("--async-save", "checkpoint.async_save", "true"),
    _key("--ckpt-step", "checkpoint.iteration"),
    # logging, evaluation, lifecycle
    _key("--log-interval", "train.log_interval"),
    _key("--eval-interval", "train.eval_interval"),
    _key("--eval-iters", "train.eval_iters"),
    _key("--tensorboard-dir", "logging.tensorboard"),
    Flag("--wandb-project", 1, (("logging.wandb", "true"), ("logging.wandb_project", None))),
    _key("--distributed-timeout-minutes", "train.timeout_minutes"),
    _key("--exit-duration-in-mins", "train.exit_duration_minutes"),
    # kernel and implementation choices megazero makes itself, and what it always does
    _ignored("--attention-backend", 1), _ignored("--transformer-impl", 1), _ignored("--use-mcore-models"),
    _ignored("--use-flash-attn"), _ignored("--no-masked-softmax-fusion"), _ignored("--no-bias-gelu-fusion"),
    _ignored("--no-bias-dropout-fusion"), _ignored("--no-bias-swiglu-fusion"), _ignored("--no-rope-fusion"),
    _ignored("--no-gradient-accumulation-fusion"), _ignored("--no-persist-layer-norm"),
    _ignored("--no-async-tensor-model-parallel-allreduce"), _ignored("--overlap-grad-reduce"),
    _ignored("--overlap-param-gather"), _ignored("--tp-comm-overlap"), _ignored("--accumulate-allreduce-grads-in-fp32"),
    _ignored("--fp16-lm-cross-entropy"), _ignored("--cross-entropy-loss-fusion"), _ignored("--use-distributed-sampler"),
    _ignored("--make-vocab-size-divisible-by", 1), _ignored("--distributed-backend", 1), _ignored("--DDP-impl", 1),
    _ignored("--data-impl", 1), _ignored("--num-workers", 1), _ignored("--ckpt-format", 1),
    _ignored("--recompute-method", 1), _ignored("--recompute-num-layers", 1), _ignored("--exit-signal-handler"),
    _ignored("--log-throughput"), _ignored("--log-params-norm"), _ignored("--log-num-zeros-in-grad"),
    _ignored("--log-timers-to-tensorboard"), _ignored("--log-validation-ppl-to-tensorboard"),
    _ignored("--log-memory-to-tensorboard"), _ignored("--timing-log-level", 1),
    # the fused scale-mask-softmax's (apex-era) fp16 guards: the scaling cancels out; SDPA's fused kernels
    # accumulate the softmax in fp32
    _ignored("--apply-query-key-layer-scaling"), _ignored("--no-query-key-layer-scaling"),
    _ignored("--attention-softmax-in-fp32"),
)
BY_NAME = {f.name: f for f in FLAGS}

MEGATRON_DEFAULTS: dict[str, dict[str, object]] = {
    "model": {"dropout": 0.1},
    "optim": {"weight_decay": 0.01, "beta2": 0.999, "decay_style": "linear", "min_lr": 0.0},
}
"""Megatron's defaults where they differ from megazero's and change the training: a Megatron launch
line (Megatron flags and no --config file) gets them for the keys it leaves out, so it trains the
same model as under Megatron. With a --config file megazero's defaults stay: one Megatron alias in
a megazero command line changes nothing else."""


# ---------------------------------------------------------------------------- translation


@dataclass
class Translation:
    """What a command line's Megatron flags become."""

    overrides: list[str] = field(default_factory=list)
    """The command line with every Megatron flag replaced by `--section.key value` overrides, in order."""
    ignored: list[str] = field(default_factory=list)
    """Flags accepted with no effect here, in the order given."""
    later: list[tuple[Flag, list[str]]] = field(default_factory=list)
    collected: dict[str, str] = field(default_factory=dict)
    used: bool = False
    """Whether any Megatron flag was given (then MEGATRON_DEFAULTS apply)."""
    setters: dict[str, tuple[str, str, list[str]]] = field(default_factory=dict)
    """megazero key -> (the Megatron flag that set it, as written, the value): two flags must agree on a key."""

    def defaults(self, has_config_file: bool) -> dict:
        """The sections a Megatron launch line starts from: MEGATRON_DEFAULTS when Megatron flags
        were given without a config file, else none."""
        return MEGATRON_DEFAULTS if self.used and not has_config_file else {}

    def defaults_note(self, has_config_file: bool) -> Optional[str]:
        """One line naming the Megatron defaults in effect (those the command line left alone)."""
        given = {arg[2:].split("=", 1)[0] for arg in self.overrides if arg.startswith("--")}
        kept = [f"{section}.{key} {show_value(value)}" for section, values in self.defaults(has_config_file).items()
                for key, value in values.items() if f"{section}.{key}" not in given]
        return (f"Megatron-LM launch line: Megatron's defaults for what it leaves out: {', '.join(kept)}"
                if kept else None)

    def apply(self, cfg: Config) -> None:
        """The flags that need the built config (every other key at its final value)."""
        for flag, values in self.later:
            assert flag.after is not None
            flag.after(cfg, values)

    def warning(self) -> Optional[str]:
        if not self.ignored:
            return None
        return (f"warning: Megatron-LM flags accepted with no effect here (kernel and implementation choices megazero "
                f"makes itself): {', '.join(dict.fromkeys(self.ignored))}")


def translate(args: list[str]) -> Translation:
    """Replace the Megatron flags of `args` by megazero overrides (others pass through unchanged).
    An argument that is neither is an error naming the closest of both."""
    out, i = Translation(), 0
    while i < len(args):
        arg = args[i]
        name, has_value, inline = arg.partition("=")
        if not arg.startswith("--") or "." in name:  # --section.key (or its value): megazero's own
            out.overrides.append(arg)
            i += 1
            continue
        flag = BY_NAME.get(name) or _unknown(name)
        values, i = _values(flag, args, i, [inline] if has_value else None)
        out.used = True
        _record(out, flag, values)
    if out.collected:
        out.overrides += ["--data.tokenizer", _tokenizer_spec(out.collected)]
    return out


def _values(flag: Flag, args: list[str], i: int, inline: Optional[list[str]]) -> tuple[list[str], int]:
    """The values `flag` at args[i] takes, and the index after them."""
    if inline is not None:
        if flag.nargs == 0:
            raise ConfigError(f"{flag.name} is a switch and takes no value; drop '={inline[0]}'")
        return inline, i + 1
    end = i + 1
    while end < len(args) and not args[end].startswith("--") and (flag.nargs == LIST or end - i <= flag.nargs):
        end += 1
    values = args[i + 1:end]
    wanted = flag.nargs if flag.nargs != LIST else max(1, len(values))
    if len(values) != wanted:
        raise ConfigError(f"{flag.name} takes {wanted} value{'s' if wanted != 1 else ''}, got {len(values)}"
                          f"{': ' + ' '.join(values) if values else ''}")
    return values, end


def _record(out: Translation, flag: Flag, values: list[str]) -> None:
    if flag.collect:
        out.collected[flag.name] = values[0]
    elif flag.after is not None:
        out.later.append((flag, values))
    elif not flag.sets:
        out.ignored.append(flag.name)
    for key, value in flag.sets:
        given = [value] if value is not None else values
        shown = " ".join([flag.name, *values])
        earlier = out.setters.setdefault(key, (flag.name, shown, given))
        if earlier[0] != flag.name and earlier[2] != given:  # the same flag twice: the last wins, as in Megatron
            raise ConfigError(f"{earlier[1]} and {shown} both set {key} (to {' '.join(earlier[2])} and "
                              f"{' '.join(given)}); pass one of them")
        out.overrides += [f"--{key}", *given]


def _tokenizer_spec(collected: dict[str, str]) -> str:
    kind = collected.get("--tokenizer-type", "GPT2BPETokenizer")
    try:
        return spec_from_megatron_args(kind, collected.get("--vocab-file"), collected.get("--merge-file"),
                                       collected.get("--tokenizer-model"))
    except DataError as e:
        raise ConfigError(str(e)) from None


def _unknown(name: str) -> Flag:
    """The error for a flag that is neither megazero's nor a Megatron flag in the table."""
    keys = {f"--{key}": key for key, *_ in config_keys()}
    close = difflib.get_close_matches(name, [*BY_NAME, *keys], n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(name.replace("-", "_"), list(keys), n=1, cutoff=0.5)
    hint = (f"did you mean {close[0]}?" if close else "megazero keys are --section.key value (--help-config lists "
            "them); the Megatron-LM flags it reads are in README's 'Coming from Megatron-LM'")
    if close and close[0] in BY_NAME and BY_NAME[close[0]].sets:
        hint = f"did you mean {close[0]} (megazero's {BY_NAME[close[0]].sets[0][0]})?"
    raise ConfigError(f"unknown flag {name}: neither a megazero key nor a Megatron-LM flag megazero reads; {hint}")


# ---------------------------------------------------------------------------- README


def markdown_table() -> str:
    """README's Megatron-LM migration table, one row per flag (the no-effect flags in one row)."""
    lines = ["| Megatron-LM flag | megazero |", "| --- | --- |"]
    for flag in FLAGS:
        if flag.sets or flag.after or flag.collect:
            lines.append(f"| `{flag.name}{_metavar(flag)}` | {_cell(flag)} |")
    ignored = ", ".join(f"`{f.name}`" for f in FLAGS if not (f.sets or f.after or f.collect))
    lines.append(f"| {ignored} | accepted and named in one warning line: kernel and implementation choices megazero "
                 f"makes itself, or what it always does |")
    return "\n".join(lines)


def defaults_table() -> str:
    """README's line on the Megatron defaults a Megatron command line gets."""
    return ", ".join(f"`{section}.{key} {show_value(value)}`" for section, values in MEGATRON_DEFAULTS.items()
                     for key, value in values.items())


def _metavar(flag: Flag) -> str:
    return {0: "", 1: " X", 3: " START INCREMENT SAMPLES", LIST: " ..."}[flag.nargs]


def _cell(flag: Flag) -> str:
    if flag.note:
        return flag.note
    return ", ".join(f"`{key} {value if value is not None else 'X'}`" for key, value in flag.sets)
