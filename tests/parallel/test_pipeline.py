"""Pipeline parallelism: stage partitioning, schedule orders and the executor's communication
plans (simulated under NCCL's rendezvous sends), and every schedule against the
single-process model (loss and every gradient), with recomputation, TP and DP composed."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections import defaultdict, deque
from typing import Optional, Sequence

import pytest
import torch

from helpers import REPO, make_config, make_trainer, run_distributed
from megazero.config import ConfigError
from megazero.pipeline.schedules import (
    ORDERS,
    Action,
    Batch,
    Order,
    Step,
    Transfer,
    forward_only_order,
    message_source,
    message_target,
    pipeline_plan,
)
from megazero.pipeline.stages import stage_layers

ROOT = str(REPO)


# ----------------------------------------------------------------------------- partitioning


def test_stage_layers_even_uneven_and_interleaved():
    assert stage_layers(8, 2, 1, 0) == [[0, 1, 2, 3]] and stage_layers(8, 2, 1, 1) == [[4, 5, 6, 7]]
    assert stage_layers(8, 2, 1, 1, [3, 5]) == [[3, 4, 5, 6, 7]]
    # vpp 2: rank r owns chunks r and r + pp of the pp x vpp equal chunks.
    assert stage_layers(8, 2, 2, 0) == [[0, 1], [4, 5]] and stage_layers(8, 2, 2, 1) == [[2, 3], [6, 7]]
    for pp, vpp in [(2, 1), (4, 1), (2, 2), (4, 2), (2, 4)]:
        layers = sorted(i for r in range(pp) for c in stage_layers(8, pp, vpp, r) for i in c)
        assert layers == list(range(8))


# ----------------------------------------------------------------------------- orders


def order_of(schedule: str) -> Order:
    return forward_only_order if schedule == "forward" else ORDERS[schedule]


class Rendezvous:
    """Every rank's plan (actions, and batches of p2p ops between them) run as NCCL would let
    it run. A send completes only once the peer has posted the matching receive (in the
    same batch or an earlier one), a receive once the peer has posted the send, and a rank
    is blocked while any op of its current batch is incomplete. Between a pair of ranks the
    i-th send meets the i-th receive (matching in posting order, no tags), which must name
    the same message. Time goes in rounds of one action per unblocked rank; communication
    takes no time."""

    def __init__(self, plans: Sequence[Sequence[Step]], pp: int, vpp: int, label: str):
        self.plans, self.pp, self.vpp, self.label = plans, pp, vpp, label
        self.position = [0] * pp
        self.current: list[Optional[list[tuple[Transfer, int]]]] = [None] * pp  # posted batch: (op, index in pair)
        self.posted: dict[tuple[bool, int, int], list[Action]] = defaultdict(list)  # (send?, from, to) -> keys
        self.inbox: list[set[Action]] = [set() for _ in range(pp)]
        self.ran: list[set[Action]] = [set() for _ in range(pp)]
        self.alive, self.peak = [0] * pp, [0] * pp
        # With W passes (zbh1) a micro-batch's activations are alive until its W, else its B.
        self.split = [any(isinstance(s, Action) and s.weight for s in plan) for plan in plans]

    def run(self) -> int:
        """Run to the end (or fail on a deadlock); returns the number of rounds."""
        rounds = 0
        while True:
            while any([self.advance(r) for r in range(self.pp)]):  # communication settles in zero time
                pass
            computing = [r for r in range(self.pp) if self.position[r] < len(self.plans[r]) and self.current[r] is None]
            if not computing:
                assert all(c is None for c in self.current), f"{self.label}: deadlock: {self.waiting()}"
                return rounds
            for r in computing:
                self.compute(r, self.plans[r][self.position[r]])
            rounds += 1

    def advance(self, r: int) -> bool:
        """Post and complete rank r's batches up to its next action; True if it moved."""
        moved = False
        while self.position[r] < len(self.plans[r]) and not isinstance(step := self.plans[r][self.position[r]], Action):
            if self.current[r] is None:
                self.current[r] = [(op, self.post(r, op)) for op in step]
                moved = True
            if not all(self.matched(r, op, i) for op, i in self.current[r]):
                return moved
            self.inbox[r].update(op.key for op, _ in self.current[r] if not op.send)
            self.current[r], self.position[r], moved = None, self.position[r] + 1, True
        return moved

    def post(self, r: int, op: Transfer) -> int:
        """Post one op of rank r; returns its index among the ops of its direction and pair."""
        pair = self.posted[(True, r, op.peer) if op.send else (False, op.peer, r)]
        pair.append(op.key)
        return len(pair) - 1

    def matched(self, r: int, op: Transfer, index: int) -> bool:
        """Has the peer posted the other half of this op (the index-th of the pair)?"""
        other = self.posted[(False, r, op.peer) if op.send else (True, op.peer, r)]
        if len(other) <= index:
            return False
        assert other[index] == op.key, f"{self.label}: rank {r}'s {op} meets rank {op.peer}'s op for {other[index]}"
        return True

    def compute(self, r: int, a: Action) -> None:
        if message_source(a, self.pp, self.vpp, r) is not None:
            assert a in self.inbox[r], f"{self.label}: rank {r} runs {a} before receiving its input"
            self.inbox[r].remove(a)
        assert a.forward or Action(True, a.chunk, a.microbatch) in self.ran[r], f"{self.label}: {a} before its forward"
        assert not a.weight or Action(False, a.chunk, a.microbatch) in self.ran[r], f"{self.label}: {a} before its B"
        self.ran[r].add(a)
        self.alive[r] += 1 if a.forward else -1 if a.weight or not self.split[r] else 0
        self.peak[r] = max(self.peak[r], self.alive[r])
        self.position[r] += 1

    def waiting(self) -> str:
        """Who waits on what, e.g. "rank 0 waits in {send B0.0}, rank 1 in {send B1.1, recv F0.2}"."""
        stuck = [(r, ", ".join(repr(op) for op, _ in self.current[r])) for r in range(self.pp) if self.current[r]]
        return ", ".join(f"rank {r} {'waits ' if i == 0 else ''}in {{{ops}}}" for i, (r, ops) in enumerate(stuck))


