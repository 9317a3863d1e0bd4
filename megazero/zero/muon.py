"""Muon on ZeRO's flat shards: each weight matrix orthogonalised whole, once per step.

Muon (optim.name muon) keeps one momentum buffer per element and updates a weight matrix W
(nn.Linear's (out, in) orientation) as torch.optim.Muon does:

    B <- lerp(B, G, 1 - momentum)                 elementwise, on each rank's shard
    U <- lerp(G, B, momentum)  (Nesterov; else B)
    O <- NewtonSchulz(U)                          the whole matrix (bf16; fp32 in fp32 training)
    W <- W (1 - lr wd) - lr adjust(out, in) O     elementwise again

The elementwise parts run where the optimizer state lives (its shard, on the device or the
host), using the state's `exp_avg` as the buffer. Newton-Schulz needs each matrix whole, while
ZeRO cuts flat buckets over dp x cp and tensor parallelism cuts matrices over tp; fused
matrices (q|k|v, SwiGLU's gate|up) are orthogonalised part by part, and an MoE layer's expert
weights ([E, out, in], model/moe.py) expert by expert: each expert's matrix (its gate and up
apart) is a matrix of its own, with the LR factor of its own shape. `MuonExchange` gives each
matrix one owner among the ranks of its pipeline stage (the grid's `stage` group: tp x cp x
dp), balancing Newton-Schulz FLOPs, and per owner: every rank writes the elements of U it holds
into a zero buffer of that owner's matrices, a `reduce` sums them into the owner (each element
has exactly one contributor, so the sum is exact), the owners orthogonalise their matrices at
once, and a `broadcast` per owner returns O, from which every rank takes its elements. Every
rank issues the same collectives in the same order, and the single process runs the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from megazero.parallel import comm
from megazero.parallel.placement import Placement, placement
from megazero.zero.partition import FlatLayout, Range

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic iteration
NS_EPS = 1e-7
NS_BATCH_NUMEL = 1 << 24  # at most this many elements of same-shaped matrices orthogonalised in one batch
# The weight matrices Muon takes: each block's attention (fused q|k|v and output) and MLP (up,
# or fused gate|up, and down) projections; in an MoE layer its experts' and its shared expert's.
# Embeddings, the output layer, norms, biases, the router and the shared expert's gate are AdamW's.
MATRICES = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight",
            ".mlp.experts.c_fc.weight", ".mlp.experts.c_proj.weight", ".mlp.shared_expert.c_fc.weight",
            ".mlp.shared_expert.c_proj.weight")


def is_muon_matrix(name: str) -> bool:
    return name.startswith("transformer.h.") and name.endswith(MATRICES)


def orthogonalize(u: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton-Schulz: U's nearest semi-orthogonal matrix, approximately (torch.optim.Muon's
    iteration on the wide orientation), in U's dtype: bf16 as torch's, or fp32 (fp32 training,
    where bf16's rounding of U would turn summation-order differences between layouts into
    differences of the update). A 3-D U is a batch of same-shaped matrices, each on its own."""
    a, b, c = NS_COEFFICIENTS
    x = u
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x / x.norm().clamp(min=NS_EPS)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    mul_add = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mul_add(x, mul_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def ns_dtype(precision: str) -> torch.dtype:
    """Newton-Schulz's dtype for train.precision: fp32 runs stay fp32 (layouts agree to 1e-5,
    and within 1e-4 of torch.optim.Muon's bf16), 16-bit runs use bf16 as torch.optim.Muon does."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def lr_factor(shape: tuple[int, int], rule: str) -> float:
    """optim.muon_adjust_lr: the LR multiplier of an (out, in) matrix."""
    rows, cols = shape
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def ns_flops(shape: tuple[int, int], steps: int) -> int:
    """FLOPs (2 per multiply-add) of Newton-Schulz on an (out, in) matrix, on the wide
    orientation X (m x n, m <= n); per iteration X = aX + (bA + cA A) X with A = X X^T:
    A 2m^2 n, A A 2m^3, its sum with bA times X 2m^2 n (the elementwise terms left out)."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def momentum_(grads: list[torch.Tensor], bufs: list[torch.Tensor], momentum: float, nesterov: bool) -> None:
    """The elementwise first half, in place: each buffer moves toward its gradient, and the
    gradient tensor becomes the update to orthogonalise."""
    for g, buf in zip(grads, bufs):
        buf.lerp_(g, 1 - momentum)
        if nesterov:
            g.lerp_(buf, momentum)
        else:
            g.copy_(buf)


@dataclass
class Matrix:
    """One matrix Muon orthogonalises: rows or columns [lo, hi) along `dim` of a full parameter."""

    name: str
    where: Placement
    dim: int
    lo: int
    hi: int
    shape: tuple[int, int]
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)
    """Where this rank holds it: (local flat start, end, along-dim offset in the matrix, rows or
    columns), each a contiguous run of this TP rank's flattened parameter."""


