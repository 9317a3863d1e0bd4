"""Which Hugging Face architecture a megazero model is, and where each of its tensors lives there.

Eight architectures, chosen by the model section:

    gpt2   GPT2LMHeadModel: learned positions, LayerNorm, GELU, biases, tied output layer.
           Names are megazero's own; the four projections are Conv1D ([in, out]) in HF.
    llama  LlamaForCausalLM: rotary positions, RMSNorm, SwiGLU (any q/K/V grouping, biases
           on or off, tied or untied output layer). megazero's fused projections are
           several HF tensors stacked along dim 0:
               attn.c_attn  = self_attn.q_proj | k_proj | v_proj
               mlp.c_fc     = mlp.gate_proj | up_proj
           and the others are renamed one to one.
    qwen2  Qwen2ForCausalLM: Llama's names; biases on q, k and v only (model.bias false,
           model.qkv_bias true).
    qwen3  Qwen3ForCausalLM: Llama's names plus self_attn.q_norm / k_norm (model.qk_layernorm);
           no biases. Each family's head size is config.json's head_dim (model.kv_channels).
    mixtral    MixtralForCausalLM: Llama's attention and norms, every MLP a mixture of experts
           (top-k of the logits, softmax over the k), under block_sparse_moe:
               mlp.router                 = block_sparse_moe.gate
               mlp.experts.c_fc[j]        = block_sparse_moe.experts.{j}.w1 | w3   (gate | up)
               mlp.experts.c_proj[j]      = block_sparse_moe.experts.{j}.w2
    qwen2_moe  Qwen2MoeForCausalLM: the same under mlp. (experts.{j}.gate_proj | up_proj,
           down_proj), softmax over every expert first unless norm_topk_prob, a sigmoid-gated
           shared expert (mlp.shared_expert.*, mlp.shared_expert_gate), dense layers where
           mlp_only_layers says (Llama's names), Qwen2's q/k/v biases where qkv_bias says.
    qwen3_moe  Qwen3MoeForCausalLM: Qwen2-MoE's experts and router without the shared expert,
           Qwen3's attention (self_attn.q_norm / k_norm: model.qk_layernorm; no biases).
    olmoe  OlmoeForCausalLM: Qwen3-MoE's names, every layer MoE, its q_norm / k_norm over the
           whole q and k projections (model.qk_layernorm_scope projection), head size h / heads.

The experts' weights are 3-D here ([E, out, in]) and one matrix per expert in the published
files (what save_pretrained writes); transformers' own modules hold them fused 3-D
(mlp.experts.gate_up_proj [E, 2F, h], mlp.experts.down_proj [E, h, F]), which is what a
state_dict saved without its conversion holds, and which the reader takes too (`fused_key`).

`pieces(name, m)` lists the HF tensors whose rows, stacked, make megazero tensor `name`
(without the vocabulary padding): export splits along them, import stacks them, and
init_from_hf reads each rank's rows from the piece that holds them. A 3-D tensor (`STACKED`:
the experts, and the [1, 1, h] shared-expert gate) is a stack of 2-D ones along dim 0:
`expert_pieces(name, m, j)` lists the pieces of its slice j.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from megazero.config import ConfigError, ModelConfig

GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
EMBEDDING, HEAD = "transformer.wte.weight", "lm_head.weight"

_LLAMA_BLOCK = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
                "attn.c_proj.weight": "self_attn.o_proj.weight", "attn.c_proj.bias": "self_attn.o_proj.bias",
                "mlp.c_proj.weight": "mlp.down_proj.weight", "mlp.c_proj.bias": "mlp.down_proj.bias",
                "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
_LLAMA_FUSED = {"attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.c_fc": ("mlp.gate_proj", "mlp.up_proj")}
# A Qwen2-MoE layer's shared expert: a dense SwiGLU MLP under its own names.
_SHARED_BLOCK = {"mlp.shared_expert.c_proj.weight": "mlp.shared_expert.down_proj.weight"}
_SHARED_FUSED = {"mlp.shared_expert.c_fc": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")}
STACKED = ("mlp.experts.c_fc.weight", "mlp.experts.c_proj.weight", "mlp.shared_expert_gate.weight")
# Each architecture's MoE module and its experts' projections: (module, gate, up, down).
_MOE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
              "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj")}
_LLAMA_TOP = {EMBEDDING: "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
              HEAD: "lm_head.weight"}

# The model keys each architecture fixes: (key, value).
_GPT2 = [("normalization", "layernorm"), ("position_embedding", "learned"), ("activation", "gelu"),
         ("bias", True), ("tie_embeddings", True), ("num_query_groups", 0), ("zero_centered_norm", False)]
_LLAMA = [("normalization", "rmsnorm"), ("position_embedding", "rope"), ("activation", "swiglu"),
          ("zero_centered_norm", False)]
# What Qwen2 and Qwen3 fix beyond Llama's keys: Qwen2's q/k/v biases alone, Qwen3's QK-norm without biases.
_QWEN2: list[tuple[str, object]] = [("bias", False), ("qk_layernorm", False)]
_QWEN3: list[tuple[str, object]] = [("bias", False), ("qkv_bias", False), ("qk_layernorm_scope", "head")]
_HF_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


class Piece(NamedTuple):
    key: str
    """The HF tensor's name."""
    rows: int
    """How many rows (dim 0) of the megazero tensor it holds."""
    transposed: bool
    """Stored [in, out] in HF (GPT-2's Conv1D)."""


