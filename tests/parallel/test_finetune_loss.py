"""The fine-tuning loss: only completion tokens count, normalised once by the global count of
counted labels, so every layout (dp, pp, tp, each ZeRO stage) reproduces the single process."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from helpers import make_trainer, run_distributed, write_masked

ITERS = 4
# Examples of 5 to 60 tokens at seq_length 32: some padded, some truncated; micro-batches of
# 2 hold different numbers of counted labels, which a per-micro-batch mean would get wrong.
LAYOUTS = {"dp2-pp2-zero1": ["--parallel.pp", "2", "--zero.stage", "1"],
           "dp2-pp2-zero3": ["--parallel.pp", "2", "--zero.stage", "3"],
           "tp2-dp2-zero2": ["--parallel.tp", "2", "--zero.stage", "2"]}
# gpt2-tiny on the indexed examples (after "--data.prefix", PREFIX).
FINETUNE = ["--data.mock", "false", "--model.seq_length", "32", "--train.iters", str(ITERS),
            "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--optim.warmup_iters", "1",
            "--optim.lr", "3e-3"]


def _losses(tr) -> list[float]:
    with contextlib.redirect_stdout(io.StringIO()):
        records = tr.run()
    return [r["loss"] for r in records] if tr.is_logger else []


def _hand_computed_first_loss(tr) -> float:
    """Masked cross-entropy of the first global batch, from the samples' masks and plain torch."""
    import torch
    import torch.nn.functional as F
    samples = [tr.train_ds[i] for i in range(tr.cfg.train.global_batch_size)]
    tokens = torch.from_numpy(np.stack([s.tokens for s in samples]))
    mask = torch.from_numpy(np.stack([s.loss_mask for s in samples]))[:, 1:].double()
    with torch.no_grad():
        logits = tr.chunks[0](tokens[:, :-1])[..., : tr.cfg.model.vocab_size].double()
    token_loss = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return float((token_loss * mask).sum() / mask.sum())


def _single(prefix: str) -> dict:
    tr = make_trainer(FINETUNE + ["--data.prefix", prefix])
    return {"hand": _hand_computed_first_loss(tr), "losses": _losses(tr)}


def _layouts(prefix: str, layouts: dict[str, list[str]] = LAYOUTS) -> dict[str, list[float]]:
    out = {}
    for name, extra in layouts.items():  # one world, several layouts
        out[name] = _losses(make_trainer(FINETUNE + ["--data.prefix", prefix] + extra))
    return out


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    lengths = np.random.default_rng(3).integers(5, 60, 200).tolist()
    return str(write_masked(tmp_path_factory.mktemp("ft") / "ft", lengths))


@pytest.fixture(scope="module")
def reference(prefix) -> dict:
    return run_distributed(_single, 1, prefix)[0]


def _assert_layouts_equal_reference(prefix: str, reference: dict, world: int, layouts: dict[str, list[str]]) -> None:
    ranks = run_distributed(_layouts, world, prefix, layouts)
    for name in layouts:
        logged = [r[name] for r in ranks if r[name]]  # from the one logging rank of that layout
        assert len(logged) == 1 and len(logged[0]) == ITERS
        diff = max(abs(a - b) for a, b in zip(logged[0], reference["losses"], strict=True))
        assert diff <= 1e-5, (name, logged[0], reference["losses"])


def test_masked_loss_single_process_equals_hand_computed_and_every_layout(prefix, reference):
    assert len(reference["losses"]) == ITERS and reference["losses"][-1] < reference["losses"][0]
    assert abs(reference["losses"][0] - reference["hand"]) <= 1e-5, reference
    _assert_layouts_equal_reference(prefix, reference, 4, LAYOUTS)


@pytest.mark.slow
def test_masked_loss_at_tp2_pp2_dp2_every_stage_and_interleaved(prefix, reference):
    layouts = {f"tp2-pp2-dp2-zero{stage}": ["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", str(stage)]
               for stage in range(4)}
    layouts["pp2-vpp2-dp4-zero3"] = ["--parallel.pp", "2", "--parallel.vpp", "2", "--zero.stage", "3",
                                     "--parallel.schedule", "interleaved", "--train.micro_batch_size", "1"]
    _assert_layouts_equal_reference(prefix, reference, 8, layouts)


@pytest.mark.slow
def test_masked_loss_with_context_parallelism(prefix, reference):
    """Each cp rank counts its positions' labels; the loss is normalised once by the global count."""
    layouts = {"cp2-dp2-zero2-ring": ["--parallel.cp", "2", "--zero.stage", "2"],
               "cp2-pp2-ulysses": ["--parallel.cp", "2", "--parallel.cp_impl", "ulysses", "--parallel.pp", "2"]}
    _assert_layouts_equal_reference(prefix, reference, 4, layouts)
