"""The Llama family (rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases, an
untied output layer): every layout equals the single process (fp32, same seed, same global
batch, losses and gradient norms within 1e-5), and one process equals Hugging Face's
LlamaForCausalLM."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_parity, logged_by_layout, logged_losses, make_trainer, run_distributed

LLAMA = "configs/llama-tiny.yaml"
ITERS = 4
SHORT = ["--train.iters", str(ITERS), "--model.seq_length", "32", "--train.global_batch_size", "8",
         "--train.micro_batch_size", "2"]


def _records(extra: list[str]) -> list[tuple[float, float]]:
    """(loss, grad norm) of each iteration, on the logging rank (empty elsewhere)."""
    return logged_losses(lambda: make_trainer(SHORT + extra, base=LLAMA))


def _layouts(layouts: dict[str, list[str]]) -> dict[str, list[tuple[float, float]]]:
    return logged_by_layout(_records, layouts)


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, float]]:
    return run_distributed(_records, 1, [])[0]


TP2, CP2 = ["--parallel.tp", "2"], ["--parallel.cp", "2"]
LAYOUTS_2 = {
    "tp2-sp": TP2 + ["--parallel.sequence_parallel", "true"],
    "cp2-ring": CP2,
    "cp2-ulysses": CP2 + ["--parallel.cp_impl", "ulysses"],  # 2 K/V groups over cp 2: sent grouped
    "pp2-1f1b": ["--parallel.pp", "2"],
}
LAYOUTS_4 = {
    "tp2-pp2-zbh1-zero1": TP2 + ["--parallel.pp", "2", "--parallel.schedule", "zbh1", "--zero.stage", "1"],
    "tp2-dp2-zero3-selective": TP2 + ["--zero.stage", "3", "--train.recompute", "selective"],
    "cp2-dp2-zero3-ring-full": CP2 + ["--zero.stage", "3", "--train.recompute", "full"],
    "dp4-zero2-offload": ["--zero.stage", "2", "--zero.offload_optimizer", "cpu"],
}
LAYOUTS_SLOW = {
    "pp2-vpp2-interleaved-sp": TP2 + ["--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.sequence_parallel",
                                      "true"],
    "pp4-gpipe": ["--parallel.pp", "4", "--parallel.schedule", "gpipe"],
    "cp4-ulysses-mqa": ["--parallel.cp", "4", "--parallel.cp_impl", "ulysses", "--model.num_query_groups", "1"],
    "tp2-cp2-ring-sp": TP2 + CP2 + ["--parallel.sequence_parallel", "true"],
    "dp4-zero3-compile": ["--zero.stage", "3", "--train.compile", "true"],
}


def test_llama_layouts_on_2_ranks(reference):
    """tp 2 with sequence parallelism, cp 2 ring and Ulysses, pp 2."""
    assert_parity(run_distributed(_layouts, 2, LAYOUTS_2)[0], reference, ITERS)


@pytest.mark.slow  # suite budget: the default run keeps tp x pp ZeRO-1, cp x dp ZeRO-3 and dp 4 ZeRO-2 in the checkpoint test
def test_llama_layouts_on_4_ranks(reference):
    """tp x pp ZB-H1 (the untied output layer on the last stage), ZeRO-3 with tp and cp,
    recompute selective and full, ZeRO-2 with the optimizer on the CPU."""
    assert_parity(run_distributed(_layouts, 4, LAYOUTS_4)[0], reference, ITERS)


@pytest.mark.slow
def test_llama_layouts_slow(reference):
    """Interleaved with sequence parallelism, pp 4 GPipe, multi-query Ulysses at cp 4 (K/V
    widened), tp x cp ring, compiled ZeRO-3."""
    mqa = run_distributed(_records, 1, ["--model.num_query_groups", "1"])[0]
    runs = run_distributed(_layouts, 4, LAYOUTS_SLOW)[0]
    assert_parity({k: v for k, v in runs.items() if "mqa" not in k}, reference, ITERS)
    assert_parity({k: v for k, v in runs.items() if "mqa" in k}, mqa, ITERS)


def test_llama_reference_learns(reference):
    """The family trains: the loss falls, every value finite."""
    longer = run_distributed(_records, 1, ["--train.iters", "8"])[0]
    assert longer[:ITERS] == reference
    assert longer[-1][0] < longer[0][0] - 0.02
    assert torch.isfinite(torch.tensor(longer)).all()


# ----------------------------------------------------------------------------- checkpoints


def _save_then_resume(save: str, first: list[str], then: dict[str, list[str]]) -> dict:
    """In one world: train `first` 4 iterations saving at 2, then each layout of `then` resumed
    from that save (iterations 3-4); the logging rank's records of each."""
    import torch.distributed as dist
    runs = {"straight": first + ["--checkpoint.save", save, "--checkpoint.interval", "2"]}
    runs.update({name: extra + ["--checkpoint.load", save, "--checkpoint.iteration", "2"]
                 for name, extra in then.items()})
    out = logged_by_layout(_records, runs)
    dist.barrier()
    return out


def test_llama_checkpoint_resumes_bitwise_and_reshards(tmp_path, reference):
    """Saved at tp 2 x pp 2 (ZeRO-1, untied output layer on the last stage): the same layout
    resumes bitwise; cp 2 x dp 2 under ZeRO-3 and, through the universal format, dp 4 under
    ZeRO-2 continue the run within 1e-5."""
    import subprocess
    import sys

    save = str(tmp_path / "ck")
    layout = TP2 + ["--parallel.pp", "2", "--zero.stage", "1"]
    got = run_distributed(_save_then_resume, 4, save, layout,
                          {"same": layout, "cp2-dp2-zero3": CP2 + ["--zero.stage", "3"]})[0]
    assert got["straight"][2:] == got["same"], (got["straight"], got["same"])
    assert_parity({"resharded": got["cp2-dp2-zero3"]}, got["straight"][2:], 2)
    universal = str(tmp_path / "universal")
    proc = subprocess.run([sys.executable, "-m", "megazero.convert", "--load", f"{save}/iter_0000002", "--to",
                           "universal", "--output", universal], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from_universal = run_distributed(_layouts, 4, {"dp4-zero2": ["--zero.stage", "2", "--checkpoint.load", universal]})
    assert_parity(from_universal[0], got["straight"][2:], 2)


def _refused(extra: list[str]) -> str:
    try:
        make_trainer(SHORT + extra, base=LLAMA)
    except Exception as e:  # the one-line refusal
        return str(e)
    return ""


def test_resume_into_another_architecture_is_refused(tmp_path):
    """A Llama checkpoint does not resume as GPT-2's block: one line naming the key."""
    save = str(tmp_path / "ck")
    run_distributed(_records, 1, ["--train.iters", "1", "--checkpoint.save", save])
    message = run_distributed(_refused, 1, ["--checkpoint.load", save, "--model.activation", "gelu"])[0]
    assert "model.activation = swiglu, but this run has gelu" in message, message
