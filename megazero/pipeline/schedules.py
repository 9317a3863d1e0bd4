"""Forward/backward schedules over the micro-batches of one iteration.

Every schedule returns this rank's share of the iteration loss: the sum over its
micro-batches of (token-loss sum / global token count), so the DP sum of the returned
values is the global mean loss and the gradients need no further rescaling (the loss is
normalised once, globally). Ranks that do not compute the loss return None.

With pp > 1 a schedule is an *order*: the list of actions (forward or backward of one
micro-batch through one model chunk) that one pipeline rank runs, in sequence. One executor
runs any order, exchanging activations and gradients with the neighbours in batches that
`pipeline_plan` derives from the orders of all ranks, so that no send waits on a receive
its peer has not posted (see p2p.py):

    gpipe        all forwards, then all backwards: m micro-batches' activations alive
    1f1b         warm-up forwards (pp - 1 - rank), then one forward / one backward in turn,
                 then the remaining backwards: at most pp micro-batches alive on rank 0
    interleaved  vpp model chunks per rank (Megatron-LM's interleaved 1F1B): micro-batches
                 go through the chunks in groups of pp, which cuts the bubble by vpp
    zbh1         zero-bubble ZB-H1: 1F1B whose backward computes input gradients only (B);
                 the weight gradients (W, see megazero/parallel/weight_grad.py) are
                 deferred to fill the cool-down bubble, with 1F1B's peak of pp in flight

Gradient sync contract with the optimizer: every backward runs inside `optimizer.no_sync()`
except the last backward of each model chunk (with zbh1: its last B and its last W, each
after every other pass that adds to the gradients it completes), so gradients are reduced
over DP once per iteration, overlapping that last backward.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Protocol, Sequence, Union

import torch

from megazero.model.gpt import GPT
from megazero.parallel.grid import ProcessGrid
from megazero.parallel.weight_grad import WeightGradSink, WeightGradStore
from megazero.pipeline.p2p import PipelineP2P

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [b, s], labels [b, s])


class GradSync(Protocol):
    """What a schedule needs from the optimizer (megazero.zero.optimizer.ZeroOptimizer)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (multiplied by the fp16 loss scale)."""

    def no_sync(self) -> ContextManager[None]:
        """Backwards inside accumulate gradients without reducing them over DP."""

    @property
    def weight_grad_sink(self) -> Optional[WeightGradSink]:
        """Where deferred weight gradients go instead of autograd (zbh1 at ZeRO-3), or None."""


Timers = Callable[[str], ContextManager[None]]
"""timers("forward") / timers("backward"): a context that times one phase (see train/metrics.py)."""


def untimed(phase: str) -> ContextManager[None]:
    return contextlib.nullcontext()


def forward_backward_no_pipelining(chunk: GPT, microbatches: Sequence[Microbatch], num_tokens: int | torch.Tensor,
                                   optimizer: Optional[GradSync] = None, forward_only: bool = False,
                                   timers: Timers = untimed) -> Optional[torch.Tensor]:
    """pp = 1: a plain loop of forward + backward per micro-batch (gradients accumulate)."""
    # On the tokens' device: a CPU accumulator plus a CUDA loss fails only on the GPU.
    total = torch.zeros((), dtype=torch.float32, device=microbatches[0][0].device)
    for i, (tokens, labels) in enumerate(microbatches):
        with torch.set_grad_enabled(not forward_only), timers("forward"):
            loss = chunk.loss(chunk(tokens, tokens=tokens), labels).sum() / num_tokens
        if not forward_only:
            assert optimizer is not None
            # Gradients accumulate locally; only the last backward reduces them over DP.
            last = i == len(microbatches) - 1
            with contextlib.nullcontext() if last else optimizer.no_sync(), timers("backward"):
                optimizer.scale_loss(loss).backward()
        total += loss.detach().float()
    return total


# ----------------------------------------------------------------------------- orders


@dataclass(frozen=True)
class Action:
    """Forward (or backward) of micro-batch `microbatch` through this rank's model chunk
    `chunk`; with `weight`, the deferred weight-gradient pass (W) of that backward (zbh1,
    whose backward computes input gradients only)."""

    forward: bool
    chunk: int
    microbatch: int
    weight: bool = False

    def __repr__(self) -> str:
        return f"{'F' if self.forward else 'W' if self.weight else 'B'}{self.chunk}.{self.microbatch}"


Order = Callable[[int, int, int, int], list[Action]]
"""(pp, vpp, pp_rank, num_microbatches) -> the actions of that rank, in order."""


def _single_chunk(name: str, vpp: int) -> None:
    if vpp != 1:
        raise ValueError(f"the {name} schedule runs one model chunk per rank (vpp {vpp}); use interleaved")


def gpipe_order(pp: int, vpp: int, pp_rank: int, m: int) -> list[Action]:
    """GPipe: every forward, then every backward (simplest; keeps all m activations)."""
    _single_chunk("gpipe", vpp)
    return [Action(True, 0, j) for j in range(m)] + [Action(False, 0, j) for j in range(m)]


def one_f_one_b_order(pp: int, vpp: int, pp_rank: int, m: int) -> list[Action]:
    """1F1B (PipeDream-flush): rank r runs pp - 1 - r warm-up forwards, so the backward of
    micro-batch j starts as soon as its gradient can arrive; then it alternates one
    forward and one backward, and drains the remaining backwards. Same bubble as GPipe,
    but at most pp - r micro-batches' activations are alive on rank r."""
    _single_chunk("1f1b", vpp)
    return _warmup_then_alternate(min(pp - 1 - pp_rank, m), pp, 1, m)


