"""Which Hugging Face architecture a megazero model is, and where each of its tensors lives there.

Four architectures, chosen by the model section:

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

`pieces(name, m)` lists the HF tensors whose rows, stacked, make megazero tensor `name`
(without the vocabulary padding): export splits along them, import stacks them, and
init_from_hf reads each rank's rows from the piece that holds them.
"""

from __future__ import annotations

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
_LLAMA_TOP = {EMBEDDING: "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
              HEAD: "lm_head.weight"}

# The model keys each architecture fixes: (key, value).
_GPT2 = [("normalization", "layernorm"), ("position_embedding", "learned"), ("activation", "gelu"),
         ("bias", True), ("tie_embeddings", True), ("num_query_groups", 0), ("zero_centered_norm", False)]
_LLAMA = [("normalization", "rmsnorm"), ("position_embedding", "rope"), ("activation", "swiglu"),
          ("zero_centered_norm", False)]
# What Qwen2 and Qwen3 fix beyond Llama's keys: Qwen2's q/k/v biases alone, Qwen3's QK-norm without biases.
_QWEN2 = [("bias", False), ("qk_layernorm", False)]
_QWEN3 = [("bias", False), ("qkv_bias", False)]
_HF_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM"}


class Piece(NamedTuple):
    key: str
    """The HF tensor's name."""
    rows: int
    """How many rows (dim 0) of the megazero tensor it holds."""
    transposed: bool
    """Stored [in, out] in HF (GPT-2's Conv1D)."""


def architecture(m: ModelConfig) -> str:
    """gpt2, llama, qwen2 or qwen3, by the model section; refused in one line when it is none."""
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
        if m.qk_layernorm:  # QK-norm is Qwen3's
            name, family = "qwen3", "Qwen3 (QK-norm)"
        elif m.qkv_bias and not m.bias:  # biases on q, k, v alone are Qwen2's (with model.bias they are Llama's)
            name, family = "qwen2", "Qwen2 (q/k/v biases)"
        extra = {"qwen2": _QWEN2, "qwen3": _QWEN3}.get(name, [])
        wrong = [(k, v) for k, v in _LLAMA + extra if getattr(m, k) != v]
        if not wrong:
            return name
    key, value = wrong[0]
    raise ConfigError(f"model.{key} {getattr(m, key)!r} has no Hugging Face {family} equivalent; Hugging Face "
                      f"export and import need model.{key} {value!r}")


def pieces(name: str, m: ModelConfig) -> list[Piece]:
    """The HF tensors that make megazero tensor `name` (full, unpadded), in row order."""
    if architecture(m) == "gpt2":
        return [Piece(name, -1, name.endswith(GPT2_CONV1D))]  # rows: all of them
    if name in _LLAMA_TOP:
        return [Piece(_LLAMA_TOP[name], -1, False)]
    prefix, _, block, rest = name.split(".", 3)  # transformer.h.{i}.rest
    assert prefix == "transformer" and _ == "h", name
    layer = f"model.layers.{block}."
    if rest in _LLAMA_BLOCK:
        return [Piece(layer + _LLAMA_BLOCK[rest], -1, False)]
    module, kind = rest.rsplit(".", 1)
    q, kv, ffn = m.q_width, m.kv_width, m.ffn_size
    rows = (q, kv, kv) if module == "attn.c_attn" else (ffn, ffn)
    return [Piece(f"{layer}{hf}.{kind}", r, False) for hf, r in zip(_LLAMA_FUSED[module], rows, strict=True)]


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
    # Llama says where its biases are; Qwen2's are always on q, k, v alone and Qwen3 has none (refused otherwise).
    biases = {"attention_bias": m.bias, "mlp_bias": m.bias} if kind == "llama" else \
        {"attention_bias": False} if kind == "qwen3" else {}
    sliding = {} if kind == "llama" else {"use_sliding_window": False}
    return {
        "architectures": [_HF_CLASS[kind]], "model_type": kind,
        "vocab_size": m.vocab_size, "max_position_embeddings": m.seq_length, "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.query_groups, "head_dim": m.head_dim, "hidden_act": "silu",
        "rms_norm_eps": m.layernorm_eps, "rope_theta": m.rope_base, "rope_scaling": scaling,
        **biases, **sliding, "attention_dropout": m.dropout,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "bos_token_id": eos, "eos_token_id": eos,
    }


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The megazero model section equivalent to an HF config.json (GPT-2, Llama, Qwen2 or Qwen3)."""
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
    raise ValueError(f"model_type '{kind}' is not gpt2, llama, qwen2 or qwen3; only GPT-2, Llama, Qwen2 and Qwen3 "
                     f"checkpoints can be imported")


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
    common = ["num_layers", "hidden_size", "num_heads", "vocab_size", "layernorm_eps", "ffn_hidden_size"]
    if architecture(m) == "gpt2":
        return common
    return common + ["num_query_groups", "normalization", "position_embedding", "rope_base", "rope_scaling",
                     "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "rope_original_max_position", "activation", "bias", "tie_embeddings", "kv_channels",
                     "qk_layernorm", "qkv_bias"]


_HF_KEYS = {
    "gpt2": {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "ffn_hidden_size": "n_inner",
             "layernorm_eps": "layer_norm_epsilon"},
    "llama": {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "ffn_hidden_size":
              "intermediate_size", "num_query_groups": "num_key_value_heads", "layernorm_eps": "rms_norm_eps",
              "rope_base": "rope_theta", "tie_embeddings": "tie_word_embeddings", "bias": "attention_bias",
              "kv_channels": "head_dim"},
}
_HF_KEYS["qwen2"] = _HF_KEYS["qwen3"] = _HF_KEYS["llama"]


def hf_key(key: str, m: ModelConfig) -> str:
    """The config.json key that holds megazero's model.KEY (its own name where they agree)."""
    kind = architecture(m)
    if key in ("qk_layernorm", "qkv_bias"):  # no key of their own: the architecture says them
        return f"model_type {kind}"
    return _HF_KEYS[kind].get(key, key)
