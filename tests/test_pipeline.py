"""Pipeline parallelism: stage partitioning, schedule orders, and every schedule against the
single-process model (loss and every gradient), with recomputation, TP and DP composed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from megazero.config import ConfigError, build_config, validate
from megazero.pipeline.schedules import (ORDERS, Action, forward_only_order, message_source, message_target)
from megazero.pipeline.stages import stage_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def simulate(schedule: str, pp: int, vpp: int, m: int) -> dict:
    """Run every rank's order as the executor would (a rank waits only for the tensor its
    next action needs; sends never wait) and check it completes. Returns, per rank, the
    time step of each action (one step per action) and the peak number of micro-batches
    whose activations are alive."""
    orders = {r: (forward_only_order(pp, vpp, r, m) if schedule == "forward" else ORDERS[schedule](pp, vpp, r, m))
              for r in range(pp)}
    done: dict[tuple[int, Action], int] = {}  # (rank, action) -> step it finished
    position = {r: 0 for r in range(pp)}
    alive = {r: 0 for r in range(pp)}
    peak = {r: 0 for r in range(pp)}
    step = 0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        ready = []
        for r in range(pp):
            if position[r] == len(orders[r]):
                continue
            a = orders[r][position[r]]
            source = message_source(a, pp, vpp, r)
            if source is not None:
                # The action that feeds `a` is the one whose message target is (r, a).
                feeder = next(b for b in orders[source] if message_target(b, pp, vpp, source) == (r, a))
                if (source, feeder) not in done:
                    continue
            if not a.forward:
                assert (r, Action(True, a.chunk, a.microbatch)) in done, f"rank {r}: {a} before its forward"
            ready.append((r, a))
        assert ready, f"{schedule} pp {pp} vpp {vpp} m {m}: deadlock at {position}"
        for r, a in ready:
            done[(r, a)] = step
            position[r] += 1
            alive[r] += 1 if a.forward else -1
            peak[r] = max(peak[r], alive[r])
        step += 1
    for r in range(pp):
        want = {Action(f, c, j) for f in ([True] if schedule == "forward" else [True, False])
                for c in range(vpp) for j in range(m)}
        assert sorted(orders[r], key=repr) == sorted(want, key=repr), f"rank {r} runs every action once"
    return {"steps": step, "peak_alive": peak}


@pytest.mark.parametrize("schedule, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
                                           ("forward", 1), ("forward", 2)])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_orders_complete_without_deadlock(schedule, pp, vpp):
    for m in (pp, 2 * pp, 3 * pp) if vpp > 1 else (1, pp - 1, pp, 2 * pp + 1):
        simulate(schedule, pp, vpp, m)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_bounds_activation_memory_and_gpipe_does_not(pp):
    m = 4 * pp
    one_f = simulate("1f1b", pp, 1, m)["peak_alive"]
    assert all(one_f[r] == min(pp - r, m) for r in range(pp)), one_f
    assert simulate("gpipe", pp, 1, m)["peak_alive"][0] == m
    # Unit-time actions: both take 2 (m + pp - 1) steps, the bubble (p - 1) / (m + p - 1).
    assert simulate("1f1b", pp, 1, m)["steps"] == simulate("gpipe", pp, 1, m)["steps"] == 2 * (m + pp - 1)


def test_interleaved_shrinks_the_bubble():
    # With chunks of 1/v the work, the interleaved pipeline fills and drains v times faster.
    pp, vpp, m = 4, 2, 8
    assert simulate("interleaved", pp, vpp, m)["steps"] < vpp * simulate("1f1b", pp, 1, m)["steps"]


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
])
def test_bad_pipeline_configs(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate(build_config({"data": {"mock": True}, "model": {"num_layers": 4}}, overrides), world)
    assert message in str(err.value)


def test_bad_pipeline_config_exits_2_with_one_line():
    env = {**os.environ, "WORLD_SIZE": "4", "RANK": "0"}
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", "configs/gpt2-tiny.yaml",
                           "--parallel.pp", "4", "--model.num_layers", "6"],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: model.num_layers (6)")


# ----------------------------------------------------------------------------- against one process


def _config(num_layers: int, tp: int, pp: int, vpp: int, schedule: str, recompute: str, gbs: int):
    return build_config({"model": {"num_layers": num_layers, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                                   "vocab_size": 256},
                         "parallel": {"tp": tp, "pp": pp, "vpp": vpp, "schedule": schedule},
                         "train": {"micro_batch_size": 2, "global_batch_size": gbs, "recompute": recompute,
                                   "seed": 11},
                         "data": {"mock": True}})


def _reference(cfg, batches):
    """Loss and gradients of the whole model in this process (no parallelism)."""
    from megazero.model.gpt import GPT
    from megazero.parallel.comm import Group
    model = GPT(cfg.model, Group("solo", None, [0], 0))
    model.init_weights(cfg.train.seed)
    num_tokens = sum(t.numel() for t, _ in batches)
    loss = sum(model.loss(model(t), y).sum() for t, y in batches) / num_tokens
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _check_layouts(num_layers: int, gbs: int, cases: list[tuple[int, int, int, str, str]]) -> list:
    """On every rank, for each case (tp, pp, vpp, schedule, recompute) with dp = world / (tp pp):
    build this rank's chunks, run one iteration, and compare this rank's loss share and its
    gradients (after the optimizer's DP and tied-embedding sync) with the reference."""
    import torch.distributed as dist
    from megazero.model.layers import shard_of
    from megazero.parallel import comm
    from megazero.parallel.grid import ProcessGrid
    from megazero.parallel.random import seed_everything
    from megazero.pipeline.schedules import forward_backward_pipelining
    from megazero.pipeline.stages import build_model_chunks
    from megazero.zero.optimizer import ZeroOptimizer

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
        cfg = _config(num_layers, tp, pp, vpp, schedule, recompute, gbs)
        validate(cfg, world)
        ref_loss, ref_grads = _reference(cfg, all_batches)
        tracker = seed_everything(cfg.train.seed, grid.pp_rank, grid.tp_rank, grid.device)
        chunks = build_model_chunks(cfg, grid, tracker)
        optimizer = ZeroOptimizer(chunks, cfg, grid)
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
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                want = ref_grads["transformer.wte.weight" if name == "lm_head.weight" else name]
                want = shard_of(want, p.tp_dim, p.tp_stride, grid.tp_rank, tp)
                torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")
                worst = max(worst, float((p.grad - want).abs().max()))
        out.append((case, worst))
    return out


def test_pp2_schedules_and_recompute_match_single_process():
    # Every schedule with every recompute mode (interleaved: 2 chunks of 1 layer per rank).
    cases = [(1, 2, 1, s, r) for s in ("gpipe", "1f1b") for r in ("none", "selective", "full")]
    cases += [(1, 2, 2, "interleaved", r) for r in ("none", "selective", "full")]
    run_distributed(_check_layouts, 2, 4, 8, cases)


def test_pp4_and_pipeline_with_tp_and_dp_match_single_process():
    cases = [(1, 4, 1, "gpipe", "none"), (1, 4, 1, "1f1b", "full"), (1, 4, 2, "interleaved", "selective"),
             (2, 2, 1, "1f1b", "none"), (2, 2, 2, "interleaved", "full"),  # tp 2 x pp 2
             (1, 2, 1, "gpipe", "none"), (1, 2, 2, "interleaved", "none")]  # pp 2 x dp 2
    run_distributed(_check_layouts, 4, 8, 16, cases)


# ----------------------------------------------------------------------------- tied embedding


def _train_and_return_tied(layouts: list[list[str]], steps: int) -> list[dict]:
    import torch.distributed as dist
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    out = []
    for overrides in layouts:
        cfg = build_config({"model": {"num_layers": 4, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                                      "vocab_size": 256},
                            "train": {"micro_batch_size": 2, "global_batch_size": 8, "iters": steps},
                            "optim": {"lr": 1e-2}, "data": {"mock": True}}, overrides)
        validate(cfg, dist.get_world_size())
        grid = ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp)
        trainer = Trainer(cfg, grid)
        initial = [c.tied_weight().detach().clone() for c in trainer.chunks if c.tied_weight() is not None]
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        tied = [c.tied_weight().detach().clone() for c in trainer.chunks if c.tied_weight() is not None]
        out.append({"initial": initial, "tied": tied, "losses": losses})
    return out


def test_tied_embedding_copies_stay_identical():
    """The first stage's wte and the last stage's lm_head start equal and, with their
    gradients summed over the embedding group, stay bitwise equal (pp 2, and vpp 2)."""
    layouts = [["--parallel.pp", "2"], ["--parallel.pp", "2", "--parallel.vpp", "2"]]
    first, last = run_distributed(_train_and_return_tied, 2, layouts, 4)
    for f, l in zip(first, last):
        assert len(f["tied"]) == 1 and len(l["tied"]) == 1
        assert torch.equal(f["initial"][0], l["initial"][0])
        assert not torch.equal(f["tied"][0], f["initial"][0])  # it was trained
        assert torch.equal(f["tied"][0], l["tied"][0])
        assert f["losses"] == [None] * 4 and all(isinstance(x, float) for x in l["losses"])
