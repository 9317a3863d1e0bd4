"""One collective order on every rank: what each rank issues on each process group is a
function of the schedule alone, never of I/O or thread timing (NCCL matches collectives by
position on a communicator, so two ranks that differ hang or mix buffers; gloo's extra
communicator for the DP reduce-scatters hides it, the recorder does not).

Each rank trains (two steps and an evaluation) with random sleeps from its own seed in
NVMe reads, host loads and copies, background checkpoint writes, and compute (every
module's forward, every gradient's accumulation), records every call (comm.record_calls), and every member of a group must
have recorded the same sequence on it; the sends one rank recorded to a peer must be that
peer's receives. Before stage 3 had fixed issue points, the NVMe case failed every time: a
prefetch all-gather went out before or after a gradient reduce-scatter depending on
whether that rank's read was done."""

from __future__ import annotations

from collections import defaultdict

import pytest

from helpers import make_config, run_distributed

TINY = ["--model.seq_length", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
        "--zero.sub_group_size", "5000", "--zero.bucket_size", "20000", "--train.iters", "2",
        "--train.eval_interval", "2", "--train.eval_iters", "1"]
# Stage 3 prefetches two units: at the next unit's hook the gather two ahead is due while its
# read may or may not be done, the case that used to depend on timing.
STAGE3 = ["--zero.stage", "3", "--zero.prefetch", "2"]
NVME = ["--zero.offload_param", "nvme", "--zero.offload_optimizer", "nvme", "--zero.buffer_count", "2"]

CASES = {
    "stage 0": ["--zero.stage", "0"],
    "stage 1": ["--zero.stage", "1"],
    "stage 2": ["--zero.stage", "2"],
    "stage 3": STAGE3,
    "stage 3, param cpu": STAGE3 + ["--zero.offload_param", "cpu"],
    "stage 3, param + optimizer nvme": STAGE3 + NVME,
    "pp 2 zbh1, stage 3, param + optimizer nvme": STAGE3 + NVME + ["--parallel.pp", "2",
                                                                   "--parallel.schedule", "zbh1"],
    "pp 2 zbh1, stage 1": ["--zero.stage", "1", "--parallel.pp", "2", "--parallel.schedule", "zbh1"],
    "tp 2 sequence parallel, stage 2": ["--zero.stage", "2", "--parallel.tp", "2",
                                        "--parallel.sequence_parallel", "true"],
    "tp 2 sequence parallel, stage 3, param cpu": STAGE3 + ["--zero.offload_param", "cpu", "--parallel.tp", "2",
                                                            "--parallel.sequence_parallel", "true"],
    "cp 2 ring, stage 3": STAGE3 + ["--parallel.cp", "2"],
    "cp 2 ulysses, stage 2": ["--zero.stage", "2", "--parallel.cp", "2", "--parallel.cp_impl", "ulysses"],
    # Muon: each matrix reduced to its owner and broadcast back over the stage's ranks.
    "muon, stage 3, param + optimizer nvme": STAGE3 + NVME + ["--optim.name", "muon"],
    "muon, pp 2, tp 2, stage 2, optimizer cpu": ["--optim.name", "muon", "--zero.stage", "2", "--parallel.pp", "2",
                                                 "--parallel.tp", "2", "--zero.offload_optimizer", "cpu"],
    # Each rank's background write ends when it ends: sealing must wait for the step's sums.
    "stage 1, async saves every iteration": ["--zero.stage", "1", "--checkpoint.save", "{tmp}/async_saves",
                                             "--checkpoint.interval", "1", "--checkpoint.async_save", "true"],
}


def _inject_delays(seed: int):
    """Random sleeps (0-`most` ms, drawn from this rank's own stream) before every NVMe read
    (on the reader threads), every stage-3 load from memory and host gradient copy; returns
    pause(most), for compute."""
    import random
    import time

    import torch.distributed as dist

    from megazero.checkpoint import background
    from megazero.zero import host_grads, shard_home, swap
    rng = random.Random(seed * 1000 + dist.get_rank())

    def pause(most: float) -> None:
        time.sleep(rng.uniform(0, most) / 1000)

    def delayed(fn, most: float):
        def call(*args, **kwargs):
            pause(most)
            return fn(*args, **kwargs)
        return call
    io = swap.SwapFile.io

    def read_late(self, buffer, offset: int, write: bool) -> None:
        if not write:
            pause(6)
        io(self, buffer, offset, write)
    swap.SwapFile.io = read_late
    shard_home.MemoryShard.load = delayed(shard_home.MemoryShard.load, 2)
    host_grads.HostGradients.copy = delayed(host_grads.HostGradients.copy, 2)
    background.write_rank_file = delayed(background.write_rank_file, 400)  # on the writer thread
    return pause


