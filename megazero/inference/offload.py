"""ZeRO-Inference: a model whose transformer blocks stay off the compute device.

The blocks' weights live in a store (host memory or a file on NVMe, see store.py) and pass
through the device one block at a time: just before block i runs, its weights are bound to
its modules; right after, they are let go. Two device buffers take turns, so while block i
computes, a background thread fetches block i + 1 (reads it from the file; on CUDA also
copies it from pinned host memory to the device with a non-blocking copy on a side stream,
and the compute stream waits on that copy's event before using it). After the last block
the first one is fetched again, for the next decoding step.

The token and position embeddings and the final LayerNorm stay resident on the device (the
head is tied to the token embedding; the Llama family's untied output layer stays resident
too): for GPT-2 1.5B that is 0.33 GB in fp32 against 5.9 GB of blocks. The KV cache is kept as usual, but every decoding step streams every block once
more: a step costs one pass over the weights whatever the batch, so large batches are what
make it pay (DeepSpeed's ZeRO-Inference makes the same trade).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Union

import torch
from torch import nn

from megazero.checkpoint.base import Checkpoint, CheckpointError
from megazero.checkpoint.tensors import fit_vocab
from megazero.inference.store import BlockLayout, HostWeightStore, NvmeWeightStore
from megazero.model.gpt import GPT
from megazero.parallel.placement import placement
from megazero.zero.materialize import replace_meta_parameters

WeightStore = Union[HostWeightStore, NvmeWeightStore]
BLOCKS = "transformer.h."


def build_offloaded_model(ckpt: Checkpoint, device: torch.device, offload: str, nvme_path: str = "",
                          prefetch: bool = True) -> tuple[GPT, "BlockStreamer"]:
    """The checkpoint's model (fp32, one process) with its blocks in a `offload` ("cpu" or
    "nvme") store and everything else on `device`, and the streamer that serves the blocks.
    The store is filled one checkpoint tensor at a time; the model is never whole anywhere."""
    with torch.device("meta"):
        model = GPT(ckpt.model_config)
    blocks = list(model.transformer.h.values())
    shapes = {tuple((n, tuple(p.shape)) for n, p in b.named_parameters()) for b in blocks}
    if len(shapes) > 1:  # the store holds one layout that every block's weights fill alike
        raise CheckpointError("offloaded generation streams blocks of one shape, but this model mixes dense and "
                              "mixture-of-experts layers (model.moe_layer_freq); generate without --offload")
    layout = BlockLayout(blocks[0], torch.float32)
    store = HostWeightStore(layout, len(blocks)) if offload == "cpu" else NvmeWeightStore(layout, len(blocks), nvme_path)
    # Everything but the blocks: the embeddings and final norm, and an untied output layer
    # (lm_head, beside model.transformer).
    resident = [m for name, m in model.transformer.named_children() if name != "h"] + \
        [m for name, m in model.named_children() if name != "transformer"]
    replace_meta_parameters(resident, device)
    try:
        _fill(ckpt, model, store, layout)
    except BaseException:
        store.close()
        raise
    return model.eval(), BlockStreamer(blocks, store, layout, device, prefetch)


def _fill(ckpt: Checkpoint, model: GPT, store: WeightStore, layout: BlockLayout) -> None:
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, full in ckpt.tensors():
            if name.startswith(BLOCKS):
                index, rel = name[len(BLOCKS):].split(".", 1)
                slot = layout.slots[rel]
                if tuple(full.shape) != slot.shape:
                    raise CheckpointError(f"{name} has shape {tuple(full.shape)} but the model config says "
                                          f"{slot.shape}; the checkpoint does not match its config")
                store.put(int(index), slot.offset, full.float())
            elif name in params:
                params[name].copy_(fit_vocab(name, full.float(), placement(params[name]).full_shape))
            else:
                continue
            seen.add(name)
    missing = set(params) - seen
    if missing:
        raise CheckpointError(f"the weights lack {len(missing)} parameters, e.g. {sorted(missing)[0]}")
    store.finish()


class BlockStreamer:
    """Serves each block its weights through forward hooks, fetching the next block on a
    background thread while the current one computes (when `prefetch`; otherwise each
    block is fetched when it is about to run, and waited for)."""

    def __init__(self, blocks: list[nn.Module], store: WeightStore, layout: BlockLayout, device: torch.device,
                 prefetch: bool):
        self.store, self.layout, self.device, self.prefetch = store, layout, device, prefetch
        self.blocks = blocks
        self.cuda = device.type == "cuda"
        # Buffers the NVMe store reads into (on the CPU they are the working set itself).
        self.buffers = [store.buffer(pin=True) if isinstance(store, NvmeWeightStore) else None for _ in range(2)]
        if self.cuda:
            self.slots = [torch.empty(layout.numel, dtype=layout.dtype, device=device) for _ in range(2)]
            self.copy_stream = torch.cuda.Stream(device)
        self.copied: list[Optional[torch.cuda.Event]] = [None, None]  # last copy out of each host buffer
        self.freed: list[Optional[torch.cuda.Event]] = [None, None]  # last compute that read each device slot
        # typeshed cannot pair a conditional initializer with its initargs
        self.pool = ThreadPoolExecutor(1, initializer=torch.cuda.set_device if self.cuda else None,  # type: ignore[arg-type]
                                       initargs=(device,) if self.cuda else ())  # type: ignore[arg-type]
        self.pending: dict[int, tuple[int, Future]] = {}  # block -> (turn, its fetch)
        self.bound: dict[int, int] = {}  # block -> the turn whose weights it runs with
        self.turn = 0
        self.wait_s = 0.0  # seconds compute waited for a block (what prefetching did not hide)
        self.fetches = 0
        self.placeholders = [self._placeholders(b) for b in blocks]
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, args, i=i: self._before(i))
            block.register_forward_hook(lambda m, args, out, i=i: self._after(i))

    @staticmethod
    def _placeholders(block: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """(module, attribute, meta parameter) of each block parameter, in layout order."""
        return [(block.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], p)
                for name, p in block.named_parameters()]

    # ------------------------------------------------------------------ fetching

    def _submit(self, i: int) -> None:
        k, self.turn = self.turn, 1 - self.turn
        self.pending[i] = (k, self.pool.submit(self._fetch, i, k, self.freed[k]))
        self.fetches += 1

    def _fetch(self, i: int, k: int, freed: Optional[torch.cuda.Event]) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """Block i's flat weights on the device, in turn k's buffers (background thread)."""
        if (copied := self.copied[k]) is not None:
            copied.synchronize()  # host buffer k is reused once its last copy is done
        host = self.store.fetch(i, self.buffers[k])
        if not self.cuda:
            return host, None
        with torch.cuda.stream(self.copy_stream):
            if freed is not None:
                self.copy_stream.wait_event(freed)  # slot k still feeds the block that ran there
            self.slots[k].copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self.copied[k] = done
        return self.slots[k], done

    # ------------------------------------------------------------------ hooks

    def _before(self, i: int) -> None:
        if i not in self.pending:
            self._submit(i)
        k, future = self.pending.pop(i)
        tic = time.perf_counter()
        flat, ready = future.result()
        self.wait_s += time.perf_counter() - tic
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        for (module, attr, _), view in zip(self.placeholders[i], self.layout.views(flat)):
            setattr(module, attr, nn.Parameter(view, requires_grad=False))
        self.bound[i] = k
        if self.prefetch:
            self._submit((i + 1) % len(self.blocks))  # after the last block: the first, for the next step

    def _after(self, i: int) -> None:
        k = self.bound.pop(i)
        if self.cuda:
            self.freed[k] = freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
        for module, attr, placeholder in self.placeholders[i]:
            setattr(module, attr, placeholder)  # a block run outside the streamer fails on meta, loudly

    def close(self) -> None:
        """Wait for fetches in flight (a prefetch of the first block is, after a step), stop
        the thread and free the store."""
        for _, future in self.pending.values():
            future.result()
        self.pending.clear()
        self.pool.shutdown()
        self.store.close()