def zbh1_order(pp: int, vpp: int, pp_rank: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2023): 1F1B with each backward split into B (input gradients, which
    the previous rank waits for) and W (weight gradients, which nobody waits for). Rank r
    lets up to r W passes wait (the last rank p - 1, rank 0 none): after each B it runs the
    oldest W only when more than r are pending, and the r left run after its last B, filling
    the cool-down, where rank r waits p - 1 - r B-times for the last rank's final gradient.
    In flight (forward done, W not yet) on any rank: at most pp micro-batches, 1F1B's peak."""
    _single_chunk("zbh1", vpp)
    order: list[Action] = []
    weights_done = 0
    for action in one_f_one_b_order(pp, vpp, pp_rank, m):
        order.append(action)
        if not action.forward and action.microbatch + 1 - weights_done > pp_rank:  # more than r W passes pending
            order.append(Action(False, 0, weights_done, weight=True))  # run the oldest
            weights_done += 1
    return order + [Action(False, 0, j, weight=True) for j in range(weights_done, m)]


def _virtual(k: int, pp: int, vpp: int, forward: bool) -> Action:
    """The k-th forward (or backward) of a rank in the interleaved schedule: micro-batches go
    in groups of pp, each group through chunk 0, 1, ... in turn (backwards through the
    chunks in reverse). At vpp 1, micro-batch k through chunk 0."""
    group, within = divmod(k, pp * vpp)
    chunk, i = divmod(within, pp)
    return Action(forward, chunk if forward else vpp - 1 - chunk, group * pp + i)