def _delay_compute(chunks, pause) -> None:
    """Random sleeps before every module's forward and after every gradient accumulation."""
    for chunk in chunks:
        for module in chunk.modules():
            module.register_forward_pre_hook(lambda m, a: pause(1))
        for p in chunk.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: pause(2))


def _record(names: list[str], tmp: str, seed: int) -> dict:
    """Train each case for two iterations, recording every call; per case, this rank's calls
    and the members of each of its groups."""
    import torch.distributed as dist

    from megazero.parallel import comm
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    pause = _inject_delays(seed)
    out = {}
    for name in names:
        args = [a.format(tmp=tmp) for a in CASES[name]]
        cfg = make_config(TINY + args + ["--zero.nvme_path", tmp], world=dist.get_world_size())
        grid = ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp, cp=cfg.parallel.cp)
        calls = comm.record_calls(grid.groups.values())
        trainer = Trainer(cfg, grid)
        _delay_compute(trainer.chunks, pause)
        trainer.run()
        out[name] = {"calls": [tuple(c) for c in calls],
                     "groups": {g.name: list(g.ranks) for g in grid.groups.values()}}
    return out


def _first_difference(a: list, b: list) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"call {i} of {len(a)} / {len(b)}: {a[i - 1:i + 2]} vs {b[i - 1:i + 2]}"


def _check(name: str, per_rank: list[dict]) -> None:
    """Every member of a group recorded the same collectives on it (group, op, shape,
    dtype), and every send of rank a to b is, in order, a receive of b from a."""
    on_group: dict[tuple, dict[int, list]] = defaultdict(dict)
    sent: dict[tuple, list] = defaultdict(list)
    received: dict[tuple, list] = defaultdict(list)
    for rank, rec in enumerate(per_rank):
        for group, ranks in rec["groups"].items():
            on_group[group, tuple(ranks)][rank] = [c[:4] for c in rec["calls"] if c[0] == group and c[4] is None]
        for group, op, shape, dtype, peer in rec["calls"]:
            if op == "send":
                sent[group, rank, peer].append((shape, dtype))
            elif op == "recv":
                received[group, peer, rank].append((shape, dtype))
    for (group, ranks), by_rank in on_group.items():
        for r in ranks[1:]:
            assert by_rank[r] == by_rank[ranks[0]], (
                f"{name}: ranks {ranks[0]} and {r} issued different collectives on group {group}: "
                f"{_first_difference(by_rank[ranks[0]], by_rank[r])}")
    for key in sent.keys() | received.keys():
        assert sent[key] == received[key], f"{name}: sends on {key[0]} from rank {key[1]} to {key[2]} " \
                                           f"unmatched: {_first_difference(sent[key], received[key])}"


def _check_all(results: list[dict], names: list[str]) -> None:
    for name in names:
        per_rank = [r[name] for r in results]
        _check(name, per_rank)
        zero = {g for g in ("dp", "dp_cp") if len(per_rank[0]["groups"].get(g, ())) > 1}  # ZeRO's groups
        if zero:  # every case but muon's pp 2 x tp 2 on 4 ranks (dp 1: the stage group below is its check)
            assert [c for c in per_rank[0]["calls"] if c[0] in zero], f"{name}: nothing recorded on the DP group"
        if name.startswith("muon"):  # the owners' exchange, on the stage group
            assert {c[1] for c in per_rank[0]["calls"] if c[0] == "stage"} == {"reduce", "broadcast"}, name


@pytest.mark.parametrize("world,names", [
    (2, ["stage 3, param + optimizer nvme", "stage 1", "stage 1, async saves every iteration",
         "muon, stage 3, param + optimizer nvme"]),
    pytest.param(2, ["stage 0", "stage 2", "stage 3", "stage 3, param cpu"], marks=pytest.mark.slow),
    pytest.param(4, ["pp 2 zbh1, stage 3, param + optimizer nvme", "pp 2 zbh1, stage 1",
                     "tp 2 sequence parallel, stage 2", "tp 2 sequence parallel, stage 3, param cpu",
                     "muon, pp 2, tp 2, stage 2, optimizer cpu"],
                 marks=pytest.mark.slow),
    pytest.param(4, ["cp 2 ring, stage 3", "cp 2 ulysses, stage 2"], marks=pytest.mark.slow),
], ids=["dp2-stage1-stage3nvme", "dp2-stages0-3", "dp2-pp2zbh1-tp2sp", "dp2-cp2"])
def test_every_rank_of_a_group_issues_the_same_collectives(tmp_path, world, names):
    _check_all(run_distributed(_record, world, names, str(tmp_path), 1), names)