def split_matrices(name: str, where: Placement, shape: tuple[int, ...], tp_rank: int, tp: int,
                   ep: tuple[int, int] = (0, 1)) -> list[Matrix]:
    """The matrices Muon orthogonalises in parameter `name` (TP-local `shape`): one per fused
    block (q|k|v, gate|up), whole over TP, with where this TP rank holds each; of an expert
    weight, one per block of each expert."""
    if where.experts:
        return expert_matrices(name, where, shape, tp_rank, tp, ep)
    dim = where.dim if where.dim is not None else 0
    full = where.full_shape
    # The full parameter's blocks along `dim` (q|k|v, gate|up: one matrix each) and this
    # TP rank's part of each, which it stores one after another along `dim`.
    blocks = where.ranges(0, 1) if where.sharded else [(0, full[dim])]
    held = where.ranges(tp_rank, tp) if where.sharded else [(0, full[dim])]
    cols = math.prod(shape) // shape[0]  # elements per row of the TP-local parameter
    out, local = [], 0
    for (lo, hi), (hlo, hhi) in zip(blocks, held):
        mshape = (hi - lo, full[1]) if dim == 0 else (full[0], hi - lo)
        m = Matrix(name, where, dim, lo, hi, mshape)
        n = hhi - hlo
        if dim == 0:  # rows: a contiguous run of the flattened local parameter
            m.pieces.append((local * cols, (local + n) * cols, hlo - lo, n))
        else:  # columns: only whole local parameters are contiguous
            if len(blocks) != 1:
                raise NotImplementedError(f"{name}: matrices fused along the input dimension")
            m.pieces.append((0, math.prod(shape), hlo - lo, n))
        local += n
        out.append(m)
    return out


def expert_matrices(name: str, where: Placement, shape: tuple[int, ...], tp_rank: int, tp: int,
                    ep: tuple[int, int] = (0, 1)) -> list[Matrix]:
    """The matrices of an expert weight [E, out, in]: per expert of the layer, all E of them in
    order (the same list on every rank of the exchange), each of its `stride` blocks (gate, up)
    split over the expert-TP ranks as a dense matrix of that placement is (`tp_rank` of `tp`).
    This rank holds pieces of its own experts only (`ep`: its rank and size in the
    expert-parallel group), each expert's TP-local part a contiguous run of the parameter."""
    one = Placement(where.full_shape[1:], 0, where.stride) if where.dim is None else \
        Placement(where.full_shape[1:], where.dim - 1, where.stride, parts=where.parts)
    if where.dim is None:  # whole experts: their gate | up blocks are still matrices of their own
        tp_rank, tp = 0, 1
    lo, hi = where.expert_range(*ep)
    local = tuple(shape[1:])
    per_expert = math.prod(local)
    out = []
    for e in range(where.experts):
        for m in split_matrices(name, one, local, tp_rank, tp):
            at = (e - lo) * per_expert
            m.pieces = [(start + at, end + at, a, n) for start, end, a, n in m.pieces] if lo <= e < hi else []
            out.append(m)
    return out


def assign_owners(costs: Sequence[int], owners: int) -> list[int]:
    """Each matrix's owner: largest cost first to the least loaded owner (ties: the lower
    index), the same on every rank."""
    load = [0] * owners
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner[i] = min(range(owners), key=lambda o: (load[o], o))
        load[owner[i]] += costs[i]
    return owner


