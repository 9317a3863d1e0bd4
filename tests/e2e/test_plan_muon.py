"""The layout planner under optim.name muon against what training allocates and moves: Muon's
matrices keep one fp32 buffer (4 B per element instead of Adam's 8), and the planner's
optimizer-state bytes equal the optimizer's allocation on the DP rank holding the most."""

from __future__ import annotations

import pytest

from helpers import run_distributed

TINY = {"model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 32, "vocab_size": 256},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "iters": 2},
        "zero": {"bucket_size": 20000}, "data": {"mock": True}, "optim": {"name": "muon"}}
# On 2 ranks: dp at ZeRO 1 (fp32) and 3 (bf16), tp 2, and the optimizer in host memory.
LAYOUTS = [["--zero.stage", "1"], ["--zero.stage", "3", "--train.precision", "bf16"], ["--parallel.tp", "2"],
           ["--zero.stage", "2", "--zero.offload_optimizer", "cpu"]]


def _measure(layouts: list[list[str]]) -> list[dict]:
    import contextlib
    import io

    import torch.distributed as dist

    from megazero.config import build_config
    from megazero.config.preflight import resolve_and_validate
    from megazero.parallel.grid import ProcessGrid
    from megazero.plan.planner import Cluster, predict, run_layout
    from megazero.train.trainer import Trainer
    out = []
    for overrides in layouts:
        cfg = build_config(TINY, overrides)
        dp = resolve_and_validate(cfg, dist.get_world_size())
        with contextlib.redirect_stdout(io.StringIO()):
            tr = Trainer(cfg, ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp, cp=cfg.parallel.cp))
        tr.train_step()
        pred = predict(cfg, run_layout(cfg, dp, cfg.parallel.cp), Cluster(dist.get_world_size(), 8, 1.0, None),
                       ranks=[tr.grid.pp_rank], device="cpu").rank(tr.grid.pp_rank)
        state = tr.optimizer.model_state_bytes()
        out.append({"case": " ".join(overrides), "optimizer": state["optimizer"] + state["offloaded_host"],
                    "predicted": pred.states["optimizer"], "host": pred.host_items["optimizer_states"]})
    return out


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    return run_distributed(_measure, 2, LAYOUTS)


def test_planner_optimizer_state_equals_the_allocation_under_muon(measured):
    for case in zip(*measured, strict=True):
        allocated = [r["optimizer"] for r in case]
        offloaded = "offload_optimizer" in case[0]["case"]  # in host memory: fp32 master weights too
        predicted = case[0]["host"] if offloaded else case[0]["predicted"]
        assert max(allocated) == predicted, case
