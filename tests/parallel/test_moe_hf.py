"""Mixtures of experts from and to Hugging Face (issue 45, 5 and 7): a run starts from a
transformers-saved MixtralForCausalLM (published per-expert names, sharded with an index) at
single-process, data-, tensor- (sequence-parallel, experts whole) and pipeline-parallel layouts
and trains step for step as MixtralForCausalLM + torch.optim.AdamW, whose loss the test builds
from HF's logits and router logits with Megatron's load-balancing and z-losses; convert --to hf
writes the published layout, which transformers loads as the right class with megazero's
logits; Qwen2-MoE (with q/k/v biases) and Qwen3-MoE (per-head q/k norms, a head size of its
own) come in and go out the same way; what megazero cannot represent is refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import full_logits, hf_adamw, make_config, make_trainer, run_distributed, save_random_hf

transformers = pytest.importorskip("transformers")

MIXTRAL = dict(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, num_local_experts=4,
               num_experts_per_tok=2, tie_word_embeddings=False, router_jitter_noise=0.0)
STEPS, LR, CLIP, AUX, Z = 3, 1e-3, 1.0, 0.1, 0.01  # large coefficients: the losses' gradients weigh
BATCH, MICRO, SEQ = 8, 2, 32
BASE: dict = {"data": {"mock": True}}  # no model keys: the run takes them from config.json
ARGS = ["--model.seq_length", str(SEQ), "--data.mock", "true", "--train.global_batch_size", str(BATCH),
        "--train.micro_batch_size", str(MICRO), "--train.iters", str(STEPS), "--optim.lr", str(LR), "--optim.min_lr",
        str(LR), "--optim.decay_style", "constant", "--optim.warmup_iters", "0", "--optim.clip_grad", str(CLIP),
        "--optim.weight_decay", "0.1", "--model.moe_aux_loss_coeff", str(AUX), "--model.moe_z_loss_coeff", str(Z),
        "--parallel.etp", "1"]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """A random MixtralForCausalLM (grouped K/V, untied) saved by transformers as shards with an index."""
    path = tmp_path_factory.mktemp("hf-mixtral")
    save_random_hf(path, "mixtral", shard_size="100KB", **MIXTRAL)
    keys = json.load(open(path / "model.safetensors.index.json"))["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in keys  # what save_pretrained writes
    return str(path)


# ----------------------------------------------------------------------------- training parity (issue 45, 5)

def megatron_aux_loss(logits: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """Megatron's load-balancing loss of one layer and micro-batch from its router logits [T, E]:
    coeff · E / (k · T²) · Σᵢ Pᵢ cᵢ, P the softmax over every expert summed over the tokens, c the
    tokens each expert got in the top k."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1).sum(0)
    counts = torch.bincount(logits.topk(topk, dim=-1).indices.reshape(-1), minlength=experts).float()
    return coeff * experts / (topk * tokens * tokens) * (probs * counts).sum()


def megatron_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    return coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()


