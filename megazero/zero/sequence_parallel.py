"""The tensor-parallel all-reduce of gradients that sequence parallelism leaves partial.

Under sequence parallelism (megazero.model.gpt.GPT.apply_sequence_parallel) every
TP-replicated parameter - LayerNorm weights and biases, the position embedding, the
row-parallel biases - is applied to this TP rank's 1/tp of the sequence only, so each TP
rank's gradient of it is a partial sum (Megatron's `sequence_parallel` parameters). One
all-reduce over the TP group after backward completes them.

It runs on this rank's gradient shard after the data-parallel reduction, at every ZeRO
stage alike: the DP reduction and the TP all-reduce are both sums, so their order does not
matter, and at stages 2/3 the full gradients no longer exist by then (each bucket was
reduce-scattered over DP as it filled). That needs the shard to hold the same elements of
the same parameters on every TP rank: the ZeRO layout depends only on parameter shapes and
order, which TP ranks share (each owns an equal shard of every split parameter), and the
constructor checks it once.
"""

from __future__ import annotations

import torch

from megazero.parallel import comm
from megazero.parallel.placement import placement
from megazero.zero.grads import GradientSync
from megazero.zero.partition import FlatLayout, Range


class SequenceParallelGrads:
    """All-reduces the partial gradients of sequence-parallel parameters over TP in one call."""

    def __init__(self, layout: FlatLayout, grads: GradientSync, tp: comm.Group):
        self.grads, self.tp = grads, tp
        # the runs of this rank's gradient shard that belong to parameters placed `sequence_parallel`
        self.ranges = [Range(b.index, start, end - start, offset, decay=False, counted=False)
                       for b, s, start, end, offset in layout.slot_pieces(layout.trainable_buckets())
                       if placement(s.param).sequence_parallel]
        where = [(r.bucket, r.start, r.length, r.shard_offset) for r in self.ranges]
        if any(other != where for other in comm.all_gather_object(where, tp)):
            raise RuntimeError("sequence parallelism: the ZeRO gradient shards of the TP ranks hold different "
                               "pieces of the LayerNorm/bias parameters, so their TP all-reduce would mix them")

    def all_reduce(self) -> None:
        """After the DP reduction, before clipping and the step: one TP all-reduce of every piece."""
        if not self.ranges or self.tp.size == 1:
            return
        views = [self.grads.buffers.view(r) for r in self.ranges]
        flat = torch.cat(views)
        comm.all_reduce(flat, self.tp)
        for view, summed in zip(views, flat.split([v.numel() for v in views])):
            view.copy_(summed)