def architecture(m: ModelConfig) -> str:
    """gpt2, llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe or olmoe, by the model section; refused
    in one line when it is none."""
    if m.position_embedding == "learned":
        # GPT-2's heads are h / heads wide; its biases cover q, k and v already.
        same = {"num_query_groups": m.query_groups == m.num_heads, "kv_channels": m.q_width == m.hidden_size,
                "qkv_bias": m.bias}
        wrong = [(k, v) for k, v in _GPT2 + [("qk_layernorm", False), ("kv_channels", 0), ("qkv_bias", False)]
                 if getattr(m, k) != v and not same.get(k)]
        if not wrong:
            return "gpt2"
        family = "GPT-2 (learned positions)"
    else:
        name, family = "llama", "Llama (rotary positions)"
        # A mixture of experts: _moe_architecture says which class, and refuses what none of them has.
        if m.qk_layernorm and not m.num_experts:  # QK-norm is Qwen3's
            name, family = "qwen3", "Qwen3 (QK-norm)"
        elif m.qkv_bias and not m.bias and not m.num_experts:  # biases on q, k, v alone are Qwen2's (with model.bias they are Llama's)
            name, family = "qwen2", "Qwen2 (q/k/v biases)"
        extra = {"qwen2": _QWEN2, "qwen3": _QWEN3}.get(name, [])
        wrong = [(k, v) for k, v in _LLAMA + extra if getattr(m, k) != v]
        if not wrong:
            return _moe_architecture(m) if m.num_experts else name
    key, value = wrong[0]
    raise ConfigError(f"model.{key} {getattr(m, key)!r} has no Hugging Face {family} equivalent; Hugging Face "
                      f"export and import need model.{key} {value!r}")


