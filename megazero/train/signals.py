"""What every rank tells every other once per iteration, with no collective of its own: the
values ride in the optimizer step's one all-reduce (zero/clip.py sums them beside the gradient
norms without reading them), so every rank reads the same sums and takes the same decision
(stop and save at the same iteration, seal a background save together). A new signal is a
new field here."""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Sequence

import torch

from megazero.checkpoint.background import WriteVotes
from megazero.parallel import comm
from megazero.train.lifecycle import StopRequest


@dataclass(frozen=True)
class StepSignals:
    """Counts of ranks: one rank's own record holds 0 or 1 in each field, the step's result
    their sums over the world. Packed in field order."""

    deadline: int = 0  # train.exit_duration_minutes reached
    sigusr1: int = 0
    sigterm: int = 0
    sigint: int = 0  # Ctrl-C under megazero.launch: a stop like SIGTERM, named as itself
    save_ended: int = 0  # checkpoint.async_save: the background write in flight ended,
    save_failed: int = 0  # and failed

    @classmethod
    def of_rank(cls, stop_code: int, write: WriteVotes) -> StepSignals:
        """This rank's record: its reason to stop now (StopRequest.code) and its background write."""
        return cls(deadline=int(stop_code == StopRequest.DEADLINE), sigusr1=int(stop_code == StopRequest.SIGUSR1),
                   sigterm=int(stop_code == StopRequest.SIGTERM), sigint=int(stop_code == StopRequest.SIGINT),
                   save_ended=write.ended, save_failed=write.failed)

    def pack(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @classmethod
    def unpack(cls, sums: Sequence[float]) -> StepSignals:
        return cls(*(int(v) for v in sums))

    def summed(self, world: comm.Group, device: torch.device) -> StepSignals:
        """The world's sums of the ranks' records, by a collective of their own (an iteration whose
        step did not run: train.rerun_on spike stopped it before)."""
        sums = torch.tensor(self.pack(), dtype=torch.float64, device=device)
        comm.all_reduce(sums, world)
        return StepSignals.unpack(sums.tolist())

    def stop_code(self) -> int:
        """The largest reason to stop any rank voted for (StopRequest.NONE: go on), so every rank
        saves and stops at the same iteration."""
        voted = ((StopRequest.DEADLINE, self.deadline), (StopRequest.SIGUSR1, self.sigusr1),
                 (StopRequest.SIGTERM, self.sigterm), (StopRequest.SIGINT, self.sigint))
        return max((code for code, ranks in voted if ranks), default=StopRequest.NONE)

    @property
    def write(self) -> WriteVotes:
        return WriteVotes(self.save_ended, self.save_failed)
