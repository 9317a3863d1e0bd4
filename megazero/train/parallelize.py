"""Apply the parallelisms to the model from outside it, in one place and a fixed order.

The GPT file knows layers (its TP layers are sized by the tensor-parallel group they are
given), not pipelines, recomputation or ZeRO. `parallelize` turns a config and a grid into
this rank's trainable share of the model:

1. Pipeline split: this rank's model chunks (its stages' layers), built whole on the meta
   device: shapes and names, no memory.
2. Tensor parallelism: every module that can be split over the TP group (column/row-
   parallel linears, the vocab-parallel embedding, attention's head count, the model's
   head and loss) keeps this rank's shard; on the meta device only shapes change.
   With `parallel.sequence_parallel` the activations between TP regions are split along
   the sequence as well (GPT.apply_sequence_parallel). With `parallel.cp` each rank holds
   its zig-zag positions of every sequence and attention spans the cp group by ring or
   Ulysses (GPT.apply_context_parallel). Mixture-of-experts layers keep this rank's experts
   of the expert-parallel group, tokens reaching the others' by a dispatcher
   (GPT.apply_expert_parallel).
3. LoRA (`finetune.lora_rank` > 0): every parameter is frozen and the targeted projections
   get trainable adapters, sharded like their base layers (megazero.model.lora); ZeRO then
   keeps gradients and optimizer state for the adapters alone.
4. Compilation (`train.compile`): torch.compile each block's forward, whole (LayerNorms,
   bias + GELU, dropout and residual adds fuse; the q/k/v split costs no copies). What
   dynamo cannot trace runs eagerly between a block's graphs, each a clean break named at
   start-up (`compile_notes`): the recomputed attention core under selective recompute
   (a checkpoint that replays RNG streams), the TP collectives, per-TP-rank dropout
   streams, the gathered matmuls of sequence parallelism.
5. Activation recomputation (`train.recompute`): wraps each (compiled) block forward
   (full) or each attention core (selective) in torch.utils.checkpoint, inside the module
   call: ZeRO-3's hooks on a block still bracket its forward, and its backward hook
   gathers the parameters before the recomputation needs them. Names never change.
6. ZeRO (`zero.stage`), like FSDP2's fully_shard: ShardedParameters lay the parameters out
   in flat buckets on the grid's device, with the hooks that reduce their gradients over DP
   (at stage 3 also gather and release them around each unit); ZeroOptimizer, built on
   them, materializes this rank's elements (its DP partition at stage 3) from the model's
   init in the compute dtype, and its fp32 master weights from the same values. The token
   embedding first learns to hand its gradient on as rows, which the buckets add in place
   (`apply_sparse_embedding_grad`): no dense V x h gradient beside its bucket.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from megazero.checkpoint.hf import HFInitialValues
from megazero.checkpoint.resume import HF, starting_point
from megazero.config.schema import Config
from megazero.model.gpt import GPT, apply_tensor_parallel
from megazero.model.layers import apply_sparse_embedding_grad
from megazero.model.lora import apply_lora, initial_adapter, is_adapter
from megazero.parallel.comm import Group
from megazero.parallel.dispatch import AllGatherDispatch, AllToAllDispatch, LocalDispatch, TokenDispatcher
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.random import RNGTracker, recompute_rng_context
from megazero.pipeline.stages import build_model_chunks
from megazero.zero.optimizer import ZeroOptimizer
from megazero.zero.shard import ShardedParameters


def parallelize(cfg: Config, grid: ProcessGrid, tracker: RNGTracker) -> tuple[list[GPT], ZeroOptimizer]:
    """This rank's model chunks and the ZeRO optimizer on their sharded parameters (see above)."""
    z = cfg.zero
    if "nvme" in (z.offload_optimizer, z.offload_param):  # a missing swap folder is made (validated creatable)
        os.makedirs(z.nvme_path, exist_ok=True)
    chunks = build_model_chunks(cfg, grid, tracker)
    for chunk in chunks:
        apply_tensor_parallel(chunk, grid.tp_group)
        if cfg.parallel.sequence_parallel:
            chunk.apply_sequence_parallel()
        chunk.apply_context_parallel(grid.cp_group, cfg.parallel.cp_impl)
        chunk.apply_expert_parallel(grid.ep_group, dispatcher(cfg, grid), grid.dp_group, token_replicas(cfg, grid),
                                    grid.expert_tp_group)
        apply_lora(chunk, cfg.finetune, tracker)
        if cfg.train.compile:
            apply_compile(chunk)
        apply_recompute(chunk, cfg.train.recompute, tracker, eager=cfg.train.compile)
    c = cfg.checkpoint  # a resume replaces every value: no HF read then (checkpoint/resume.py)
    initial = hf_initial_values(cfg, grid) if starting_point(c.load, c.iteration, c.init_from_hf) == HF else None
    if cfg.finetune.lora_rank:
        initial = with_adapter_init(initial, chunks, cfg.train.seed, grid)
    for chunk in chunks:
        apply_sparse_embedding_grad(chunk)
    return chunks, ZeroOptimizer(ShardedParameters(chunks, cfg, grid, initial), cfg, grid)


Initial = Callable[[int, str, torch.nn.Parameter], torch.Tensor]