def simulate(plans: Sequence[Sequence[Step]], pp: int, vpp: int, m: int, label: str = "",
             forward_only: bool = False) -> dict:
    """Run the plans under rendezvous sends (see Rendezvous) and check that they complete,
    that every rank ran each of its actions once and used every message it received.
    Returns the number of rounds and, per rank, the peak number of micro-batches whose
    activations are alive."""
    sim = Rendezvous(plans, pp, vpp, label)
    steps = sim.run()
    for r in range(pp):
        want = {Action(f, c, j) for f in ([True] if forward_only else [True, False])
                for c in range(vpp) for j in range(m)}
        if sim.split[r]:
            want |= {Action(False, c, j, weight=True) for c in range(vpp) for j in range(m)}
        assert sim.ran[r] == want and len(want) == sum(isinstance(s, Action) for s in plans[r]), \
            f"{label}: rank {r} runs every action once"
        assert not sim.inbox[r], f"{label}: rank {r} never used {sorted(sim.inbox[r], key=repr)}"
    return {"steps": steps, "peak_alive": dict(enumerate(sim.peak))}


def simulate_plan(schedule: str, pp: int, vpp: int, m: int) -> dict:
    """Simulate the plans the executor runs for `schedule` ("forward": evaluation)."""
    plans = [pipeline_plan(order_of(schedule), pp, vpp, r, m) for r in range(pp)]
    return simulate(plans, pp, vpp, m, f"{schedule} pp {pp} vpp {vpp} m {m}", schedule == "forward")


def old_executor_plan(schedule: str, pp: int, vpp: int, pp_rank: int, m: int) -> list[Step]:
    """The batches the executor posted before plans: one before the first action with the
    receive it needs, then after each action one with the send of its output and the
    receive the NEXT action needs (preceded by the receives of whatever that peer sends
    first, which wait in the inbox)."""
    order = order_of(schedule)(pp, vpp, pp_rank, m)
    incoming = {peer: deque(t[1] for a in order_of(schedule)(pp, vpp, peer, m)
                            if (t := message_target(a, pp, vpp, peer)) is not None and t[0] == pp_rank)
                for peer in {(pp_rank - 1) % pp, (pp_rank + 1) % pp}}
    inbox: set[Action] = set()

    def batch(sent: Optional[tuple[int, Action]], upcoming: Optional[Action]) -> Batch:
        ops = [Transfer(True, *sent)] if sent is not None else []
        source = None if upcoming is None else message_source(upcoming, pp, vpp, pp_rank)
        while source is not None and upcoming not in inbox:
            ops.append(Transfer(False, source, incoming[source].popleft()))
            inbox.add(ops[-1].key)
        inbox.discard(upcoming)
        return tuple(ops)

    plan: list[Step] = [batch(None, order[0])]
    for i, action in enumerate(order):
        plan += [action, batch(message_target(action, pp, vpp, pp_rank), order[i + 1] if i + 1 < len(order) else None)]
    return [step for step in plan if step != ()]


