"""When and how a training run saves; the trainer calls `after_step` once per iteration and
`close` at the end. When: every checkpoint.interval iterations, at the last iteration, and when
the ranks agreed to stop early. How: synchronously (save.py), or written in the background
(checkpoint.async_save, background.py) and sealed (`latest`, keep_last) at the first iteration
boundary after the step's sums say every rank's write ended, at the next save, or at the end.
A failed save raises on every rank, unless checkpoint.on_save_error is continue and it is not
the run's last save. What each rank writes comes from a `SaveSource` (the trainer).
"""

from __future__ import annotations

import os
import sys
from typing import Iterator, Optional, Protocol

import torch
from torch import nn

from megazero.checkpoint.adapter import save_adapter
from megazero.checkpoint.background import BackgroundSave, WriteVotes, start_save
from megazero.checkpoint.base import CheckpointSaveError
from megazero.checkpoint.gathered import save_model_16bit
from megazero.checkpoint.save import save_sharded, weights_only_note, without_left_out
from megazero.config import Config
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.host import HostSnapshot


class SaveSource(Protocol):
    """The training side of a checkpoint (the trainer)."""

    def rank_state(self, snapshot: Optional[HostSnapshot]) -> dict:
        """This rank's state, a private host copy (in `snapshot`'s reused tensors when given)."""

    def full_parameters(self, trainable_only: bool = False) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, value full over DP) of this rank's chunks: a collective."""

    def check_saveable(self, iteration: int) -> None:
        """Raise (on every rank alike) when the weights must not be saved."""


class CheckpointManager:
    """checkpoint.save's schedule and the background save in flight (see the module docstring)."""

    def __init__(self, cfg: Config, grid: ProcessGrid, source: SaveSource, is_logger: bool):
        self.cfg, self.grid, self.source, self.is_logger = cfg, grid, source, is_logger
        self.pending: Optional[BackgroundSave] = None
        # checkpoint.async_save: the host copy that every save reuses.
        self.snapshot = HostSnapshot() if cfg.checkpoint.async_save else None

    def votes(self) -> WriteVotes:
        """This rank's background write, to be summed over the world in the next optimizer step
        (every rank has one in flight or none)."""
        return self.pending.votes() if self.pending is not None else WriteVotes()

    def after_step(self, iteration: int, written: WriteVotes, stop: bool) -> bool:
        """At the end of `iteration`, with the world's sums of `votes` from its step and whether
        the ranks agreed to stop: seal the background save once every write ended, then save
        when one is due. Returns whether this iteration was saved (every rank alike)."""
        if self.pending is not None and BackgroundSave.due(written, self.grid.world_size):
            self.finish(last=False)
        c, last = self.cfg.checkpoint, iteration == self.cfg.train.iters
        if not c.save or not (stop or last or (c.interval and iteration % c.interval == 0)):
            return False
        self.save(iteration, last=stop or last)
        return True

    def close(self) -> None:
        """The run's end waits for its last save."""
        if self.pending is not None:
            self.finish(last=True)

    def save(self, iteration: int, last: bool = True) -> None:
        """Save (collective). A failed save raises on every rank, unless checkpoint.on_save_error is
        continue and this is not the `last` save of the run: then training goes on. With
        checkpoint.async_save the previous save is finished first, and this one is written in
        the background (the `last` one is waited for)."""
        if self.pending is not None:  # its snapshot is about to be refilled
            self.finish(last=False)
        self.source.check_saveable(iteration)
        c = self.cfg.checkpoint
        extra = self._extra if c.save_model_16bit or self.cfg.finetune.lora_rank else None
        assert c.save is not None  # saving is configured
        try:
            if c.async_save:
                self.pending = start_save(c.save, iteration, self._rank_state, self.cfg, self.grid, c.keep_last, extra)
            else:
                path = save_sharded(c.save, iteration, self._rank_state, self.cfg, self.grid, c.keep_last, extra)
        except CheckpointSaveError as e:
            self._failed(e, last)
            return
        if c.async_save and last:  # its failure goes through _failed there
            self.finish(last=True)
        elif not c.async_save and self.is_logger:
            print(f"saved checkpoint {path}{weights_only_note(self.cfg)}", flush=True)

    def _rank_state(self) -> dict:
        return without_left_out(self.source.rank_state(self.snapshot), self.cfg)

    def _extra(self, directory: str) -> list[str]:
        """The gathered files beside the rank files: the 16-bit model, LoRA adapters."""
        written = []
        if self.cfg.checkpoint.save_model_16bit:
            dtype = torch.float16 if self.cfg.train.precision == "fp16" else torch.bfloat16
            path = save_model_16bit(directory, self.source.full_parameters(), self.cfg, self.grid, dtype)
            written.append(os.path.basename(path))
        if self.cfg.finetune.lora_rank:  # the adapters alone, whole, as PEFT loads them
            written += save_adapter(directory, self.source.full_parameters(trainable_only=True), self.cfg, self.grid)
        return written

    def finish(self, last: bool) -> None:
        """Collective: wait for the background save's writes and seal it (`latest`, keep_last)."""
        pending, self.pending = self.pending, None
        assert pending is not None  # every rank has the same save in flight
        try:
            path = pending.finish()
        except CheckpointSaveError as e:
            self._failed(e, last)
            return
        if self.is_logger:
            print(f"saved checkpoint {path} (written in the background since iteration {pending.save.iteration})"
                  f"{weights_only_note(self.cfg)}", flush=True)

    def _failed(self, e: CheckpointSaveError, last: bool) -> None:
        """Every rank gets the same error: all stop, or (on_save_error continue) all go on."""
        if self.cfg.checkpoint.on_save_error == "stop" or last:
            raise e
        if self.is_logger:
            print(f"warning: {e} (checkpoint.on_save_error continue: training on, retrying at the next "
                  f"interval)", file=sys.stderr, flush=True)
