"""Context parallelism (parallel.cp): which positions of a sequence each cp rank holds, and
attention over the whole sequence from those pieces, by ring (ring_attention.py) or Ulysses.

The layout, stated once (`zigzag_positions`): the sequence of s positions is cut into 2 x cp
chunks of L = s / (2 cp); rank r holds chunks r and 2cp-1-r, in that order. Under causal
attention a late chunk attends to many keys and an early one to few, so pairing them gives
every rank the same work (Megatron's and torchtitan's load balancing). Everything that is
per position follows this one layout: the data loader's token and label slices, the position
ids of the embedding, and Ulysses' reordering.

Ulysses (DeepSpeed-Ulysses): before attention one all-to-all turns q, k, v from this rank's
positions of all its heads, [b, H, s/cp, d], into all positions of H/cp of the heads,
[b, H/cp, s, d]; the sequence is put in natural order, attended causally as in a single
process, put back, and a second all-to-all returns [b, H, s/cp, d]. Its backward is the same
pair of all-to-alls reversed. Bytes each rank sends per layer and direction: (cp-1)/cp of q,
k, v and the output, each (s/cp) x h.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from megazero.parallel import comm
from megazero.parallel.ring_attention import ring_attention

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""Causal attention of whole sequences, q, k, v [b, h, s, d] -> [b, h, s, d] (with dropout)."""


def zigzag_positions(seq_len: int, rank: int, size: int) -> np.ndarray:
    """The positions (int64, in order) that cp rank `rank` of `size` holds: chunks rank and
    2 size - 1 - rank of the 2 size chunks of a `seq_len` sequence."""
    if seq_len % (2 * size):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 x cp = {2 * size}")
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return np.concatenate([np.arange(first, first + chunk), np.arange(second, second + chunk)])


def shard_sequence(x: np.ndarray, rank: int, size: int) -> np.ndarray:
    """This cp rank's positions of `x` [b, s, ...] (tokens or labels): [b, s / size, ...]."""
    return x if size == 1 else x[:, zigzag_positions(x.shape[1], rank, size)]


# ----------------------------------------------------------------------------- Ulysses


def _seq_to_heads(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """[b, H, S, d] (this rank's S positions) -> [b, H/n, n S, d] (every rank's positions,
    rank-major, of this rank's H/n heads)."""
    n, (b, heads, s, d) = group.size, x.shape
    send = x.reshape(b, n, heads // n, s, d).transpose(0, 1).contiguous()  # piece i: head group i
    received = torch.empty_like(send)
    comm.all_to_all(received, send, group)  # piece i: rank i's positions of this rank's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // n, n * s, d)


def _heads_to_seq(y: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """The inverse of _seq_to_heads: [b, H/n, n S, d] -> [b, H, S, d]."""
    n, (b, heads, ns, d) = group.size, y.shape
    send = y.reshape(b, heads, n, ns // n, d).permute(2, 0, 1, 3, 4).contiguous()  # piece i: rank i's positions
    received = torch.empty_like(send)
    comm.all_to_all(received, send, group)  # piece i: this rank's positions of head group i
    return received.transpose(0, 1).reshape(b, n * heads, ns // n, d)


@functools.lru_cache(maxsize=8)
def _orders(seq: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered order of a sequence's positions (as an all-gather over the cp ranks lays
    them out) and its inverse (position p sits at index natural[p] when gathered): the same
    for every layer and micro-batch, so built once."""
    gathered = torch.as_tensor(np.concatenate([zigzag_positions(seq, r, n) for r in range(n)]), device=device)
    natural = torch.empty_like(gathered)
    natural[gathered] = torch.arange(seq, device=device)
    return gathered, natural


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: comm.Group,
                      attend: Attend) -> torch.Tensor:
    """Causal attention of this rank's zig-zag positions, q [b, H, s/n, d] and k, v [b, G, s/n,
    d] (G divides H: grouped-query attention), by Ulysses (see above); `attend` runs on whole
    sequences of H/n heads (and their K/V groups). Returns [b, H, s/n, d]."""
    b, n = q.shape[0], group.size
    gathered, natural = _orders(q.shape[2] * n, n, q.device)
    if k.shape[1] == q.shape[1]:
        qkv = comm.transposed_pair(torch.stack([q, k, v]).flatten(0, 1), group, _seq_to_heads, _heads_to_seq)
        q, k, v = qkv.index_select(2, natural).unflatten(0, (3, b)).unbind(0)
    else:
        q, k, v = _grouped_to_heads(q, k, v, group, natural)
    y = attend(q, k, v).index_select(2, gathered)
    return comm.transposed_pair(y, group, _heads_to_seq, _seq_to_heads)


def _grouped_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: comm.Group,
                      natural: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ulysses' first all-to-all for grouped-query attention, q [b, H, S, d] and k, v
    [b, G, S, d]: rank i receives q heads i H/n.. and the K/V groups they read, i G/n..
    (heads of one group are adjacent, so a slice of the groups serves a slice of the heads).
    When G is not a multiple of n, K/V are first widened to one head per query (the only
    case that repeats K/V heads). Still one all-to-all: the pieces travel as one tensor,
    arranged so that piece i is [q_i | k_i | v_i]."""
    n, (b, heads, s, d) = group.size, q.shape
    if k.shape[1] % n:
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    groups = k.shape[1]
    pieces = [x.reshape(b, n, x.shape[1] // n, s, d) for x in (q, k, v)]
    mixed = torch.cat(pieces, dim=2).view(b, heads + 2 * groups, s, d)
    whole = comm.transposed_pair(mixed, group, _seq_to_heads, _heads_to_seq).index_select(2, natural)
    return whole.split([heads // n, groups // n, groups // n], dim=1)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: comm.Group, impl: str,
                      attend: Attend, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this cp rank's positions against the whole sequence: parallel.cp_impl
    ring (with attention dropout `dropout`, drawn from the default stream) or ulysses (`attend`,
    whole-sequence attention with its dropout, is Ulysses' core)."""
    if impl == "ring":
        return ring_attention(q, k, v, group, dropout=dropout)
    if impl == "ulysses":
        return ulysses_attention(q, k, v, group, attend)
    raise ValueError(f"parallel.cp_impl {impl!r} is not ring or ulysses")
