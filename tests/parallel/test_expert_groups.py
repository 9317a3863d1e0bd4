"""The experts' groups built on gloo ranks (issue 45, 2): four ranks, dp 4 folded as ep 2 x
expert-dp 2, so both groups are new communicators; an all-reduce over each sums exactly its
members' ranks."""

from __future__ import annotations

from helpers import run_distributed


def _sum_ranks_over_expert_groups() -> dict:
    import torch
    import torch.distributed as dist

    from megazero.parallel.comm import all_reduce
    from megazero.parallel.grid import ProcessGrid

    grid = ProcessGrid.create(tp=1, pp=1, ep=2, etp=1)
    out = {"coords": tuple(grid.expert_coords())}
    for kind in ("ep", "expert_dp", "expert_tp"):
        group = grid[kind]
        t = torch.tensor([float(dist.get_rank())])
        all_reduce(t, group)
        out[kind] = (group.ranks, t.item(), group.counter["all_reduce"] > 0 if group.size > 1 else None)
    return out


def test_ep_and_expert_dp_groups_reduce_over_their_members():
    for rank, out in enumerate(run_distributed(_sum_ranks_over_expert_groups, 4, timeout=120)):
        ep = [rank - rank % 2, rank - rank % 2 + 1]  # etp 1, ep fastest: [0, 1] and [2, 3]
        edp = [rank % 2, rank % 2 + 2]  # the ranks of the same expert shard: [0, 2] and [1, 3]
        assert out["coords"] == (0, rank % 2, rank // 2, 0)
        assert out["ep"] == (ep, float(sum(ep)), True)
        assert out["expert_dp"] == (edp, float(sum(edp)), True)
        assert out["expert_tp"] == ([rank], float(rank), None)
