"""The rules a resolved config must meet: `validate(cfg, world_size)` checks every value and their
consistency, changing nothing, before any process group is built (train/preflight.py adds other
modules' checks). Errors are one line naming the key, the values and the fix.
"""

from __future__ import annotations

import math
import os
from typing import Optional

from megazero.config.schema import (
    Config,
    ConfigError,
    FinetuneConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    ZeroConfig,
)
from megazero.config.sharding import Sharding, sharding


def schedule_warnings(cfg: Config) -> list[str]:
    """Lines about a config that is valid but almost surely not meant: an LR warm-up that lasts
    the whole run or leaves no decay phase. (Keys set that the run never reads: config/reads.py.)"""
    t, o = cfg.train, cfg.optim
    lines = []
    warmup = warmup_length(o, t.iters)
    if warmup and t.iters and warmup >= t.iters:
        lines.append(f"warning: optim.warmup_iters ({warmup:g}) >= train.iters ({t.iters}): the whole run warms up "
                     f"and the LR never decays; lower optim.warmup_iters or raise train.iters")
    elif warmup and t.iters and o.decay_iters and warmup >= o.decay_iters:
        lines.append(f"warning: optim.warmup_iters ({warmup:g}) >= optim.decay_iters ({o.decay_iters}): the LR "
                     f"jumps to min_lr after the warm-up, with no decay; raise optim.decay_iters")
    return lines


def _check_document_resets(cfg: Config) -> None:
    """data.reset_position_ids / reset_attention_mask find documents by the tokenizer's end-of-document
    id, in the whole sample: a context-parallel rank holds only its zig-zag chunks of it."""
    d = cfg.data
    for key, on in (("data.reset_position_ids", d.reset_position_ids), ("data.reset_attention_mask",
                                                                         d.reset_attention_mask)):
        if on and not d.tokenizer:
            raise ConfigError(f"{key} needs data.tokenizer (its end-of-document id); set it, or drop {key}")
        if on and cfg.parallel.cp > 1:
            raise ConfigError(f"{key} needs parallel.cp 1 (context-parallel attention takes no document mask; "
                              f"cp is {cfg.parallel.cp}); set parallel.cp 1, or drop {key}")


