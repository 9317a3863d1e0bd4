"""Asynchronous checkpoint saves (checkpoint.async_save): training goes on while each rank's
file is written.

At the save iteration every rank opens the checkpoint (save.Save), copies its state into
host memory (the optimizer's reused HostSnapshot: the training step changes the originals
next) and hands it to a thread that writes and hashes the rank file; the 16-bit export and
LoRA adapters, which are gathers, are still written in the foreground. Nothing is sealed
by the thread: the digests are collected, metadata.json written, the directory renamed and
`latest` advanced (and keep_last applied) by `finish()`, a collective on the main thread at
a point every rank reaches in the same order: the first iteration boundary after the
optimizer step's sums say every rank's write ended (`votes`, `due`), or the next save, or
the end of the run. A write that failed on any rank (disk full) fails the save there on
every rank, as a synchronous save would. A kill at any moment leaves `latest` on the last
sealed checkpoint (the unsealed ITER.tmp is removed by the next save).

A thread, not a process: the state is already in this process's memory, so a thread
writes it with no second copy and no transfer, and the work is file writes and sha256
over large buffers, both of which run without the GIL.
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple, Optional

from megazero.checkpoint.save import Save, write_rank_file
from megazero.config.schema import Config
from megazero.parallel.grid import ProcessGrid


class WriteVotes(NamedTuple):
    """Ranks whose background write ended, and of those the ones whose write failed: one rank's
    own (0 or 1 each; 0 with no write in flight), or their sums over the world."""

    ended: int = 0
    failed: int = 0


class BackgroundSave:
    """One checkpoint whose rank file a thread is writing; `finish()` seals it."""

    def __init__(self, save: Save, state: dict):
        self.save = save
        self._done = threading.Event()
        self._entry: Optional[dict] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._write, args=(state,), daemon=True,
                                        name=f"megazero-save-{save.iteration}")
        self._thread.start()

    def _write(self, state: dict) -> None:
        try:
            self._entry = write_rank_file(self.save.rank_file, state)
        except BaseException as e:  # handed to the main thread, which raises it at finish()
            self._error = e
        finally:
            self._done.set()

    def votes(self) -> WriteVotes:
        """This rank's write, to be summed over the world in the step."""
        done = self._done.is_set()
        return WriteVotes(int(done), int(done and self._error is not None))

    @staticmethod
    def due(summed: WriteVotes, world_size: int) -> bool:
        """Given the world's sums of `votes`: every write ended, or one failed (then there is
        no checkpoint to wait for: the others' writes are joined and the save abandoned)."""
        return summed.failed > 0 or summed.ended == world_size

    def wait(self) -> None:
        """Block until this rank's write has ended (successfully or not)."""
        self._thread.join()

    def finish(self) -> str:
        """Collective: wait for this rank's write, then seal the checkpoint (or raise
        CheckpointSaveError on every rank when a write failed). Returns its path."""
        self.wait()
        self.save.record_rank_files(self._result)
        return self.save.seal()

    def _result(self) -> dict:
        if self._error is not None:
            raise self._error
        assert self._entry is not None  # the thread ended without an error
        return self._entry


def start_save(save_dir: str, iteration: int, rank_state: Callable[[], dict], cfg: Config, grid: ProcessGrid,
               keep_last: int = 0, extra: Optional[Callable[[str], list[str]]] = None) -> BackgroundSave:
    """Collective: open the checkpoint, take this rank's state (a host copy the caller no
    longer changes), write the gathered extras, and start writing the rank file in the
    background. Raises CheckpointSaveError on every rank when any of that failed."""
    save = Save(save_dir, iteration, cfg, grid, keep_last)
    save.open()
    state = save.step(rank_state)  # assembling state can fail on one rank (NVMe scratch space)
    if extra is not None:
        save.add_extra(extra)
    return BackgroundSave(save, state)
