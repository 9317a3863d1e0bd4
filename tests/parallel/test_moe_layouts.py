"""A Mixtral-style mixture of experts (configs/mixtral-tiny.yaml, experts whole on every rank:
ep 1, etp 1) at every dense layout equals the single process: fp32, dropless, same seed and
global batch; per iteration the LM loss, the gradient norm (the load-balancing and z-losses'
gradients included) and the logged aux and z-losses within 1e-5."""

from __future__ import annotations

import pytest

from helpers import (
    MOE_ITERS,
    MOE_SHORT,
    REPO,
    assert_parity,
    assert_tensorboard_matches,
    logged_by_layout,
    make_trainer,
    moe_records,
    read_jsonl,
    run_distributed,
)

MIXTRAL = "configs/mixtral-tiny.yaml"
ITERS, SHORT = MOE_ITERS, MOE_SHORT


def _records(extra: list[str]) -> list[tuple[float, ...]]:
    """(loss, grad norm, aux loss, z-loss) of each iteration on the logging rank (empty elsewhere)."""
    return moe_records(SHORT + extra)


def _layouts(layouts: dict[str, list[str]]) -> dict[str, list]:
    return logged_by_layout(_records, layouts)


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, ...]]:
    return run_distributed(_records, 1, [])[0]


TP2, CP2, PP2 = ["--parallel.tp", "2"], ["--parallel.cp", "2"], ["--parallel.pp", "2"]
LAYOUTS_2 = {
    "dp2-zero1": ["--zero.stage", "1"],
    "tp2-sp": TP2 + ["--parallel.sequence_parallel", "true"],
    "tp2": TP2,
    "cp2-ring": CP2,
    "pp2-1f1b-recompute": PP2 + ["--train.recompute", "full"],
}
LAYOUTS_4 = {
    "tp2-pp2-zbh1": TP2 + PP2 + ["--parallel.schedule", "zbh1"],
    "pp2-vpp2-interleaved": PP2 + ["--parallel.vpp", "2"],
    "cp2-ulysses-dp2-zero3": CP2 + ["--parallel.cp_impl", "ulysses", "--zero.stage", "3"],
    "dp4-zero2-offload": ["--zero.stage", "2", "--zero.offload_optimizer", "cpu"],
    "tp2-cp2-sp-selective": TP2 + CP2 + ["--parallel.sequence_parallel", "true", "--train.recompute", "selective"],
}


def test_moe_layouts_on_2_ranks(reference):
    """Data parallelism, tp 2 with and without sequence parallelism, cp 2, pp 2 with full recompute."""
    assert_parity(run_distributed(_layouts, 2, LAYOUTS_2)[0], reference, ITERS)


@pytest.mark.slow
def test_moe_layouts_on_4_ranks(reference):
    """ZB-H1 and interleaved pipelines, Ulysses with ZeRO-3, ZeRO-2 offload, tp x cp with selective recompute."""
    assert_parity(run_distributed(_layouts, 4, LAYOUTS_4)[0], reference, ITERS)


@pytest.mark.slow  # suite budget: the parity at dp 2 (test_moe_layouts_on_2_ranks) keeps the losses' scaling in the default run
def test_moe_losses_do_not_depend_on_how_the_batch_is_cut():
    """The sequence-wise load-balancing loss and the z-loss are means over sequences and tokens:
    the same whatever the micro-batch size and gradient accumulation (and data ranks)."""
    seq = ["--model.moe_load_balancing", "seq_aux_loss"]
    cuts = {"micro1": seq + ["--train.micro_batch_size", "1"], "micro4": seq + ["--train.micro_batch_size", "4"],
            "micro2-dp2": seq + ["--zero.stage", "1"]}
    one = run_distributed(_records, 1, seq)[0]
    assert_parity(run_distributed(_layouts, 2, {"micro2-dp2": cuts.pop("micro2-dp2")})[0], one, ITERS)
    for extra in cuts.values():
        assert_parity({"cut": run_distributed(_records, 1, extra)[0]}, one, ITERS)


