"""Megatron-LM's GPT pretraining flags as aliases of megazero's config keys.

`FLAGS` is the one table: `translate(args)` turns the flags of a Megatron launch line
(`--num-layers 24 --fp16 --data-path 0.3 A 0.7 B ...`) into `--section.key value` overrides,
and the same rows generate README's migration table (`markdown_table()`). A flag that
changes nothing here (a kernel or implementation choice megazero makes itself) is accepted
and named in one warning line; flags outside megazero's reach are refused, all of them named
in one line; an unknown flag is an error naming the closest megazero key or Megatron flag. A
few flags need the whole config (the virtual pipeline size is layers per stage over N, the
distributed optimizer means ZeRO 1 unless a stage is set); they are checked or applied once
the config is built (`Translation.apply`).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn, Optional

from megazero.config.help import config_keys, show_value
from megazero.config.schema import Config, ConfigError
from megazero.config.sharding import sharding
from megazero.config.suggest import closest, key_candidates

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
    choices: Optional[dict[str, str]] = None
    """Megatron's value -> megazero's, for a one-value flag whose values are spelled differently
    (--normalization RMSNorm: rmsnorm); any other value is refused in one line naming these."""
    needs: str = ""
    """Another flag that must be on the line too (Megatron ignores this one without it)."""
    refused: str = ""
    """Why megazero refuses the flag (one line, raised as the line is translated)."""
    implies: tuple[tuple[str, object], ...] = ()
    """(megazero key, Megatron's argparse default): what the flag turns on takes Megatron's default for a key
    nothing set (--group-query-attention alone is multi-query); named in the defaults line."""
    convert: Optional[Callable[[str, str], str]] = None
    """(flag, Megatron's value) -> megazero's value, for a value written in another form (--moe-layer-freq's
    Python list expressions); a value it cannot read is refused in one line."""
    tell: Optional[Callable[[list[str]], Optional[str]]] = None
    """The flag's values -> one line saying how megazero does it when that differs from what Megatron would
    (--moe-router-dtype fp64: megazero routes in fp32), or None; printed as the line is read."""


def _key(name: str, key: str, note: str = "", choices: Optional[dict[str, str]] = None) -> Flag:
    return Flag(name, 1, ((key, None),), note, choices=choices)


def _switch(name: str, key: str, value: str) -> Flag:
    return Flag(name, 0, ((key, value),))


def _no_effect(*names: str, refused: str = "") -> tuple[Flag, ...]:
    """Flags that change nothing here, written as README shows them ("--name X" takes a value): accepted
    and named in one warning line, or refused with the reason `refused`."""
    return tuple(Flag(name.removesuffix(" X"), int(name.endswith(" X")), refused=refused,
                      note=f"refused: {refused}" if refused else "accepted, no effect") for name in names)


# ---------------------------------------------------------------------------- the flags that need the whole config


def _set(cfg: Config, name: str, value: object) -> None:
    """Set `section.key` on the built config, recorded as set by the user (cfg.set_keys)."""
    section, key = name.split(".")
    setattr(getattr(cfg, section), key, value)
    cfg.set_keys |= {name}
    cfg.cli_keys |= {name}


def _zero_stage(stage: int) -> Callable[[Config, list[str]], None]:
    """A flag that means ZeRO stage `stage` when zero.stage is 0 (a stage set that shards already stays):
    Megatron's distributed optimizer shards the optimizer states over DP (stage 1), PyTorch FSDP2
    parameters, gradients and optimizer states (stage 3)."""

    def apply(cfg: Config, values: list[str]) -> None:
        if sharding(cfg.zero.stage).replicated:
            _set(cfg, "zero.stage", stage)
    return apply


def _virtual_stage_layers(cfg: Config, values: list[str]) -> None:
    """--num-layers-per-virtual-pipeline-stage N: vpp = layers per pipeline stage / N."""
    n, m, p = _number("--num-layers-per-virtual-pipeline-stage", values[0]), cfg.model, cfg.parallel
    per_stage, rest = divmod(m.num_layers, p.pp)
    if n < 1 or rest or per_stage % n:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage ({n}) must divide the layers per pipeline stage "
                          f"(num_layers / pp = {m.num_layers} / {p.pp}); pick a divisor of {m.num_layers // p.pp}")
    if p.vpp not in (1, per_stage // n):
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {n} means parallel.vpp {per_stage // n}, but "
                          f"parallel.vpp is {p.vpp}; pass one of the two")
    _set(cfg, "parallel.vpp", per_stage // n)


def _max_positions(cfg: Config, values: list[str]) -> None:
    """Learned positions: megazero learns exactly seq_length of them (GPT-2), so the two must
    agree. Rotary positions have no table (Megatron sizes its rotary cache with it): any length
    that holds a sample."""
    n = _number("--max-position-embeddings", values[0])
    if cfg.model.position_embedding == "rope":
        if n < cfg.model.seq_length:
            raise ConfigError(f"--max-position-embeddings ({n}) is shorter than --seq-length "
                              f"({cfg.model.seq_length}); rotary positions must reach every token of a sample")
        return
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


def _no_position_embedding(cfg: Config, values: list[str]) -> None:
    """Megatron drops the learned position table; megazero's models without one are rotary."""
    if cfg.model.position_embedding != "rope":
        raise ConfigError("--no-position-embedding without rotary positions would train a model with no positions, "
                          "which megazero does not build; add --position-embedding-type rope")


def _rotary_percent(cfg: Config, values: list[str]) -> None:
    """megazero rotates every channel of a head (Llama); partial rotary (GPT-NeoX's 0.25) is not built."""
    if _number("--rotary-percent", values[0], float) != 1.0:
        raise ConfigError(f"--rotary-percent {values[0]}: megazero rotates all of each head's channels; "
                          f"only --rotary-percent 1.0 is supported")


def _kv_channels(cfg: Config, values: list[str]) -> None:
    """--kv-channels: the head width. Equal to hidden_size / num_heads it is the width megazero uses
    anyway (Llama lines pass it), so it sets nothing; another width (Qwen3: 128 at h 2048 and 32
    heads) is model.kv_channels."""
    n, m = _number("--kv-channels", values[0]), cfg.model
    if n < 1:
        raise ConfigError(f"--kv-channels ({n}) must be a positive head width, e.g. --hidden-size / "
                          f"--num-attention-heads ({m.hidden_size} / {m.num_heads})")
    if n * m.num_heads != m.hidden_size:
        _set(cfg, "model.kv_channels", n)


def _moe_layer_recompute(cfg: Config, values: list[str]) -> None:
    """Megatron recomputes the MoE layers alone; megazero's nearest is recomputing whole blocks
    (train.recompute full), which recomputes each MoE layer too (selective covers only attention)."""
    _set(cfg, "train.recompute", "full")


def _moe_layer_recompute_line(values: list[str]) -> str:
    return ("--moe-layer-recompute: megazero recomputes whole transformer blocks, each MoE layer among them "
            "(train.recompute full): the MoE layers' activations are freed as in Megatron, attention's too")


def _router_dtype_line(values: list[str]) -> Optional[str]:
    """megazero computes router logits and probabilities in fp32 in every precision: fp32 is what it
    does; fp64 is said."""
    return (None if values[0] == "fp32" else f"--moe-router-dtype {values[0]}: megazero routes in fp32 in every "
            f"precision (router logits, probabilities and combine weights), not {values[0]}")


_FREQ_LIMIT = 1 << 20
"""Most entries a --moe-layer-freq list expression may build (a model has far fewer layers)."""


def _layer_freq(flag: str, raw: str) -> str:
    """Megatron's --moe-layer-freq: an integer k (every k-th layer MoE) or a Python list expression
    over + and * such as ([0]*3+[1]*29) or [0,1,1,1], as megazero's model.moe_layer_freq (an integer,
    or the 0/1 list written as YAML). Read by walking the expression's syntax tree, never by eval."""
    try:
        value = _freq_value(ast.parse(raw.strip(), mode="eval").body)
    except (SyntaxError, ValueError):
        raise ConfigError(f"{flag} {raw!r}: write an integer k (every k-th layer MoE) or a list of 0 (dense) and "
                          f"1 (MoE) built with + and *, e.g. '([0]*3+[1]*29)' or '[0,1,1,1]'") from None
    return str(value) if isinstance(value, int) else f"[{', '.join(map(str, value))}]"


def _freq_value(node: ast.expr) -> int | list[int]:
    """An integer or list of integers from List, integer Constant and BinOp(+, *) nodes (ValueError otherwise)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        entries = [_freq_value(item) for item in node.elts]
        flat = [entry for entry in entries if isinstance(entry, int)]
        return flat if len(flat) == len(entries) else _not_a_layer_pattern("a nested list")
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult))):
        return _not_a_layer_pattern(f"{type(node).__name__} is neither a list, an integer, + nor *")
    left, right = _freq_value(node.left), _freq_value(node.right)
    if isinstance(left, int) and isinstance(right, int):
        return left + right if isinstance(node.op, ast.Add) else left * right
    if isinstance(left, list) and isinstance(right, list):
        return left + right if isinstance(node.op, ast.Add) else _not_a_layer_pattern("a list times a list")
    count, items = (left, right) if isinstance(left, int) else (right, left)
    if isinstance(node.op, ast.Add) or not isinstance(count, int) or not isinstance(items, list):
        return _not_a_layer_pattern("a list added to an integer")
    if len(items) * count > _FREQ_LIMIT:
        return _not_a_layer_pattern("too long")
    return items * count


def _not_a_layer_pattern(why: str) -> NoReturn:
    raise ValueError(why)


def _swiglu_width(cfg: Config, values: list[str]) -> None:
    """Without --ffn-hidden-size Megatron sizes a SwiGLU MLP to about 2/3 of 4h (a multiple of
    64), keeping its parameters near GELU's; megazero's default would be 4h."""
    if "model.ffn_hidden_size" not in cfg.set_keys:
        _set(cfg, "model.ffn_hidden_size", int(4 * cfg.model.hidden_size * 2 / 3 / 64) * 64)


def _train_samples(cfg: Config, values: list[str]) -> None:
    """--train-samples S: train.iters = the steps that consume S samples (batch ramp-up included),
    as Megatron counts them."""
    from megazero.config.rules import rampup_steps
    n, t = _number("--train-samples", values[0]), cfg.train
    if "train.iters" in cfg.set_keys:
        raise ConfigError(f"--train-samples {n} and --train-iters {t.iters} both set the run's length; pass one")
    if t.rampup_batch_size is None:
        _set(cfg, "train.iters", n // t.global_batch_size)
        return
    start, increment, per_increment = rampup_steps(t, 1)
    iters, consumed = 0, 0
    while consumed < int(t.rampup_batch_size[2]) and consumed < n:  # the ramp: a step of each size
        batch = min(t.global_batch_size, start + increment * int(consumed / per_increment)) if per_increment \
            else t.global_batch_size
        iters, consumed = iters + 1, consumed + batch
    _set(cfg, "train.iters", iters + max(0, n - consumed) // t.global_batch_size)


_POINTERS = ("latest", "latest_checkpointed_iteration.txt", "universal.json")
"""The files that make checkpoint.load a checkpoint to resume (megazero's, Megatron's, a universal one)."""


def _exit_on_missing(cfg: Config, values: list[str]) -> None:
    """Megatron's --exit-on-missing-checkpoint: a --load that holds nothing stops the run instead
    of training from scratch."""
    c = cfg.checkpoint
    if not c.load:
        raise ConfigError("--exit-on-missing-checkpoint needs --load DIR")
    if not c.iteration and not any(os.path.isfile(os.path.join(c.load, n)) for n in _POINTERS):
        raise ConfigError(f"--exit-on-missing-checkpoint: --load {c.load} holds no checkpoint (none of "
                          f"{', '.join(_POINTERS)}); check the path")


def _profile(cfg: Config, values: list[str]) -> None:
    """Megatron's --profile alone brackets the steps for Nsight Systems; --use-pytorch-profiler
    (logging.profiler torch, set as the line is read) traces them with torch.profiler instead."""
    if cfg.logging.profiler == "none":
        _set(cfg, "logging.profiler", "nsys")


def _accepted(cfg: Config, values: list[str]) -> None:
    """A flag whose meaning another flag carries (checked when the line is translated)."""


def _spiky_loss(cfg: Config, values: list[str]) -> None:
    """--check-for-spiky-loss: rerun on spikes too, unless the line turned reruns off."""
    if cfg.train.rerun_on == "none":
        raise ConfigError("--check-for-spiky-loss with train.rerun_on none (--rerun-mode disabled): a spike would be "
                          "caught and nothing rerun; drop one of the two")
    _set(cfg, "train.rerun_on", "spike")


def _number(flag: str, raw: str, kind: type = int) -> Any:
    """A flag's value as an integer, or as a number (`kind` float)."""
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{flag} ({raw!r}) must be {'an integer' if kind is int else 'a number'}") from None


# ---------------------------------------------------------------------------- the table

_NO_FP8 = ("megazero has no FP8 training (it needs Transformer Engine's FP8 matmuls on a Hopper-class GPU); "
           "train in bf16 (--bf16) and drop the FP8 flags")
_NO_DEEPEP = ("DeepEP's fused dispatch kernels (Megatron's flex dispatcher) are outside megazero's reach; its experts "
              "get their tokens by --moe-token-dispatcher-type alltoall or allgather: drop the flag")
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
    _key("--norm-epsilon", "model.layernorm_eps"),
    _key("--vocab-size", "model.vocab_size"),
    # the Llama family (issue 34)
    Flag("--swiglu", 0, (("model.activation", "swiglu"),), "`model.activation swiglu` (without --ffn-hidden-size: "
         "Megatron's width, 8h/3 rounded down to a multiple of 64)", after=_swiglu_width),
    _switch("--squared-relu", "model.activation", "squared_relu"),
    _key("--normalization", "model.normalization", choices={"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}),
    _key("--position-embedding-type", "model.position_embedding",
         choices={"learned_absolute": "learned", "rope": "rope"}),
    _switch("--use-rotary-position-embeddings", "model.position_embedding", "rope"),
    Flag("--no-position-embedding", 0, note="no learned position table: needs rotary positions (checked)",
         after=_no_position_embedding),
    _key("--rotary-base", "model.rope_base"),
    Flag("--rotary-percent", 1, note="1.0 only (every channel of a head rotates; checked)", after=_rotary_percent),
    Flag("--group-query-attention", 0, note="grouped-query attention: `model.num_query_groups` from --num-query-groups, "
         "else 1 (Megatron's default: multi-query)", implies=(("model.num_query_groups", 1),)),
    Flag("--num-query-groups", 1, (("model.num_query_groups", None),), needs="--group-query-attention"),
    Flag("--kv-channels", 1, note="`model.kv_channels` when it differs from --hidden-size / --num-attention-heads "
         "(Qwen3); equal to it, nothing to set", after=_kv_channels),
    _switch("--qk-layernorm", "model.qk_layernorm", "true"),
    _switch("--add-qkv-bias", "model.qkv_bias", "true"),
    _switch("--untie-embeddings-and-output-weights", "model.tie_embeddings", "false"),
    _switch("--disable-bias-linear", "model.bias", "false"),
    _switch("--add-bias-linear", "model.bias", "true"),
    _switch("--apply-layernorm-1p", "model.zero_centered_norm", "true"),
    # parallelism
    _key("--tensor-model-parallel-size", "parallel.tp"),
    _key("--pipeline-model-parallel-size", "parallel.pp"),
    Flag("--num-layers-per-virtual-pipeline-stage", 1, note="`parallel.vpp` = layers per pipeline stage / N",
         after=_virtual_stage_layers),
    _switch("--sequence-parallel", "parallel.sequence_parallel", "true"),
    Flag("--use-distributed-optimizer", 0, note="`zero.stage 1` when `zero.stage` is 0 (2 and 3 shard further)",
         after=_zero_stage(1)),
    Flag("--use-torch-fsdp2", 0, note="`zero.stage 3` when `zero.stage` is 0 (parameters, gradients and optimizer "
         "states sharded)", after=_zero_stage(3)),
    _key("--context-parallel-size", "parallel.cp", "`parallel.cp X` (ring attention in Megatron's load-balanced "
         "order by default)"),
    Flag("--cp-comm-type", 1, note="`parallel.cp_impl`: p2p is `ring`, a2a is `ulysses`", after=_cp_comm_type),
    # mixture of experts (issue 45)
    _key("--num-experts", "model.num_experts"),
    _key("--moe-router-topk", "model.moe_router_topk"),
    _key("--expert-model-parallel-size", "parallel.ep"),
    _key("--expert-tensor-parallel-size", "parallel.etp"),
    _key("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size"),
    Flag("--moe-layer-freq", 1, (("model.moe_layer_freq", None),), "`model.moe_layer_freq`: an integer k as it is, a "
         "list expression such as `([0]*3+[1]*29)` as the 0/1 list it builds", convert=_layer_freq),
    _key("--moe-router-load-balancing-type", "model.moe_load_balancing",
         choices={t: t for t in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")}),
    _key("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff"),
    _key("--moe-z-loss-coeff", "model.moe_z_loss_coeff"),
    _key("--moe-router-score-function", "model.moe_router_score_function",
         choices={"softmax": "softmax", "sigmoid": "sigmoid"}),
    _switch("--moe-router-pre-softmax", "model.moe_router_pre_softmax", "true"),
    _key("--moe-router-topk-scaling-factor", "model.moe_router_topk_scaling_factor"),
    _key("--moe-router-num-groups", "model.moe_router_num_groups"),
    _key("--moe-router-group-topk", "model.moe_router_group_topk"),
    _switch("--moe-router-enable-expert-bias", "model.moe_router_enable_expert_bias", "true"),
    _key("--moe-router-bias-update-rate", "model.moe_router_bias_update_rate"),
    _key("--moe-shared-expert-intermediate-size", "model.moe_shared_expert_ffn_hidden_size"),
    _switch("--moe-shared-expert-gate", "model.moe_shared_expert_gate", "true"),
    _key("--moe-expert-capacity-factor", "model.moe_capacity_factor"),
    # Megatron ignores the drop policy of a dropless model (and asserts on padding without a capacity)
    Flag("--moe-token-drop-policy", 1, (("model.moe_token_drop_policy", None),),
         choices={"probs": "probs", "position": "position"}, needs="--moe-expert-capacity-factor"),
    Flag("--moe-pad-expert-input-to-capacity", 0, (("model.moe_pad_to_capacity", "true"),),
         needs="--moe-expert-capacity-factor"),
    _key("--moe-token-dispatcher-type", "parallel.moe_dispatcher",
         choices={"alltoall": "alltoall", "allgather": "allgather"}),
    Flag("--moe-router-dtype", 1, note="fp32: what megazero always does (routing in fp32 in every precision); "
         "fp64 is said in one line and routed in fp32", choices={"fp32": "", "fp64": ""}, tell=_router_dtype_line),
    _switch("--moe-per-layer-logging", "logging.moe_per_layer", "true"),
    Flag("--moe-layer-recompute", 0, note="`train.recompute full` (whole blocks recomputed, each MoE layer among "
         "them; said in one line)", after=_moe_layer_recompute, tell=_moe_layer_recompute_line),
    # batch and iterations
    _key("--micro-batch-size", "train.micro_batch_size"),
    _key("--global-batch-size", "train.global_batch_size"),
    Flag("--rampup-batch-size", 3, (("train.rampup_batch_size", None),),
         "`train.rampup_batch_size START INCREMENT SAMPLES` (the LR schedule then counts samples)"),
    _key("--train-iters", "train.iters"),
    Flag("--train-samples", 1, note="`train.iters`: the steps that consume that many samples (ramp-up included)",
         after=_train_samples),
    _key("--seed", "train.seed"),
    # precision and the fp16 loss scale
    _switch("--fp16", "train.precision", "fp16"),
    _switch("--bf16", "train.precision", "bf16"),
    _key("--initial-loss-scale", "zero.initial_loss_scale"),
    _key("--loss-scale-window", "zero.loss_scale_window"),
    _key("--hysteresis", "zero.hysteresis"),
    _key("--min-loss-scale", "zero.min_loss_scale"),
    _switch("--grad-reduce-in-bf16", "zero.reduce_dtype", "bf16"),
    Flag("--calculate-per-token-loss", 0, note="what megazero always does: the loss is the sum over every counted "
         "token of the global batch over their number", after=_accepted),
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
    _key("--lr-decay-samples", "optim.decay_samples"),
    _key("--lr-warmup-samples", "optim.warmup_samples"),
    _key("--decoupled-lr", "optim.decoupled_lr"),
    _key("--decoupled-min-lr", "optim.decoupled_min_lr"),
    # Megatron's adam is AdamW (decoupled weight decay), its sgd torch.optim.SGD, as megazero's.
    _key("--optimizer", "optim.name", choices={"adam": "adamw", "sgd": "sgd", "muon": "muon"}),
    _key("--sgd-momentum", "optim.sgd_momentum"),
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
    _switch("--eod-mask-loss", "data.eod_mask_loss", "true"),
    _switch("--reset-position-ids", "data.reset_position_ids", "true"),
    _switch("--reset-attention-mask", "data.reset_attention_mask", "true"),
    _key("--data-cache-path", "data.cache_dir"),
    Flag("--tokenizer-type", 1, note="`data.tokenizer`: GPT2BPETokenizer `gpt2bpe:V,M`; SentencePieceTokenizer, "
                                     "Llama2Tokenizer `sentencepiece:F`; HuggingFaceTokenizer with a local "
                                     "--tokenizer-model DIR: its files decide (tokenizer.json `hf:DIR`, tokenizer.model "
                                     "`sentencepiece:DIR`); NullTokenizer none (token ids below --vocab-size); "
                                     "GPT2BPETokenizer when left out", collect="tokenizer"),
    Flag("--dataloader-type", 1, note="single, cyclic: megazero's datasets reshuffle every epoch whatever the flag "
         "(each epoch's documents in a new seeded order, its samples permuted within it), what cyclic adds to "
         "single; named in the warning line", choices={"single": "", "cyclic": ""}),
    Flag("--vocab-file", 1, note="`data.tokenizer gpt2bpe:V,M` with --merge-file", collect="tokenizer"),
    Flag("--merge-file", 1, note="`data.tokenizer gpt2bpe:V,M` with --vocab-file", collect="tokenizer"),
    Flag("--tokenizer-model", 1, note="`data.tokenizer sentencepiece:F` (HuggingFaceTokenizer: `hf:DIR` or "
         "`sentencepiece:DIR`)", collect="tokenizer"),
    # checkpoints
    _key("--save", "checkpoint.save"),
    _key("--load", "checkpoint.load", "`checkpoint.load` (also a Megatron save directory: its "
                                      "`latest_checkpointed_iteration.txt`)"),
    _key("--save-interval", "checkpoint.interval"),
    _switch("--async-save", "checkpoint.async_save", "true"),
    _key("--ckpt-step", "checkpoint.iteration"),
    Flag("--ckpt-format", 1, note="torch, torch_dist: megazero's sharded format either way (resharded on load to any "
         "layout, like torch_dist); others refused", choices={"torch": "", "torch_dist": ""}),
    Flag("--no-save-optim", 0, (("checkpoint.save_optimizer", "false"),), "`checkpoint.save_optimizer false`: "
         "checkpoints of the weights alone (fine-tuned from, not resumed bitwise; said at each save)"),
    Flag("--no-save-rng", 0, (("checkpoint.save_rng", "false"),), "`checkpoint.save_rng false`: checkpoints "
         "without the RNG streams (said at each save)"),
    Flag("--no-load-optim", 0, (("checkpoint.load_optimizer", "false"),), "`checkpoint.load_optimizer false`: "
         "the checkpoint's weights, loop position and LR schedule with a fresh optimizer state"),
    Flag("--no-load-rng", 0, (("checkpoint.load_rng", "false"),), "`checkpoint.load_rng false`: RNG streams "
         "reseeded from the seed and the iteration"),
    Flag("--exit-on-missing-checkpoint", 0, note="a `--load` directory without a checkpoint is an error (checked)",
         after=_exit_on_missing),
    Flag("--use-checkpoint-args", 0, note="what megazero always checks: the model keys must equal the checkpoint's "
         "(a resume names a differing key)", after=_accepted),
    # logging, evaluation, lifecycle
    _key("--log-interval", "train.log_interval"),
    _key("--eval-interval", "train.eval_interval"),
    _key("--eval-iters", "train.eval_iters"),
    _key("--tensorboard-dir", "logging.tensorboard"),
    Flag("--wandb-project", 1, (("logging.wandb", "true"), ("logging.wandb_project", None))),
    _key("--distributed-timeout-minutes", "train.timeout_minutes"),
    _key("--exit-duration-in-mins", "train.exit_duration_minutes"),
    _key("--rerun-mode", "train.rerun_on", "`train.rerun_on nan` (validate_results: rerun a non-finite step; "
         "with --check-for-spiky-loss `spike`), `none` (disabled); report_stats refused",
         choices={"validate_results": "nan", "disabled": "none"}),
    Flag("--check-for-nan-in-loss-and-grad", 0, note="what megazero always does (a non-finite loss or gradient norm "
         "skips the step on every rank); train.rerun_on nan (the default) also reruns it", after=_accepted),
    Flag("--check-for-spiky-loss", 0, note="`train.rerun_on spike` (with --rerun-mode validate_results, the "
         "default there); the factor is `train.spike_factor`", after=_spiky_loss),
    Flag("--profile", 0, note="`logging.profiler nsys` (a CUDA profiler range for Nsight Systems), or `torch` "
         "with --use-pytorch-profiler", after=_profile),
    Flag("--use-pytorch-profiler", 0, (("logging.profiler", "torch"),), "`logging.profiler torch`: a torch.profiler "
         "trace per profiling rank beside the TensorBoard logs", needs="--profile"),
    _key("--profile-step-start", "logging.profile_start"),
    _key("--profile-step-end", "logging.profile_end"),
    Flag("--profile-ranks", LIST, (("logging.profile_ranks", None),), "`logging.profile_ranks R ...` (rank 0 when left out)"),
    # kernel and implementation choices megazero makes itself, and what it always does
    *_no_effect("--attention-backend X", "--transformer-impl X", "--use-mcore-models", "--use-flash-attn",
                "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
                "--no-persist-layer-norm", "--no-async-tensor-model-parallel-allreduce", "--overlap-grad-reduce",
                "--overlap-param-gather", "--tp-comm-overlap", "--accumulate-allreduce-grads-in-fp32",
                "--fp16-lm-cross-entropy", "--cross-entropy-loss-fusion", "--use-distributed-sampler",
                "--make-vocab-size-divisible-by X", "--distributed-backend X", "--DDP-impl X", "--data-impl X",
                "--num-workers X", "--recompute-method X", "--recompute-num-layers X", "--exit-signal-handler",
                "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
                "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard", "--timing-log-level X"),
    # the fused scale-mask-softmax's (apex-era) fp16 guards: the scaling cancels out; SDPA's fused kernels
    # accumulate the softmax in fp32
    *_no_effect("--apply-query-key-layer-scaling", "--no-query-key-layer-scaling", "--attention-softmax-in-fp32"),
    # memory housekeeping, data-loading and naming details
    *_no_effect("--manual-gc", "--manual-gc-interval X", "--empty-unused-memory-level X",
                "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--tiktoken-pattern X",
                "--use-contiguous-parameters-in-local-ddp", "--wandb-exp-name X", "--wandb-save-dir X"),
    # MoE kernels: megazero's experts always compute as one grouped GEMM, its dispatch is its own
    *_no_effect("--moe-grouped-gemm", "--moe-use-legacy-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion",
                "--moe-shared-expert-overlap"),
    # MoE features outside megazero's reach (they change what is trained, or need kernels it does not have)
    *_no_effect("--moe-enable-deepep", "--moe-deepep-num-sms X", refused=_NO_DEEPEP),
    *_no_effect("--moe-use-upcycling", refused="megazero does not turn a dense checkpoint into an MoE one; train the "
                "MoE from scratch or from a Hugging Face MoE checkpoint (checkpoint.init_from_hf), and drop the flag"),
    *_no_effect("--moe-router-padding-for-fp8", refused=_NO_FP8),
    *_no_effect("--moe-input-jitter-eps X", "--moe-router-topk-limited-devices X", "--moe-router-force-load-balancing",
                refused="megazero's router has no input jitter, device-limited routing (use --moe-router-num-groups "
                        "with --moe-router-group-topk) or forced balancing; drop the flag"),
    # FP8 needs Transformer Engine's FP8 GEMMs; megazero trains in fp32, bf16 or fp16
    *_no_effect("--fp8-format X", "--fp8-recipe X", "--fp8-margin X", "--fp8-interval X", "--fp8-amax-history-len X",
                "--fp8-amax-compute-algo X", "--fp8-param-gather", "--keep_fp8_weight_transpose_cache",
                refused=_NO_FP8),
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
    later: list[tuple[Callable[[Config, list[str]], None], list[str]]] = field(default_factory=list)
    collected: dict[str, str] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    """The Megatron flags given, in order (any: MEGATRON_DEFAULTS apply)."""
    setters: dict[str, tuple[str, str, list[str]]] = field(default_factory=dict)
    """megazero key -> (the Megatron flag that set it, as written, the value): two flags must agree on a key."""
    implied: list[str] = field(default_factory=list)
    """Megatron's defaults that flags given implied (Flag.implies), as 'key value (flag)', once applied."""
    told: list[str] = field(default_factory=list)
    """Lines the flags' `tell` said (how megazero does what they ask), in order, once each."""
    refused: dict[str, str] = field(default_factory=dict)
    """Refused flags -> why: all of them named in one error line once the line is read."""

    def defaults(self, has_config_file: bool) -> dict:
        """The sections a Megatron launch line starts from: MEGATRON_DEFAULTS when Megatron flags
        were given without a config file, else none."""
        return MEGATRON_DEFAULTS if self.seen and not has_config_file else {}

    def defaults_note(self, has_config_file: bool) -> Optional[str]:
        """One line naming the Megatron defaults in effect (those the command line left alone)."""
        given = {arg[2:].split("=", 1)[0] for arg in self.overrides if arg.startswith("--")}
        kept = [f"{section}.{key} {show_value(value)}" for section, values in self.defaults(has_config_file).items()
                for key, value in values.items() if f"{section}.{key}" not in given] + self.implied
        return (f"Megatron-LM launch line: Megatron's defaults for what it leaves out: {', '.join(kept)}"
                if kept else None)

    def apply(self, cfg: Config) -> None:
        """The flags that need the built config (every other key at its final value)."""
        for after, values in self.later:
            after(cfg, values)
        for name in dict.fromkeys(self.seen):
            for key, value in BY_NAME[name].implies:
                if key not in cfg.set_keys:  # a file's or the command line's value wins
                    _set(cfg, key, value)
                    self.implied.append(f"{key} {show_value(value)} ({name})")

    def warning(self) -> Optional[str]:
        return (f"warning: Megatron-LM flags accepted with no effect here (kernel and implementation choices megazero "
                f"makes itself): {', '.join(dict.fromkeys(self.ignored))}" if self.ignored else None)


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
        _record(out, flag, values)
        out.seen.append(name)
    if out.refused:  # every flag outside megazero's reach at once, grouped by the reason
        reasons = {why: [n for n, w in out.refused.items() if w == why] for why in out.refused.values()}
        raise ConfigError("; ".join(f"{', '.join(names)}: {why}" for why, names in reasons.items()))
    for name in out.seen:
        if BY_NAME[name].needs and BY_NAME[name].needs not in out.seen:
            raise ConfigError(f"{name} needs {BY_NAME[name].needs} (Megatron-LM ignores it without); add it")
    kind = out.collected.get("--tokenizer-type", "GPT2BPETokenizer")
    if out.collected and kind != "NullTokenizer":  # NullTokenizer: none (token ids; --vocab-size sizes the model)
        files = map(out.collected.get, ("--vocab-file", "--merge-file", "--tokenizer-model"))
        out.overrides += ["--data.tokenizer", tokenizer_spec(kind, *files)]
    return out


# Megatron-LM's --tokenizer-type names and the data.tokenizer kind each becomes (the kinds' own
# names are taken too).
TOKENIZER_TYPES = {
    "GPT2BPETokenizer": "gpt2bpe",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "HuggingFaceTokenizer": "hf",
}


def tokenizer_spec(tokenizer_type: str, vocab_file: Optional[str], merge_file: Optional[str],
                   tokenizer_model: Optional[str]) -> str:
    """data.tokenizer from Megatron-LM's tokenizer flags (--tokenizer-type, --vocab-file, --merge-file,
    --tokenizer-model), by their names: the files are read later, by data/'s tokenizers (a directory,
    as a bare spec, is read by what it holds)."""
    kind = TOKENIZER_TYPES.get(tokenizer_type, tokenizer_type)
    if kind == "gpt2bpe":
        if not vocab_file or not merge_file:
            raise ConfigError(f"--tokenizer-type {tokenizer_type} needs --vocab-file and --merge-file")
        return f"gpt2bpe:{vocab_file},{merge_file}"
    if kind == "sentencepiece":
        if not tokenizer_model:
            raise ConfigError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
        return f"sentencepiece:{tokenizer_model}"
    if kind != "hf":
        names = ", ".join(dict.fromkeys([*TOKENIZER_TYPES, *TOKENIZER_TYPES.values()]))
        raise ConfigError(f"--tokenizer-type {tokenizer_type!r} is not supported; use one of {names}")
    # HuggingFaceTokenizer's --tokenizer-model: a local directory (its files decide: tokenizer.json,
    # or Llama 2's tokenizer.model) or a tokenizer.json; Megatron also takes a hub name, which needs the network.
    if not tokenizer_model:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model DIR (a directory with tokenizer.json)")
    if os.path.isdir(tokenizer_model):
        return tokenizer_model
    if os.path.isfile(tokenizer_model) and tokenizer_model.endswith(".json"):
        return f"hf:{tokenizer_model}"
    raise ConfigError(f"--tokenizer-type {tokenizer_type} --tokenizer-model {tokenizer_model}: megazero reads a local "
                      f"directory holding tokenizer.json (or the file itself), not a hub name; download the tokenizer first")


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
    if flag.refused:
        out.refused[flag.name] = flag.refused
        return
    if flag.choices is not None and not flag.sets:  # a value checked, nothing set
        _chosen(flag, values[0])
    said = flag.tell(values) if flag.tell else None
    if said and said not in out.told:
        out.told.append(said)
    if flag.collect:
        out.collected[flag.name] = values[0]
    elif flag.after is not None:
        out.later.append((flag.after, values))
    elif not flag.sets and not flag.implies and not flag.tell:
        out.ignored.append(" ".join([flag.name, *values]) if flag.choices else flag.name)
    for key, value in flag.sets:
        given = [value] if value is not None else [_chosen(flag, v) for v in values]
        shown = " ".join([flag.name, *values])
        earlier = out.setters.setdefault(key, (flag.name, shown, given))
        if earlier[0] != flag.name and earlier[2] != given:  # the same flag twice: the last wins, as in Megatron
            raise ConfigError(f"{earlier[1]} and {shown} both set {key} (to {' '.join(earlier[2])} and "
                              f"{' '.join(given)}); pass one of them")
        out.overrides += [f"--{key}", *given]


def _chosen(flag: Flag, value: str) -> str:
    """megazero's spelling of a flag's value (the value itself unless the flag has choices or a converter)."""
    if flag.convert is not None:
        return flag.convert(flag.name, value)
    if flag.choices is None:
        return value
    if value not in flag.choices:
        raise ConfigError(f"{flag.name} {value}: megazero builds {', '.join(flag.choices)}; "
                          f"{value} is outside its reach")
    return flag.choices[value]


def _unknown(name: str) -> Flag:
    """The error for a flag that is neither megazero's nor a Megatron flag in the table: it names
    the nearest Megatron flag, megazero key or short alias (--tp: --parallel.tp)."""
    keys = [key for key, *_ in config_keys()]
    close = closest(name, [*((flag, flag) for flag in BY_NAME), *key_candidates(keys)])
    flag = BY_NAME.get(close)
    hint = f"did you mean {close} (megazero's {flag.sets[0][0]})?" if flag and flag.sets else f"did you mean {close}?"
    raise ConfigError(f"unknown flag {name}: neither a megazero key nor a Megatron-LM flag megazero reads; {hint}")


# ---------------------------------------------------------------------------- README


def markdown_table() -> str:
    """README's Megatron-LM migration table, one row per flag (the no-effect flags in one row)."""
    lines = ["| Megatron-LM flag | megazero |", "| --- | --- |"]
    for flag in FLAGS:
        if (flag.sets or flag.after or flag.collect or flag.choices or flag.implies or flag.tell) and not flag.refused:
            lines.append(f"| `{flag.name}{_METAVARS[flag.nargs]}` | {_cell(flag)} |")
    refused = [f for f in FLAGS if f.refused]
    for why in dict.fromkeys(f.refused for f in refused):
        names = ", ".join(f"`{f.name}`" for f in refused if f.refused == why)
        lines.append(f"| {names} | refused in one line: {why} |")
    ignored = ", ".join(f"`{f.name}`" for f in FLAGS
                        if not (f.sets or f.after or f.collect or f.choices or f.implies or f.tell or f.refused))
    lines.append(f"| {ignored} | accepted and named in one warning line: kernel and implementation choices megazero "
                 f"makes itself, or what it always does |")
    return "\n".join(lines)


def defaults_table() -> str:
    """README's line on the Megatron defaults a Megatron command line gets."""
    return ", ".join(f"`{section}.{key} {show_value(value)}`" for section, values in MEGATRON_DEFAULTS.items()
                     for key, value in values.items())


_METAVARS = {0: "", 1: " X", 3: " START INCREMENT SAMPLES", LIST: " ..."}


def _cell(flag: Flag) -> str:
    if flag.note:
        return flag.note
    if flag.choices:
        return ", ".join(f"{theirs}: `{flag.sets[0][0]} {ours}`" for theirs, ours in flag.choices.items())
    return ", ".join(f"`{key} {value if value is not None else 'X'}`" for key, value in flag.sets)
