"""The experts' folding of the grid (issue 45, 2), as pure functions of the degrees: etp x ep x
edp = tp x cp x dp in each pipeline stage, etp fastest, then ep, then edp, pp outermost; the
dense order untouched; a layout that does not divide refused with the nearest valid values.
No processes: the ranks each group would hold are computed, not built."""

from __future__ import annotations

import pytest

import megazero.parallel.grid as grid_module
from megazero.config.rules import expert_grid_problem
from megazero.parallel.grid import ProcessGrid


def _grid(tp: int, cp: int, dp: int, pp: int, ep: int, etp: int = 0) -> ProcessGrid:
    return ProcessGrid(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp)


@pytest.mark.parametrize("layout, groups", [
    # tp 2 x dp 4, ep 2, etp 1: experts split over the two tp ranks, replicated over dp.
    ((2, 1, 4, 1, 2, 1), {"expert_tp": [[r] for r in range(8)], "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
                          "expert_dp": [[0, 2, 4, 6], [1, 3, 5, 7]]}),
    # tp 2 x dp 4, ep 4, etp 1: ep spans tp and dp ranks.
    ((2, 1, 4, 1, 4, 1), {"expert_tp": [[r] for r in range(8)], "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
                          "expert_dp": [[0, 4], [1, 5], [2, 6], [3, 7]]}),
    # tp 2 x dp 4, ep 2, etp = tp: expert_tp is the tp group, ep runs over dp.
    ((2, 1, 4, 1, 2, 0), {"expert_tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
                          "expert_dp": [[0, 4], [1, 5], [2, 6], [3, 7]]}),
    # tp 1 x cp 2 x dp 2, ep 4: ep spans the context- and data-parallel ranks.
    ((1, 2, 2, 1, 4, 1), {"expert_tp": [[0], [1], [2], [3]], "ep": [[0, 1, 2, 3]], "expert_dp": [[0], [1], [2], [3]]}),
    # tp 2 x cp 2 x dp 1 x pp 2, ep 2, etp 1: each pipeline stage folds its own 4 ranks.
    ((2, 2, 1, 2, 2, 1), {"expert_tp": [[r] for r in range(8)], "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
                          "expert_dp": [[0, 2], [1, 3], [4, 6], [5, 7]]}),
])
def test_expert_groups_fold_each_stage(layout, groups):
    tp, cp, dp, pp, ep, etp = layout
    grid = _grid(*layout)
    assert grid.etp * grid.ep * grid.edp == tp * cp * dp
    for kind, expected in groups.items():
        assert grid.group_ranks(kind) == expected, kind
    stage = tp * cp * dp
    for kind in groups:  # every rank in exactly one group of each kind, within its own pipeline stage
        members = sorted(r for g in grid.group_ranks(kind) for r in g)
        assert members == list(range(grid.world_size))
        assert all(len({r // stage for r in g}) == 1 for g in grid.group_ranks(kind))


@pytest.mark.parametrize("layout", [(2, 1, 4, 1, 2, 1), (2, 1, 4, 1, 4, 1), (2, 1, 4, 1, 2, 2), (1, 2, 2, 1, 4, 1),
                                    (2, 2, 1, 2, 2, 1), (4, 2, 2, 2, 4, 2), (2, 1, 2, 1, 1, 2)])
def test_expert_rank_formula_round_trips_and_keeps_the_dense_order(layout):
    tp, cp, dp, pp, ep, etp = layout
    grid, dense = _grid(*layout), ProcessGrid(tp=tp, pp=pp, dp=dp, cp=cp)
    for r in range(grid.world_size):
        c = grid.expert_coords(r)
        assert grid.expert_rank_of(c.etp, c.ep, c.edp, c.pp) == r
        assert c.pp == grid.coords(r).pp  # the folding stays inside the pipeline stage
        assert grid.coords(r) == dense.coords(r)  # ep changes no dense coordinate
    for kind in ("tp", "cp", "dp", "dp_cp", "pp", "stage", "embed"):
        assert grid.group_ranks(kind) == dense.group_ranks(kind), kind


def test_etp_fastest_then_ep_then_edp_then_pp():
    grid = _grid(2, 2, 2, 2, 2, 2)  # etp 2, ep 2, edp 2, pp 2
    moves = []
    for r in range(1, grid.world_size):
        a, b = grid.expert_coords(r - 1), grid.expert_coords(r)
        moves += [d for d in ("etp", "ep", "edp", "pp") if getattr(a, d) != getattr(b, d) and d not in moves]
    assert moves == ["etp", "ep", "edp", "pp"]


@pytest.mark.parametrize("layout, message", [
    ((2, 1, 4, 3, 0, 0), "parallel.ep (3) x parallel.etp (2) must divide the ranks of a pipeline stage, tp x cp x dp "
                         "(2 x 1 x 4 = 8); try ep 2 or 4"),
    ((2, 1, 4, 16, 1, 0), "parallel.ep (16) x parallel.etp (1) must divide the ranks of a pipeline stage, tp x cp x dp "
                          "(2 x 1 x 4 = 8); try ep 8"),
    ((1, 2, 3, 1, 4, 0), "parallel.etp (4) must divide the ranks of a pipeline stage, tp x cp x dp (1 x 2 x 3 = 6); "
                         "try etp 3 or 6"),
    ((2, 1, 4, 4, 1, 6), "parallel.ep (4) must divide model.num_experts (6): each EP rank holds whole experts; "
                         "try ep 2"),
])
def test_a_layout_that_does_not_divide_names_the_nearest_valid_values(layout, message):
    tp, cp, dp, ep, etp, experts = layout
    assert expert_grid_problem(tp, cp, dp, ep, etp or tp, experts) == message
    if not experts:  # the grid refuses by the same rule
        with pytest.raises(ValueError, match=r"^parallel\.e"):
            _grid(tp, cp, dp, 1, ep, etp)


def test_a_dense_layout_creates_no_expert_group(monkeypatch):
    """At ep 1 and etp = tp the expert groups are the dense groups (no new communicator, so a
    dense run is unchanged); with ep 4 only the groups that differ from every dense one are created."""
    created: list[list[int]] = []

    def record(ranks, world_size, timeout):  # a group of one gets no communicator: not recorded
        if len(ranks) == 1:
            return None
        created.append(ranks)
        return object()

    monkeypatch.setattr(grid_module, "_new_group", record)
    monkeypatch.setattr(grid_module.dist, "new_group", lambda ranks, timeout=None: object())
    dense_kinds = ("tp", "dp", "pp", "embed", "stage", "cp", "dp_cp")
    for ep, etp in ((1, 0), (4, 1)):
        created.clear()
        grid = _grid(2, 2, 2, 1, ep, etp)
        grid.build_groups()
        dense = [g for kind in dense_kinds for g in grid.group_ranks(kind) if len(g) > 1] + [list(range(8))]
        if ep == 1:
            assert created == dense
            assert grid.expert_tp_group is grid.tp_group and grid.expert_dp_group is grid.dp_cp_group
            assert grid.ep_group.ranks == [0] and grid.ep_group.pg is None
        else:  # etp 1: groups of one; ep [0, 1, 2, 3], [4, 5, 6, 7] are new; expert_dp [0, 4], ... are the dp groups
            assert created == dense + [[0, 1, 2, 3], [4, 5, 6, 7]]
            assert grid.expert_dp_group is grid.dp_group and grid.ep_group.ranks == [0, 1, 2, 3]
