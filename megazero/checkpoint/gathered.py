"""A 16-bit copy of the whole model written during training (`checkpoint.save_model_16bit`).

Every parameter is assembled in full — from its ZeRO-3 shards over DP (one gather unit at
a time), an expert weight's experts (all-gathered within the expert-parallel group), its TP
shards (all-gathered within the TP group) and its pipeline stage (sent to global rank 0) — and written by global rank 0 alone into one safetensors file holding the
non-parallel model's state_dict (megazero names, tp = 1 vocab padding) with the model
config in its metadata. Rank 0 never holds more than one full parameter: the file's
header is written first from the model's shapes and each tensor lands at its offset
(the order in which the stages deliver them does not matter).

Everything that meets a collective or a p2p exchange lives on `grid.device` (NCCL takes
only CUDA tensors); parameters stay on the device until the writer copies each one to the
host through its pinned buffer.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Callable, Iterator

import torch
from torch import nn

from megazero.checkpoint.base import MODEL_16BIT
from megazero.checkpoint.tensors import fit_vocab, plain_shapes, save_safetensors_streaming
from megazero.config.schema import Config
from megazero.config.sharding import parameter_groups
from megazero.model.lora import adapter_shapes
from megazero.parallel import comm
from megazero.parallel.comm import Group
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.placement import placement


def tp_full(local: torch.Tensor, param: nn.Parameter, tp: Group) -> torch.Tensor:
    """Join the TP shards of one parameter (collective over the TP group)."""
    where = placement(param)
    if not where.sharded or tp.size == 1:
        return local
    flat = torch.empty(tp.size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather_into(flat, local.reshape(-1), tp)
    return where.unshard(list(flat.view(tp.size, *local.shape).unbind(0)))


def experts_full(local: torch.Tensor, param: nn.Parameter, ep: Group) -> torch.Tensor:
    """Stack every expert-parallel rank's experts of an expert weight (collective over ep)."""
    if not placement(param).experts or ep.size == 1:
        return local
    flat = torch.empty(ep.size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather_into(flat, local.reshape(-1), ep)
    return flat.view(ep.size * local.shape[0], *local.shape[1:])


def save_model_16bit(directory: str, full_parameters: Iterator[tuple[str, nn.Parameter, torch.Tensor]],
                     cfg: Config, grid: ProcessGrid, dtype: torch.dtype) -> str:
    """Collective over the world: write DIRECTORY/model_16bit.safetensors from rank 0.

    `full_parameters` yields (name, parameter, value) for this rank's chunks with every
    value full over DP (the optimizer gathers ZeRO-3 shards unit by unit). A LoRA run's
    adapters are stored too, with its finetune section in the metadata, so that readers
    fold them in (plain.py)."""
    path = os.path.join(directory, MODEL_16BIT)
    shapes, metadata = plain_shapes(cfg.model), {"format": "pt", "megazero_model": json.dumps(cfg.model.__dict__)}
    if cfg.finetune.lora_rank:
        shapes.update(adapter_shapes(cfg.model, cfg.finetune))
        metadata["megazero_finetune"] = json.dumps(dataclasses.asdict(cfg.finetune))
    save_gathered(path, full_parameters, shapes, grid, dtype, metadata)
    return path


def save_gathered(path: str, full_parameters: Iterator[tuple[str, nn.Parameter, torch.Tensor]],
                  shapes: dict[str, tuple[int, ...]], grid: ProcessGrid, dtype: torch.dtype,
                  metadata: dict[str, str], key: Callable[[str], str] = str) -> None:
    """Collective over the world: rank 0 writes the parameters named in `shapes` (full
    shapes), each assembled whole, into one safetensors file stored under `key(name)`."""
    own = _joined(full_parameters, shapes, grid, dtype)
    failure = None
    if grid.rank == 0:
        tensors = ((key(n), t) for n, t in itertools.chain(own, _other_stages(shapes, dtype, grid)))
        try:
            save_safetensors_streaming(path, {key(n): s for n, s in shapes.items()}, dtype, tensors, metadata)
        except OSError as e:  # disk full: still take every tensor the others send, or they would wait forever
            failure = e
            for _ in tensors:
                pass
    else:
        leader = grid.dp_cp_group.rank == 0 and grid.tp_rank == 0  # speaks for its pipeline stage
        names = list(shapes)
        for name, full in own:
            if leader:
                _send(names.index(name), full, grid)
        if leader:
            _send(-1, torch.empty(0, dtype=dtype, device=grid.device), grid)  # end of this stage's parameters
    comm.barrier(grid["world"])
    if failure is not None:
        raise failure


def _joined(full_parameters: Iterator, shapes: dict, grid: ProcessGrid, dtype: torch.dtype) -> Iterator:
    """(name, full tensor) on the DP-rank-0 row, one at a time; other rows only take part
    in the ZeRO-3 gathers that `full_parameters` runs and in the experts' all-gathers."""
    for name, param, value in full_parameters:
        # A tied head (wte's copy) is not in the non-parallel model's shapes; an untied one is.
        if name not in shapes:
            continue
        value = experts_full(value.detach(), param, grid.ep_group)  # every rank: the ep group spans dp x cp ranks
        if grid.dp_cp_group.rank != 0:
            continue
        tensor = grid[parameter_groups(placement(param)).tensor]  # tp, or an expert weight's expert_tp
        yield name, fit_vocab(name, tp_full(value, param, tensor), shapes[name]).to(dtype)


def _send(index: int, tensor: torch.Tensor, grid: ProcessGrid) -> None:
    pp = grid.pp_group
    _send_and_wait(torch.tensor([index], dtype=torch.int64, device=grid.device), pp)
    if index >= 0:
        _send_and_wait(tensor.contiguous(), pp)


def _send_and_wait(t: torch.Tensor, pp: Group) -> None:
    """Send to the pipeline's first stage and return once the tensor is delivered. On CUDA,
    wait() only orders the current stream after the send, so the CPU would race ahead and
    queue every full parameter of this stage on the device while rank 0 still writes the
    stages before it; synchronizing keeps one parameter in flight, as gloo does."""
    comm.send(t, pp.ranks[0], pp).wait()
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _other_stages(shapes: dict, dtype: torch.dtype, grid: ProcessGrid) -> Iterator:
    """Each later stage's tensors, as its leader sends them to rank 0 (received on the
    device; the writer copies each to the host before the next arrives)."""
    names, pp = list(shapes), grid.pp_group
    for stage in range(1, grid.pp):
        src = grid.rank_of(0, 0, stage)
        while True:
            index = torch.empty(1, dtype=torch.int64, device=grid.device)
            comm.recv(index, src, pp).wait()
            if int(index) < 0:  # int() synchronizes: the index has arrived
                break
            name = names[int(index)]
            t = torch.empty(shapes[name], dtype=dtype, device=grid.device)
            comm.recv(t, src, pp).wait()
            yield name, t