def plan_cases() -> list[tuple[str, int, int, int]]:
    """(schedule, pp, vpp, m): every schedule at pp 2, 3, 4, 8, vpp 1, 2, 4 where it runs
    chunks, and m from pp (from 1 for one chunk) to 8 pp (multiples of pp with vpp chunks)."""
    cases = []
    for schedule, vpps in [("gpipe", [1]), ("1f1b", [1]), ("zbh1", [1]), ("interleaved", [1, 2, 4]),
                           ("forward", [1, 2, 4])]:
        for pp, vpp in itertools.product([2, 3, 4, 8], vpps):
            grouped = schedule == "interleaved" or vpp > 1  # micro-batches go in groups of pp
            cases += [(schedule, pp, vpp, m) for m in range(pp if grouped else 1, 8 * pp + 1)
                      if not (grouped and m % pp)]
    return cases


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "interleaved", "forward"])
def test_executor_plans_complete_under_rendezvous_sends(schedule):
    cases = [c for c in plan_cases() if c[0] == schedule]
    for case in cases:
        simulate_plan(*case)


def test_simulator_catches_the_old_executors_deadlock():
    """The old executor paired a send with the receive its own next action needed; under
    rendezvous sends interleaved pp 2, vpp 2, m 4 hangs with both ranks sending."""
    pp, vpp, m = 2, 2, 4
    plans = [old_executor_plan("interleaved", pp, vpp, r, m) for r in range(pp)]
    with pytest.raises(AssertionError) as err:
        simulate(plans, pp, vpp, m, "old interleaved pp 2 vpp 2 m 4")
    assert "deadlock: rank 0 waits in {send B0.0}, rank 1 in {send B1.1, recv F0.2}" in str(err.value)
    # Its 1F1B batches happened to pair up: the simulator flags the pairing, not the orders.
    old = simulate([old_executor_plan("1f1b", 4, 1, r, 8) for r in range(4)], 4, 1, 8)
    assert old == simulate_plan("1f1b", 4, 1, 8)


def test_p2p_refuses_a_tensor_its_peer_would_misread():
    from types import SimpleNamespace

    from megazero.pipeline.p2p import PipelineP2P
    grid = SimpleNamespace(pp_group=None, pp_rank=1, device=torch.device("cpu"))
    p2p = PipelineP2P(grid, (2, 4, 8), torch.float32)
    with pytest.raises(ValueError, match=r"would send a \(2, 4, 8\) torch.bfloat16 tensor on cpu; .* expect "
                                         r"\(2, 4, 8\) torch.float32 on cpu"):
        p2p.exchange([(0, torch.zeros(2, 4, 8, dtype=torch.bfloat16))], [])
    with pytest.raises(RuntimeError, match="needs message F0.1 before it arrived"):
        p2p.take(Action(True, 0, 1))


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_bounds_activation_memory_and_gpipe_does_not(pp):
    m = 4 * pp
    one_f = simulate_plan("1f1b", pp, 1, m)["peak_alive"]
    assert all(one_f[r] == min(pp - r, m) for r in range(pp)), one_f
    assert simulate_plan("gpipe", pp, 1, m)["peak_alive"][0] == m
    # Unit-time actions: both take 2 (m + pp - 1) steps, the bubble (p - 1) / (m + p - 1).
    assert simulate_plan("1f1b", pp, 1, m)["steps"] == simulate_plan("gpipe", pp, 1, m)["steps"] == 2 * (m + pp - 1)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zbh1_keeps_1f1b_memory_and_cuts_its_idle_time_to_a_third(pp):
    from megazero.plan.formulas import pipeline_bubble, simulated_bubble
    for m in (pp, 2 * pp, 8 * pp):
        zb = simulate_plan("zbh1", pp, 1, m)
        # At most pp micro-batches in flight (forward done, W not yet) on any rank: 1F1B's rank 0.
        assert max(zb["peak_alive"].values()) == zb["peak_alive"][0] == pp, zb
        # Unit-time F, B and W: 3m + p - 1 steps, so each rank idles p - 1, a third of 1F1B's
        # 3 (p - 1) (its backward is B + W: 2 units; the simulator counts it as one step).
        assert zb["steps"] == 3 * m + pp - 1
        assert simulated_bubble(pp, 1, m, "zbh1") == pytest.approx(pipeline_bubble(pp, 1, m, "zbh1"), abs=1e-12)
        idle = {s: simulated_bubble(pp, 1, m, s) * (3 * m) / (1 - simulated_bubble(pp, 1, m, s))
                for s in ("1f1b", "zbh1")}
        assert idle["zbh1"] == pytest.approx(idle["1f1b"] / 3) == pytest.approx(pp - 1)