def _transformers_run(hf_dir: str) -> list[tuple[float, float, float]]:
    """MixtralForCausalLM + torch.optim.AdamW on megazero's global batches: the LM loss from HF's
    logits, plus each layer's aux and z-losses per micro-batch from HF's router logits, averaged
    over the micro-batches as megazero weighs them; (LM loss, aux, z) per step."""
    from megazero.data.mock import MockGPTDataset
    o = make_config(ARGS, base=BASE, world=1).optim
    ds = MockGPTDataset(BATCH * STEPS, SEQ, MIXTRAL["vocab_size"], 1234)
    model = transformers.MixtralForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    opt = hf_adamw(list(model.parameters()), o, LR)
    out = []
    for step in range(STEPS):
        rows = torch.stack([torch.as_tensor(ds[i]) for i in range(BATCH * step, BATCH * (step + 1))]).long()
        # Samples are SEQ + 1 tokens: megazero's inputs are the first SEQ, its labels the last SEQ.
        result = model(input_ids=rows[:, :-1], output_router_logits=True)  # routing is per token: one forward
        lm = torch.nn.functional.cross_entropy(result.logits.flatten(0, 1), rows[:, 1:].flatten())
        per_micro = MICRO * SEQ  # router logits are [batch x seq, E], micro-batches in row order
        micro = [layer[m:m + per_micro] for layer in result.router_logits for m in range(0, BATCH * SEQ, per_micro)]
        aux = sum(megatron_aux_loss(logits, MIXTRAL["num_experts_per_tok"], AUX) for logits in micro) / (BATCH // MICRO)
        z = sum(megatron_z_loss(logits, Z) for logits in micro) / (BATCH // MICRO)
        opt.zero_grad()
        (lm + aux + z).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        out.append((lm.item(), aux.item(), z.item()))
    return out


def _runs(hf_dir: str, layouts: dict[str, list[str]]) -> dict[str, list]:
    """In a spawned rank: each layout trained from hf_dir; the logging rank's (loss, aux, z) per step."""
    import contextlib
    import io

    import torch.distributed as dist
    out = {}
    for name, extra in layouts.items():
        tr = make_trainer(ARGS + extra + ["--checkpoint.init_from_hf", hf_dir], base=BASE)
        with contextlib.redirect_stdout(io.StringIO()):
            records = tr.run()
        mine = [(r["loss"], r["moe_aux_loss"], r["moe_z_loss"]) for r in records] if tr.is_logger else []
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out[name] = next(r for r in everyone if r)
    return out


def _assert_as_transformers(runs: dict[str, list], expected: list) -> None:
    for name, run in runs.items():
        assert len(run) == STEPS, name
        worst = max(abs(a - b) for got, want in zip(run, expected, strict=True) for a, b in zip(got, want, strict=True))
        assert worst <= 1e-4, (name, run, expected)


def test_mixtral_from_hugging_face_trains_as_transformers(mixtral_dir):
    """tp 2 with sequence parallelism (experts whole: etp 1) and pp 2, each from the sharded HF
    directory: every step's LM, aux and z-loss equal MixtralForCausalLM + AdamW's within 1e-4 (the
    losses' gradients in the update, clipped)."""
    expected = _transformers_run(mixtral_dir)
    assert expected[-1][0] < expected[0][0] and expected[0][1] > 0.05  # it learns; the aux loss weighs
    layouts = {"tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"], "pp2": ["--parallel.pp", "2"]}
    _assert_as_transformers(run_distributed(_runs, 2, mixtral_dir, layouts)[0], expected)


@pytest.mark.slow
def test_mixtral_from_hugging_face_trains_as_transformers_in_one_process_and_dp(mixtral_dir):
    """The same in one process, and at dp 2 (ZeRO-1)."""
    expected = _transformers_run(mixtral_dir)
    _assert_as_transformers(run_distributed(_runs, 1, mixtral_dir, {"one process": []})[0], expected)
    _assert_as_transformers(run_distributed(_runs, 2, mixtral_dir, {"dp2-zero1": ["--zero.stage", "1"]})[0], expected)


# ----------------------------------------------------------------------------- reading (issue 45, 7)

def _values(hf_dir: str, **where) -> dict[str, torch.Tensor]:
    """Every parameter's starting value as checkpoint.init_from_hf reads it from hf_dir (`where`:
    HFInitialValues.value's ep / etp ranks), for the model its config.json describes."""
    from megazero.checkpoint.hf import HFInitialValues, open_hf
    from megazero.model.gpt import GPT, moe_layers
    from megazero.parallel.comm import Group
    m = open_hf(hf_dir).model_config
    with torch.device("meta"):
        model = GPT(m)
    rank, size = where.get("etp", (0, 1))
    for layer in moe_layers(model) if size > 1 else []:  # each expert split as at etp = tp (shapes only)
        layer.experts.apply_etp(Group("etp", None, list(range(size)), rank))
    reader = HFInitialValues(hf_dir, m)
    return {name: reader.value(name, p, 0, 1, **where) for name, p in model.named_parameters()}


def test_the_fused_layout_reads_as_the_published_one_and_each_rank_its_experts(mixtral_dir, tmp_path):
    """A directory holding transformers' in-memory tensors (mlp.gate, mlp.experts.gate_up_proj
    [E, 2F, h], down_proj [E, h, F]: a state_dict saved without the conversion) starts the same
    model as the published per-expert names; an expert-parallel rank reads only its experts."""
    from safetensors.torch import save_file
    model = transformers.MixtralForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32)
    fused = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and "model.layers.0.mlp.gate.weight" in fused
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(mixtral_dir, "config.json")).read())
    published, in_memory = _values(mixtral_dir), _values(str(tmp_path))
    assert published.keys() == in_memory.keys()
    for name, value in published.items():
        assert torch.equal(value, in_memory[name]), name
    c_fc = "transformer.h.1.mlp.experts.c_fc.weight"
    assert torch.equal(published[c_fc], fused["model.layers.1.mlp.experts.gate_up_proj"])
    for directory in (mixtral_dir, str(tmp_path)):  # expert-parallel rank 1 of 2: experts 2 and 3
        second = _values(directory, ep=(1, 2))
        assert torch.equal(second[c_fc], published[c_fc][2:]), directory
        assert torch.equal(second["transformer.h.0.mlp.router.weight"], published["transformer.h.0.mlp.router.weight"])
        _assert_each_rank_reads_its_expert_slices(directory, published)


