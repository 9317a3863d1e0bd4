"""optim.name muon on the Llama family: grouped q|k|v (q wider than k and v under GQA) and
SwiGLU's gate|up are orthogonalised part by part, so the single process trains as transformers'
LlamaForCausalLM with torch.optim.Muon on q/k/v/o/gate/up/down_proj and torch.optim.AdamW on the
rest, and tp 2 (tp 2 x dp 2 ZeRO-3: slow) equals the single process."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    assert_parity,
    hf_adamw,
    hf_reference_losses,
    logged_by_layout,
    logged_losses,
    make_config,
    make_trainer,
    run_distributed,
    save_random_hf,
)

transformers = pytest.importorskip("transformers")

LLAMA = "configs/llama-tiny.yaml"  # 4 heads over 2 K/V groups, SwiGLU; config.json below agrees with it
HF = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
          tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
MUON_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STEPS = 4
LR, MUON_LR = 3e-3, 0.02
ARGS = ["--model.seq_length", "32", "--data.mock", "true", "--train.global_batch_size", "8",
        "--train.micro_batch_size", "2", "--train.iters", str(STEPS), "--optim.name", "muon", "--optim.lr", str(LR),
        "--optim.min_lr", str(LR), "--optim.muon_lr", str(MUON_LR), "--optim.decay_style", "constant",
        "--optim.warmup_iters", "0", "--optim.clip_grad", "0.5", "--optim.weight_decay", "0.1"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A random LlamaForCausalLM of llama-tiny's shape with non-trivial RMSNorm weights."""
    return save_random_hf(tmp_path_factory.mktemp("hf-llama-muon"), "llama", **HF)


def _transformers_losses(hf_dir: str) -> list[float]:
    """LlamaForCausalLM after one global-norm clip: torch.optim.Muon on the seven projections
    (already nn.Linear's (out, in)), torch.optim.AdamW on embeddings, output layer (decayed) and
    norms (not), on megazero's global batches (mock sample i depends only on (seed, i))."""
    o = make_config(ARGS, base=LLAMA).optim
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    matrices = [p for name, p in model.named_parameters() if name.endswith(tuple(f"{t}.weight" for t in MUON_TARGETS))]
    assert len(matrices) == 7 * HF["num_hidden_layers"]
    taken = {id(p) for p in matrices}
    muon = torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                            nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps, adjust_lr_fn=o.muon_adjust_lr)
    adam = hf_adamw([p for p in model.parameters() if id(p) not in taken], o, LR)
    return hf_reference_losses(model, STEPS, HF["vocab_size"], 1234, o.clip_grad,
                               lambda _: (muon.step(), adam.step()))


def _layouts(hf_dir: str, layouts: dict[str, list[str]]) -> dict[str, list[tuple[float, float]]]:
    """(loss, grad norm) of each step per layout, on the logging rank."""
    return logged_by_layout(lambda extra: logged_losses(
        lambda: make_trainer(ARGS + extra + ["--checkpoint.init_from_hf", hf_dir], base=LLAMA)), layouts)


@pytest.fixture(scope="module")
def single(hf_dir) -> dict[str, list[tuple[float, float]]]:
    return run_distributed(_layouts, 1, hf_dir, {"muon": [], "adamw": ["--optim.name", "adamw"]})[0]


def test_single_process_trains_as_transformers_with_torch_muon(hf_dir, single):
    expected = _transformers_losses(hf_dir)
    ours, adamw = ([loss for loss, _ in single[k]] for k in ("muon", "adamw"))
    # torch.optim.Muon orthogonalises in bf16 (it casts the update), megazero's fp32 run in fp32: the
    # reference's updates carry bf16 rounding, 1.3e-4 in the loss by the third step on an AVX-512 CPU
    # (under 1e-4 on earlier CI machines). The GPT-2 run (the check) stays within 1e-4.
    assert max(abs(a - b) for a, b in zip(ours, expected, strict=True)) <= 2e-4, (ours, expected)
    # Muon's steps weigh: AdamW alone lands far outside that tolerance
    assert max(abs(a - b) for a, b in zip(adamw, expected, strict=True)) > 1e-2, (adamw, expected)


def test_tp2_equals_single_process(hf_dir, single):
    """q|k|v's and gate|up's rows split over 2 TP ranks, each part gathered whole for Newton-Schulz."""
    assert_parity(run_distributed(_layouts, 2, hf_dir, {"tp2": ["--parallel.tp", "2"]})[0], single["muon"], STEPS)


@pytest.mark.slow
def test_tp2_dp2_zero3_equals_single_process(hf_dir, single):
    layout = {"tp2-dp2-zero3": ["--parallel.tp", "2", "--zero.stage", "3"]}
    assert_parity(run_distributed(_layouts, 4, hf_dir, layout)[0], single["muon"], STEPS)
