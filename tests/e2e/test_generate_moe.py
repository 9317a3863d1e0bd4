"""Generation with mixtures of experts: greedy ids equal transformers' generate on the same
Mixtral and Qwen3-MoE directories, in memory and (Mixtral, every block alike) with the blocks
streamed from host memory (ZeRO-Inference); left-padded rows route their padding too, which
changes no real token. A model mixing dense and MoE blocks is refused offloaded, in one line."""

from __future__ import annotations

import pytest
import torch

from megazero.checkpoint.base import CheckpointError
from megazero.checkpoint.load import open_checkpoint
from megazero.generate import build_model, generate_batch
from megazero.inference.offload import build_offloaded_model
from megazero.parallel.comm import Group

transformers = pytest.importorskip("transformers")

SOLO = Group("solo", None, [0], 0)
COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=48, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
              bos_token_id=298, eos_token_id=299, num_experts_per_tok=2)
MODELS = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=48, num_local_experts=4, sliding_window=None)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=48, intermediate_size=96, num_experts=4, head_dim=24,
                       norm_topk_prob=True, mlp_only_layers=[0])),
}
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11], [60, 3, 200, 14]]
NEW_TOKENS = 8


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_equals_transformers_in_memory_and_offloaded(kind, tmp_path):
    config_class, model_class, extra = MODELS[kind]
    torch.manual_seed(0)
    hf = model_class(config_class(**COMMON, **extra)).eval()
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                            pad_token_id=0)[0].tolist() for p in PROMPTS]
    assert all(len(set(ids[len(p):])) > 2 for ids, p in zip(expected, PROMPTS, strict=True))  # not one token repeated
    ckpt = open_checkpoint(str(tmp_path / "hf"))
    assert generate_batch(build_model(ckpt, SOLO), PROMPTS, NEW_TOKENS, temperature=0.0) == expected
    if kind == "qwen3_moe":  # its first layer is dense: blocks of two shapes, which the store cannot stream
        with pytest.raises(CheckpointError, match="mixes dense and mixture-of-experts layers"):
            build_offloaded_model(ckpt, torch.device("cpu"), "cpu", str(tmp_path), True)
        return
    offloaded, streamer = build_offloaded_model(ckpt, torch.device("cpu"), "cpu", str(tmp_path), True)
    try:
        assert generate_batch(offloaded, PROMPTS, NEW_TOKENS, temperature=0.0) == expected
    finally:
        streamer.close()