def test_interleaved_shrinks_the_bubble():
    # With chunks of 1/v the work, the interleaved pipeline fills and drains v times faster.
    pp, vpp, m = 4, 2, 8
    assert simulate_plan("interleaved", pp, vpp, m)["steps"] < vpp * simulate_plan("1f1b", pp, 1, m)["steps"]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, world, message", [
    (["--model.num_layers", "6", "--parallel.pp", "4"], 4,
     "model.num_layers (6) must be divisible by parallel.pp (4); try pp 1, 2, 3 or 6, or set parallel.pp_layers"),
    (["--model.num_layers", "8", "--parallel.pp", "2", "--parallel.vpp", "3"], 2,
     "parallel.vpp (3) must divide num_layers / pp (8 / 2 = 4); try vpp 1 or 2 or 4"),
    (["--parallel.pp", "2", "--parallel.vpp", "2", "--train.global_batch_size", "12"], 2,
     "interleaved schedule needs micro-batches per iteration (3) to be a multiple of parallel.pp (2)"),
    (["--parallel.pp", "2", "--parallel.schedule", "interleaved"], 2,
     "parallel.schedule interleaved needs parallel.vpp > 1"),
    (["--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.schedule", "gpipe"], 2,
     "parallel.schedule gpipe runs one model chunk per rank, but parallel.vpp is 2"),
    (["--parallel.vpp", "2"], 1, "parallel.vpp (2) needs parallel.pp > 1"),
    (["--parallel.pp", "2", "--parallel.pp_layers", "[1, 2]"], 2,
     "parallel.pp_layers ([1, 2]) must list pp (2) positive counts summing to model.num_layers (4)"),
    (["--parallel.pp", "2", "--parallel.pp_layers", "[1, 3]", "--parallel.vpp", "2"], 2,
     "parallel.pp_layers (uneven split) cannot be combined with parallel.vpp > 1"),
    (["--parallel.pp", "8"], 8, "model.num_layers (4) must be divisible by parallel.pp (8)"),
    (["--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.schedule", "zbh1"], 2,
     "parallel.schedule zbh1 runs one model chunk per rank, but parallel.vpp is 2"),
    (["--parallel.pp", "2", "--parallel.schedule", "zbh1", "--train.compile", "true"], 2,
     "parallel.schedule zbh1 cannot defer weight gradients inside compiled blocks"),
])
def test_bad_pipeline_configs(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        make_config(overrides, base={"data": {"mock": True}, "model": {"num_layers": 4}}, world=world)
    assert message in str(err.value)


def test_bad_pipeline_config_exits_2_with_one_line():
    env = {**os.environ, "WORLD_SIZE": "4", "RANK": "0"}
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml",
                           "--parallel.pp", "4", "--model.num_layers", "6"],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: model.num_layers (6)")


# ----------------------------------------------------------------------------- against one process


def _config(num_layers: int, tp: int, pp: int, vpp: int, schedule: str, recompute: str, gbs: int,
            zero_stage: int = 0, world: int | None = None):
    return make_config(base={"model": {"num_layers": num_layers, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                                       "vocab_size": 256},
                             "parallel": {"tp": tp, "pp": pp, "vpp": vpp, "schedule": schedule},
                             "train": {"micro_batch_size": 2, "global_batch_size": gbs, "recompute": recompute,
                                       "seed": 11},
                             "zero": {"stage": zero_stage}, "data": {"mock": True}}, world=world)