def validate(cfg: Config, world_size: int) -> int:
    """Check every value of a resolved config and their consistency; return the inferred
    data-parallel degree. Changes nothing."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not cfg.data.mock and not cfg.data.prefix and not cfg.data.stream:
        raise ConfigError("no training data: set data.prefix (indexed dataset prefixes), data.stream (raw text "
                          "tokenized on the fly) or data.mock true")
    if cfg.data.eod_mask_loss and not cfg.data.tokenizer:
        raise ConfigError("data.eod_mask_loss needs data.tokenizer (its end-of-document id); set it, or drop "
                          "data.eod_mask_loss")
    _check_document_resets(cfg)
    if cfg.data.stream_valid_docs < 0:
        raise ConfigError(f"data.stream_valid_docs ({cfg.data.stream_valid_docs}) must not be negative")
    if cfg.data.loader_workers < -1:
        raise ConfigError(f"data.loader_workers ({cfg.data.loader_workers}) must be -1 (auto), 0 (in-process) or more")
    for low, keys in ((1, ("model.num_layers", "model.hidden_size", "model.num_heads", "model.seq_length",
                           "model.vocab_size", "parallel.tp", "parallel.pp", "parallel.vpp", "train.micro_batch_size",
                           "train.global_batch_size", "train.log_interval", "zero.sub_group_size", "zero.bucket_size",
                           "train.max_skipped_steps")),
                      (0, ("train.iters", "train.eval_interval", "train.eval_iters", "optim.warmup_iters", "optim.lr",
                           "optim.min_lr", "optim.clip_grad", "optim.weight_decay", "model.ffn_hidden_size",
                           "checkpoint.interval", "checkpoint.keep_last", "train.exit_duration_minutes"))):
        for key in keys:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)  # a number (model.vocab_size is resolved by now)
            if value < low:
                raise ConfigError(f"{key} ({value}) must " + ("be at least 1" if low else "not be negative"))
    if t.timeout_minutes <= 0:
        raise ConfigError(f"train.timeout_minutes ({t.timeout_minutes:g}) must be positive, e.g. 10")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout ({m.dropout}) must be in [0, 1)")
    _validate_optim(cfg.optim)
    _validate_zero(cfg)
    _validate_finetune(cfg.finetune)
    if cfg.optim.name == "muon" and cfg.finetune.lora_rank:
        raise ConfigError(f"optim.name muon with finetune.lora_rank {cfg.finetune.lora_rank}: LoRA freezes the block "
                          f"matrices Muon steps, so Muon would step nothing (the adapters train with AdamW); use "
                          f"--optim.name adamw")
    _validate_profiler(cfg)
    _validate_silent_faults(t, world_size)
    if m.hidden_size % m.num_heads and not m.kv_channels:  # with kv_channels the heads need not tile h
        raise ConfigError(f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads}); "
                          f"or set model.kv_channels, the head size")
    _refuse(qk_norm_tp_problem(m, p.tp))
    _refuse(model_family_problem(m), tp_problem(m.num_heads, m.ffn_size, p.tp, m.query_groups),
            cp_problem(m.seq_length, p.cp))  # then cp >= 1
    _refuse(ulysses_problem(m.num_heads, p.tp, p.cp, p.cp_impl), world_problem(world_size, p.tp, p.pp, p.cp))
    dp = world_size // (p.tp * p.pp * p.cp)
    _refuse(batch_problem(t.global_batch_size, t.micro_batch_size, dp))
    if t.rampup_batch_size is not None:
        rampup_steps(t, dp)  # its one-line errors
    _validate_pipeline(cfg, dp)
    _validate_moe(cfg, dp)
    if p.sequence_parallel:
        _refuse(sequence_parallel_problem(m.seq_length, p.tp, p.cp))
        if p.tp > 1 and cfg.finetune.lora_rank:
            raise ConfigError(f"parallel.sequence_parallel cannot be combined with finetune.lora_rank "
                              f"({cfg.finetune.lora_rank}): the LoRA adapters read replicated activations; turn one off")
    _refuse(expert_tp_problem(p.tp, p.expert_tp, m.num_experts))
    return dp


def expert_tp_problem(tp: int, etp: int, num_experts: int) -> Optional[str]:
    """Expert tensor parallelism is built over the TP group itself (etp = tp, the default: each
    expert's MLP split as the dense MLP is) or not at all (etp 1: whole experts, ep splits them);
    an expert_tp group of other ranks than the TP group's (1 < etp != tp) would need the tokens
    gathered over a group the dense layers do not share, which the MoE layer does not do."""
    if num_experts and etp not in (1, tp):
        return (f"parallel.etp ({etp}) must be 1 or parallel.tp ({tp}): experts split over other ranks than the TP "
                f"group's are not built; use --parallel.etp {tp} (the default) or --parallel.etp 1")
    return None


def _validate_optim(o: OptimConfig) -> None:
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr ({o.min_lr}) must not exceed optim.lr ({o.lr})")
    if not 0.0 <= o.warmup_fraction <= 1.0:
        raise ConfigError(f"optim.warmup_fraction ({o.warmup_fraction:g}) must be in [0, 1], e.g. 0.01")
    if o.warmup_fraction and o.warmup_iters:
        raise ConfigError(f"optim.warmup_iters ({o.warmup_iters}) and optim.warmup_fraction ({o.warmup_fraction:g}) "
                          f"both set the warm-up (--lr-warmup-iters, --lr-warmup-fraction); keep one, set the other to 0")
    if o.muon_lr < 0:
        raise ConfigError(f"optim.muon_lr ({o.muon_lr:g}) must not be negative, e.g. 0.02")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"optim.muon_momentum ({o.muon_momentum:g}) must be in [0, 1), e.g. 0.95")
    if not 1 <= o.muon_ns_steps < 100:
        raise ConfigError(f"optim.muon_ns_steps ({o.muon_ns_steps}) must be in [1, 99], e.g. 5")
    if not 0.0 <= o.sgd_momentum < 1.0:
        raise ConfigError(f"optim.sgd_momentum ({o.sgd_momentum:g}) must be in [0, 1), e.g. 0.9")


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


def _validate_zero(cfg: Config) -> None:
    z, precision = cfg.zero, cfg.train.precision
    stage = sharding(z.stage)  # refuses a number that names no stage
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
    _validate_offload(z, stage)
    changed = [k for k in ("initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale")
               if f"zero.{k}" in cfg.set_keys]
    if changed and precision != "fp16":
        raise ConfigError(f"zero.{changed[0]} configures the fp16 loss scaler, but train.precision is {precision}; "
                          f"drop it or use --train.precision fp16")


def _validate_profiler(cfg: Config) -> None:
    lg = cfg.logging
    if lg.profiler == "none":
        return
    if not 0 <= lg.profile_start < lg.profile_end:
        raise ConfigError(f"logging.profile_start ({lg.profile_start}) and logging.profile_end ({lg.profile_end}) must "
                          f"satisfy 0 <= start < end: the steps start to end - 1 are profiled")
    if not all(isinstance(r, int) and r >= 0 for r in lg.profile_ranks):
        raise ConfigError(f"logging.profile_ranks ({lg.profile_ranks}) must be global rank numbers, e.g. 0 1")
    if lg.profiler == "torch" and not (lg.tensorboard or cfg.checkpoint.save or lg.jsonl):
        raise ConfigError("logging.profiler torch writes its trace beside the run's logs: set logging.tensorboard "
                          "(--tensorboard-dir), checkpoint.save or logging.jsonl")


FAULT_KINDS = ("bitflip", "transient_nan", "persistent_nan", "slow")
"""train.inject_fault's kinds (train/inject.py)."""


def fault_spec(text: str, world_size: int) -> tuple[str, int, int]:
    """train.inject_fault KIND:RANK:ITER -> (kind, rank, iteration), or one line naming what is wrong."""
    kind, rank, iteration = (text.split(":") + ["", ""])[:3] if text.count(":") == 2 else ("", "", "")
    if kind not in FAULT_KINDS or not rank.isdigit() or not iteration.isdigit():
        raise ConfigError(f"train.inject_fault ({text!r}) must be KIND:RANK:ITER with KIND one of "
                          f"{', '.join(FAULT_KINDS)}, e.g. bitflip:1:4")
    if int(rank) >= world_size or int(iteration) < 1:
        raise ConfigError(f"train.inject_fault ({text!r}): RANK must be below the world size ({world_size}) and ITER "
                          f"at least 1 (iterations count from 1), e.g. {kind}:{world_size - 1}:1")
    return kind, int(rank), int(iteration)


def _validate_silent_faults(t: TrainConfig, world_size: int) -> None:
    for key in ("replica_check_interval", "straggler_interval"):
        value = getattr(t, key)
        if value is not None and value < 0:
            raise ConfigError(f"train.{key} ({value}) must not be negative (0: off; unset: train.log_interval)")
    for key in ("spike_factor", "straggler_factor"):
        if not getattr(t, key) > 1.0:
            raise ConfigError(f"train.{key} ({getattr(t, key):g}) must be above 1 (a multiple of the reference), "
                              f"e.g. {10 if key == 'spike_factor' else 1.5}")
    if t.inject_fault is not None:
        fault_spec(t.inject_fault, world_size)


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


def _validate_offload(z: ZeroConfig, stage: Sharding) -> None:
    if z.offload_param != "none" and not stage.parameters:
        raise ConfigError(f"zero.offload_param {z.offload_param} offloads stage 3's parameter shards, which needs "
                          f"zero.stage 3 (got {z.stage}); set --zero.stage 3 or --zero.offload_param none")
    if z.offload_optimizer != "none" and not stage.optimizer:
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
    _refuse(nvme_path_problem(z.nvme_path))


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


def _validate_pipeline(cfg: Config, dp: int) -> None:
    p, t = cfg.parallel, cfg.train
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    _refuse(pp_problem(cfg.model.num_layers, p.pp, p.vpp, p.pp_layers),
            zbh1_problem(p.vpp, t.compile) if p.schedule == "zbh1" and p.pp > 1 else None,
            interleaved_problem(p.pp, p.vpp, None))
    if p.vpp > 1 and p.schedule == "gpipe":
        raise ConfigError(f"parallel.schedule gpipe runs one model chunk per rank, but parallel.vpp is {p.vpp}; "
                          f"use --parallel.schedule interleaved or --parallel.vpp 1")
    _refuse(interleaved_problem(p.pp, p.vpp, microbatches))
    if p.vpp > 1 and t.rampup_batch_size is not None:  # every batch of the ramp too: START and INCREMENT
        unit = t.micro_batch_size * dp * p.pp
        if any(int(v) % unit for v in t.rampup_batch_size[:2]):
            raise ConfigError(f"interleaved schedule needs every ramp-up batch in whole rounds of parallel.pp "
                              f"micro-batches: train.rampup_batch_size START and INCREMENT "
                              f"({t.rampup_batch_size[0]}, {t.rampup_batch_size[1]}) must be multiples of "
                              f"micro_batch_size x dp x pp ({t.micro_batch_size} x {dp} x {p.pp} = {unit})")
    if p.vpp == 1 and p.schedule == "interleaved":
        raise ConfigError("parallel.schedule interleaved needs parallel.vpp > 1")


def _validate_moe(cfg: Config, dp: int) -> None:
    """The mixture-of-experts keys (model.moe_*, parallel.ep / etp) and the experts' folding of the grid."""
    m, p = cfg.model, cfg.parallel
    for key in ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size", "moe_router_num_groups",
                "moe_router_group_topk", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
                "kv_channels"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key} ({getattr(m, key)}) must not be negative")
    if p.ep < 1 or p.etp < 0:
        raise ConfigError(f"parallel.ep ({p.ep}) must be at least 1 and parallel.etp ({p.etp}) not negative "
                          f"(0 means parallel.tp)")
    if not m.num_experts:
        if p.ep > 1 or p.expert_tp != p.tp:
            raise ConfigError(f"parallel.ep ({p.ep}) and parallel.etp ({p.etp}) split experts, but model.num_experts "
                              f"is 0 (a dense model); set model.num_experts, or parallel.ep 1 and parallel.etp 0")
        return
    _refuse(moe_layers_problem(m), moe_router_problem(m), moe_capacity_problem(m, cfg.set_keys),
            expert_grid_problem(p.tp, p.cp, dp, p.ep, p.expert_tp, m.num_experts),
            expert_width_problem(m.moe_ffn_size, m.moe_shared_expert_ffn_hidden_size, p.expert_tp, p.tp))