def _assert_each_rank_reads_its_expert_slices(directory: str, published: dict[str, torch.Tensor]) -> None:
    """Expert-tensor-parallel rank r of 2 reads rows r of gate and of up (c_fc), columns r of down
    (c_proj), of its experts (here with ep 2's rank 1: experts 2 and 3)."""
    for r in range(2):
        mine = _values(directory, ep=(1, 2), etp=(r, 2))
        for layer in range(MIXTRAL["num_hidden_layers"]):
            c_fc, c_proj = (published[f"transformer.h.{layer}.mlp.experts.{k}.weight"][2:] for k in ("c_fc", "c_proj"))
            gate, up = (block.chunk(2, dim=1)[r] for block in c_fc.chunk(2, dim=1))
            assert torch.equal(mine[f"transformer.h.{layer}.mlp.experts.c_fc.weight"], torch.cat([gate, up], dim=1))
            assert torch.equal(mine[f"transformer.h.{layer}.mlp.experts.c_proj.weight"], c_proj.chunk(2, dim=2)[r])


# ----------------------------------------------------------------------------- convert --to hf (issue 45, 7)

ROWS = torch.randint(0, MIXTRAL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


def _one_step_saved(hf_dir: str, save: str, extra: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """From hf_dir at `extra`'s layout, the model's logits of ROWS at the start and after one step,
    which is saved."""
    t = make_trainer(ARGS + extra + ["--train.iters", "1", "--checkpoint.init_from_hf", hf_dir,
                                     "--checkpoint.save", save], base=BASE)
    start = full_logits(t, ROWS)
    t.train_step()
    t.checkpoints.save(t.iteration, last=False)
    return start, full_logits(t, ROWS)


def _export(hf_dir: str, tmp_path, world: int, extra: list[str]) -> tuple[str, torch.Tensor, torch.Tensor]:
    """The convert --to hf export of one step from hf_dir; the logits at the start and of the export."""
    from megazero.convert import main as convert
    save, export = str(tmp_path / "save"), str(tmp_path / "export")
    start, stepped = run_distributed(_one_step_saved, world, hf_dir, save, extra)[0]
    convert(["--load", save, "--to", "hf", "--output", export])
    return export, start, stepped


def test_mixtral_exports_as_mixtral_with_its_logits(mixtral_dir, tmp_path):
    """At tp 2 with sequence parallelism and each expert split over the TP group (etp 2: every rank
    reads its slice of every expert) the run starts with transformers' logits; a step, converted
    with --to hf: the published per-expert names, loaded by transformers as MixtralForCausalLM,
    logits within 1e-5."""
    from safetensors import safe_open
    export, started, expected = _export(mixtral_dir, tmp_path, 2, ["--parallel.tp", "2", "--parallel.sequence_parallel",
                                                                   "true", "--parallel.etp", "2"])
    with torch.no_grad():
        original = transformers.MixtralForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
        assert (original(ROWS).logits - started).abs().max() <= 1e-5
    with safe_open(os.path.join(export, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w1.weight",
            "model.layers.0.block_sparse_moe.experts.0.w2.weight"} <= keys
    assert not any("gate_up_proj" in k or ".mlp." in k for k in keys)
    config = json.load(open(os.path.join(export, "config.json")))
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"],
            config["router_aux_loss_coef"]) == (4, 2, 48, AUX)
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        assert type(hf).__name__ == "MixtralForCausalLM"
        got = hf(ROWS).logits
    assert (got - expected).abs().max() <= 1e-5


QWEN2_MOE = dict(vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
                 shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64, rms_norm_eps=1e-5, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=False, mlp_only_layers=[1], qkv_bias=True, tie_word_embeddings=False)
QWEN3_MOE = dict(vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
                 rms_norm_eps=1e-5, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                 tie_word_embeddings=False)


def _comes_in_and_goes_out(hf_dir: str, tmp_path, cls: str) -> None:
    """hf_dir's logits at tp 2 (experts whole) equal transformers', and the export of one step
    loads as `cls` with the stepped model's logits (1e-5)."""
    with torch.no_grad():
        before = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ROWS).logits
    export, started, expected = _export(hf_dir, tmp_path, 2, ["--parallel.tp", "2"])
    assert (started - before).abs().max() <= 1e-5
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        assert type(hf).__name__ == cls
        got = hf(ROWS).logits
    assert (got - expected).abs().max() <= 1e-5


def test_qwen2_moe_comes_in_and_goes_out(tmp_path):
    """Qwen2-MoE with q/k/v biases (a gated shared expert, softmax before the top k, layer 1
    dense): the run takes its keys from config.json, its logits at tp 2 equal transformers',
    and its export loads as Qwen2MoeForCausalLM with the same logits (1e-5)."""
    hf_dir = save_random_hf(tmp_path / "hf", "qwen2_moe", **QWEN2_MOE)
    m = make_config(ARGS + ["--checkpoint.init_from_hf", hf_dir], base=BASE, world=1).model
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_layer_freq, m.ffn_hidden_size, m.moe_router_pre_softmax,
            m.moe_shared_expert_ffn_hidden_size, m.moe_shared_expert_gate, m.qkv_bias, m.bias) == (
        4, 24, [1, 0], 80, True, 40, True, True, False)
    _comes_in_and_goes_out(hf_dir, tmp_path, "Qwen2MoeForCausalLM")
    assert json.load(open(os.path.join(tmp_path, "export", "config.json")))["qkv_bias"] is True


