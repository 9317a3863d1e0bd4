"""LoRA on a mixture of experts (issue 45, 4 and 7): beside the attention projections, each
expert's gate, up and down matrices get an adapter of their own (stacked [E, r, in] / [E, out, r],
experts whole on every rank). From a transformers-saved MixtralForCausalLM, a fine-tune at dp 2
(ZeRO-3) equals the single process; the adapter directory is PEFT's (per-expert names
block_sparse_moe.experts.{j}.w1 / w3 / w2, target_modules w1, w3, w2), which peft's PeftModel
loads on transformers' MixtralForCausalLM with megazero's logits, as does the --merge-lora export."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import full_logits, make_trainer, run_distributed, save_random_hf

transformers = pytest.importorskip("transformers")

MIXTRAL = dict(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, num_local_experts=4,
               num_experts_per_tok=2, tie_word_embeddings=False, router_jitter_noise=0.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"]  # Mixtral's names for the experts' gate, up, down
BASE: dict = {"data": {"mock": True}}
ARGS = ["--model.seq_length", "32", "--data.mock", "true", "--train.global_batch_size", "8",
        "--train.micro_batch_size", "2", "--optim.lr", "2e-2", "--optim.min_lr", "2e-2", "--optim.decay_style",
        "constant", "--optim.warmup_iters", "0", "--model.moe_aux_loss_coeff", "0.1", "--model.moe_z_loss_coeff",
        "0.01", "--parallel.etp", "1", "--finetune.lora_rank", "4", "--finetune.lora_alpha", "8",
        "--finetune.lora_targets", *TARGETS]
STEPS = 3
ROWS = torch.randint(0, MIXTRAL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    return save_random_hf(tmp_path_factory.mktemp("hf-mixtral"), "mixtral", **MIXTRAL)


def _fine_tune(hf_dir: str, save: str, extra: list[str]) -> tuple[list[float], torch.Tensor]:
    """STEPS LoRA steps from hf_dir at `extra`'s layout, saved: the losses and the logits of ROWS."""
    t = make_trainer(ARGS + extra + ["--train.iters", str(STEPS), "--checkpoint.init_from_hf", hf_dir,
                                     "--checkpoint.save", save], base=BASE)
    losses = [t.train_step()["loss"] for _ in range(STEPS)]
    t.checkpoints.save(t.iteration, last=False)
    return losses, full_logits(t, ROWS)


@pytest.fixture(scope="module")
def one(mixtral_dir, tmp_path_factory) -> tuple[str, list[float], torch.Tensor]:
    save = str(tmp_path_factory.mktemp("lora-one") / "save")
    losses, logits = run_distributed(_fine_tune, 1, mixtral_dir, save, [])[0]
    return save, losses, logits


@pytest.mark.parametrize("layout", [pytest.param(["--zero.stage", "3"], marks=pytest.mark.slow),
                                    ["--parallel.ep", "2", "--zero.stage", "1"],
                                    pytest.param(["--parallel.tp", "2"], marks=pytest.mark.slow),
                                    ["--parallel.tp", "2", "--parallel.etp", "2"]],
                         ids=["dp2-zero3", "ep2-zero1", "tp2-etp1", "tp2-etp2"])
def test_expert_adapters_at_2_ranks_equal_the_single_process(mixtral_dir, one, tmp_path, layout):
    """At ep 2 each rank holds its experts' adapters, at etp 2 its part of every expert's; the
    exported adapter gathers them all."""
    from safetensors.torch import load_file
    save, expected, logits = one[0], one[1], one[2]
    per_rank = run_distributed(_fine_tune, 2, mixtral_dir, str(tmp_path / "save"), layout)
    for losses, got in per_rank:
        assert max(abs(a - b) for a, b in zip(losses, expected, strict=True)) <= 1e-5, (losses, expected)
        assert (got - logits).abs().max() <= 1e-5
    adapter = os.path.join(f"iter_{STEPS:07d}", "adapter", "adapter_model.safetensors")
    mine, reference = load_file(str(tmp_path / "save" / adapter)), load_file(os.path.join(save, adapter))
    assert mine.keys() == reference.keys()
    assert max((mine[k] - reference[k]).abs().max().item() for k in mine) <= 1e-5


def test_expert_adapters_load_in_peft_on_mixtral_and_merge(mixtral_dir, one, tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from megazero.convert import main as convert
    save, _, expected = one
    ckpt = os.path.join(save, f"iter_{STEPS:07d}")
    adapter = os.path.join(ckpt, "adapter")
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"]
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    experts = MIXTRAL["num_local_experts"]
    assert len(tensors) == 2 * (4 + 3 * experts) * 2  # layers x (attention + each expert's w1, w3, w2) x (A, B)
    expert = "base_model.model.model.layers.1.block_sparse_moe.experts.3"
    assert tensors[f"{expert}.w1.lora_A.weight"].shape == (4, 64)
    assert tensors[f"{expert}.w3.lora_B.weight"].shape == (48, 4)
    assert tensors[f"{expert}.w2.lora_A.weight"].shape == (4, 48)
    assert all(t.abs().sum() > 0 for t in tensors.values())  # every expert's adapter trained and whole
    merged = str(tmp_path / "merged")
    convert(["--load", ckpt, "--to", "hf", "--output", merged, "--merge-lora"])
    with torch.no_grad():
        plain = transformers.MixtralForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
        unadapted = plain(ROWS).logits
        adapted = peft.PeftModel.from_pretrained(plain, adapter).eval()
        got = adapted(ROWS).logits
        folded = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ROWS).logits
        for name, p in adapted.named_parameters():  # PEFT applied the experts' adapters: without them, other logits
            if "experts" in name and "lora_B" in name:
                p.zero_()
        attention_only = adapted(ROWS).logits
    assert (unadapted - expected).abs().max() > 1e-3 and (attention_only - expected).abs().max() > 1e-3
    assert (got - expected).abs().max() <= 1e-5
    assert (folded - expected).abs().max() <= 1e-5


QWEN3_MOE = dict(vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
                 rms_norm_eps=1e-5, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
                 tie_word_embeddings=False)
QWEN_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def test_qwen3_moe_expert_adapters_load_in_peft(tmp_path):
    """Qwen's names: mlp.experts.{j}.gate_proj / up_proj / down_proj, target_modules as given; PEFT
    on transformers' Qwen3MoeForCausalLM gives megazero's logits (1e-5)."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    hf_dir = save_random_hf(tmp_path / "hf", "qwen3_moe", **QWEN3_MOE)
    targets = ["--finetune.lora_targets", *QWEN_TARGETS]
    _, expected = run_distributed(_fine_tune, 1, hf_dir, str(tmp_path / "save"), targets)[0]
    adapter = os.path.join(tmp_path, "save", f"iter_{STEPS:07d}", "adapter")
    assert json.load(open(os.path.join(adapter, "adapter_config.json")))["target_modules"] == QWEN_TARGETS
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert tensors["base_model.model.model.layers.0.mlp.experts.2.up_proj.lora_B.weight"].shape == (24, 4)
    assert tensors["base_model.model.model.layers.1.mlp.experts.0.down_proj.lora_A.weight"].shape == (4, 24)
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        assert type(plain).__name__ == "Qwen3MoeForCausalLM"
        got = peft.PeftModel.from_pretrained(plain, adapter).eval()(ROWS).logits
    assert (got - expected).abs().max() <= 1e-5
