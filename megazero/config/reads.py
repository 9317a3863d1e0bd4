"""The keys a run reads only under some choice: the one home of that knowledge.

`READ_ONLY` says, for each such key, the choice that reads it (optim.muon_* only under
optim.name muon, parallel.cp_impl only at cp > 1, ...). A key the user set for this run
whose choice is not made changes nothing, so `unread_warning` names every such key in one
line, as Megatron-LM warns of a flag its other flags leave unused. A key added to the schema
that only some choice reads gets a row here (tests/unit/test_config.py checks that every row
names keys the schema has).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import AbstractSet, Callable, Optional

from megazero.config.schema import Config


@dataclass(frozen=True)
class ReadOnly:
    """Keys that only `reads(cfg)` makes the run read."""

    keys: tuple[str, ...]
    """`section.key`s; `section.prefix*` stands for every key of that prefix."""
    when: str
    """The choice that reads them, as the warning names it."""
    reads: Callable[[Config], bool]


def _nvme(c: Config) -> bool:
    return "nvme" in (c.zero.offload_optimizer, c.zero.offload_param)


READ_ONLY = (
    ReadOnly(("optim.muon_*",), "optim.name muon", lambda c: c.optim.name == "muon"),
    ReadOnly(("optim.sgd_momentum",), "optim.name sgd", lambda c: c.optim.name == "sgd"),
    # Adam's moments: AdamW's, and Muon's for the parameters it leaves to AdamW; SGD has none
    ReadOnly(("optim.beta1", "optim.beta2", "optim.eps"), "optim.name adamw or muon", lambda c: c.optim.name != "sgd"),
    ReadOnly(("optim.decoupled_min_lr",), "optim.decoupled_lr", lambda c: c.optim.decoupled_lr is not None),
    ReadOnly(("zero.nvme_path",), "zero.offload_optimizer or zero.offload_param nvme", _nvme),
    ReadOnly(("zero.buffer_count",), "zero.offload_optimizer nvme", lambda c: c.zero.offload_optimizer == "nvme"),
    ReadOnly(("parallel.cp_impl",), "parallel.cp > 1", lambda c: c.parallel.cp > 1),
    ReadOnly(("parallel.schedule",), "parallel.pp > 1", lambda c: c.parallel.pp > 1),
    ReadOnly(("parallel.sequence_parallel",), "parallel.tp > 1", lambda c: c.parallel.tp > 1),
    ReadOnly(("finetune.lora_alpha", "finetune.lora_dropout", "finetune.lora_targets"), "finetune.lora_rank > 0",
             lambda c: c.finetune.lora_rank > 0),
    ReadOnly(("model.rope_base", "model.rope_scaling"), "model.position_embedding rope",
             lambda c: c.model.position_embedding == "rope"),
    ReadOnly(("model.rope_scaling_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
              "model.rope_original_max_position"), "model.rope_scaling llama3 with rope",
             lambda c: c.model.position_embedding == "rope" and c.model.rope_scaling == "llama3"),
    ReadOnly(("model.qk_layernorm_scope",), "model.qk_layernorm true", lambda c: c.model.qk_layernorm),
    ReadOnly(("model.moe_*", "logging.moe_per_layer"), "model.num_experts > 0", lambda c: c.model.num_experts > 0),
    # at ep 1 each rank holds every expert: no token travels, whichever dispatcher is named
    ReadOnly(("parallel.moe_dispatcher",), "parallel.ep > 1", lambda c: c.parallel.ep > 1),
    ReadOnly(("train.spike_factor",), "train.rerun_on spike", lambda c: c.train.rerun_on == "spike"),
    ReadOnly(("train.straggler_factor",), "train.straggler_interval not 0", lambda c: c.train.straggler_interval != 0),
    ReadOnly(("train.eval_iters",), "train.eval_interval > 0", lambda c: c.train.eval_interval > 0),
    ReadOnly(("logging.profile_start", "logging.profile_end", "logging.profile_ranks"), "logging.profiler torch or nsys",
             lambda c: c.logging.profiler != "none"),
    ReadOnly(("logging.wandb_project",), "logging.wandb true", lambda c: c.logging.wandb),
    ReadOnly(("data.stream_*", "data.loader_workers", "checkpoint.load_data_state"), "data.stream",
             lambda c: bool(c.data.stream)),
)


def unread_keys(cfg: Config, given: AbstractSet[str]) -> dict[str, str]:
    """Of the keys `given`, those this config's choices never read -> the choice that would."""
    unread = {}
    for row in READ_ONLY:
        if row.reads(cfg):
            continue
        for key in sorted(given):
            if any(fnmatch.fnmatchcase(key, pattern) for pattern in row.keys):
                unread[key] = row.when
    return unread


def unread_warning(cfg: Config, given: AbstractSet[str]) -> Optional[str]:
    """One line naming the keys of `given` (those the user set for this run) that change nothing."""
    unread = unread_keys(cfg, given)
    if not unread:
        return None
    named = ", ".join(f"{key} (read with {when})" for key, when in unread.items())
    return f"warning: set but not read by this run, so they change nothing: {named}; drop them or make that choice"