def _warmup_then_alternate(warmup: int, pp: int, vpp: int, m: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward in turn, then the remaining
    backwards: the m x vpp of each, in `_virtual`'s order."""
    total = m * vpp
    order = [_virtual(k, pp, vpp, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [_virtual(warmup + k, pp, vpp, True), _virtual(k, pp, vpp, False)]
    return order + [_virtual(k, pp, vpp, False) for k in range(total - warmup, total)]


def interleaved_order(pp: int, vpp: int, pp_rank: int, m: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B over vpp chunks per rank (m a multiple of pp).
    The warm-up is longer than 1F1B's: the first backward needs a micro-batch to have gone
    through all pp x vpp virtual stages, (vpp - 1) pp forwards of this rank's earlier
    chunks plus two per rank still ahead of it (one forward there, one backward back)."""
    if m % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) to be a multiple of pp ({pp})")
    return _warmup_then_alternate(min((pp - 1 - pp_rank) * 2 + (vpp - 1) * pp, m * vpp), pp, vpp, m)


def forward_only_order(pp: int, vpp: int, pp_rank: int, m: int) -> list[Action]:
    """Evaluation: the forwards alone, micro-batches in order through the chunks in turn."""
    return [_virtual(k, pp, vpp, True) for k in range(m * vpp)]


def activation_events(order: Sequence[Action]) -> list[tuple[bool, int]]:
    """(forward?, chunk) of the actions of `order` that take (a forward) or free (the last
    backward pass of a micro-batch: its W where backward is split, else its B) saved
    activations. B frees most of a zbh1 micro-batch's activations, but W still holds its
    matmul inputs and output gradients: counting it alive until W is the bound."""
    split = any(a.weight for a in order)
    return [(a.forward, a.chunk) for a in order if a.forward or a.weight or not split]


ORDERS: dict[str, Order] = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "interleaved": interleaved_order,
                            "zbh1": zbh1_order}


# ----------------------------------------------------------------------------- messages


def message_target(action: Action, pp: int, vpp: int, pp_rank: int) -> Optional[tuple[int, Action]]:
    """Where the tensor an action produces goes: (pipeline rank, the action that consumes it
    there), or None. Virtual stage s = chunk x pp + rank; forwards feed stage s + 1,
    backwards feed stage s - 1, and the first and last virtual stages talk to no one; a W
    pass only accumulates weight gradients on its own rank."""
    if action.weight:
        return None
    stage = action.chunk * pp + pp_rank
    target = stage + 1 if action.forward else stage - 1
    if not 0 <= target < pp * vpp:
        return None
    return target % pp, Action(action.forward, target // pp, action.microbatch)


def message_source(action: Action, pp: int, vpp: int, pp_rank: int) -> Optional[int]:
    """The pipeline rank whose message this action needs (None: it needs none; a W pass
    uses what its B pass saved)."""
    if action.weight:
        return None
    stage = action.chunk * pp + pp_rank
    source = stage - 1 if action.forward else stage + 1
    return source % pp if 0 <= source < pp * vpp else None


# ----------------------------------------------------------------------------- communication plan


@dataclass(frozen=True)
class Transfer:
    """One p2p op of a batch: send (or receive) the tensor that action `key` of the receiving
    rank consumes, to (or from) pipeline rank `peer`."""

    send: bool
    peer: int
    key: Action

    def __repr__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.key!r}"


Batch = tuple[Transfer, ...]
Step = Union[Action, Batch]
"""A plan is a list of steps: run an action, or post a batch of transfers and wait for all of it."""


def pipeline_plan(order: Order, pp: int, vpp: int, pp_rank: int, m: int) -> tuple[Step, ...]:
    """What pipeline rank `pp_rank` does, in sequence, to run `order`: its actions, and
    between them the batches of sends and receives it posts.

    The plan comes from one run of every rank's order in unit-time steps: at step t each
    rank runs its next action if that action's input arrived before t, and then every rank
    posts batch t, which holds the sends of what it produced at t and the receives of what
    its neighbours produced at t. So every send's receive is in the peer's batch of the
    same step, and no plan can deadlock even when a send blocks until its receive is
    posted: batch t of a rank waits only for the neighbours' batch t, the actions in
    between wait for nothing, and by induction on t every rank reaches and completes each
    of its batches. Megatron-LM's paired calls (send_forward_recv_backward, ...) are this
    plan written out by hand for 1F1B. Every rank's first batch needs no one else's work
    (only rank 0 computes before it), so all ranks join the first call on the pp group.

    A receive may come in before its action is due (it waits in the inbox); that is the
    price of pairing it with the send that produced it."""
    return _plans(order, pp, vpp, m)[pp_rank]


@functools.lru_cache(maxsize=32)
def _plans(order: Order, pp: int, vpp: int, m: int) -> tuple[tuple[Step, ...], ...]:
    """Every rank's plan (see pipeline_plan); cached, as every iteration runs the same one."""
    pending = [deque(order(pp, vpp, r, m)) for r in range(pp)]
    plans: list[list[Step]] = [[] for _ in range(pp)]
    arrived: set[tuple[int, Action]] = set()  # (rank, action): the action's input has come in
    while any(pending):
        ready = [r for r in range(pp) if pending[r] and (message_source(pending[r][0], pp, vpp, r) is None
                                                         or (r, pending[r][0]) in arrived)]
        if not ready:
            stuck = {r: pending[r][0] for r in range(pp) if pending[r]}
            raise ValueError(f"{order.__name__}(pp {pp}, vpp {vpp}, m {m}) deadlocks on its own data: the next "
                             f"actions {stuck} each wait for another rank's; an action must follow its feeder")
        sends: list[list[Transfer]] = [[] for _ in range(pp)]
        receives: list[list[Transfer]] = [[] for _ in range(pp)]
        for r in ready:
            action = pending[r].popleft()
            plans[r].append(action)
            target = message_target(action, pp, vpp, r)
            if target is not None:  # the peer receives it in its batch of this same step
                sends[r].append(Transfer(True, *target))
                receives[target[0]].append(Transfer(False, r, target[1]))
                arrived.add(target)
        for r in range(pp):
            if sends[r] or receives[r]:
                plans[r].append(tuple(sends[r] + receives[r]))
    return tuple(tuple(plan) for plan in plans)


# ----------------------------------------------------------------------------- executor


def weight_grad_stores(chunks: Sequence[GPT]) -> list[WeightGradStore]:
    """Each chunk's store of deferred weight-gradient work (for orders with W passes)."""
    if any(c.weight_grads is None for c in chunks):
        raise ValueError("this schedule defers weight gradients, but the model chunks were built without a "
                         "WeightGradStore; build them with megazero.pipeline.stages for parallel.schedule zbh1")
    return [c.weight_grads for c in chunks if c.weight_grads is not None]  # all, after the check above


def forward_backward_pipelining(chunks: Sequence[GPT], microbatches: Sequence[Microbatch], num_tokens: int | torch.Tensor,
                                grid: ProcessGrid, schedule: str, dtype: torch.dtype,
                                optimizer: Optional[GradSync] = None, forward_only: bool = False,
                                stats: Optional[dict] = None, timers: Timers = untimed) -> Optional[torch.Tensor]:
    """Run one iteration's micro-batches through this rank's model chunks in the order of
    `schedule` (gpipe | 1f1b | interleaved | zbh1; forward_only: forwards alone), exchanging
    activations [micro_batch_size, seq_length (/ tp with sequence parallelism), hidden] in
    `dtype` with the neighbours.
    `stats`, when given, receives "wait_s": the seconds this rank waited on neighbours;
    `timers` times the forward and backward phases."""
    pp, vpp, rank, m = grid.pp, len(chunks), grid.pp_rank, len(microbatches)
    order_of = forward_only_order if forward_only else ORDERS[schedule]
    order = order_of(pp, vpp, rank, m)
    tokens = microbatches[0][0]
    shape = chunks[0].hidden_shape(tokens.shape[0], tokens.shape[1])  # 1/tp of the sequence under sequence parallelism
    p2p = PipelineP2P(grid, shape, dtype)
    # The last backward of each chunk (its last B and last W where they are split) reduces
    # its gradients over DP; earlier ones only accumulate.
    synced = set({(a.chunk, a.weight): a for a in order if not a.forward}.values())
    stores = weight_grad_stores(chunks) if any(a.weight for a in order) else None
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    total = torch.zeros((), dtype=torch.float32, device=grid.device)

    def run(action: Action, received: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """One action; returns the tensor to pass on (None on the first/last virtual stage)."""
        nonlocal total
        chunk = chunks[action.chunk]
        key = (action.chunk, action.microbatch)
        if action.forward:
            tokens, labels = microbatches[action.microbatch]
            x = tokens if chunk.pre_process else received.requires_grad_(not forward_only)  # type: ignore[union-attr]  # received: not the first stage
            with torch.set_grad_enabled(not forward_only), timers("forward"):
                y = chunk(x, tokens=tokens)  # the tokens: where documents start, on every stage
                if chunk.post_process:
                    y = chunk.loss(y, labels).sum() / num_tokens
                    total += y.detach().float()
            if not forward_only:
                saved[key] = (x, y)
            return None if chunk.post_process else y
        assert optimizer is not None  # backward passes: not forward_only
        sync = contextlib.nullcontext() if action in synced else optimizer.no_sync()
        if action.weight:
            assert stores is not None
            with sync, timers("backward"):
                stores[action.chunk].run_next(optimizer.weight_grad_sink)
            return None
        x, y = saved.pop(key)
        with sync, stores[action.chunk].defer() if stores else contextlib.nullcontext(), timers("backward"):
            if chunk.post_process:
                optimizer.scale_loss(y).backward()
            else:
                torch.autograd.backward(y, received)
        return None if chunk.pre_process else x.grad

    # Run this rank's plan: actions, and between them batches that send what the last
    # action produced and receive what the neighbours produced at the same step.
    outbox: dict[Action, torch.Tensor] = {}  # keyed by the action that consumes the tensor
    for step in pipeline_plan(order_of, pp, vpp, rank, m):
        if isinstance(step, Action):
            fed = message_source(step, pp, vpp, rank) is not None
            out = run(step, p2p.take(step) if fed else None)
            target = message_target(step, pp, vpp, rank)
            if target is not None:
                assert out is not None  # an action with a receiver produces its tensor
                outbox[target[1]] = out
        else:
            p2p.exchange([(grid.stage_rank(t.peer), outbox.pop(t.key)) for t in step if t.send],
                         [(grid.stage_rank(t.peer), t.key) for t in step if not t.send])
    p2p.finish()
    if stats is not None:
        stats["wait_s"] = p2p.wait_seconds
    return total if grid.is_last_stage else None
