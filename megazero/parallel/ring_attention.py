"""Ring attention over the context-parallel group, on the zig-zag layout (context.py).

Rank r of n holds queries, keys and values of sequence chunks r and 2n-1-r (each of L
positions). Its causal attention needs the keys of every earlier position, held by the other
ranks: the K/V blocks travel once around the ring (rank r sends to r+1, receives from r-1),
and each step's transfer is launched before the attention of the block already here, so
communication overlaps compute. At step i rank r holds the block of rank j = (r - i) mod n:

    i = 0    its own chunks: causal attention within the block (positions increase in it)
    j < r    both query chunks come after chunk j and before chunk 2n-1-j:
             all queries against the first half of the block, no mask
    j > r    only query chunk 2n-1-r comes after chunks j and 2n-1-j (both), and chunk r
             after neither: the second half of the queries against the whole block, no mask

so every step after the first costs every rank the same half block (the load balance of
the zig-zag order). The partial outputs merge by the log-sum-exp rule:
lse = logaddexp(lse_a, lse_b), out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).

Backward runs the same ring: the K/V blocks travel again, and with each travels the
gradient of that block's keys and values accumulated by the ranks it has visited, so after
n exchanges it is back with its owner, complete. Each block's share of the gradients comes
from the kernel's backward given the final output and log-sum-exp (attention_block.py).

Attention dropout (`dropout` > 0) drops each block's share of the probabilities with a mask
the block's backward replays (attention_block.py): the merge is linear in the dropped
probabilities, and the log-sum-exp it uses is the undropped one, so the result is dropout
on the whole row's softmax, as in one process. The masks come from the caller's stream,
which differs per cp rank (a rank's queries are its own positions).

Grouped-query attention: K/V carry fewer heads than q (H/G queries share each K/V head).
The ring carries the grouped blocks, so the bytes shrink with the groups; each block is
widened to q's heads only for the kernel (aten's flash kernels take equal head counts) and
its K/V gradient folded back by summing over each group's queries.

Bytes each rank sends per layer: forward (n-1) K/V blocks of 2 x (s/n) x h; backward as many
K/V blocks again plus n gradient blocks (fp32 for 16-bit K/V).
"""

from __future__ import annotations

from typing import Optional

import torch

from megazero.parallel import comm
from megazero.parallel.attention_block import BlockKernel, accumulation_dtype, default_scale, pick


def _pass_on(send: torch.Tensor, group: comm.Group) -> tuple[torch.Tensor, list]:
    """Send `send` to the next rank of the ring and receive the previous rank's (same shape):
    returns the receive buffer and the handles to wait before reading it (or changing `send`)."""
    n, r = group.size, group.rank
    incoming = torch.empty_like(send)
    return incoming, comm.batch_p2p([("send", send, group.ranks[(r + 1) % n]),
                                     ("recv", incoming, group.ranks[(r - 1) % n])], group)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out, lse (accumulation dtype) <- the log-sum-exp merge of themselves with a block's partial result, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(block_out.to(out.dtype) * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _block_of(step: int, group: comm.Group) -> tuple[str, str]:
    """(query rows, key rows) of the local chunks that step `step` attends with (see above):
    each "both", "first" or "second" of the two chunks."""
    j, r = (group.rank - step) % group.size, group.rank
    if step == 0:
        return "both", "both"
    return ("both", "first") if j < r else ("second", "both")


def _block(step: int, group: comm.Group, q: torch.Tensor, kv: torch.Tensor, rep: int) -> tuple:
    """_block_of's rows and columns, and q, k, v of them: contiguous, k and v widened to q's heads."""
    rows, cols = _block_of(step, group)
    k, v = (_widen(_part(t, cols), rep).contiguous() for t in (kv[0], kv[1]))
    return rows, cols, _part(q, rows).contiguous(), k, v


def _part(x: torch.Tensor, which: str, dim: int = -2) -> torch.Tensor:
    """A view of both chunks of `x` along the sequence `dim`, or of the first or second."""
    if which == "both":
        return x
    half = x.shape[dim] // 2
    return x.narrow(dim, 0 if which == "first" else half, half)


def _widen(x: torch.Tensor, rep: int) -> torch.Tensor:
    """Grouped K/V heads [b, G, L, d] -> [b, G x rep, L, d], each repeated for its group's queries."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold(dx: torch.Tensor, rep: int) -> torch.Tensor:
    """The inverse of _widen for gradients: a group's queries' shares summed, [b, G, L, d]."""
    if rep == 1:
        return dx
    b, h, length, d = dx.shape
    return dx.view(b, h // rep, rep, length, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: comm.Group, kernel: BlockKernel, scale: float, dropout: float):
        n, rep = group.size, q.shape[1] // k.shape[1]
        kv = torch.stack([k, v]).contiguous()
        acc = accumulation_dtype(q.dtype)
        # Laid out [b, s, h, d] as SDPA's output is, so that the caller's merge of the heads into
        # [b, s, h x d] is a view (in fp32 the output *is* this buffer: no second copy kept).
        b, h, sq, d = q.shape
        out = torch.zeros(b, sq, h, d, dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        extras = []
        for step in range(n):
            if step + 1 < n:  # the next block travels while this one is attended
                incoming, works = _pass_on(kv, group)
            rows, _, qb, kb, vb = _block(step, group, q, kv, rep)
            block_out, block_lse, extra = kernel.forward(qb, kb, vb, step == 0, scale, dropout)
            extras.append(extra)
            _merge(_part(out, rows), _part(lse, rows, -1), block_out, block_lse)
            if step + 1 < n:
                _wait(works)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.scale, ctx.extras, ctx.dropout = group, kernel, scale, extras, dropout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, kernel, scale, n = ctx.group, ctx.kernel, ctx.scale, ctx.group.size
        rep = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        kv = torch.stack([k, v]).contiguous()
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        # The gradient of the block held now, as it arrives from the ranks it visited before.
        dkv_in, dkv_works = torch.zeros(kv.shape, dtype=acc, device=q.device), []
        for step in range(n):
            if step + 1 < n:
                incoming, works = _pass_on(kv, group)
            rows, cols, qb, kb, vb = _block(step, group, q, kv, rep)
            dqb, dkb, dvb = kernel.backward(_part(dout, rows), qb, kb, vb, _part(out, rows), _part(lse, rows, -1),
                                            ctx.extras[step], step == 0, scale, ctx.dropout)
            _part(dq, rows).add_(dqb)
            _wait(dkv_works)
            dkv = dkv_in
            _part(dkv[0], cols).add_(_fold(dkb, rep))
            _part(dkv[1], cols).add_(_fold(dvb, rep))
            # On to the next rank, who holds this block at the next step; after the last step
            # the next rank is the block's owner.
            dkv_in, dkv_works = _pass_on(dkv, group)
            if step + 1 < n:
                _wait(works)
                kv = incoming
        _wait(dkv_works)
        dk, dv = dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: comm.Group,
                   kernel: Optional[str] = None, scale: Optional[float] = None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's zig-zag chunks, q [b, h, 2L, d] and k, v [b, g, 2L, d]
    (g divides h: grouped-query attention), against the whole sequence spread over `group`;
    the output [b, h, 2L, d] of this rank's queries. `kernel`:
    the block kernel's name (default: attention_block.pick); `dropout`: attention dropout's p."""
    chosen = pick(q.device, q.dtype, kernel, dropout)
    return _RingAttention.apply(q, k, v, group, chosen, default_scale(q.shape[-1]) if scale is None else scale,
                                dropout)
