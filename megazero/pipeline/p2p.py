"""Point-to-point exchange of activations and their gradients between pipeline neighbours.

A pipeline rank talks to two neighbours: activations go forward to the next rank and
gradients come back from it; activations come in from the previous rank and gradients go
back to it. With vpp model chunks per rank the ring wraps around (the last rank's chunk v
feeds the first rank's chunk v + 1), so the neighbours are (rank - 1) and (rank + 1) mod pp.

Every message is one tensor of a shape known ahead on both sides, [micro_batch_size,
seq_length, hidden_size] in the compute dtype, so nothing but the tensors is exchanged.
All traffic goes through `comm.batch_p2p`, so the bytes are counted on the pp group.

Matching without tags. Between one pair of ranks, gloo (like NCCL) matches messages in the
order they were posted. Both sides know the whole schedule, so the receiver knows the exact
order in which a neighbour will send, and it posts its receives in that same order: a
message that arrives before it is needed (possible at pp = 2, where one neighbour sends both
activations and gradients) is kept in an inbox until its turn. Sends are never waited on
before the end of the iteration, and a receive is waited on only when its tensor is needed,
so no rank ever blocks on anything but data the schedule says must exist first: a schedule
whose order respects the data dependencies cannot deadlock.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Hashable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid


class PipelineP2P:
    """The message traffic of one pipeline rank for one schedule run.

    `incoming[peer]` lists, in the order that peer sends them, the keys under which this
    rank will ask for the peer's messages (a key names what the message is for, e.g. the
    action that consumes it). `exchange` sends this rank's latest output and receives the
    tensor the next action needs, as one batch (Megatron pairs send-forward with
    receive-backward the same way).
    """

    def __init__(self, grid: ProcessGrid, shape: Sequence[int], dtype: torch.dtype,
                 incoming: dict[int, Iterable[Hashable]]):
        self.grid, self.group = grid, grid.pp_group
        self.shape, self.dtype = tuple(shape), dtype
        self.expected = {peer: deque(keys) for peer, keys in incoming.items()}
        self.inbox: dict[Hashable, torch.Tensor] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.wait_seconds = 0.0
        """Time spent blocked on neighbours (the pipeline bubble as this rank sees it)."""

    def exchange(self, send: Optional[tuple[int, torch.Tensor]] = None,
                 take: Optional[tuple[int, Hashable]] = None) -> Optional[torch.Tensor]:
        """Start sending `send` = (global rank, tensor) without waiting for it, and return the
        tensor that `take` = (global rank, key) names, receiving first every message that
        rank sends before it (they wait in the inbox for their turn)."""
        ops, wanted = [], []
        if send is not None:
            peer, tensor = send
            ops.append(("send", tensor.detach().contiguous(), peer))
        if take is not None and take[1] not in self.inbox:
            peer, key = take
            queue = self.expected.get(peer, deque())
            if key not in queue:
                raise RuntimeError(f"pipeline rank {self.grid.pp_rank} expects no message {key!r} from rank {peer}")
            while not wanted or wanted[-1] != key:
                wanted.append(queue.popleft())
            ops += [("recv", torch.empty(self.shape, dtype=self.dtype, device=self.grid.device), peer)
                    for _ in wanted]
        works = comm.batch_p2p(ops, self.group)
        tic = time.perf_counter()
        if len(works) != len(ops):  # NCCL coalesces a batch into one work, ordered on the stream
            for work in works:
                work.wait()
        else:
            if send is not None:
                # Keep the tensor alive until its send has completed.
                self.sends.append((works[0], ops[0][1]))
            for work in works[len(works) - len(wanted):]:
                work.wait()
        self.wait_seconds += time.perf_counter() - tic
        self.inbox.update((k, op[1]) for k, op in zip(wanted, ops[len(ops) - len(wanted):]))
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        return self.inbox.pop(take[1]) if take is not None else None

    def flush(self) -> None:
        """Wait for every send to complete (end of the schedule) and check that every message
        the schedule announced was received."""
        tic = time.perf_counter()
        for work, _ in self.sends:
            work.wait()
        self.wait_seconds += time.perf_counter() - tic
        self.sends.clear()
        leftover = [k for q in self.expected.values() for k in q] + list(self.inbox)
        if leftover:
            raise RuntimeError(f"pipeline rank {self.grid.pp_rank} ended with unreceived messages {leftover[:4]}")