@pytest.mark.slow
def test_moe_reference_learns_and_balances(reference):
    """The aux loss sits near its coefficient per layer (an even load gives exactly it) and the LM loss falls."""
    assert all(0.1 * 4 * 0.9 < aux < 0.1 * 4 * 1.5 for _, _, aux, _ in reference)
    longer = run_distributed(_records, 1, ["--train.iters", "8"])[0]
    assert longer[-1][0] < longer[0][0]


BIAS = ["--model.moe_router_score_function", "sigmoid", "--model.moe_router_enable_expert_bias", "true",
        "--model.moe_router_bias_update_rate", "0.05", "--model.moe_load_balancing", "none"]


def _bias_run(root: str) -> dict:
    """Aux-loss-free balancing in one rank of each layout: 3 iterations straight (the bias table
    after them), and the same run saved at 2 and resumed to 3."""
    import contextlib
    import io
    args = SHORT[2:] + BIAS + ["--train.iters", "3", "--checkpoint.interval", "2"]
    out = {}
    for name, extra in {"straight": [], "resumed": ["--checkpoint.load", f"{root}/straight",
                                                    "--checkpoint.iteration", "2"]}.items():
        tr = make_trainer(args + extra + ["--checkpoint.save", f"{root}/{name}"], base=MIXTRAL)
        with contextlib.redirect_stdout(io.StringIO()):
            records = tr.run()
        out[name] = ([(r["loss"], r["grad_norm"]) for r in records], tr.moe.state_dict())
    return out


def test_expert_bias_updates_from_every_ranks_counts_and_resumes(tmp_path):
    """b += rate · sign(mean(c) − c) after each global batch, with the counts of every data rank:
    the bias moves the routing of the next steps, so dp 2 equals one process only when the counts
    were summed over both; a resume from iteration 2 continues bit for bit with the saved bias."""
    one = run_distributed(_bias_run, 1, str(tmp_path / "one"))[0]
    two = run_distributed(_bias_run, 2, str(tmp_path / "two"))[0]
    straight, bias = one["straight"]
    # 3 steps of ± rate (or 0 where an expert got exactly the mean): odd multiples where every step moved it
    assert bias is not None and any(b != 0 for row in bias for b in row)
    assert all(abs(b) <= 3 * 0.05 + 1e-6 and round(b / 0.05) == pytest.approx(b / 0.05, abs=1e-4)
               for row in bias for b in row)
    resumed, resumed_bias = one["resumed"]
    assert resumed == straight[2:] and resumed_bias == bias
    assert_parity({"dp2": two["straight"][0]}, straight, 3)
    assert two["straight"][1] == bias


def test_moe_figures_reach_the_jsonl_the_line_and_tensorboard(tmp_path):
    """moe_aux_loss, moe_z_loss, moe_imbalance and (with a capacity) moe_dropped in the JSONL, the
    iteration line's aux / imbalance / dropped, and Megatron's load_balancing_loss / z_loss tags;
    with logging.moe_per_layer each layer's losses in both."""
    import subprocess
    import sys
    jsonl, tb = str(tmp_path / "m.jsonl"), str(tmp_path / "tb")
    proc = subprocess.run([sys.executable, "-m", "megazero.train", "--config", MIXTRAL, "--train.iters", "2",
                           "--model.moe_capacity_factor", "0.5", "--logging.jsonl", jsonl, "--logging.tensorboard",
                           tb, "--logging.moe_per_layer", "true"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_jsonl(jsonl)
    assert all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 and r["moe_imbalance"] >= 1 and r["moe_dropped"] > 0
               for r in records)
    for r in records:  # logging.moe_per_layer: each of the 4 MoE layers' share, summing to the total
        assert sorted(r["moe_aux_loss_layers"]) == ["0", "1", "2", "3"]
        assert abs(sum(r["moe_aux_loss_layers"].values()) - r["moe_aux_loss"]) < 1e-6
        assert abs(sum(r["moe_z_loss_layers"].values()) - r["moe_z_loss"]) < 1e-6
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == 2 and all("| aux " in line and "| imbalance " in line and "| dropped " in line
                                   for line in lines)
    assert_tensorboard_matches(tb, records)