def dispatcher(cfg: Config, grid: ProcessGrid) -> TokenDispatcher:
    """How routed tokens reach experts on other ranks (parallel.moe_dispatcher); none at ep 1."""
    if grid.ep == 1:
        return LocalDispatch()
    return (AllGatherDispatch if cfg.parallel.moe_dispatcher == "allgather" else AllToAllDispatch)(grid.ep_group)


def token_replicas(cfg: Config, grid: ProcessGrid) -> Optional[Group]:
    """The ranks that hold the same tokens but not the same experts' place: the TP group without
    sequence parallelism at etp 1 (its ranks are ep or expert-dp ranks of the experts' folding);
    None where each rank's tokens are its own (sequence parallelism, or tp 1)."""
    if grid.tp == 1 or cfg.parallel.sequence_parallel or grid.etp == grid.tp:
        return None
    return grid.tp_group


def with_adapter_init(base: Optional[Initial], chunks: list[GPT], seed: int, grid: ProcessGrid) -> Initial:
    """Starting values with LoRA: adapters from their own init, every other parameter from
    `base` (e.g. HF weights) or the model's init."""
    def value(chunk: int, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        if is_adapter(name):
            return initial_adapter(name, p, seed, grid.tp_rank, grid.tp, (grid.ep_rank, grid.ep))
        return base(chunk, name, p) if base is not None else chunks[chunk].initial_value(name, seed)
    return value


def hf_initial_values(cfg: Config, grid: ProcessGrid) -> Initial:
    """checkpoint.init_from_hf: starting values read from HF weights, each rank reading only its
    TP shard of one parameter at a time (of an expert weight: its experts, each its etp shard)."""
    assert cfg.checkpoint.init_from_hf
    hf = HFInitialValues(cfg.checkpoint.init_from_hf, cfg.model)
    experts = {"ep": (grid.ep_rank, grid.ep), "etp": (grid.etp_rank, grid.etp)}
    return lambda chunk, name, p: hf.value(name, p, grid.tp_rank, grid.tp, **experts)


def apply_compile(model: GPT) -> None:
    """torch.compile every block's forward (ZeRO's hooks stay outside: they run around the
    module call, not inside its forward). Under context parallelism the attention core runs
    eagerly between the block's two graphs: its ring exchanges and all-to-alls are megazero's
    own autograd Functions around collectives, which dynamo cannot trace."""
    for block in model.transformer.h.values():
        if block.attn.cp.size > 1:
            block.attn.attend = torch.compiler.disable(block.attn.attend)
        block.forward = torch.compile(block.forward)


def compile_notes(cfg: Config) -> list[str]:
    """One line per part of the model that train.compile leaves eager, and why."""
    if not cfg.train.compile:
        return []
    notes = []
    if cfg.train.recompute == "selective":
        notes.append("the recomputed attention core (train.recompute selective) runs eagerly between each block's two "
                     "graphs: dynamo cannot trace a checkpoint that replays RNG streams")
    if cfg.parallel.tp > 1:
        notes.append("the tensor-parallel collectives run eagerly between each block's graphs: dynamo cannot trace "
                     "megazero's collective autograd Functions")
    if cfg.parallel.tp > 1 and cfg.model.dropout > 0:
        notes.append("attention dropout from the per-TP-rank RNG stream runs eagerly: dynamo cannot trace RNG-state swaps")
    if cfg.parallel.cp > 1:
        notes.append(f"the context-parallel attention core (parallel.cp_impl {cfg.parallel.cp_impl}) runs eagerly "
                     f"between each block's two graphs: dynamo cannot trace its collectives")
    if cfg.parallel.sequence_parallel and cfg.parallel.tp > 1:
        notes.append("the gathered matmuls of sequence parallelism run eagerly: dynamo cannot trace their collectives")
    return [f"train.compile: {n}" for n in notes]


def apply_recompute(model: GPT, mode: str, tracker: Optional[RNGTracker], eager: bool = False) -> None:
    """full: keep only each block's input and recompute the block in backward; selective:
    recompute only the attention core, whose s x s intermediates dominate activation
    memory (Korthikanti et al., 2022). Parameter names do not change. `eager`: the
    recomputed attention core runs outside the compiled block around it."""
    if mode == "none":
        return
    for block in model.transformer.h.values():
        if mode == "full":
            block.forward = _recomputed(block.forward, tracker)
        else:
            attend = _recomputed(block.attn.attend, tracker)
            block.attn.attend = torch.compiler.disable(attend) if eager else attend


def _recomputed(fn: Callable, tracker: Optional[RNGTracker]) -> Callable:
    """fn(x, kv=None, pos=0, rope=None, documents=None) recomputed in backward when it runs with
    gradients and without a KV cache; dropout masks are replayed from the same RNG states."""
    @functools.wraps(fn)
    def run(x: torch.Tensor, kv=None, pos: int = 0, rope=None, documents=None) -> torch.Tensor:
        if kv is not None or not torch.is_grad_enabled():
            return fn(x, kv, pos, rope, documents)
        return checkpoint(fn, x, None, 0, rope, documents, use_reentrant=False,
                          context_fn=recompute_rng_context(tracker))
    return run