def _moe_architecture(m: ModelConfig) -> str:
    """mixtral, qwen2_moe, qwen3_moe or olmoe for a mixture of experts of the Llama family; what none
    of these classes computes is refused in one line naming the key and the value they need."""
    refused = [("moe_router_score_function", "softmax", m.moe_router_score_function != "softmax"),
               ("moe_router_topk_scaling_factor", None, m.moe_router_topk_scaling_factor not in (None, 1.0)),
               ("moe_router_num_groups", 0, m.moe_router_num_groups > 0),
               ("moe_router_enable_expert_bias", False, m.moe_router_enable_expert_bias),
               ("moe_capacity_factor", None, m.moe_capacity_factor is not None),  # HF's experts are dropless
               ("bias", False, m.bias)]
    for key, value, wrong in refused:
        if wrong:
            raise ConfigError(f"model.{key} {getattr(m, key)!r} has no equivalent in Hugging Face's Mixtral, "
                              f"Qwen2-MoE, Qwen3-MoE or OLMoE; Hugging Face export and import of a mixture of experts "
                              f"need model.{key} {value!r}")
    if m.qk_layernorm and m.qk_layernorm_scope == "projection":
        return _olmoe(m)
    if m.qk_layernorm:  # Qwen3-MoE's attention: no shared expert, no biases
        clash = ("moe_shared_expert_ffn_hidden_size", 0) if m.moe_shared_expert_ffn_hidden_size else \
            ("qkv_bias", False) if m.qkv_bias else None
        if clash:
            raise ConfigError(f"model.{clash[0]} {getattr(m, clash[0])!r} with model.qk_layernorm true: Qwen3-MoE, "
                              f"the mixture of experts with per-head q/k norms, has none; Hugging Face export and "
                              f"import need model.{clash[0]} {clash[1]!r}")
        return "qwen3_moe"
    if m.moe_shared_expert_ffn_hidden_size:
        if not m.moe_shared_expert_gate:
            raise ConfigError("model.moe_shared_expert_gate false: Qwen2-MoE gates its shared expert; Hugging Face "
                              "export and import need model.moe_shared_expert_gate true")
        return "qwen2_moe"
    dense = [i for i in range(m.num_layers) if not _is_moe(m, i)]
    if m.moe_router_pre_softmax or dense or m.qkv_bias:
        reason = (f"dense layers {dense}" if dense else "model.moe_router_pre_softmax true" if m.moe_router_pre_softmax
                  else "model.qkv_bias true")
        raise ConfigError(f"{reason} without a shared expert: Mixtral has neither, and Qwen2-MoE, which has, always "
                          f"has a shared expert; Hugging Face export needs model.moe_shared_expert_ffn_hidden_size "
                          f"> 0 with model.moe_shared_expert_gate true, or (without q/k/v biases) Qwen3-MoE's "
                          f"model.qk_layernorm true, or a Mixtral-style model")
    return "mixtral"


def _olmoe(m: ModelConfig) -> str:
    """OLMoE, the mixture of experts with q/k norms over the whole projections: every layer MoE, no
    shared expert or biases, heads h / heads wide (its q_norm is hidden_size wide)."""
    dense = [i for i in range(m.num_layers) if not _is_moe(m, i)]
    clash = ("moe_shared_expert_ffn_hidden_size", 0) if m.moe_shared_expert_ffn_hidden_size else \
        ("qkv_bias", False) if m.qkv_bias else ("kv_channels", 0) if m.q_width != m.hidden_size else \
        ("moe_layer_freq", 1) if dense else None
    if clash:
        raise ConfigError(f"model.{clash[0]} {getattr(m, clash[0])!r} with model.qk_layernorm_scope projection: OLMoE, "
                          f"the mixture of experts with q/k norms over the whole projections, has none; Hugging Face "
                          f"export and import need model.{clash[0]} {clash[1]!r}")
    return "olmoe"


