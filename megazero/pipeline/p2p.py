"""Point-to-point exchange of activations and their gradients between pipeline neighbours.

A pipeline rank talks to two neighbours: activations go forward to the next rank and
gradients come back from it; activations come in from the previous rank and gradients go
back to it. With vpp model chunks per rank the ring wraps around (the last rank's chunk v
feeds the first rank's chunk v + 1), so the neighbours are (rank - 1) and (rank + 1) mod pp.

Every message is one tensor of a shape known ahead on both sides, [micro_batch_size,
seq_length, hidden_size] (seq_length / tp under sequence parallelism) in the compute dtype,
so nothing but the tensors is exchanged.
All traffic goes through `comm.batch_p2p`, so the bytes are counted on the pp group.

Rendezvous. Under NCCL a send may not complete until the peer has posted the matching
receive, and the next batch a rank posts queues behind the previous one; so a rank is stuck
in a batch until every op in it has met its partner. This class only posts a batch and
waits for all of it; which ops go together is the schedule's job (`pipeline_plan` in
schedules.py pairs each send with the receive the peer posts in its batch of the same
step, the way Megatron-LM pairs send-forward with receive-backward).

Matching without tags. Between one pair of ranks, gloo (like NCCL) matches messages in the
order they were posted, and both sides derive their batches from the same plan, so a
receive is simply filed under the key (the action that will consume it) the plan gives it;
it waits in the inbox until that action runs.
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence

import torch

from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid


class PipelineP2P:
    """The message traffic of one pipeline rank for one schedule run: batches of sends and
    receives posted and waited for together, and an inbox of what has arrived."""

    def __init__(self, grid: ProcessGrid, shape: Sequence[int], dtype: torch.dtype):
        self.grid, self.group = grid, grid.pp_group
        self.shape, self.dtype = tuple(shape), dtype
        self.inbox: dict[Hashable, torch.Tensor] = {}
        self.wait_seconds = 0.0
        """Time spent blocked on neighbours (the pipeline bubble as this rank sees it)."""

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], receives: Sequence[tuple[int, Hashable]]) -> None:
        """Post one batch: send each (global rank, tensor) and receive one tensor from each
        (global rank, key) into the inbox under `key`, then wait until all of it is done.
        Sends and receives to one peer are matched by the peer in the order listed here."""
        ops = [("send", self._outgoing(tensor), peer) for peer, tensor in sends]
        buffers = [torch.empty(self.shape, dtype=self.dtype, device=self.grid.device) for _ in receives]
        ops += [("recv", buffer, peer) for buffer, (peer, _) in zip(buffers, receives)]
        works = comm.batch_p2p(ops, self.group)
        tic = time.perf_counter()
        for work in works:  # NCCL may answer one work for the whole (coalesced) batch
            work.wait()
        self.wait_seconds += time.perf_counter() - tic
        # `ops` kept the sent tensors alive until their sends completed, just above.
        for (_, key), buffer in zip(receives, buffers):
            self.inbox[key] = buffer

    def take(self, key: Hashable) -> torch.Tensor:
        """The received tensor filed under `key` (it leaves the inbox)."""
        if key not in self.inbox:
            raise RuntimeError(f"pipeline rank {self.grid.pp_rank} needs message {key!r} before it arrived; "
                               f"the communication plan must receive it in an earlier batch")
        return self.inbox.pop(key)

    def finish(self) -> None:
        """End of the schedule: every message that arrived must have been used."""
        if self.inbox:
            raise RuntimeError(f"pipeline rank {self.grid.pp_rank} ended with unused messages {list(self.inbox)[:4]}")

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as it goes on the wire. The receiver allocated `shape` in `dtype` on its
        device ahead, so any other shape or dtype would be misread there, not rejected."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype or tensor.device != self.grid.device:
            raise ValueError(f"pipeline rank {self.grid.pp_rank} would send a {tuple(tensor.shape)} {tensor.dtype} "
                             f"tensor on {tensor.device}; its neighbours expect {self.shape} {self.dtype} on "
                             f"{self.grid.device} (pass the model's compute dtype to the schedule)")
        return tensor.detach().contiguous()