class MuonExchange:
    """Gathers each matrix's update to its owner, orthogonalises, returns the result (see above)."""

    def __init__(self, layout: FlatLayout, muon: frozenset[str], group: comm.Group, tp_rank: int, tp: int,
                 contributes: bool, device: torch.device, steps: int, rule: str, dtype: torch.dtype,
                 ep: tuple[int, int] = (0, 1)) -> None:
        self.group, self.contributes, self.device, self.steps, self.rule = group, contributes, device, steps, rule
        self.dtype = dtype  # Newton-Schulz's, and the buffers' (each element has one contributor: exact in any)
        # A Muon parameter's elements in this rank's shard: (offset in the flattened TP-local
        # parameter, shard range) pieces.
        self.pieces: dict[str, list[tuple[int, Range]]] = {}
        matrices: list[Matrix] = []
        for b, s in layout.slots():
            if s.name in muon and b.trainable and s.name not in self.pieces:
                self.pieces[s.name] = []
                matrices += split_matrices(s.name, placement(s.param), s.shape, tp_rank, tp, ep)
        for b, s, start, end, offset in layout.slot_pieces(layout.trainable_buckets()):
            if s.name in self.pieces:
                r = Range(b.index, start, end - start, offset, True, True, True)
                self.pieces[s.name].append((start - s.offset, r))
        # Matrices per owner, largest Newton-Schulz cost first to the least loaded (ties: the lower
        # index), each owner's by shape, then in model order (same-shaped matrices lie side by side
        # in its buffer, to be orthogonalised as a batch): the same on every rank.
        owner = assign_owners([ns_flops(m.shape, steps) for m in matrices], group.size)
        self.owned = [sorted((m for i, m in enumerate(matrices) if owner[i] == o), key=lambda m: m.shape)
                      for o in range(group.size)]

    # ------------------------------------------------------------------ the step

    def _buffer(self, matrices: Sequence[Matrix], zero: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One owner's matrices laid end to end in one buffer, and a view of each."""
        sizes = [math.prod(m.shape) for m in matrices]
        flat = (torch.zeros if zero else torch.empty)(sum(sizes), dtype=self.dtype, device=self.device)
        return flat, [part.view(m.shape) for part, m in zip(flat.split(sizes), matrices)]

    def step(self, views: Callable[[Range], torch.Tensor]) -> None:
        """Replace U (in the gradient ranges `views` gives) by lr_factor x O for every Muon
        element of this rank's shard (collective over the stage group)."""
        mine: Optional[tuple[torch.Tensor, list[torch.Tensor]]] = None
        for o, matrices in enumerate(self.owned):
            flat, mats = self._buffer(matrices, zero=True)
            if self.contributes:
                for m, view in zip(matrices, mats):
                    self._gather(m, view, views)
            comm.reduce(flat, o, self.group)
            if o == self.group.rank:
                mine = flat, mats
        if mine is not None:
            self._orthogonalize(self.owned[self.group.rank], *mine)
        for o, matrices in enumerate(self.owned):
            flat, mats = mine if o == self.group.rank and mine is not None else self._buffer(matrices, zero=False)
            comm.broadcast(flat, o, self.group)
            for m, view in zip(matrices, mats):
                self._return(m, view, views)

    def _gather(self, m: Matrix, view: torch.Tensor, views: Callable[[Range], torch.Tensor]) -> None:
        """This rank's elements of U into matrix m's `view` (rows of a TP part are contiguous
        there: copied straight in; columns through a staging copy of the part)."""
        for part, runs in self._held(m, view):
            flat = part.view(-1) if part.is_contiguous() else part.new_zeros(part.numel())
            for lo, hi, glo, ghi, r in runs:
                flat[lo:hi].copy_(views(r)[glo:ghi])
            if not part.is_contiguous():
                part.copy_(flat.view(part.shape))

    def _return(self, m: Matrix, view: torch.Tensor, views: Callable[[Range], torch.Tensor]) -> None:
        """lr_factor x O of this rank's elements of matrix m into the gradient ranges (in fp32:
        converted, then scaled)."""
        scale = lr_factor(m.shape, self.rule)
        for part, runs in self._held(m, view):
            values = part.reshape(-1)  # a view for rows, a copy for columns
            for lo, hi, glo, ghi, r in runs:
                out = views(r)[glo:ghi]
                out.copy_(values[lo:hi])
                out.mul_(scale)

    def _orthogonalize(self, matrices: list[Matrix], flat: torch.Tensor, mats: list[torch.Tensor]) -> None:
        """Newton-Schulz on this owner's matrices in place, same-shaped neighbours (adjacent in
        `flat`) as batches of at most NS_BATCH_NUMEL elements."""
        i, at = 0, 0
        while i < len(matrices):
            shape, numel = matrices[i].shape, mats[i].numel()
            j = i + 1
            while j < len(matrices) and matrices[j].shape == shape and (j - i + 1) * numel <= NS_BATCH_NUMEL:
                j += 1
            batch = flat[at: at + (j - i) * numel]
            if j - i == 1:
                mats[i].copy_(orthogonalize(mats[i], self.steps))
            else:
                batch.view(j - i, *shape).copy_(orthogonalize(batch.view(j - i, *shape), self.steps))
            i, at = j, at + (j - i) * numel

    def _held(self, m: Matrix, view: torch.Tensor
              ) -> Iterator[tuple[torch.Tensor, list[tuple[int, int, int, int, Range]]]]:
        """For each run of m's TP-local parameter that this rank's shard holds pieces of: what
        this TP rank holds of m (a view of its `view`), and per piece (lo, hi) in the run, (lo,
        hi) in a shard range, and that range."""
        for start, end, at, n in m.pieces:
            runs = []
            for off, r in self.pieces[m.name]:
                lo, hi = max(start, off), min(end, off + r.length)
                if lo < hi:
                    runs.append((lo - start, hi - start, lo - off, hi - off, r))
            if runs:
                yield view.narrow(m.dim, at, n), runs