def _is_moe(m: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` is an MoE layer, as model.gpt.is_moe_layer says: repeated here because
    this module stays torch-free (config resolution reads it before torch is imported)."""
    freq = m.moe_layer_freq
    return bool(m.num_experts) and (bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0)


def pieces(name: str, m: ModelConfig) -> list[Piece]:
    """The HF tensors that make megazero tensor `name` (full, unpadded), in row order."""
    arch = architecture(m)
    if arch == "gpt2":
        return [Piece(name, -1, name.endswith(GPT2_CONV1D))]  # rows: all of them
    if name in _LLAMA_TOP:
        return [Piece(_LLAMA_TOP[name], -1, False)]
    layer, rest = _in_block(name)
    if rest == "mlp.router.weight":
        return [Piece(f"{layer}{_MOE_NAMES[arch][0]}.gate.weight", -1, False)]
    whole = {**_LLAMA_BLOCK, **_SHARED_BLOCK}
    if rest in whole:
        return [Piece(layer + whole[rest], -1, False)]
    module, kind = rest.rsplit(".", 1)
    q, kv, ffn, shared = m.q_width, m.kv_width, m.ffn_size, m.moe_shared_expert_ffn_hidden_size
    rows = {"attn.c_attn": (q, kv, kv), "mlp.c_fc": (ffn, ffn), "mlp.shared_expert.c_fc": (shared, shared)}[module]
    fused = {**_LLAMA_FUSED, **_SHARED_FUSED}[module]
    return [Piece(f"{layer}{hf}.{kind}", r, False) for hf, r in zip(fused, rows, strict=True)]


def expert_pieces(name: str, m: ModelConfig, j: int) -> list[Piece]:
    """The HF tensors that make slice j (expert j) of a STACKED megazero tensor, in row order."""
    layer, rest = _in_block(name)
    if rest == "mlp.shared_expert_gate.weight":  # [1, 1, h] here, [1, h] there
        return [Piece(f"{layer}mlp.shared_expert_gate.weight", -1, False)]
    module, gate, up, down = _MOE_NAMES[architecture(m)]
    expert = f"{layer}{module}.experts.{j}."
    if rest == "mlp.experts.c_proj.weight":
        return [Piece(f"{expert}{down}.weight", -1, False)]
    assert rest == "mlp.experts.c_fc.weight", name
    return [Piece(f"{expert}{gate}.weight", m.moe_ffn_size, False), Piece(f"{expert}{up}.weight", m.moe_ffn_size, False)]


def fused_key(name: str) -> str | None:
    """The 3-D tensor of transformers' modules equal to STACKED megazero tensor `name` (the same
    [E, 2F, h] gate | up and [E, h, F] layouts, for every architecture under mlp.), None for
    the shared-expert gate, which has no such form."""
    layer, rest = _in_block(name)
    fused = {"mlp.experts.c_fc.weight": "mlp.experts.gate_up_proj", "mlp.experts.c_proj.weight": "mlp.experts.down_proj"}
    return layer + fused[rest] if rest in fused else None


def in_memory_key(key: str) -> str:
    """The name transformers' Mixtral module gives a published tensor: its conversion mapping
    renames block_sparse_moe to mlp on load (and back on save), so a state_dict saved
    without that conversion has the router at mlp.gate.weight."""
    return key.replace(".block_sparse_moe.", ".mlp.")


def _in_block(name: str) -> tuple[str, str]:
    """transformer.h.{i}.REST -> (model.layers.{i}., REST)."""
    prefix, h, block, rest = name.split(".", 3)
    assert (prefix, h) == ("transformer", "h"), name
    return f"model.layers.{block}.", rest


def hf_module(rest: str) -> str | None:
    """The LlamaForCausalLM module (inside model.layers.{i}) of megazero's projection `rest`
    inside a block: a whole one (attn.c_proj: self_attn.o_proj) or a part of a fused one
    (attn.c_attn.q_proj: self_attn.q_proj); None for what Llama has no module for."""
    if rest + ".weight" in _LLAMA_BLOCK:
        return _LLAMA_BLOCK[rest + ".weight"].removesuffix(".weight")
    module, _, part = rest.rpartition(".")
    return next((hf for hf in _LLAMA_FUSED.get(module, ()) if hf.endswith("." + part)), None)


def hf_adapter_name(name: str) -> str:
    """The LlamaForCausalLM name of a LoRA weight of the family (transformer.h.{i}.attn.c_attn
    .q_proj.lora_A.weight: model.layers.{i}.self_attn.q_proj.lora_A.weight), as PEFT names it
    behind base_model.model.; a name without a Llama module is kept."""
    head, lora, kind = name.rsplit(".", 2)
    prefix, h, block, rest = head.split(".", 3)
    hf = hf_module(rest)
    if (prefix, h) != ("transformer", "h") or hf is None:
        return name
    return f"model.layers.{block}.{hf}.{lora}.{kind}"


def hf_expert_adapter_name(name: str, m: ModelConfig) -> str:
    """The published per-expert name of one expert's LoRA weight (transformer.h.{i}.mlp.experts.{j}
    .c_fc.gate_proj.lora_A.weight: model.layers.{i}.block_sparse_moe.experts.{j}.w1.lora_A.weight for
    Mixtral, ...mlp.experts.{j}.gate_proj... for the Qwen models), as PEFT names it behind base_model.model."""
    head, lora, kind = name.rsplit(".", 2)
    layer, rest = _in_block(head)
    j, projection = rest.removeprefix("mlp.experts.").split(".", 1)
    module, gate, up, down = _MOE_NAMES[architecture(m)]
    hf = {"c_fc.gate_proj": gate, "c_fc.up_proj": up, "c_proj": down}[projection]
    return f"{layer}{module}.experts.{j}.{hf}.{lora}.{kind}"


def hf_config(m: ModelConfig, eos_token_id: int | None = None) -> dict:
    """The config.json of a megazero model, for its architecture."""
    assert isinstance(m.vocab_size, int)
    eos = m.vocab_size - 1 if eos_token_id is None else eos_token_id
    if architecture(m) == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": m.vocab_size, "n_positions": m.seq_length, "n_ctx": m.seq_length,
            "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_heads,
            "n_inner": m.ffn_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": m.layernorm_eps, "initializer_range": m.init_std,
            "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
            "tie_word_embeddings": True, "bos_token_id": eos, "eos_token_id": eos,
        }
    scaling = None
    if m.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": m.rope_scaling_factor, "low_freq_factor": m.rope_low_freq_factor,
                   "high_freq_factor": m.rope_high_freq_factor,
                   "original_max_position_embeddings": m.rope_original_max_position}
    kind = architecture(m)
    # Llama says where its biases are; Qwen2's are always on q, k, v alone and Qwen3 has none (refused otherwise);
    # the mixtures of experts say theirs in _moe_hf_config.
    biases = {"attention_bias": m.bias, "mlp_bias": m.bias} if kind == "llama" else \
        {"attention_bias": False} if kind == "qwen3" else {}
    sliding = {"use_sliding_window": False} if kind in ("qwen2", "qwen3") else {}
    llama = {
        "architectures": [_HF_CLASS[kind]], "model_type": kind,
        "vocab_size": m.vocab_size, "max_position_embeddings": m.seq_length, "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.query_groups, "head_dim": m.head_dim, "hidden_act": "silu",
        "rms_norm_eps": m.layernorm_eps, "rope_theta": m.rope_base, "rope_scaling": scaling,
        **biases, **sliding, "attention_dropout": m.dropout,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "bos_token_id": eos, "eos_token_id": eos,
    }
    return _moe_hf_config(m, kind, llama) if m.num_experts else llama


def _moe_hf_config(m: ModelConfig, arch: str, llama: dict) -> dict:
    """Mixtral's, Qwen2-MoE's or Qwen3-MoE's config.json (`arch`): Llama's attention and norms
    (Qwen3's q/k norms), and the experts.
    HF adds its load-balancing loss only with output_router_logits, so that says whether the run
    had one."""
    common = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    moe = {"num_experts_per_tok": m.moe_router_topk, "router_aux_loss_coef": m.moe_aux_loss_coeff,
           "output_router_logits": m.moe_aux_loss_coeff > 0}
    if arch == "mixtral":
        return {**common, **moe, "intermediate_size": m.moe_ffn_size, "num_local_experts": m.num_experts, "sliding_window": None,
                "router_jitter_noise": 0.0}
    qwen = {"num_experts": m.num_experts, "moe_intermediate_size": m.moe_ffn_size,
            "norm_topk_prob": not m.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(m.num_layers) if not _is_moe(m, i)], "use_sliding_window": False}
    if arch == "qwen3_moe":
        return {**common, **moe, **qwen, "attention_bias": False}
    if arch == "olmoe":  # its experts are intermediate_size wide; every layer is MoE
        return {**common, **moe, "num_experts": m.num_experts, "intermediate_size": m.moe_ffn_size,
                "norm_topk_prob": not m.moe_router_pre_softmax, "attention_bias": False, "clip_qkv": None}
    return {**common, **moe, **qwen, "shared_expert_intermediate_size": m.moe_shared_expert_ffn_hidden_size,
            "qkv_bias": m.qkv_bias}


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The megazero model section equivalent to an HF config.json (GPT-2, Llama, Qwen2, Qwen3 or a
    mixture of experts)."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        inner = hf.get("n_inner") or 0
        return ModelConfig(num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_heads=hf["n_head"],
                           seq_length=hf["n_positions"], vocab_size=hf["vocab_size"],
                           ffn_hidden_size=0 if inner == 4 * hf["n_embd"] else inner,
                           layernorm_eps=hf.get("layer_norm_epsilon", 1e-5),
                           init_std=hf.get("initializer_range", 0.02), dropout=0.0)
    if kind in ("llama", "qwen2", "qwen3"):
        return _llama_config(hf, kind)
    if kind in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return _moe_config(hf, kind)
    raise ValueError(f"model_type '{kind}' is none of gpt2, llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, "
                     f"olmoe; only GPT-2, Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE checkpoints "
                     f"can be imported")


def _moe_config(hf: dict, kind: str) -> ModelConfig:
    """Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE as megazero's keys: the attention and norms of the dense
    family it extends (Llama's; Qwen2's q/k/v biases where qkv_bias says; Qwen3's per-head q/k norm,
    model.qk_layernorm, or OLMoE's over the whole projections, qk_layernorm_scope projection), and
    the experts; a head size of its own is model.kv_channels. What megazero's layer does not compute
    is refused (ValueError, one line)."""
    if kind == "olmoe" and hf.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv {hf['clip_qkv']}: megazero does not clip q, k and v")
    window = hf.get("sliding_window") if kind == "mixtral" or hf.get("use_sliding_window") else None
    if window and window < hf["max_position_embeddings"]:
        raise ValueError(f"sliding_window {window} is below max_position_embeddings ({hf['max_position_embeddings']}); "
                         f"megazero's attention sees the whole causal context")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias true: megazero's mixtures of experts have no o_proj bias")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    # Every one of these classes takes config.json's head_dim, hidden_size / num_attention_heads without it.
    head_dim = hf.get("head_dim") or hidden // heads
    mixtral = kind == "mixtral"
    wide = kind in ("mixtral", "olmoe")  # their experts' width is intermediate_size
    layers = hf["num_hidden_layers"]
    dense = set(hf.get("mlp_only_layers") or ())
    step = hf.get("decoder_sparse_step", 1)
    moe = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]  # Qwen's rule for MoE layers
    shared = hf.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
    family = {"mixtral": "llama", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "olmoe": "qwen3"}[kind]
    base = _llama_config({**hf, "head_dim": head_dim, "attention_bias": False, "mlp_bias": False,
                          "use_sliding_window": False}, family)
    return dataclasses.replace(
        base, num_experts=hf.get("num_local_experts") or hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size" if wide else "moe_intermediate_size"],
        moe_layer_freq=1 if all(moe) else moe, moe_router_pre_softmax=not (mixtral or hf.get("norm_topk_prob", False)),
        moe_shared_expert_ffn_hidden_size=shared, moe_shared_expert_gate=bool(shared),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0,
        qkv_bias=kind == "qwen2_moe" and bool(hf.get("qkv_bias", True)),
        qk_layernorm_scope="projection" if kind == "olmoe" else "head")


def _llama_config(hf: dict, arch: str) -> ModelConfig:
    """Llama, Qwen2 or Qwen3 (`arch`): Llama's keys, with Qwen2's q/k/v biases or Qwen3's QK-norm."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    # Qwen3's own default head size is 128, whatever hidden / heads: absent, it is that.
    head_dim = hf.get("head_dim") or (128 if arch == "qwen3" else hidden // heads)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not silu (SwiGLU)")
    if arch == "llama" and bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise ValueError("attention_bias and mlp_bias differ; megazero's model.bias covers both")
    if arch == "qwen3" and hf.get("attention_bias"):
        raise ValueError("attention_bias true (biases on q, k, v and o but not the MLP) has no megazero equivalent")
    if arch != "llama" and hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window true: megazero's attention is full causal attention")
    # Newer transformers write rope_parameters (theta inside); older ones rope_theta and rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    base = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    extra: dict = {}
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ValueError(f"rope scaling {kind!r} is not llama3, the one megazero implements")
        extra = dict(rope_scaling="llama3", rope_scaling_factor=float(scaling["factor"]),
                     rope_low_freq_factor=float(scaling["low_freq_factor"]),
                     rope_high_freq_factor=float(scaling["high_freq_factor"]),
                     rope_original_max_position=int(scaling["original_max_position_embeddings"]))
    groups = hf.get("num_key_value_heads") or heads
    return ModelConfig(num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
                       num_query_groups=0 if groups == heads else groups, seq_length=hf["max_position_embeddings"],
                       vocab_size=hf["vocab_size"], ffn_hidden_size=hf["intermediate_size"],
                       layernorm_eps=hf.get("rms_norm_eps", 1e-6), init_std=hf.get("initializer_range", 0.02),
                       dropout=0.0, normalization="rmsnorm", position_embedding="rope", rope_base=float(base),
                       activation="swiglu", bias=arch == "llama" and bool(hf.get("attention_bias", False)),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       kv_channels=0 if head_dim * heads == hidden else head_dim,
                       qk_layernorm=arch == "qwen3", qkv_bias=arch == "qwen2", **extra)


def set_by_hf(m: ModelConfig) -> list[str]:
    """The model keys an HF config.json decides (seq_length may be lower in a run)."""
    common = ["num_layers", "hidden_size", "num_heads", "vocab_size", "layernorm_eps"]
    if m.position_embedding == "learned":  # GPT-2
        return common + ["ffn_hidden_size"]
    family = common + ["num_query_groups", "normalization", "position_embedding", "rope_base", "rope_scaling",
                       "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_position", "activation", "bias", "tie_embeddings", "kv_channels",
                       "qk_layernorm", "qk_layernorm_scope", "qkv_bias", "num_experts"]
    if not m.num_experts:
        return family + ["ffn_hidden_size"]
    every_layer_moe = all(_is_moe(m, i) for i in range(m.num_layers))
    return family + ([] if every_layer_moe else ["ffn_hidden_size"]) + [
        "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
        "moe_shared_expert_ffn_hidden_size", "moe_shared_expert_gate"]


def suggested_by_hf(m: ModelConfig) -> list[str]:
    """Model keys config.json gives a run that leaves them unset, but a run may choose otherwise: the
    load-balancing coefficient, and the dense MLP width of a model without dense layers."""
    if not m.num_experts:
        return []
    every_layer_moe = all(_is_moe(m, i) for i in range(m.num_layers))
    return ["moe_aux_loss_coeff"] + (["ffn_hidden_size"] if every_layer_moe else [])


_GPT2_KEYS = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "ffn_hidden_size": "n_inner",
              "layernorm_eps": "layer_norm_epsilon"}
_FAMILY_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "ffn_hidden_size":
                "intermediate_size", "num_query_groups": "num_key_value_heads", "layernorm_eps": "rms_norm_eps",
                "rope_base": "rope_theta", "tie_embeddings": "tie_word_embeddings", "bias": "attention_bias",
                "kv_channels": "head_dim", "moe_router_topk": "num_experts_per_tok",
                "moe_ffn_hidden_size": "moe_intermediate_size", "moe_router_pre_softmax": "not norm_topk_prob",
                "moe_layer_freq": "mlp_only_layers / decoder_sparse_step",
                "moe_shared_expert_ffn_hidden_size": "shared_expert_intermediate_size",
                "moe_shared_expert_gate": "shared_expert_gate"}
_HF_KEYS = {"gpt2": _GPT2_KEYS, "qwen2_moe": {**_FAMILY_KEYS, "qkv_bias": "qkv_bias"},
            "mixtral": {**_FAMILY_KEYS, "num_experts": "num_local_experts", "moe_ffn_hidden_size": "intermediate_size"},
            "olmoe": {**_FAMILY_KEYS, "moe_ffn_hidden_size": "intermediate_size"}}


def hf_key(key: str, model_type: str) -> str:
    """The config.json key (of HF model_type `model_type`) that holds megazero's model.KEY (its own
    name where they agree; the model_type itself for what only the architecture says)."""
    table = _HF_KEYS.get(model_type, _FAMILY_KEYS)
    if key not in table and key in ("qk_layernorm", "qk_layernorm_scope", "qkv_bias"):  # no key of their own: the architecture says them
        return f"model_type {model_type}"
    return table.get(key, key)