def _reference(cfg, batches):
    """Loss and gradients of the whole model in this process (no parallelism)."""
    from megazero.model.gpt import GPT
    model = GPT(cfg.model)
    model.init_weights(cfg.train.seed)
    num_tokens = sum(t.numel() for t, _ in batches)
    loss = sum(model.loss(model(t), y).sum() for t, y in batches) / num_tokens
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _full_grads(optimizer, chunks) -> dict:
    """Each parameter's gradient after the DP sync: its .grad, or at ZeRO stages 2-3 (where a
    rank keeps only its slice of each bucket) the slices gathered over DP."""
    from megazero.parallel import comm
    if not optimizer.sharding.gradients:
        return {n: p.grad for c in chunks for n, p in c.named_parameters()}
    out = {}
    for b in optimizer.layout.trainable_buckets():
        full = torch.empty(b.numel, device=optimizer.grid.device)
        comm.all_gather_into(full, optimizer.grads.buffers.own_slice(b), optimizer.grid.dp_group)
        out |= {s.name: full[s.offset: s.offset + s.numel].view(s.shape)
                for s in b.slots}
    return out


def _check_layouts(num_layers: int, gbs: int, cases: list[tuple[int, int, int, str, str]], zero_stage: int = 0) -> list:
    """On every rank, for each case (tp, pp, vpp, schedule, recompute) with dp = world / (tp pp):
    build this rank's chunks, run one iteration, and compare this rank's loss share and its
    gradients (after the optimizer's DP and tied-embedding sync) with the reference."""
    import torch.distributed as dist

    from megazero.parallel import comm
    from megazero.parallel.grid import ProcessGrid
    from megazero.parallel.placement import placement
    from megazero.parallel.random import seed_everything
    from megazero.pipeline.schedules import forward_backward_pipelining
    from megazero.train.parallelize import parallelize

    world = dist.get_world_size()
    grids: dict[tuple[int, int], ProcessGrid] = {}
    g = torch.Generator().manual_seed(5)
    all_batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
                   for _ in range(gbs // 2)]
    out = []
    for tp, pp, vpp, schedule, recompute in cases:
        if (tp, pp) not in grids:  # every rank builds the same grids in the same order
            grids[tp, pp] = ProcessGrid(tp=tp, pp=pp, dp=world // (tp * pp), rank=dist.get_rank())
            grids[tp, pp].build_groups()
        grid = grids[tp, pp]
        cfg = _config(num_layers, tp, pp, vpp, schedule, recompute, gbs, zero_stage, world)
        ref_loss, ref_grads = _reference(cfg, all_batches)
        tracker = seed_everything(cfg.train.seed, grid.pp_rank, grid.tp_rank, grid.device)
        chunks, optimizer = parallelize(cfg, grid, tracker)
        # This DP rank's micro-batches: the same slicing as Trainer.microbatches.
        mine = [all_batches[j * grid.dp + grid.dp_rank] for j in range(len(all_batches) // grid.dp)]
        loss = forward_backward_pipelining(chunks, mine, 16 * gbs, grid, schedule, torch.float32, optimizer)
        optimizer.finish_grad_sync()
        case = f"tp {tp} pp {pp} vpp {vpp} {schedule} recompute {recompute}"
        if loss is not None:
            comm.all_reduce(loss, grid.dp_group)
            assert abs(float(loss) - ref_loss) < 1e-6, (case, float(loss), ref_loss)
        else:
            assert not grid.is_last_stage
        worst = 0.0
        grads = _full_grads(optimizer, chunks)
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                want = ref_grads["transformer.wte.weight" if name == "lm_head.weight" else name]
                want = placement(p).shard(want, grid.tp_rank, tp)
                torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")
                worst = max(worst, float((grads[name] - want).abs().max()))
        out.append((case, worst))
    return out


def test_pp2_schedules_and_recompute_match_single_process():
    # Every schedule with every recompute mode (interleaved: 2 chunks of 1 layer per rank).
    cases = [(1, 2, 1, s, r) for s in ("gpipe", "1f1b") for r in ("none", "selective", "full")]
    cases += [(1, 2, 2, "interleaved", r) for r in ("none", "selective", "full")]
    run_distributed(_check_layouts, 2, 4, 8, cases)


PP4_CASES = [(1, 4, 1, "1f1b", "full"), (1, 4, 2, "interleaved", "selective"),
             (2, 2, 2, "interleaved", "full"),  # tp 2 x pp 2
             (1, 2, 1, "gpipe", "none")]  # pp 2 x dp 2
PP4_MORE = [(1, 4, 1, "gpipe", "none"), (2, 2, 1, "1f1b", "none"), (1, 2, 2, "interleaved", "none")]


@pytest.mark.parametrize("cases", [PP4_CASES, pytest.param(PP4_MORE, marks=pytest.mark.slow)], ids=["main", "more"])
def test_pp4_and_pipeline_with_tp_and_dp_match_single_process(cases):
    run_distributed(_check_layouts, 4, 8, 16, cases)


@pytest.mark.slow  # suite budget: ZB-H1 runs by default at pp 2 x dp 2 (ZeRO-3 below, ZeRO-2 end to end)
def test_zbh1_matches_single_process():
    """ZB-H1's deferred weight gradients land where a plain backward puts them: pp 4 with full
    recompute, and pp 2 x dp 2 (reduced over DP after the last W)."""
    run_distributed(_check_layouts, 4, 8, 16, [(1, 4, 1, "zbh1", "full"), (1, 2, 1, "zbh1", "none")])


@pytest.mark.slow  # suite budget
def test_zbh1_zero3_matches_single_process():
    """ZeRO-3 under ZB-H1, pp 2 x dp 2: W lands its weight gradients with the parameters
    released; the loss and every gradient (gathered over DP) equal one process's."""
    run_distributed(_check_layouts, 4, 8, 16, [(1, 2, 1, "zbh1", "none"), (1, 2, 1, "zbh1", "full")], 3)


@pytest.mark.slow
def test_zbh1_with_tp_matches_single_process():
    run_distributed(_check_layouts, 4, 8, 16, [(2, 2, 1, "zbh1", "selective"), (1, 4, 1, "zbh1", "none")])


# ----------------------------------------------------------------------------- tied embedding


def _train_and_return_tied(layouts: list[list[str]], steps: int) -> list[dict]:
    out = []
    for overrides in layouts:
        trainer = make_trainer(overrides, base={
            "model": {"num_layers": 4, "hidden_size": 32, "num_heads": 4, "seq_length": 16, "vocab_size": 256},
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "iters": steps},
            "optim": {"lr": 1e-2}, "data": {"mock": True}})
        initial = [c.tied_weight().detach().clone() for c in trainer.chunks if c.tied_weight() is not None]
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        tied = [c.tied_weight().detach().clone() for c in trainer.chunks if c.tied_weight() is not None]
        out.append({"initial": initial, "tied": tied, "losses": losses})
    return out


def test_tied_embedding_copies_stay_identical():
    """The first stage's wte and the last stage's lm_head start equal and, with their
    gradients summed over the embedding group, stay bitwise equal (pp 2, vpp 2, and zbh1 in
    bf16, whose head gradient lands in a deferred W pass)."""
    layouts = [["--parallel.pp", "2"], ["--parallel.pp", "2", "--parallel.vpp", "2"],
               ["--parallel.pp", "2", "--parallel.schedule", "zbh1", "--train.precision", "bf16"]]
    first, last = run_distributed(_train_and_return_tied, 2, layouts, 4)
    for f, l in zip(first, last, strict=True):
        assert len(f["tied"]) == 1 and len(l["tied"]) == 1
        assert torch.equal(f["initial"][0], l["initial"][0])
        assert not torch.equal(f["tied"][0], f["initial"][0])  # it was trained
        assert torch.equal(f["tied"][0], l["tied"][0])
        assert f["losses"] == [None] * 4 and all(isinstance(x, float) for x in l["losses"])


@pytest.mark.slow
def test_zbh1_trains_like_1f1b_in_bf16():
    """bf16 at ZeRO 0 and 2: the same losses as 1F1B (deferring a matmul changes no value)."""
    layouts = [["--parallel.pp", "2", "--train.precision", "bf16", "--parallel.schedule", s, "--zero.stage", z]
               for z in ("0", "2") for s in ("1f1b", "zbh1")]
    last = run_distributed(_train_and_return_tied, 2, layouts, 3)[1]
    for one_f, zb in zip(last[::2], last[1::2], strict=True):
        assert zb["losses"] == pytest.approx(one_f["losses"], abs=1e-3)
