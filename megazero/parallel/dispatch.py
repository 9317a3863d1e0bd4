"""How routed tokens reach their experts and come back: the token dispatchers.

The MoE layer (model/moe.py) sorts its (token, expert) pairs by expert and hands them to a
dispatcher with the number of pairs per expert. The dispatcher returns the pairs that this
rank's experts compute, grouped by local expert, with their counts; `combine` takes the
experts' outputs back in that order and returns them in the order `dispatch` was given. The
model never knows how the tokens travelled.

- `LocalDispatch`: every expert is on this rank (expert parallelism 1): nothing moves.
- `AllToAllDispatch`: the experts are split over the expert-parallel group (rank r holds the
  r-th E/ep of them); each rank sends each (token, expert) pair to the rank of its expert and
  gets back its experts' outputs: one all-to-all of the counts, one of the tokens, and the
  reverse one to combine. What travels is what is computed.
- `AllGatherDispatch`: every rank gathers the pairs of the whole expert-parallel group, computes
  its experts' share, and a reduce-scatter brings each rank its own pairs' outputs (Megatron's
  allgather dispatcher: more bytes, no count exchange before the tokens move).

Every rank of a group issues the same collectives in the same order, whatever the routing:
a dispatcher's calls depend only on the layer's shape, never on how many tokens an expert got.

Experts split by expert tensor parallelism (etp = tp: each expert's MLP cut over the TP group as
the dense MLP is) run as a TP region around the dispatch: the routed tokens and their
probabilities enter it (`enter_expert_tp`: replicated rows copied, or under sequence parallelism
each rank's rows gathered) and the weighted, combined output leaves it summed over the group
(`leave_expert_tp`: all-reduce, or reduce-scatter back to each rank's rows).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from megazero.parallel.comm import (
    Group,
    all_gather_into,
    all_to_all,
    copy_to_tp,
    exchange_rows,
    reduce_from_tp,
    reduce_scatter_into,
    transposed_pair,
)


class TokenDispatcher(Protocol):
    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """tokens [N, h] sorted by global expert, counts [E] (int64 on the CPU: their sum is N)
        -> this rank's experts' tokens [M, h] grouped by local expert, their counts [E_local]
        (CPU), and what `combine` needs to send the outputs back."""
        ...

    def combine(self, outputs: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' outputs [M, h] in `dispatch`'s returned order -> [N, h] in its input order."""
        ...


class LocalDispatch:
    """All experts live here: dispatch and combine are identities."""

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return tokens, counts, None

    def combine(self, outputs: torch.Tensor, state: Any) -> torch.Tensor:
        return outputs