def moe_layers_problem(m: ModelConfig) -> Optional[str]:
    """Which layers are MoE (moe_layer_freq) and the experts' widths."""
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers or any(isinstance(v, bool) or v not in (0, 1) for v in freq):
            return (f"model.moe_layer_freq ({freq}) must list 0 (dense) or 1 (MoE) for each of model.num_layers "
                    f"({m.num_layers}) layers, e.g. {[0] + [1] * (m.num_layers - 1)}, or be an integer k")
        if 1 not in freq:
            return (f"model.moe_layer_freq ({freq}) makes no layer MoE; put a 1 where a layer has experts, "
                    f"or set model.num_experts 0 for a dense model")
    elif freq < 1:
        return f"model.moe_layer_freq ({freq}) must be at least 1 (every k-th layer is MoE; 1: every layer)"
    if m.moe_shared_expert_gate and not m.moe_shared_expert_ffn_hidden_size:
        return ("model.moe_shared_expert_gate gates the shared expert, but model.moe_shared_expert_ffn_hidden_size "
                "is 0 (none); set its width or drop the gate")
    return None


def moe_router_problem(m: ModelConfig) -> Optional[str]:
    """The router's top-k, group-limited routing, score function and expert bias."""
    e, k = m.num_experts, m.moe_router_topk
    if not 1 <= k <= e:
        return f"model.moe_router_topk ({k}) must be in 1..model.num_experts ({e}), e.g. {min(2, e)}"
    if k == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax:
        return ("model.moe_router_topk 1 with softmax after the top-k gives every token weight 1 and the router no "
                "gradient; set model.moe_router_pre_softmax true or moe_router_topk 2")
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        return (f"model.moe_router_pre_softmax applies to softmax scores, but moe_router_score_function is "
                f"{m.moe_router_score_function}; drop moe_router_pre_softmax")
    if m.moe_router_topk_scaling_factor is not None and m.moe_router_topk_scaling_factor <= 0:
        return f"model.moe_router_topk_scaling_factor ({m.moe_router_topk_scaling_factor:g}) must be positive, or null"
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        return ("model.moe_router_enable_expert_bias biases sigmoid scores (DeepSeek-V3); set "
                "model.moe_router_score_function sigmoid or drop the expert bias")
    return group_routing_problem(e, k, m.moe_router_num_groups, m.moe_router_group_topk)


