"""Import a DeepSpeed JSON config (ds_config.json) onto megazero's config sections.

`megazero-train --config ds_config.json` (or `--deepspeed-config FILE` beside a YAML
`--config`) reads it. Every DeepSpeed key is either mapped onto a megazero key (converting
units where they differ), accepted because megazero always behaves that way (e.g.
`overlap_comm: true`), or listed by name in one warning line as unsupported: nothing is
dropped silently. A key whose megazero counterpart does not exist in this version (e.g.
`zero.offload_optimizer` before offload lands) is reported, never invented. The value
"auto" (Hugging Face's placeholder) leaves megazero's value in place. Batch sizes given on
the command line win over the file's (a config written for another world size then runs: its
gradient_accumulation_steps is re-derived, with a note). Contradictions
(bf16 and fp16 both on, batch sizes that do not multiply out, another optimizer) are a
`ConfigError`.

`ROWS` documents every key the importer reads; they generate README's "Coming from DeepSpeed"
table (`markdown_table()`, filled in by scripts/update_readme_config.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Optional

from megazero.config.help import show_value
from megazero.config.parse import check_value, has_key, read_mapping
from megazero.config.schema import Config, ConfigError
from megazero.config.suggest import edit_distance

# DeepSpeed key -> megazero key, value unchanged.
SIMPLE = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_clipping": "optim.clip_grad",
    "steps_per_print": "train.log_interval",
    "wall_clock_breakdown": "logging.timers",
    "communication_data_type": "zero.reduce_dtype",
    "zero_optimization.stage": "zero.stage",
    "zero_optimization.sub_group_size": "zero.sub_group_size",
    "zero_optimization.reduce_bucket_size": "zero.bucket_size",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "checkpoint.save_model_16bit",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "checkpoint.save_model_16bit",
    "zero_optimization.gather_16bit_weights_on_model_save": "checkpoint.save_model_16bit",  # the current name
    "tensor_parallel.autotp_size": "parallel.tp",
    "zero_optimization.offload_optimizer.device": "zero.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "zero.nvme_path",
    "zero_optimization.offload_optimizer.pin_memory": "zero.pin_memory",
    "zero_optimization.offload_optimizer.buffer_count": "zero.buffer_count",
    "zero_optimization.offload_param.device": "zero.offload_param",
    "zero_optimization.offload_param.nvme_path": "zero.nvme_path",
    "zero_optimization.offload_param.pin_memory": "zero.pin_memory",
    "zero_optimization.offload_param.buffer_count": "zero.buffer_count",
    "fp16.loss_scale_window": "zero.loss_scale_window",
    "fp16.hysteresis": "zero.hysteresis",
    "fp16.min_loss_scale": "zero.min_loss_scale",
    "optimizer.params.lr": "optim.lr",
    "optimizer.params.eps": "optim.eps",
    "optimizer.params.weight_decay": "optim.weight_decay",
    "wandb.enabled": "logging.wandb",
    "wandb.project": "logging.wandb_project",
}

# DeepSpeed key -> the value that describes what megazero always does (accepted silently).
FIXED = {
    "zero_optimization.overlap_comm": True,  # buckets are reduced as backward produces them
    "zero_optimization.contiguous_gradients": True,  # gradients live in flat per-bucket buffers
    "zero_optimization.reduce_scatter": True,  # stage 2/3 reduce-scatter
    "zero_optimization.allgather_partitions": True,
    "fp16.loss_scale": 0,  # 0: dynamic loss scaling
    "fp16.consecutive_hysteresis": False,  # hysteresis refills only when the scale grows
    "data_types.grad_accum_dtype": "fp32",  # Megatron's main_grad
    "optimizer.params.adam_w_mode": True,
    "optimizer.params.bias_correction": True,
    "optimizer.params.amsgrad": False,
    "optimizer.params.torch_adam": None,  # implementation choices: any value
    "optimizer.params.fused": None,
    "optimizer.params.foreach": None,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": None,
}

# "type": "SGD" is torch.optim.SGD (DeepSpeed builds any torch.optim class by name): its parameters megazero's
# SGD (optim.name sgd) has only at the value it always uses; another value is refused, as the run could not do it.
SGD_FIXED = {"dampening": 0, "nesterov": False, "maximize": False}

# Keys read by the importer's own code (beside SIMPLE and FIXED): with those, what a typo is checked against.
HANDLED = ("gradient_accumulation_steps", "bf16.enabled", "bfloat16.enabled", "fp16.enabled", "fp16.initial_scale_power",
           "optimizer.type", "optimizer.params.betas", "scheduler.type", "scheduler.params.total_num_steps",
           "scheduler.params.last_batch_iteration", "zero_optimization.allgather_bucket_size",
           "zero_optimization.stage3_prefetch_bucket_size", "optimizer.params.momentum",
           *(f"optimizer.params.{name}" for name in SGD_FIXED))

ADAM_TYPES = ("adam", "adamw", "fusedadam", "cpuadam")
SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}  # -> optim.decay_style
# DeepSpeed's defaults for the scheduler parameters a config leaves out.
SCHEDULER_DEFAULTS = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log",
                      "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0001}
# The parameters each scheduler's constructor takes: another one (cos_min_ratio under WarmupLR) is listed as unsupported.
_WARMUP = {"warmup_num_steps", "warmup_type", "last_batch_iteration"}
SCHEDULER_PARAMS = {"WarmupLR": _WARMUP | {"warmup_min_lr", "warmup_max_lr"},
                    "WarmupDecayLR": _WARMUP | {"warmup_min_lr", "warmup_max_lr", "total_num_steps"},
                    "WarmupCosineLR": _WARMUP | {"warmup_min_ratio", "cos_min_ratio", "total_num_steps"}}
# DeepSpeed's defaults where megazero's differ, for what a config leaves out: its Adam's (FusedAdam's) parameters,
# as megazero keys, when the file has an optimizer section.
OPTIMIZER_DEFAULTS = {"optim.beta1": ("betas", 0.9), "optim.beta2": ("betas", 0.999), "optim.eps": ("eps", 1e-8),
                      "optim.weight_decay": ("weight_decay", 0.0)}
SGD_DEFAULTS = {"optim.sgd_momentum": ("momentum", 0.0), "optim.weight_decay": ("weight_decay", 0.0)}  # torch's


@dataclass(frozen=True)
class Row:
    """One row of README's DeepSpeed migration table. In both cells "{}" stands for what the
    keys say themselves: the DeepSpeed keys, and the megazero keys SIMPLE maps them onto."""

    keys: tuple[str, ...]
    """The DeepSpeed keys the row documents (of SIMPLE, FIXED, HANDLED or the scheduler's params);
    none for a row on a setting the JSON import does not read (Ulysses)."""
    megazero: str = "{}"
    """The megazero cell; written out for keys the importer's code converts."""
    deepspeed: str = "{}"
    """The DeepSpeed cell; written out where the keys alone would not say it (older names, units)."""
    values: bool = False
    """Whether "{}" in the DeepSpeed cell shows each key with its FIXED value."""


# README's table, in its order: every key the importer reads is in a row (tests/e2e/test_deepspeed_config.py
# checks it), so a new mapping cannot be left out of README.
ROWS = (
    Row(("train_batch_size", "train_micro_batch_size_per_gpu")),
    Row(("gradient_accumulation_steps",),
        "derives the missing batch size (global = micro × accumulation × dp) or is checked against both; with a "
        "batch size on the command line, re-derived from it (one `note:` line)"),
    Row(("tensor_parallel.autotp_size",), "{} (0, AutoTP off, is accepted; dp = world / (tp × pp))"),
    Row(("gradient_clipping", "steps_per_print")),
    Row(("bf16.enabled", "bfloat16.enabled", "fp16.enabled"), "`train.precision bf16` / `fp16`",
        "`bf16.enabled` (or `bfloat16.enabled`), `fp16.enabled`"),
    Row(("fp16.initial_scale_power",), "`zero.initial_loss_scale` 2^P", "{} P"),
    # fp16.loss_scale (FIXED at 0) is named in the megazero cell, beside the keys that tune that dynamic scaling.
    Row(("fp16.loss_scale_window", "fp16.hysteresis", "fp16.min_loss_scale", "fp16.loss_scale"),
        "{} (`loss_scale 0`, dynamic, is what megazero does)",
        "`fp16.loss_scale_window`, `fp16.hysteresis`, `fp16.min_loss_scale`"),
    Row(("communication_data_type",), "{} (fp32, bf16)"),
    Row(("zero_optimization.stage", "zero_optimization.sub_group_size")),
    Row((), "`parallel.cp N`, `parallel.cp_impl ulysses` (a command-line setting: the DeepSpeed JSON import does "
            "not read it)",
        "DeepSpeed-Ulysses sequence parallelism (`sequence_parallel_size` N; Megatron-DeepSpeed's "
        "`--ds-sequence-parallel-size N`)"),
    Row(("zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size"),
        "{} (one size: megazero all-gathers the buckets it reduces)",
        "`zero_optimization.reduce_bucket_size` (`allgather_bucket_size` when equal or alone)"),
    Row(("zero_optimization.stage3_prefetch_bucket_size",),
        "`zero.prefetch` (transformer blocks: elements / 12h², rounded up)", "{} (elements)"),
    Row(("zero_optimization.gather_16bit_weights_on_model_save",
         "zero_optimization.stage3_gather_16bit_weights_on_model_save",
         "zero_optimization.stage3_gather_fp16_weights_on_model_save"),
        deepspeed="`zero_optimization.gather_16bit_weights_on_model_save` (or its older names "
                  "`stage3_gather_16bit_weights_on_model_save`, `stage3_gather_fp16_weights_on_model_save`)"),
    Row(tuple(f"zero_optimization.{section}.{key}" for section in ("offload_optimizer", "offload_param")
              for key in ("device", "nvme_path", "pin_memory", "buffer_count")),
        "`zero.offload_optimizer` / `zero.offload_param`, `zero.nvme_path`, `zero.pin_memory`, `zero.buffer_count` "
        "where this version has them; otherwise listed as unsupported (`device: none` is accepted)",
        "`zero_optimization.offload_optimizer` / `offload_param` (`device`, `nvme_path`, `pin_memory`, "
        "`buffer_count`)"),
    Row(("zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter",
         "zero_optimization.allgather_partitions"), "accepted when true (what megazero always does)"),
    Row(("optimizer.type", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
         "optimizer.params.weight_decay"),
        "`optim.lr`, `optim.beta1`, `optim.beta2`, `optim.eps`, `optim.weight_decay`",
        "`optimizer.type` Adam/AdamW; `optimizer.params` `lr`, `betas`, `eps`, `weight_decay`"),
    Row(("optimizer.type", "optimizer.params.momentum", "optimizer.params.dampening", "optimizer.params.nesterov",
         "optimizer.params.maximize"),
        "`optim.name sgd`, `optim.sgd_momentum` (torch's default 0 when left out), `optim.lr`, `optim.weight_decay`; "
        "`dampening` 0, `nesterov` and `maximize` false only (another value is refused in one line)",
        "`optimizer.type` SGD (torch.optim.SGD); `optimizer.params` `lr`, `momentum`, `weight_decay`, `dampening`, "
        "`nesterov`, `maximize`"),
    Row(("scheduler.type", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
         "scheduler.params.warmup_num_steps"),
        "`optim.min_lr`, `optim.lr`, `optim.warmup_iters`, `optim.decay_style constant`",
        "`scheduler.type` `WarmupLR` (`warmup_min_lr`, `warmup_max_lr`, `warmup_num_steps`)"),
    Row(("scheduler.type", "scheduler.params.total_num_steps"),
        "as WarmupLR + `optim.decay_iters`, `optim.decay_style linear`",
        "`scheduler.type` `WarmupDecayLR` (same + `total_num_steps`)"),
    Row(("scheduler.type", "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps",
         "scheduler.params.cos_min_ratio"),
        "`optim.decay_iters`, `optim.warmup_iters`, `optim.min_lr` = lr × ratio, `optim.decay_style cosine`",
        "`scheduler.type` `WarmupCosineLR` (`total_num_steps`, `warmup_num_steps`, `cos_min_ratio`)"),
    Row(("wandb.enabled", "wandb.project")),
    Row(("wall_clock_breakdown",), "{} where this version has it; otherwise listed when true"),
    # The keys accepted at the value megazero always has, and those whose value changes nothing here.
    Row(("fp16.consecutive_hysteresis", "data_types.grad_accum_dtype", "optimizer.params.adam_w_mode",
         "optimizer.params.bias_correction", "optimizer.params.amsgrad"),
        "accepted at these values (what megazero always does); another value is listed as unsupported",
        values=True),
    Row(("optimizer.params.torch_adam", "optimizer.params.fused", "optimizer.params.foreach", "zero_allow_untested_optimizer",
         "scheduler.params.last_batch_iteration"),
        "accepted with any value: implementation choices megazero makes itself, and the scheduler's starting "
        "iteration (megazero's checkpoint holds the iteration)"),
)


@dataclass
class DeepSpeedImport:
    """megazero config sections ({section: {key: value}}, a config file's shape) and the
    DeepSpeed keys with no equivalent, as 'key (value)'."""

    sections: dict = field(default_factory=dict)
    unsupported: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    """Lines about values re-derived for this run (gradient_accumulation_steps)."""
    defaults: list = field(default_factory=list)
    """DeepSpeed's defaults applied for what the file leaves out, as 'megazero.key value'."""

    def defaults_note(self, path: str) -> Optional[str]:
        """One line naming DeepSpeed's defaults in effect (as the Megatron path names Megatron's)."""
        return (f"{path}: DeepSpeed's defaults for what it leaves out: {', '.join(self.defaults)}"
                if self.defaults else None)

    def written(self) -> set[str]:
        """The megazero keys the file's own keys set (DeepSpeed's defaults for what it leaves out aside)."""
        defaults = {line.split()[0] for line in self.defaults}
        return {f"{section}.{key}" for section, values in self.sections.items() for key in values} - defaults

    def warning(self, path: str) -> Optional[str]:
        return (f"warning: {path}: {len(self.unsupported)} DeepSpeed key(s) have no megazero equivalent and are "
                f"ignored: {', '.join(self.unsupported)}" if self.unsupported else None)


def load_deepspeed_config(path: str, base: Config, world_size: int,
                          command_line: AbstractSet[str] = frozenset()) -> DeepSpeedImport:
    """Read a ds_config.json; `base` (the config without it, command-line overrides included)
    supplies the layout and model that unit conversions need; `command_line` names the keys
    the command line sets (they win over the file)."""
    data = read_mapping(path, "DeepSpeed config", "JSON", json.load, "pass the path of your ds_config.json")
    return import_deepspeed(data, base, world_size, command_line)


def import_deepspeed(ds: dict, base: Config, world_size: int,
                     command_line: AbstractSet[str] = frozenset()) -> DeepSpeedImport:
    out = _Importer(base, world_size, command_line)
    precision = [k for k in ("bf16", "bfloat16", "fp16") if _enabled(ds.get(k))]
    if len(precision) > 1:
        raise ConfigError(f"DeepSpeed config enables both {precision[0]} and {precision[1]}; enable one")
    sections = {"optimizer": out.optimizer, "scheduler": out.scheduler, "zero_optimization": out.zero_optimization,
                "bf16": out.precision, "bfloat16": out.precision, "fp16": out.precision}
    for key, value in sorted(ds.items(), key=lambda item: item[0] == "scheduler"):  # it reads optim.lr
        if key in sections and isinstance(value, dict):
            sections[key](value, key)
        elif key != "gradient_accumulation_steps":
            out.walk(key, value)
    out.batch(ds)
    if "gradient_clipping" not in ds:
        out.default("optim.clip_grad", 0.0, "gradient_clipping")  # DeepSpeed's default: no clipping
    return out.result


class _Importer:
    def __init__(self, base: Config, world_size: int, command_line: AbstractSet[str]) -> None:
        self.base, self.result = base, DeepSpeedImport()
        self.world_size, self.command_line = world_size, command_line

    @property
    def dp(self) -> int:
        """The data-parallel degree at this world size, with the tp the run will have (the
        command line's, else the file's autotp_size, else the YAML's)."""
        tp = self.base.parallel.tp
        if "parallel.tp" not in self.command_line:
            tp = self.result.sections.get("parallel", {}).get("tp", tp)
        return max(1, self.world_size // (tp * self.base.parallel.pp * self.base.parallel.cp))

    # -- generic keys

    def walk(self, path: str, value: Any) -> None:
        """Map `path` (a dotted DeepSpeed key) or report it; sections are walked key by key,
        a disabled section ("enabled": false) is off in DeepSpeed too."""
        if value == "auto" or (path == "tensor_parallel.autotp_size" and value == 0):  # 0: AutoTP off (the default)
            return
        if path in SIMPLE and has_key(SIMPLE[path]):
            self.set(SIMPLE[path], value, path)
        elif path in FIXED and FIXED[path] in (None, value):
            return
        elif isinstance(value, dict) and path not in SIMPLE:
            if value.get("enabled", True) is False:
                return
            for key, inner in value.items():
                self.walk(f"{path}.{key}", inner)
        else:
            self.unsupported(path, value)

    def set(self, name: str, value: Any, source: str, replace: bool = False) -> None:
        """Map `value` onto megazero key `name`; two DeepSpeed keys mapped onto one megazero key
        must agree, unless `replace` (the later key wins in DeepSpeed too)."""
        if value == "auto":
            return
        section, key = name.split(".")
        value = check_value(name, _whole(value), f"DeepSpeed {source} (megazero {name})")
        previous = self.result.sections.setdefault(section, {}).get(key, value)
        if previous != value and not replace:
            raise ConfigError(f"DeepSpeed {source} ({value!r}) disagrees with another key mapped onto {name} "
                              f"({previous!r}); give both the same value")
        self.result.sections[section][key] = value

    def default(self, name: str, value: Any, source: str) -> None:
        """DeepSpeed's own default for what the file leaves out, mapped onto `name` and named in
        the defaults line; the YAML's or the command line's value of `name` wins over it."""
        if name in self.base.set_keys:
            return
        self.set(name, value, source, replace=True)
        self.result.defaults.append(f"{name} {show_value(value)}")

    def unsupported(self, path: str, value: Any) -> None:
        """List a key the user wrote as ignored, unless it is one edit away from a key megazero
        reads (a typo such as zero_optimisation would otherwise run with DeepSpeed's defaults)."""
        typo = misspelt(path)
        if typo is not None:
            raise ConfigError(f"DeepSpeed key {path} is unknown; did you mean {typo}?")
        shown = "{...}" if isinstance(value, dict) else show_value(value)
        self.result.unsupported.append(f"{path} ({shown})")

    # -- sections with conversions

    def precision(self, section: dict, key: str) -> None:
        mode = "fp16" if key == "fp16" else "bf16"
        # "enabled": "auto" (Hugging Face) keeps megazero's precision; the section's other keys
        # then apply when that precision is this section's.
        if not _enabled(section) and not (section.get("enabled") == "auto" and self.base.train.precision == mode):
            return
        self.set("train.precision", mode, f"{key}.enabled")
        for name, value in section.items():
            if name == "initial_scale_power" and value != "auto":
                power = check_value("zero.hysteresis", _whole(value), f"DeepSpeed {key}.{name}")  # an integer
                self.set("zero.initial_loss_scale", 2.0 ** power, f"{key}.{name}")
            elif name != "enabled":
                self.walk(f"{key}.{name}", value)

    def zero_optimization(self, section: dict, _: str) -> None:
        reduce_bucket = section.get("reduce_bucket_size")
        for name, value in section.items():
            path = f"zero_optimization.{name}"
            if name in ("offload_optimizer", "offload_param") and isinstance(value, dict) \
                    and value.get("device", "none") == "none":
                continue  # no offload: its other keys do not apply
            if name == "allgather_bucket_size" and value != "auto":
                # megazero all-gathers the same buckets it reduces (one zero.bucket_size).
                if reduce_bucket in (None, "auto", value):
                    self.set("zero.bucket_size", value, path)
                else:
                    self.unsupported(path, value)
            elif name == "stage3_prefetch_bucket_size" and value != "auto":  # elements; megazero counts blocks
                m = self.base.model
                block = 4 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * m.ffn_size
                self.set("zero.prefetch", math.ceil(int(value) / block), path)
            else:
                self.walk(path, value)

    def optimizer(self, section: dict, _: str) -> None:
        kind = str(section.get("type", "AdamW"))
        params = section.get("params", {}) if isinstance(section.get("params"), dict) else {}
        if kind.lower() == "sgd":
            self.set("optim.name", "sgd", "optimizer.type")
            self._sgd_params(params)
        elif kind.lower() in ADAM_TYPES:
            self._adam_params(params)
        else:
            raise ConfigError(f"DeepSpeed optimizer.type ({kind}) is not supported: megazero trains with Adam/AdamW "
                              f"or SGD; use \"type\": \"AdamW\" or \"SGD\" (or optim.name muon for Muon)")
        for name, value in section.items():
            if name != "type" and not (name == "params" and isinstance(value, dict)):
                self.walk(f"optimizer.{name}", value)
        for key, (param, value) in (SGD_DEFAULTS if kind.lower() == "sgd" else OPTIMIZER_DEFAULTS).items():
            if param not in params:
                self.default(key, value, f"optimizer.params.{param}")

    def _adam_params(self, params: dict) -> None:
        for param, inner in params.items():
            if param == "betas" and inner != "auto":
                self.set("optim.beta1", inner[0], "optimizer.params.betas[0]")
                self.set("optim.beta2", inner[1], "optimizer.params.betas[1]")
            else:
                self.walk(f"optimizer.params.{param}", inner)

    def _sgd_params(self, params: dict) -> None:
        """torch.optim.SGD's parameters: lr, momentum and weight_decay mapped, the rest at megazero's
        fixed values (or refused), Adam's (betas, eps) listed as unsupported."""
        for param, inner in params.items():
            path = f"optimizer.params.{param}"
            if param == "momentum":
                self.set("optim.sgd_momentum", inner, path)
            elif param in SGD_FIXED:
                if inner not in ("auto", SGD_FIXED[param]):
                    raise ConfigError(f"DeepSpeed {path} ({show_value(inner)}): megazero's SGD (optim.name sgd) runs "
                                      f"with dampening 0, no Nesterov and no maximize; drop it or set "
                                      f"{param} {show_value(SGD_FIXED[param])}")
            elif param in ("lr", "weight_decay") or FIXED.get(path, 0) is None:
                self.walk(path, inner)
            else:
                self.unsupported(path, inner)

    def scheduler(self, section: dict, _: str) -> None:
        kind = section.get("type")
        if kind not in SCHEDULERS:
            raise ConfigError(f"DeepSpeed scheduler.type ({kind}) is not supported; use one of "
                              f"{', '.join(SCHEDULERS)} or leave the scheduler to optim.* keys")
        written = section.get("params", {})
        params = {**SCHEDULER_DEFAULTS, **written}

        def put(name: str, value: Any, param: str, replace: bool = False) -> None:
            """`value` (from params[param]) onto `name`: written, or DeepSpeed's default, named."""
            if param in written:
                self.set(name, value, f"scheduler.params.{param}", replace)
            elif value != "auto":
                self.default(name, value, f"scheduler.params.{param}")

        put("optim.warmup_iters", params["warmup_num_steps"], "warmup_num_steps")
        if params["warmup_type"] in ("linear", "log"):  # DeepSpeed's default: log
            put("optim.warmup_style", params["warmup_type"], "warmup_type")
        elif params["warmup_type"] != "auto":
            self.unsupported("scheduler.params.warmup_type", params["warmup_type"])
        if kind == "WarmupCosineLR":
            lr = self.result.sections.get("optim", {}).get("lr", self.base.optim.lr)
            if params["cos_min_ratio"] != "auto":
                put("optim.min_lr", lr * params["cos_min_ratio"], "cos_min_ratio")
            if params["warmup_min_ratio"] not in (0, "auto"):
                self.unsupported("scheduler.params.warmup_min_ratio", params["warmup_min_ratio"])
        else:
            # DeepSpeed's scheduler sets the LR, whatever optimizer.params.lr says.
            put("optim.lr", params["warmup_max_lr"], "warmup_max_lr", replace=True)
            put("optim.min_lr", params["warmup_min_lr"], "warmup_min_lr")
        self.set("optim.decay_style", SCHEDULERS[kind], "scheduler.type")
        if kind != "WarmupLR":
            if "total_num_steps" not in params:
                raise ConfigError(f"DeepSpeed scheduler {kind} needs params.total_num_steps (the decay length)")
            self.set("optim.decay_iters", params["total_num_steps"], "scheduler.params.total_num_steps")
        for name in sorted(set(written) - SCHEDULER_PARAMS[kind]):
            if params[name] != "auto":
                self.unsupported(f"scheduler.params.{name}", params[name])

    def batch(self, ds: dict) -> None:
        """train_batch_size = micro x accumulation x dp, as in DeepSpeed: any two give the third.
        Batch sizes on the command line win: the file's gradient_accumulation_steps (written for
        its own world size) is then re-derived from them, with a note."""
        train = self.result.sections.get("train", {})
        given = [k for k in ("micro_batch_size", "global_batch_size") if f"train.{k}" in self.command_line]
        for key in given:
            train.pop(key, None)
        known = {k: train.get(k, getattr(self.base.train, k)) for k in ("micro_batch_size", "global_batch_size")
                 if k in train or k in given}
        accumulation = ds.get("gradient_accumulation_steps", "auto")
        if accumulation != "auto":
            accumulation = check_value("train.micro_batch_size", _whole(accumulation),
                                       "DeepSpeed gradient_accumulation_steps")
        micro, total = known.get("micro_batch_size"), known.get("global_batch_size")
        if given and micro is not None and total is not None:  # the file's accumulation re-derived, with a note
            if accumulation == "auto" or micro < 1 or total % (micro * self.dp):  # validate()'s error, not a note
                return
            now = total // (micro * self.dp)
            if now != accumulation:
                self.result.notes.append(f"note: DeepSpeed gradient_accumulation_steps ({accumulation}) is re-derived "
                                         f"as {now} from the command line's batch sizes: train.global_batch_size "
                                         f"{total} = train.micro_batch_size {micro} x {now} x dp {self.dp}")
            return
        if accumulation == "auto":
            return
        label = "train.global_batch_size" if "global_batch_size" in given else "DeepSpeed train_batch_size"
        if total is None:
            micro = self.base.train.micro_batch_size if micro is None else micro
            self.set("train.global_batch_size", micro * accumulation * self.dp, "gradient_accumulation_steps")
        elif micro is None:
            if total % (accumulation * self.dp):
                raise ConfigError(f"{label} ({total}) must be divisible by DeepSpeed gradient_accumulation_steps x "
                                  f"dp ({accumulation} x {self.dp}){MOVED}")
            self.set("train.micro_batch_size", total // (accumulation * self.dp), "gradient_accumulation_steps")
        elif total != micro * accumulation * self.dp:
            raise ConfigError(f"DeepSpeed train_batch_size ({total}) must equal train_micro_batch_size_per_gpu x "
                              f"gradient_accumulation_steps x dp ({micro} x {accumulation} x {self.dp} = "
                              f"{micro * accumulation * self.dp}){MOVED}")


MOVED = ("; fix one of them, or, for another world size than the file's, give the batch sizes on the command "
         "line (--train.micro_batch_size, --train.global_batch_size): they win over the file")


def misspelt(path: str) -> Optional[str]:
    """The known DeepSpeed key `path` is one edit away from (a letter added, dropped, changed or
    two swapped in one of its parts), or None: the first part of `path` no known key has at
    that place is compared with the parts known keys have there."""
    known = [k.split(".") for k in (*SIMPLE, *FIXED, *HANDLED, *(f"scheduler.params.{p}" for p in SCHEDULER_DEFAULTS))]
    parts = path.split(".")
    for i, part in enumerate(parts):
        here = {k[i] for k in known if len(k) > i and k[:i] == parts[:i]}
        if part in here:
            continue
        near = sorted(c for c in here if edit_distance(part, c) == 1)
        return ".".join(parts[:i] + near[:1] + parts[i + 1:]) if near else None
    return None


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled", False) is True


def _whole(value: Any) -> Any:
    """JSON configs write sizes as 5e8 (a float): an integral float becomes an int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# ---------------------------------------------------------------------------- README


def markdown_table() -> str:
    """README's DeepSpeed migration table, one line per row of ROWS."""
    lines = ["| DeepSpeed key | megazero key |", "| --- | --- |"]
    lines += [f"| {row.deepspeed.replace('{}', _deepspeed_cell(row))} | "
              f"{row.megazero.replace('{}', _megazero_keys(row.keys))} |" for row in ROWS]
    return "\n".join(lines)


def _deepspeed_cell(row: Row) -> str:
    """The row's keys; a key in the same section as the one before it is written without the
    section (`zero_optimization.stage`, `sub_group_size`), to keep long rows readable."""
    shown, parent = [], None
    for key in row.keys:
        here, _, name = key.rpartition(".")
        text = f"`{name if here and here == parent else key}`"
        shown.append(f"{text} {show_value(FIXED[key])}" if row.values else text)
        parent = here
    return ", ".join(shown)


def _megazero_keys(keys: tuple[str, ...]) -> str:
    """The megazero keys SIMPLE maps `keys` onto, each once (several DeepSpeed names share one)."""
    return ", ".join(f"`{name}`" for name in dict.fromkeys(SIMPLE[k] for k in keys if k in SIMPLE))