def _by_local_expert(blocks: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Row indices that regroup rows arriving as blocks [source q][local expert j] (sizes
    `blocks` [P, E_local], block (q, j) starting at row starts[q, j]) by local expert, each
    expert's rows in source order."""
    sources, experts = blocks.shape
    pieces = [torch.arange(int(starts[q, j]), int(starts[q, j] + blocks[q, j]))
              for j in range(experts) for q in range(sources)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


class AllToAllDispatch:
    """Expert parallelism by all-to-all over `ep`: rank r holds experts [r·E/ep, (r+1)·E/ep)."""

    def __init__(self, ep: Group):
        self.ep = ep

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        n = self.ep.size
        send = counts.view(n, -1)  # row q: how many pairs go to each of member q's experts
        recv = torch.empty_like(send, device=tokens.device)
        all_to_all(recv, send.to(tokens.device), self.ep)
        recv = recv.cpu()
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = exchange_rows(tokens, send_rows, recv_rows, self.ep)  # [source][local expert]
        starts = (recv.view(-1).cumsum(0) - recv.view(-1)).view_as(recv)
        order = _by_local_expert(recv, starts).to(tokens.device)
        return arrived[order], recv.sum(0), (order, send_rows, recv_rows)

    def combine(self, outputs: torch.Tensor, state: Any) -> torch.Tensor:
        order, send_rows, recv_rows = state
        arrived_order = outputs[torch.argsort(order)]  # back to [source][local expert]
        return exchange_rows(arrived_order, recv_rows, send_rows, self.ep)


class AllGatherDispatch:
    """Expert parallelism by all-gather over `ep` (each rank's pairs padded to the longest),
    and a reduce-scatter back."""

    def __init__(self, ep: Group):
        self.ep = ep

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        n, h = self.ep.size, tokens.shape[-1]
        every = torch.empty(n * counts.numel(), dtype=counts.dtype, device=tokens.device)
        all_gather_into(every, counts.to(tokens.device), self.ep)
        every = every.cpu().view(n, -1)  # [source, global expert]
        longest = int(every.sum(1).max())
        padded = torch.cat([tokens, tokens.new_zeros(longest - tokens.shape[0], h)])
        gathered = transposed_pair(padded, self.ep, _gather_rows, _reduce_scatter_rows)  # [n · longest, h]
        mine = every.view(n, n, -1)[:, self.ep.rank]  # [source, local expert]
        starts = every.cumsum(1) - every  # each source's expert blocks, from its own first row
        first = starts.view(n, n, -1)[:, self.ep.rank] + torch.arange(n).unsqueeze(1) * longest
        order = _by_local_expert(mine, first).to(tokens.device)
        return gathered[order], mine.sum(0), (order, longest, tokens.shape[0])

    def combine(self, outputs: torch.Tensor, state: Any) -> torch.Tensor:
        order, longest, rows = state
        every = outputs.new_zeros(self.ep.size * longest, outputs.shape[-1]).index_copy(0, order, outputs)
        return transposed_pair(every, self.ep, _reduce_scatter_rows, _gather_rows)[:rows]


def _gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.new_empty((group.size * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_into(out, x.contiguous(), group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // group.size,) + tuple(x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group)
    return out


# ----------------------------------------------------------------------------- replicated tokens
# Ranks that hold the same tokens (tensor-parallel ranks without sequence parallelism) but
# different experts' places in the experts' folding (etp 1: they are ep or expert-dp ranks) must
# not each send every token: an expert would see each token once per replica, and its gradient,
# summed over expert-dp, would count it as often. Each replica routes the same tokens, sends only
# its share of them, and the shares' outputs are gathered back.


def share_rows(rows: int, group: Group) -> slice:
    """This member's share of `rows` rows (ceil-sized shares in member order, the last shorter)."""
    per = -(-rows // group.size)
    return slice(min(rows, group.rank * per), min(rows, (group.rank + 1) * per))


def _own_share(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x[share_rows(x.shape[0], group)].contiguous()


def _gather_shares(x: torch.Tensor, group: Group, rows: int) -> torch.Tensor:
    """Every member's share (padded to the longest) gathered, then cut back to `rows` rows."""
    per = -(-rows // group.size)
    padded = torch.cat([x, x.new_zeros((per - x.shape[0],) + tuple(x.shape[1:]))]) if x.shape[0] < per else x
    out = x.new_empty((group.size * per,) + tuple(x.shape[1:]))
    all_gather_into(out, padded.contiguous(), group)
    return out[:rows]


def token_share(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This member's share of rows that every member of `group` holds alike; backward, every
    member's gradient of its share gathered (each is complete: the rows' consumers downstream
    are replicated too)."""
    if group.size == 1:
        return x
    rows = x.shape[0]
    return transposed_pair(x, group, _own_share, lambda g, grp: _gather_shares(g, grp, rows))


def gather_token_shares(x: torch.Tensor, group: Group, rows: int) -> torch.Tensor:
    """Inverse of `token_share`: every member's share gathered into the `rows` rows; backward,
    this member's share of the (replicated) gradient."""
    if group.size == 1:
        return x
    return transposed_pair(x, group, lambda t, grp: _gather_shares(t, grp, rows), _own_share)


# ----------------------------------------------------------------------------- expert tensor parallelism
# Each expert_tp rank computes its slice of every expert's MLP (c_fc's output rows, c_proj's input
# columns) for the same tokens, so its output is a partial sum and its gradient of the tokens (and,
# through the weighted combine, of their probabilities) is partial too. The router stays outside:
# it runs replicated (or on each rank's own positions under sequence parallelism), so its own
# gradients are whole and must not be summed again.


def enter_expert_tp(rows: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Rows [N, ...] (tokens, their probabilities) entering the experts split over `group`:
    replicated rows as they are, their partial gradients summed in backward; under sequence
    parallelism every rank's rows gathered (rank order), the gradients reduce-scattered back."""
    if group.size == 1:
        return rows
    if sequence_parallel:
        return transposed_pair(rows, group, _gather_rows, _reduce_scatter_rows)
    return copy_to_tp(rows, group)


def gather_expert_tp(rows: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Rows without a gradient (the chosen experts, the capacity's mask) as `enter_expert_tp`
    lays them out."""
    if not sequence_parallel or group.size == 1:
        return rows
    if rows.dtype == torch.bool:  # not every backend gathers booleans
        return _gather_rows(rows.to(torch.uint8), group).bool()
    return _gather_rows(rows, group)


def leave_expert_tp(out: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """The experts' partial output [N', h] summed over `group`: on every rank, or under sequence
    parallelism each rank its own rows of the sum (the transpose of `enter_expert_tp`)."""
    if group.size == 1:
        return out
    if sequence_parallel:
        return transposed_pair(out, group, _reduce_scatter_rows, _gather_rows)
    return reduce_from_tp(out, group)
