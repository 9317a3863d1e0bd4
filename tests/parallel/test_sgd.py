"""optim.name sgd (Megatron's --optimizer sgd): the single process trains as Hugging Face GPT-2
with torch.optim.SGD (momentum, L2 weight decay on the matrices only) after one global-norm clip,
under the warmup and cosine LR schedule; dp 2 at ZeRO-1 and ZeRO-3 equal the single process; the
momentum buffer is saved and resumed bitwise; another optimizer's checkpoint is refused unless
checkpoint.load_optimizer false."""

from __future__ import annotations

import io

import pytest
import torch

from helpers import (
    HF_TINY_GPT2,
    assert_momentum_checkpoints,
    hf_reference_losses,
    hf_tiny_gpt2_args,
    make_config,
    make_trainer,
    momentum_checkpoints,
    run_distributed,
)

transformers = pytest.importorskip("transformers")

HF = HF_TINY_GPT2  # the model of hf_tiny_gpt2_dir
STEPS = 4
ARGS = hf_tiny_gpt2_args(STEPS, [
    "--optim.name", "sgd", "--optim.sgd_momentum", "0.8", "--optim.lr", "0.2", "--optim.min_lr", "0.05",
    "--optim.warmup_iters", "1", "--optim.decay_style", "cosine", "--optim.clip_grad", "0.5"])


def _torch_losses(hf_tiny_gpt2_dir: str, momentum: float) -> list[float]:
    """GPT2LMHeadModel trained with torch.optim.SGD: weight decay on the matrices (megazero decays
    no 1-D parameter), the LR of megazero's schedule set before each step."""
    from megazero.train.lr import LRSchedule
    cfg = make_config(ARGS)
    o = cfg.optim
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_tiny_gpt2_dir, torch_dtype=torch.float32)
    params = list(model.parameters())
    sgd = torch.optim.SGD([{"params": [p for p in params if p.dim() > 1], "weight_decay": o.weight_decay},
                           {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                          lr=o.lr, momentum=momentum, foreach=False)

    def step(i: int) -> None:
        for g in sgd.param_groups:
            g["lr"] = LRSchedule.from_config(o, cfg.train.iters).at(i)
        sgd.step()
    return hf_reference_losses(model, STEPS, HF["vocab_size"], cfg.train.seed, o.clip_grad, step)


def _losses(hf_tiny_gpt2_dir: str) -> list[float]:
    tr = make_trainer(ARGS + ["--checkpoint.init_from_hf", hf_tiny_gpt2_dir])
    return [tr.train_step()["loss"] for _ in range(STEPS)]


def test_single_process_trains_as_transformers_with_torch_sgd(hf_tiny_gpt2_dir):
    expected = _torch_losses(hf_tiny_gpt2_dir, make_config(ARGS).optim.sgd_momentum)
    ours = run_distributed(_losses, 1, hf_tiny_gpt2_dir)[0]
    diff = max(abs(a - b) for a, b in zip(ours, expected, strict=True))
    assert diff <= 1e-5, (diff, ours, expected)
    # The momentum weighs: without it the losses land far outside that tolerance
    plain = _torch_losses(hf_tiny_gpt2_dir, 0.0)
    assert max(abs(a - b) for a, b in zip(plain, expected, strict=True)) > 1e-3, (plain, expected, diff)


# ----------------------------------------------------------------------------- layouts

TINY = ["--model.seq_length", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
        "--zero.sub_group_size", "5000", "--zero.bucket_size", "20000", "--optim.name", "sgd",
        "--optim.clip_grad", "0.5", "--optim.lr", "0.05"]


def _run(args: list[str]) -> bytes:
    """3 steps: this rank's full parameters and losses (sent by value)."""
    tr = make_trainer(TINY + args)
    losses = [tr.train_step()["loss"] for _ in range(3)]
    buf = io.BytesIO()
    torch.save({"params": tr.optimizer.sharded.full_state_dict(), "losses": losses}, buf)
    return buf.getvalue()


def _outs(world: int, args: list[str]) -> list[dict]:
    return [torch.load(io.BytesIO(r), weights_only=False) for r in run_distributed(_run, world, args)]


@pytest.fixture(scope="module")
def reference() -> dict:
    return _outs(1, [])[0]


@pytest.mark.parametrize("layout", [["--zero.stage", "1"], pytest.param(["--zero.stage", "3"], marks=pytest.mark.slow),
                                    pytest.param(["--zero.stage", "2", "--zero.offload_optimizer", "cpu"],
                                                 marks=pytest.mark.slow)])
def test_dp2_equals_single_process(reference, layout):
    for out in _outs(2, layout):
        assert max(abs(a - b) for a, b in zip(out["losses"], reference["losses"], strict=True)) <= 1e-5
        for name, p in out["params"].items():
            full = reference["params"]["transformer.wte.weight" if name == "lm_head.weight" else name]
            torch.testing.assert_close(p, full, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------------- checkpoints

def _checkpoints(root: str) -> dict:
    return momentum_checkpoints(TINY + ["--zero.stage", "1"], root)


def test_momentum_is_saved_and_resumed_bitwise(tmp_path):
    """dp 2 ZeRO-1: saved and resumed bitwise; an AdamW resume refused unless checkpoint.load_optimizer false."""
    for out in run_distributed(_checkpoints, 2, str(tmp_path)):
        assert_momentum_checkpoints(out, "sgd")