def test_qwen3_moe_comes_in_and_goes_out(tmp_path):
    """Qwen3-MoE (per-head q/k norms, heads of 24 beside h / heads 16, top k then softmax over the
    k, layer 0 dense, no shared expert): model.qk_layernorm and model.kv_channels from config.json,
    logits at tp 2 equal transformers', the export loads as Qwen3MoeForCausalLM with the same
    logits (1e-5)."""
    hf_dir = save_random_hf(tmp_path / "hf", "qwen3_moe", **QWEN3_MOE)
    m = make_config(ARGS + ["--checkpoint.init_from_hf", hf_dir], base=BASE, world=1).model
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_layer_freq, m.ffn_hidden_size, m.moe_router_pre_softmax,
            m.moe_shared_expert_ffn_hidden_size, m.qk_layernorm, m.kv_channels, m.qkv_bias) == (
        4, 24, [0, 1], 80, False, 0, True, 24, False)
    _comes_in_and_goes_out(hf_dir, tmp_path, "Qwen3MoeForCausalLM")
    config = json.load(open(os.path.join(tmp_path, "export", "config.json")))
    assert (config["head_dim"], config["mlp_only_layers"], config["norm_topk_prob"]) == (24, [0], True)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("family, config, refusal", [
    ("olmoe", {**{k: v for k, v in QWEN2_MOE.items() if "shared" not in k and k not in ("qkv_bias", "mlp_only_layers")},
               "clip_qkv": 8.0}, r"clip_qkv 8.0: megazero does not clip q, k and v"),
])
def test_what_megazero_cannot_compute_yet_is_refused_in_one_line(tmp_path, family, config, refusal):
    from megazero.config import ConfigError
    hf_dir = save_random_hf(tmp_path, family, **config)
    with pytest.raises(ConfigError, match=refusal) as refused:
        make_config(ARGS + ["--checkpoint.init_from_hf", hf_dir], base=BASE, world=1)
    assert "\n" not in str(refused.value)


def test_an_moe_without_a_hugging_face_class_is_refused_at_export():
    """Sigmoid routing (DeepSeek-V3), pre-softmax routing without a shared expert or q/k norms, or
    q/k norms with a shared expert, has no class among Mixtral, Qwen2-MoE and Qwen3-MoE: refused in
    one line naming the key; q/k norms alone are Qwen3-MoE."""
    from megazero.checkpoint.hf_names import hf_config
    from megazero.config import ConfigError, ModelConfig
    family = dict(normalization="rmsnorm", position_embedding="rope", activation="swiglu", bias=False, vocab_size=300,
                  num_experts=4)
    with pytest.raises(ConfigError, match=r"model.moe_router_score_function 'sigmoid' has no equivalent in Hugging "
                                          r"Face's Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE; .* need model.moe_router_score_function "
                                          r"'softmax'"):
        hf_config(ModelConfig(**family, moe_router_score_function="sigmoid"))
    with pytest.raises(ConfigError, match=r"model.moe_router_pre_softmax true without a shared expert"):
        hf_config(ModelConfig(**family, moe_router_pre_softmax=True))
    with pytest.raises(ConfigError, match=r"model.moe_shared_expert_ffn_hidden_size 32 with model.qk_layernorm "
                                          r"true: Qwen3-MoE, .* has none"):
        hf_config(ModelConfig(**family, qk_layernorm=True, moe_shared_expert_ffn_hidden_size=32,
                              moe_shared_expert_gate=True))
    assert hf_config(ModelConfig(**family))["architectures"] == ["MixtralForCausalLM"]
    assert hf_config(ModelConfig(**family, qk_layernorm=True, moe_router_pre_softmax=True))["architectures"] == [
        "Qwen3MoeForCausalLM"]
