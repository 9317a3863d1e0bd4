"""LoRA adapters saved as PEFT saves them, so `peft.PeftModel.from_pretrained(GPT2LMHeadModel
.from_pretrained(EXPORT), SAVE/iter_N/adapter)` loads a megazero fine-tune.

    SAVE/iter_NNNNNNN/adapter/adapter_config.json        peft_type LORA, r, lora_alpha, ...
    SAVE/iter_NNNNNNN/adapter/adapter_model.safetensors  fp32, whole adapters

Each adapter is assembled whole, like model_16bit.safetensors: from its ZeRO-3 shards over
DP (only the trainable buckets are gathered, never the frozen base), its TP shards and its
pipeline stage, and written by global rank 0; an MoE layer's expert adapters ([E, r, in] and
[E, out, r]) are written expert by expert, PEFT's adapters of each expert's own Linear
(block_sparse_moe.experts.{j}.w1 / w3 / w2 for Mixtral, with target_modules w1, w3, w2;
mlp.experts.{j}.gate_proj / up_proj / down_proj for the Qwen models), which PEFT fuses itself
when transformers holds the experts fused. For GPT-2, PEFT's names are megazero's behind
`base_model.model.`; its shapes for GPT-2's Conv1D with fan_in_fan_out are lora_A [r, in]
and lora_B [out, r], megazero's own. For the Llama family they are LlamaForCausalLM's
(model.layers.{i}.self_attn.q_proj.lora_A.weight, ...; fan_in_fan_out false): megazero
keeps one adapter per part of its fused q|k|v and gate|up projections, each exactly the
adapter PEFT puts on that part's own Linear, so only the names change.

`convert --to torch|hf` exports the base model alone (`base_only`: the model the adapter
directory applies to), or with `--merge-lora` the adapters folded into it (`merge_lora`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Iterator

import torch
from torch import nn

from megazero.atomic import write_text
from megazero.checkpoint.base import Checkpoint, CheckpointError
from megazero.checkpoint.gathered import experts_full, save_gathered, tp_full
from megazero.checkpoint.hf_names import architecture, hf_adapter_name, hf_expert_adapter_name
from megazero.config.schema import Config, ModelConfig
from megazero.config.sharding import parameter_groups
from megazero.model.lora import adapter_shapes, is_adapter, merged_weight
from megazero.model.lora_targets import FAMILY_PARTS, hf_target_names, part_rows, uses_hf_names
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.placement import placement

ADAPTER_DIR = "adapter"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
"""Mixtral's names of its experts' projections (PEFT's target_modules for them)."""


def peft_config(cfg: Config) -> dict:
    """adapter_config.json: what PEFT needs to rebuild the adapted GPT-2, LlamaForCausalLM or
    mixture of experts."""
    f, family = cfg.finetune, uses_hf_names(cfg.model)
    targets = hf_target_names(f.lora_targets, cfg.model) if family else list(f.lora_targets)
    if family and cfg.model.num_experts and architecture(cfg.model) == "mixtral":
        targets = [MIXTRAL_EXPERT_NAMES.get(t, t) for t in targets]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": f.lora_rank, "lora_alpha": f.lora_alpha,
            "lora_dropout": f.lora_dropout, "target_modules": targets,
            "fan_in_fan_out": not family,  # GPT-2's projections are Conv1D ([in, out] weights), Llama's Linear
            "bias": "none", "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "base_model_name_or_path": cfg.checkpoint.init_from_hf}


def save_adapter(directory: str, adapters: Iterator[tuple[str, nn.Parameter, torch.Tensor]], cfg: Config,
                 grid: ProcessGrid) -> list[str]:
    """Collective over the world: DIRECTORY/adapter/ in PEFT's format, written by rank 0.
    `adapters` yields (name, parameter, value full over DP) for this rank's trainable
    parameters. Returns the files written, relative to DIRECTORY."""
    out = os.path.join(directory, ADAPTER_DIR)
    if grid.rank == 0:
        os.makedirs(out, exist_ok=True)
        write_text(os.path.join(out, CONFIG_NAME), json.dumps(peft_config(cfg), indent=1))
    shapes = {n: s for name, shape in adapter_shapes(cfg.model, cfg.finetune).items()
              for n, s in _expert_by_expert(name, shape)}
    save_gathered(os.path.join(out, WEIGHTS_NAME), _each_expert(adapters, grid), shapes, grid, torch.float32,
                  {"format": "pt"}, key=functools.partial(peft_key, cfg.model))
    return [os.path.join(ADAPTER_DIR, CONFIG_NAME), os.path.join(ADAPTER_DIR, WEIGHTS_NAME)]


def _expert_by_expert(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """An expert adapter [E, ...] as E adapters, named transformer.h.{i}.mlp.experts.{j}.REST; any
    other adapter as it is."""
    if ".mlp.experts." not in name:
        return [(name, shape)]
    head, rest = name.split(".mlp.experts.", 1)
    return [(f"{head}.mlp.experts.{j}.{rest}", shape[1:]) for j in range(shape[0])]


def _each_expert(adapters: Iterator[tuple[str, nn.Parameter, torch.Tensor]], grid: ProcessGrid
                 ) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
    """The adapters with each expert adapter gathered over the expert-parallel group and joined
    over its expert-TP group (collectives), then cut into its experts', each piece a plain
    replicated parameter to save_gathered."""
    for name, param, value in adapters:
        if ".mlp.experts." not in name:
            yield name, param, value
            continue
        value = experts_full(value.detach(), param, grid.ep_group)
        value = tp_full(value, param, grid[parameter_groups(placement(param)).tensor])  # split over expert_tp
        for (piece, _), part in zip(_expert_by_expert(name, tuple(value.shape)), value.unbind(0), strict=True):
            yield piece, nn.Parameter(part, requires_grad=False), part


def peft_key(m: ModelConfig, name: str) -> str:
    """PEFT's key of adapter weight `name`: megazero's own name for GPT-2, the LlamaForCausalLM
    module's for the family (each part of a fused projection is its own Linear there), each
    expert's Linear's for an expert's adapter."""
    if not uses_hf_names(m):
        return PEFT_PREFIX + name
    return PEFT_PREFIX + (hf_expert_adapter_name(name, m) if ".mlp.experts." in name else hf_adapter_name(name))


# ----------------------------------------------------------------------------- exports


def has_adapters(ckpt: Checkpoint) -> bool:
    return ckpt.adapters is not None


def base_only(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint seen without its adapters: the frozen base model (what PEFT's adapter
    directory is applied to)."""
    return dataclasses.replace(ckpt, shapes={n: s for n, s in ckpt.shapes.items() if not is_adapter(n)},
                               adapters=None)


def adapters_folded(ckpt: Checkpoint) -> Checkpoint:
    """The model a checkpoint describes, LoRA adapters (if any) folded in: what to run."""
    return merge_lora(ckpt) if has_adapters(ckpt) else ckpt


def describe_adapters(ckpt: Checkpoint) -> str:
    """The adapters of a LoRA checkpoint in one phrase: rank, alpha, and the weights they adapt
    (e.g. "rank 8, alpha 16 (W + 2 B A) on 8 weights: attn.c_attn, mlp.c_fc of 4 blocks")."""
    assert ckpt.adapters is not None
    scale, _ = ckpt.adapters
    adapted = sorted(n.removesuffix(".lora_A.weight") for n in ckpt.shapes if n.endswith(".lora_A.weight"))
    rank = ckpt.shapes[adapted[0] + ".lora_A.weight"][0] if adapted else 0
    kinds = sorted({n.split(".", 3)[-1] for n in adapted})  # transformer.h.{i}.<kind>
    blocks = len({n.split(".")[2] for n in adapted})
    return (f"rank {rank}, alpha {scale * rank:g} (W + {scale:g} B A) on {len(adapted)} weights: "
            f"{', '.join(kinds)} of {blocks} block{'s' * (blocks != 1)}")


def merge_lora(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint with every adapter folded into its base weight (W + alpha/r B A) and
    the adapters gone: a plain GPT-2."""
    if ckpt.adapters is None:
        raise CheckpointError(f"{ckpt.kind} '{ckpt.ckpt}' holds no LoRA adapters; drop --merge-lora")
    scale, full = ckpt.adapters

    m = ckpt.model_config

    def stream(kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in ckpt.stream(kind):
            module = name.removesuffix(".weight")
            if module + ".lora_A.weight" in ckpt.shapes:
                t = merged_weight(t, full(module + ".lora_A.weight"), full(module + ".lora_B.weight"), scale)
            experts = module.endswith(".mlp.experts.c_fc")  # rows of each expert: dim 1
            for part, (inside, position) in FAMILY_PARTS.items():  # the Llama family's q_proj of c_attn, ...
                adapter = f"{module}.{part}"
                if position is None or not (module.endswith(inside) or experts and inside == "mlp.c_fc") \
                        or adapter + ".lora_A.weight" not in ckpt.shapes:
                    continue
                lo, hi = (position * m.moe_ffn_size, (position + 1) * m.moe_ffn_size) if experts else \
                    part_rows(m, inside, position)
                t = t.clone()
                rows = t[:, lo:hi] if experts else t[lo:hi]
                rows.copy_(merged_weight(rows, full(adapter + ".lora_A.weight"), full(adapter + ".lora_B.weight"),
                                         scale))
            yield name, t
    return dataclasses.replace(base_only(ckpt), stream=stream)
