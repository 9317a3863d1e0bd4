"""megazero.harness.spawn, which the distributed tests and the benchmark scripts run their
ranks with: results in rank order, reports as they come, and a failed or dead rank ending the
call with its reason instead of a wait."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from megazero.harness.spawn import RankFailed, run_ranks, stream_ranks


def _rank_and_sum(x: int) -> tuple[int, int, str]:
    t = dist.get_rank() + x
    total = [None] * dist.get_world_size()
    dist.all_gather_object(total, t)
    return dist.get_rank(), sum(total), os.environ["OMP_NUM_THREADS"]


def _count_up(report, n: int) -> str:
    for i in range(n):
        report(i)
    return "dropped"


def _fail_on_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one says no")
    dist.barrier()  # rank 0 waits for a peer that never comes: the harness must not


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_run_ranks_returns_each_ranks_result_in_rank_order():
    assert run_ranks(_rank_and_sum, 2, 10, timeout=120) == [(0, 21, "1"), (1, 21, "1")]


def test_stream_ranks_yields_every_report():
    got = list(stream_ranks(_count_up, 2, 3, timeout=120))
    assert sorted(got) == [(r, i) for r in range(2) for i in range(3)]
    assert [i for r, i in got if r == 1] == [0, 1, 2]  # one rank's reports keep their order


def test_a_raising_rank_ends_the_call_with_its_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed:.*ValueError: rank one says no"):
        run_ranks(_fail_on_one, 2, timeout=120)


def test_a_dead_rank_is_reported_not_waited_for():
    with pytest.raises(RankFailed, match=r"rank 0 died without an answer \(exit code -9\)") as err:
        run_ranks(_die, 1, backend=None)  # no timeout: only noticing the death ends the wait
    assert err.value.exitcode == -signal.SIGKILL