def group_routing_problem(experts: int, topk: int, groups: int, group_topk: int) -> Optional[str]:
    """Group-limited routing: equal groups of experts, top-k drawn from group_topk of them."""
    if not groups:
        return (f"model.moe_router_group_topk ({group_topk}) needs model.moe_router_num_groups; set it or drop "
                f"group_topk") if group_topk else None
    if experts % groups:
        divisors = [d for d in range(2, experts + 1) if experts % d == 0]
        return (f"model.moe_router_num_groups ({groups}) must divide model.num_experts ({experts}) into equal groups;"
                f" try {_nearest(divisors, groups)}")
    if not 1 <= group_topk <= groups:
        return f"model.moe_router_group_topk ({group_topk}) must be in 1..model.moe_router_num_groups ({groups})"
    if topk > group_topk * (experts // groups):
        return (f"model.moe_router_topk ({topk}) exceeds the experts of moe_router_group_topk ({group_topk}) groups "
                f"of {experts // groups}; raise moe_router_group_topk or lower moe_router_topk")
    return None


def moe_capacity_problem(m: ModelConfig, set_keys: frozenset[str]) -> Optional[str]:
    """Token dropping: a positive capacity factor, and its keys only with one."""
    if m.moe_capacity_factor is not None:
        if m.moe_capacity_factor <= 0:
            return (f"model.moe_capacity_factor ({m.moe_capacity_factor:g}) must be positive, e.g. 1.25, or null "
                    f"(dropless)")
        return None
    for key in ("moe_token_drop_policy", "moe_pad_to_capacity"):
        if f"model.{key}" in set_keys:
            return (f"model.{key} applies when tokens are dropped, but model.moe_capacity_factor is null (dropless); "
                    f"set a capacity factor, e.g. 1.25, or drop {key}")
    return None


def _refuse(*problems: Optional[str]) -> None:
    """Raise the first problem found, if any."""
    for problem in problems:
        if problem:
            raise ConfigError(problem)


# ---------------------------------------------------------------------------- layout rules
# The one home of the rules a parallel layout must meet: validate() below, the planner
# (plan/planner.py: layout_problem, check_fixed) and ProcessGrid.create call these. Each takes
# plain numbers and returns the problem in one line, with the numbers and the fix, or None.


def world_problem(world: int, tp: int, pp: int, cp: int = 1) -> Optional[str]:
    """world = tp x cp x pp x dp: the world size must be a multiple of tp x cp x pp."""
    if world % (tp * pp * cp) == 0:
        return None
    names, sizes = ("parallel.tp x parallel.pp", f"{tp} x {pp}") if cp == 1 else \
        ("parallel.tp x parallel.pp x parallel.cp", f"{tp} x {pp} x {cp}")
    return (f"world size ({world}) must be divisible by {names} ({sizes} = {tp * pp * cp}); "
            f"change --nproc_per_node or the layout")


def model_family_problem(m: ModelConfig) -> Optional[str]:
    """The Llama-family options: K/V groups that divide the heads, an even rotary head, sane llama3 factors."""
    if m.num_query_groups < 0 or m.num_heads % m.query_groups:
        return (f"model.num_query_groups ({m.num_query_groups}) must divide model.num_heads ({m.num_heads}); "
                f"1 is multi-query, 0 means num_heads")
    if m.position_embedding == "rope" and m.head_dim % 2:
        size = f"model.kv_channels is {m.kv_channels}" if m.kv_channels else \
            f"model.hidden_size / model.num_heads is {m.head_dim}"
        return f"rotary embeddings need an even head dimension: {size}"
    if m.rope_scaling == "llama3" and not (m.rope_scaling_factor > 0 and
                                           m.rope_high_freq_factor > m.rope_low_freq_factor > 0):
        return (f"model.rope_scaling llama3 needs rope_scaling_factor > 0 and rope_high_freq_factor "
                f"({m.rope_high_freq_factor}) > rope_low_freq_factor ({m.rope_low_freq_factor}) > 0")
    return None


def tp_problem(num_heads: int, ffn_size: int, tp: int, groups: int = 0) -> Optional[str]:
    """Tensor parallelism splits the heads, their K/V groups (`groups`, 0: one per head) and the
    MLP width evenly over the tp ranks."""
    if num_heads % tp:
        return f"model.num_heads ({num_heads}) must be divisible by parallel.tp ({tp})"
    if groups and groups % tp:
        return (f"model.num_query_groups ({groups}) must be divisible by parallel.tp ({tp}): each rank holds "
                f"whole K/V groups; lower parallel.tp or raise model.num_query_groups")
    if ffn_size % tp:
        return f"MLP width ({ffn_size}) must be divisible by parallel.tp ({tp})"
    return None


def qk_norm_tp_problem(m: ModelConfig, tp: int) -> Optional[str]:
    """A q/k norm over the whole projections (OLMoE) would need each position's sum of squares over
    the heads that tensor parallelism splits: not built, so tp 1."""
    if m.qk_layernorm and m.qk_layernorm_scope == "projection" and tp > 1:
        return (f"model.qk_layernorm_scope projection normalises q and k over all heads, which parallel.tp ({tp}) "
                f"splits; use --parallel.tp 1 (data, pipeline or context parallelism instead)")
    return None


def cp_problem(seq_length: int, cp: int) -> Optional[str]:
    """Context parallelism cuts each sequence into 2 x cp equal chunks (zig-zag)."""
    if cp < 1:
        return f"parallel.cp ({cp}) must be at least 1 (1 turns context parallelism off)"
    if seq_length % (2 * cp) and cp > 1:
        return (f"parallel.cp ({cp}) cuts model.seq_length ({seq_length}) into 2 x cp = {2 * cp} equal chunks: "
                f"make seq_length a multiple of {2 * cp} or change parallel.cp")
    return None


def ulysses_problem(num_heads: int, tp: int, cp: int, cp_impl: str) -> Optional[str]:
    """Ulysses' all-to-all gives each rank num_heads / (tp x cp) whole heads."""
    if cp_impl != "ulysses" or cp == 1 or num_heads % (tp * cp) == 0:
        return None
    return (f"parallel.cp_impl ulysses gives each rank num_heads / (tp x cp) heads, but model.num_heads "
            f"({num_heads}) is not divisible by {tp} x {cp} = {tp * cp}; change parallel.cp or use parallel.cp_impl ring")


def pp_problem(num_layers: int, pp: int, vpp: int = 1, pp_layers: Optional[list] = None) -> Optional[str]:
    """The layers split over pp stages (evenly, or as pp_layers lists), each into vpp chunks."""
    if pp_layers is not None:
        if vpp > 1:
            return "parallel.pp_layers (uneven split) cannot be combined with parallel.vpp > 1"
        if len(pp_layers) != pp or sum(pp_layers) != num_layers or min(pp_layers) < 1:
            return (f"parallel.pp_layers ({pp_layers}) must list pp ({pp}) positive counts summing to "
                    f"model.num_layers ({num_layers})")
        return None
    if num_layers % pp:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        return (f"model.num_layers ({num_layers}) must be divisible by parallel.pp ({pp}); try pp "
                f"{', '.join(map(str, divisors[:-1]))} or {divisors[-1]}, or set parallel.pp_layers for an uneven split")
    if num_layers % (pp * vpp):
        hint = [v for v in range(1, num_layers + 1) if num_layers % (pp * v) == 0]
        return (f"parallel.vpp ({vpp}) must divide num_layers / pp ({num_layers} / {pp} = {num_layers / pp:g}); "
                f"try vpp {' or '.join(map(str, hint))}")
    return None


def batch_problem(global_batch_size: int, micro_batch_size: int, dp: int) -> Optional[str]:
    """Every iteration's global batch splits into whole micro-batches on every DP rank."""
    if global_batch_size % (micro_batch_size * dp) == 0:
        return None
    return (f"train.global_batch_size ({global_batch_size}) must be a multiple of micro_batch_size x dp "
            f"({micro_batch_size} x {dp} = {micro_batch_size * dp})")


def interleaved_problem(pp: int, vpp: int, microbatches: Optional[int]) -> Optional[str]:
    """vpp > 1 chunks per rank: the interleaved schedule, which runs micro-batches in rounds of pp
    (`microbatches` None: not known yet)."""
    if vpp == 1:
        return None
    if pp == 1:
        return f"parallel.vpp ({vpp}) needs parallel.pp > 1"
    if microbatches is not None and microbatches % pp:
        return (f"interleaved schedule needs micro-batches per iteration ({microbatches}) to be a multiple of "
                f"parallel.pp ({pp}); change train.global_batch_size")
    return None


def sequence_parallel_problem(seq_length: int, tp: int, cp: int) -> Optional[str]:
    """Sequence parallelism splits each rank's part of the sequence over the tp ranks."""
    if tp == 1 or seq_length % (tp * cp) == 0:
        return None
    what = "model.seq_length" + (f" / parallel.cp ({cp})" if cp > 1 else "")
    return (f"parallel.sequence_parallel splits {what} ({seq_length}) over parallel.tp ({tp}): make it a multiple "
            f"of {tp * cp} or turn sequence_parallel off")


def zbh1_problem(vpp: int, compile: bool) -> Optional[str]:
    """What the zero-bubble schedule's deferred weight gradients cannot run with yet."""
    if vpp > 1:
        return (f"parallel.schedule zbh1 runs one model chunk per rank, but parallel.vpp is {vpp}; use "
                f"--parallel.vpp 1, or --parallel.schedule interleaved")
    if compile:
        return ("parallel.schedule zbh1 cannot defer weight gradients inside compiled blocks; use --train.compile "
                "false or --parallel.schedule 1f1b")
    return None


def expert_grid_problem(tp: int, cp: int, dp: int, ep: int, etp: int, num_experts: int = 0) -> Optional[str]:
    """Experts fold the tp x cp x dp ranks of each pipeline stage as etp x ep x expert-dp, so etp x ep
    must divide them; ep must also divide num_experts (when given: each EP rank holds whole experts).
    The refusal names the nearest valid values."""
    stage, where = tp * cp * dp, f"tp x cp x dp ({tp} x {cp} x {dp} = {tp * cp * dp})"
    if ep < 1 or etp < 1:
        return f"parallel.ep ({ep}) and parallel.etp ({etp}) must be at least 1"
    if stage % etp:
        return (f"parallel.etp ({etp}) must divide the ranks of a pipeline stage, {where}; try etp "
                f"{_nearest([d for d in range(1, stage + 1) if stage % d == 0], etp)}")
    fits = [d for d in range(1, stage // etp + 1) if (stage // etp) % d == 0 and not (num_experts and num_experts % d)]
    if stage % (etp * ep):
        return (f"parallel.ep ({ep}) x parallel.etp ({etp}) must divide the ranks of a pipeline stage, {where}; "
                f"try ep {_nearest(fits, ep)}")
    if num_experts and num_experts % ep:
        return (f"parallel.ep ({ep}) must divide model.num_experts ({num_experts}): each EP rank holds whole "
                f"experts; try ep {_nearest(fits, ep)}")
    return None


def expert_width_problem(width: int, shared_width: int, etp: int, tp: int) -> Optional[str]:
    """Expert tensor parallelism splits each expert's MLP over etp ranks; the shared expert, a dense
    MLP, splits over tp."""
    if width % etp:
        return (f"the experts' MLP width ({width}, model.moe_ffn_hidden_size) must be divisible by parallel.etp "
                f"({etp}); change one")
    if shared_width % tp:
        return (f"model.moe_shared_expert_ffn_hidden_size ({shared_width}) must be divisible by parallel.tp ({tp})")
    return None


def _nearest(options: list[int], want: int) -> str:
    """The options nearest to `want`, below and above: "2 or 4", or one of them."""
    below = [o for o in options if o < want]
    above = [o for o in options if o > want]
    return " or ".join(str(o) for o in (below[-1:] + above[:1])) or str(want)
