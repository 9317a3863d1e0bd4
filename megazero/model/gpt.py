"""GPT-2, as OpenAI built it, readable top to bottom and ready to be cut into stages.

Learned position embeddings, pre-LayerNorm blocks, GELU (tanh), causal attention through
scaled_dot_product_attention, a final LayerNorm and an output head tied to the token
embedding. A `GPT` instance owns a contiguous range of blocks (a pipeline stage or model
chunk); the embedding lives only on the first stage, the final norm and head only on the
last. Blocks sit in a ModuleDict keyed by their global index, so parameter names do not
depend on the layout.

Parameter names are Hugging Face GPT2LMHeadModel's, one to one:

    transformer.wte.weight              [V_pad/tp, h]    HF [V, h] (rows past V are padding)
    transformer.wpe.weight              [s, h]
    transformer.h.{i}.ln_1.{weight,bias}
    transformer.h.{i}.attn.c_attn.{weight,bias}    weight [3h/tp, h] = HF Conv1D weight^T
    transformer.h.{i}.attn.c_proj.{weight,bias}    weight [h, h/tp]  = HF Conv1D weight^T
    transformer.h.{i}.attn.{q,k}_norm.weight       [head_dim], whole on every rank (model.qk_layernorm);
                                                   q's and k's widths with qk_layernorm_scope projection
    transformer.h.{i}.ln_2.{weight,bias}
    transformer.h.{i}.mlp.c_fc.{weight,bias}       weight [4h/tp, h] = HF Conv1D weight^T
    transformer.h.{i}.mlp.c_proj.{weight,bias}     weight [h, 4h/tp] = HF Conv1D weight^T
    transformer.ln_f.{weight,bias}
    lm_head.weight      only on a last stage without the embedding: its tied copy of wte

HF stores the four projections as Conv1D ([in, out]); here they are nn.Linear-shaped
([out, in]), so export transposes them and strips the vocab padding. The Llama family
(hf_names.py) renames them; with model.kv_channels the attention's q and output widths are
num_heads x kv_channels instead of h, and with model.qkv_bias c_attn alone has a bias.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config.schema import ModelConfig
from megazero.model.cross_entropy import vocab_parallel_cross_entropy
from megazero.model.documents import DocumentResets
from megazero.model.layers import (
    ColumnParallelLinear,
    Dropout,
    RowParallelLinear,
    TiedRows,
    VocabParallelEmbedding,
    activate,
    column_parallel_linear,
    padded_vocab_size,
    placed_parameter,
    split_parameter_,
)
from megazero.model.moe import MoE, moe_spec
from megazero.model.rotary import Llama3Scaling, apply_rotary, inverse_frequencies, rotary_tables
from megazero.parallel.comm import Group, solo_group
from megazero.parallel.context import context_attention, zigzag_positions
from megazero.parallel.dispatch import TokenDispatcher
from megazero.parallel.placement import place, placement
from megazero.parallel.random import RNGTracker, in_stream
from megazero.parallel.weight_grad import WeightGradStore

Rope = tuple[torch.Tensor, torch.Tensor]
"""Rotary cos and sin tables of the positions attention sees, [s, d] or [b, s, d] (rotary.py)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tracker: Optional[RNGTracker]):
        super().__init__()
        self.heads = cfg.num_heads  # this rank's heads (all until tensor parallelism splits them)
        self.groups = cfg.query_groups  # this rank's K/V heads: grouped-query attention when fewer
        self.head_dim = cfg.head_dim
        self.tp_size = 1
        self.cp, self.cp_impl = solo_group(), "ring"  # context parallelism: GPT.apply_context_parallel
        self.dropout = cfg.dropout
        self.tracker = tracker
        # The fused projection's rows are q | k | v, each split over the TP ranks on its own
        # (stride 3, or the three sizes under grouped-query attention), so a rank owns whole
        # query heads and the K/V groups they read. q is heads x head_dim wide, which is not
        # the hidden size when model.kv_channels sets the head size (Qwen3).
        q, kv, h = cfg.q_width, cfg.kv_width, cfg.hidden_size
        parts = () if self.groups == self.heads else (q, kv, kv)
        self.c_attn = ColumnParallelLinear(h, q + 2 * kv, bias=cfg.bias or cfg.qkv_bias, stride=3, parts=parts)
        self.c_proj = RowParallelLinear(q, h, bias=cfg.bias)
        self.resid_dropout = Dropout(cfg.dropout, tracker)
        # QK-norm (Qwen3): one RMSNorm over each head's width, its weight shared by every head;
        # or (OLMoE) over the whole q and k projections, each position's heads together.
        self.qk_whole = cfg.qk_layernorm_scope == "projection"
        self.q_norm = head_norm(cfg, q if self.qk_whole else 0) if cfg.qk_layernorm else None
        self.k_norm = head_norm(cfg, kv if self.qk_whole else 0) if cfg.qk_layernorm else None

    def apply_tp(self, tp: Group) -> None:
        self.heads //= tp.size  # c_attn's split hands each rank whole heads of q, k and v
        self.groups //= tp.size
        self.tp_size = tp.size
        # The q/k norm weights stay whole on every rank, but each rank applies them to its own
        # heads only: their gradients are partial sums over TP (with or without sequence
        # parallelism), completed by the same TP all-reduce as sequence-parallel LayerNorms'.
        for n in (self.q_norm, self.k_norm):
            if n is not None:
                for w in n.parameters():
                    place(w, dataclasses.replace(placement(w), sequence_parallel=True))

    def attend(self, qkv: torch.Tensor, kv: Optional["LayerKV"] = None, pos: int = 0,
               rope: Optional[Rope] = None, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention core: q, k, v -> weighted values (selective recompute wraps this); q
        and k rotated by their positions first when the model uses rotary embeddings;
        `documents`: the mask that keeps packed documents apart (documents.py), else causal."""
        b, s, _ = qkv.shape
        if self.groups == self.heads:
            q, k, v = split_heads(qkv, self.heads, self.head_dim)
        else:
            q, k, v = split_grouped_heads(qkv, self.heads, self.groups, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # before rotary, as Qwen3 and OLMoE do
            q, k = (over_heads(self.q_norm, q), over_heads(self.k_norm, k)) if self.qk_whole else \
                (self.q_norm(q), self.k_norm(k))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        mask = documents
        if kv is not None:  # incremental decoding: attend to every cached position as well
            k, v = kv.append(k, v, pos)
            mask = kv.mask
        if self.cp.size > 1 and kv is None:
            causal = functools.partial(self._attention, mask=None, causal=True)
            attend = functools.partial(context_attention, q, k, v, self.cp, self.cp_impl, causal, self._dropout_p())
            # Ulysses' whole-sequence attention picks its own stream (_attention); the ring drops
            # this rank's queries' probabilities: from the per-rank stream.
            y = self._in_rank_stream(attend) if self.cp_impl == "ring" else attend()
        else:
            y = self._attention(q, k, v, mask, pos == 0 and mask is None)
        return y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                   causal: bool) -> torch.Tensor:
        """SDPA with attention dropout. A prompt is causal within itself; a single new token
        sees all the past; left-padded prompts (a batch of several lengths) say so in `mask`."""
        # enable_gqa: each K/V head serves its group's queries without being repeated (where
        # the backend allows; the math backend repeats them itself).
        sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=self._dropout_p(),
                                 is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
        return self._in_rank_stream(sdpa)

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _in_rank_stream(self, attend: Callable[[], torch.Tensor]) -> torch.Tensor:
        """attend() with attention dropout. Attention probabilities of this rank's heads (and,
        under context parallelism, its queries) are distinct per TP and cp rank: their dropout
        masks come from the per-rank stream."""
        if self.tracker is not None and self._dropout_p() > 0 and self.tp_size * self.cp.size > 1:
            return in_stream(self.tracker, "tp", attend)
        return attend()

    def forward(self, x: torch.Tensor, kv: Optional["LayerKV"] = None, pos: int = 0,
                rope: Optional[Rope] = None, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.attend(self.c_attn(x), kv, pos, rope, documents)
        return self.resid_dropout(self.c_proj(y))


def split_heads(qkv: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v [b, heads, s, head_dim]: views of the fused projection's output [b, s, 3 x heads
    x head_dim]. Eagerly their gradients go back through _HeadsOfQKV (one copy); compiled,
    the compiler fuses autograd's own (a stack, then a contiguous copy)."""
    if torch.compiler.is_compiling():
        b, s, _ = qkv.shape
        return qkv.view(b, s, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return _HeadsOfQKV.apply(qkv, heads, head_dim)


def split_grouped_heads(qkv: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q [b, heads, s, d] and k, v [b, groups, s, d] from the fused projection's output
    [b, s, (heads + 2 groups) d] (grouped-query attention: its rows are q | k | v)."""
    b, s, _ = qkv.shape
    q, k, v = qkv.split([heads * head_dim, groups * head_dim, groups * head_dim], dim=-1)
    return tuple(t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))


class _HeadsOfQKV(torch.autograd.Function):
    """split_heads with a backward that writes the three head gradients straight into one
    [b, s, 3, heads, head_dim] tensor, the layout of the projection's output: one pass over
    them instead of autograd's two (unbind's stack, then the copy that view needs)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, head_dim: int):
        b, s, _ = qkv.shape
        ctx.shape = qkv.shape
        return qkv.view(b, s, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # autograd materializes unused outputs' gradients as zeros
        b, s, width = ctx.shape
        return torch.stack([g.transpose(1, 2) for g in grads], dim=2).view(b, s, width), None, None  # [b, s, 3, h, d]


class MLP(nn.Module):
    """GPT-2's GELU MLP, Megatron's squared ReLU, or Llama's SwiGLU: c_fc's rows then are
    gate | up (stride 2: each split over the TP ranks, so a rank's gate and up rows pair
    up), and the activation is silu(gate) x up."""

    def __init__(self, cfg: ModelConfig, tracker: Optional[RNGTracker], width: int = 0):
        """`width`: the hidden width when not model.ffn_size (an MoE layer's shared expert)."""
        super().__init__()
        self.activation = cfg.activation
        gated, width = cfg.activation == "swiglu", width or cfg.ffn_size
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, (2 if gated else 1) * width, bias=cfg.bias,
                                         stride=2 if gated else 1)
        self.c_proj = RowParallelLinear(width, cfg.hidden_size, bias=cfg.bias)
        self.dropout = Dropout(cfg.dropout, tracker)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(activate(self.c_fc(x), self.activation)))


class ZeroCenteredLayerNorm(nn.LayerNorm):
    """LayerNorm whose weight w is applied as 1 + w (model.zero_centered_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight w is applied as 1 + w (model.zero_centered_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def head_norm(cfg: ModelConfig, width: int = 0) -> nn.Module:
    """model.qk_layernorm's RMSNorm of one head's width, or of `width` (applied as 1 + w with
    zero_centered_norm)."""
    return (ZeroCenteredRMSNorm if cfg.zero_centered_norm else nn.RMSNorm)(width or cfg.head_dim,
                                                                           eps=cfg.layernorm_eps)


def over_heads(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """`norm` over each position's heads together: t [b, heads, s, d] seen as [b, s, heads x d]."""
    b, n, s, d = t.shape
    return norm(t.transpose(1, 2).reshape(b, s, n * d)).view(b, s, n, d).transpose(1, 2)


def norm(cfg: ModelConfig) -> nn.Module:
    """A block's (or the final) norm: LayerNorm with bias, or RMSNorm (a weight only); with
    model.zero_centered_norm, its weight stored around 0 and applied as 1 + w."""
    if cfg.normalization == "rmsnorm":
        return (ZeroCenteredRMSNorm if cfg.zero_centered_norm else nn.RMSNorm)(cfg.hidden_size, eps=cfg.layernorm_eps)
    return (ZeroCenteredLayerNorm if cfg.zero_centered_norm else nn.LayerNorm)(cfg.hidden_size, eps=cfg.layernorm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tracker: Optional[RNGTracker], moe: bool = False):
        """`moe`: the MLP is a mixture of experts (model.num_experts, model.moe_layer_freq)."""
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg, tracker)
        self.ln_2 = norm(cfg)
        self.mlp: nn.Module = MLP(cfg, tracker)
        if moe:
            width = cfg.moe_shared_expert_ffn_hidden_size
            self.mlp = MoE(cfg.hidden_size, cfg.activation, moe_spec(cfg), MLP(cfg, tracker, width) if width else None)

    def forward(self, x: torch.Tensor, kv: Optional["LayerKV"] = None, pos: int = 0,
                rope: Optional[Rope] = None, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv, pos, rope, documents)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """One stage (or model chunk) of GPT-2: blocks `layers`, plus the embedding when
    `pre_process` and the final norm and tied head when `post_process`. Built whole (tp = 1);
    tensor parallelism splits its TP layers afterwards, from outside (each module's
    `apply_tp`, called by `apply_tensor_parallel` below)."""

    def __init__(self, cfg: ModelConfig, tracker: Optional[RNGTracker] = None,
                 layers: Optional[Sequence[int]] = None, pre_process: bool = True, post_process: bool = True):
        super().__init__()
        self.cfg, self.tp, self.cp, self.ep, self.tracker = cfg, solo_group(), solo_group(), solo_group(), tracker
        self.etp = solo_group()  # the group each expert's MLP is split over (apply_expert_parallel)
        self.sequence_parallel = False
        self.layers = list(range(cfg.num_layers) if layers is None else layers)
        self.pre_process, self.post_process = pre_process, post_process
        self.weight_grads: Optional[WeightGradStore] = None  # set: the head's weight gradient may be deferred
        # set (data.reset_position_ids / reset_attention_mask): positions and attention restart at each document
        self.document_resets: Optional[DocumentResets] = None
        assert isinstance(cfg.vocab_size, int), "resolve the config first"
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, 1)

        self.transformer: Any = nn.Module()  # a plain container: its children are set below
        self.rotary = rotary_frequencies(cfg)  # None with learned positions
        if pre_process:
            self.transformer.wte = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size)
            # Values come from init_weights / initial_value: no reset_parameters (on the meta device
            # its normal_ would import torch._dynamo, seconds per process).
            if self.rotary is None:
                self.transformer.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size,
                                                    _weight=torch.empty(cfg.seq_length, cfg.hidden_size))
            self.transformer.drop = Dropout(cfg.dropout, tracker)
        self.transformer.h = nn.ModuleDict({str(i): Block(cfg, tracker, is_moe_layer(cfg, i)) for i in self.layers})
        if post_process:
            self.transformer.ln_f = norm(cfg)
            # The output layer: its own weight when untied; tied, the last stage keeps its own
            # copy of the embedding when the embedding lives elsewhere.
            if not cfg.tie_embeddings or not pre_process:
                self.lm_head: Any = nn.Module()
                self.lm_head.weight = placed_parameter((self.padded_vocab, cfg.hidden_size), 0)
        for p in self.parameters():  # pin the default (replicated at this, the full, shape) of LayerNorm, wpe
            place(p, placement(p))  # as ZeRO-3 later points .data at placeholders of other shapes

    def apply_tp(self, tp: Group) -> None:
        """The model's own TP state: the group its head and loss use, the vocabulary padded
        to a multiple of 128 x tp, and the last stage's copy of the tied embedding split like
        the embedding itself (its layers split themselves)."""
        assert isinstance(self.cfg.vocab_size, int)
        self.tp, self.padded_vocab = tp, padded_vocab_size(self.cfg.vocab_size, tp.size)
        if self.post_process and hasattr(self, "lm_head"):
            split_parameter_(self.lm_head, "weight", tp, full_rows=self.padded_vocab)

    def apply_sequence_parallel(self) -> None:
        """Megatron's sequence parallelism (after apply_tp; nothing to do at tp = 1): outside
        the TP regions, LayerNorm, dropout and the residual stream hold only this rank's 1/tp
        of the sequence, [b, s/tp, h], instead of all of it replicated. The TP layers enter
        and leave their regions by all-gather / reduce-scatter along the sequence, dropout
        there draws per-rank masks, and the hidden states between pipeline stages shrink to
        `hidden_shape`. Every TP-replicated parameter (LayerNorm, position embedding,
        row-parallel bias) then sees only this rank's positions, so its gradient is partial:
        its placement says `sequence_parallel`, for the TP all-reduce after backward
        (megazero.zero.sequence_parallel)."""
        if self.tp.size == 1:
            return
        for module in self.modules():
            if hasattr(module, "sequence_parallel"):
                module.sequence_parallel = True  # type: ignore[assignment]  # torch types Module attributes Tensor | Module
        for p in self.parameters():
            # Expert weights excepted: the ranks sharing a micro-batch's tokens are folded into
            # their expert-dp group (etp 1), over which ZeRO sums their gradients anyway.
            if not (where := placement(p)).sharded and not where.experts:
                place(p, dataclasses.replace(where, sequence_parallel=True))
        for layer in moe_layers(self):  # each TP rank routes its own positions: counts summed over tp
            layer.split_groups.append(self.tp)

    def apply_context_parallel(self, cp: Group, impl: str) -> None:
        """Context parallelism (nothing to do at cp = 1): every sequence reaches this rank as
        its zig-zag positions, [b, s/cp] (the data loader cuts them: parallel/context.py), so
        the position ids follow that layout and attention reaches the other positions through
        the cp group (ring or Ulysses). Parameters are whole on every cp rank; their
        gradients are reduced over dp x cp by ZeRO."""
        if cp.size == 1:
            return
        self.cp = cp
        for module in self.modules():
            if isinstance(module, CausalSelfAttention):
                module.cp, module.cp_impl = cp, impl
        for layer in moe_layers(self):  # each cp rank routes its own positions: counts summed over cp
            layer.split_groups.append(cp)

    def apply_expert_parallel(self, ep: Group, dispatcher: TokenDispatcher, dp: Group,
                              token_replicas: Optional[Group] = None, expert_tp: Optional[Group] = None) -> None:
        """Mixture of experts: each MoE layer keeps this rank's experts of the `ep` group, each
        split over `expert_tp` (the TP group at etp = tp; None: whole), and sends tokens to the
        others' by `dispatcher`; global_aux_loss counts tokens over `dp` too. `token_replicas`:
        ranks holding the same tokens (tp without sequence parallelism) whose experts' places
        differ (etp 1): each sends its share of the tokens to the experts."""
        self.ep = ep
        if expert_tp is not None:
            self.etp = expert_tp
        for layer in moe_layers(self):
            layer.apply_ep(ep, dispatcher, expert_tp)
            layer.data_group = dp
            if token_replicas is not None:
                layer.token_replicas = token_replicas

    def hidden_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """Shape of the hidden states a stage passes on for [batch, seq] tokens."""
        return batch, seq // self.tp.size if self.sequence_parallel else seq, self.cfg.hidden_size

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, cache: Optional["KVCache"] = None,
                tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tokens [b, s] on the first stage (hidden states `hidden_shape` elsewhere) ->
        hidden states, or this rank's vocab slice of the logits [b, s, V_pad/tp] on the last.
        With a `cache` (generation) the tokens continue the cached ones. `tokens`: the
        micro-batch's tokens on every stage, where `document_resets` keeps packed documents apart."""
        start = cache.length if cache is not None else 0
        if cache is not None and self.sequence_parallel:
            raise ValueError("generation with a KV cache needs a model without sequence parallelism")
        # This rank's tokens of each sequence: hidden states reaching a later stage under
        # sequence parallelism hold 1/tp of them, attention all of them.
        seq = x.shape[1] * (self.tp.size if self.sequence_parallel and not self.pre_process else 1)
        pos = torch.arange(start, start + seq, device=x.device)
        if self.cp.size > 1:  # this rank's zig-zag positions of the whole sequence
            if cache is not None:
                raise ValueError("generation with a KV cache needs a model without context parallelism")
            pos = torch.as_tensor(zigzag_positions(seq * self.cp.size, self.cp.rank, self.cp.size), device=x.device)
        if cache is not None:
            pos = cache.begin(start, pos)  # per-row positions and masks when the prompts are left-padded
        documents = None
        if self.document_resets is not None and tokens is not None and cache is None:
            reset, documents = self.document_resets.layout(tokens)  # per-row positions and masks
            pos = reset if reset is not None else pos
        # Rotary: attention sees the whole (gathered) local sequence, so its positions are all of pos.
        rope = None
        if self.rotary is not None:
            self.rotary = self.rotary.to(pos.device)  # once: moved to the run's device on first use
            rope = rotary_tables(self.rotary, pos)
        # Embedding and head share their weight here: the rows join the head's gradient in place.
        tied = TiedRows() if (self.pre_process and self.post_process and self.cfg.tie_embeddings
                              and self.transformer.wte.sparse_grad and self.weight_grads is None
                              and torch.is_grad_enabled()) else None
        if self.pre_process:
            x = self.transformer.wte(x, tied)
            if self.rotary is None:
                if self.sequence_parallel:  # the embedding's output holds this rank's positions only
                    pos = pos.chunk(self.tp.size, dim=-1)[self.tp.rank]
                x = x + self.transformer.wpe(pos)
            x = self.transformer.drop(x)
        for i, block in self.transformer.h.items():
            x = block(x, cache.layers[int(i)] if cache is not None else None, start, rope, documents)
        if cache is not None:
            cache.length += x.shape[1]
        if not self.post_process:
            return x
        x = self.transformer.ln_f(x)
        weight = self.lm_head.weight if hasattr(self, "lm_head") else self.transformer.wte.weight
        if tied is not None:
            weight = tied.head(weight)
        return column_parallel_linear(x, weight, None, self.weight_grads, self.tp, self.sequence_parallel)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy [b, s] from vocab-parallel logits (padding masked out); 0, with
        no gradient, where a label is negative (a prompt or padding token of fine-tuning data)."""
        assert isinstance(self.cfg.vocab_size, int)
        return vocab_parallel_cross_entropy(logits, labels, self.tp, self.cfg.vocab_size).masked_fill(labels < 0, 0.0)

    # ------------------------------------------------------------------ init

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Set every (materialized) parameter to its `initial_value`."""
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, seed))

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """GPT-2 init of one parameter, independent of the layout: its full tensor is drawn
        (on the CPU, in fp32) from a generator seeded by (seed, its name) and this rank keeps
        its TP shard. So tp = 1, 2, 4, any pipeline split and any ZeRO partition start from
        the same model; a model built on the meta device is materialized from this, one
        parameter at a time."""
        p = self.get_parameter(name)
        where = placement(p)
        tensor = self.etp if where.experts else self.tp  # an expert weight's slice is its expert_tp group's
        return where.expert_shard(where.shard(self._full_init(name, p, seed), tensor.rank, tensor.size),
                                  self.ep.rank, self.ep.size)

    def _full_init(self, name: str, p: nn.Parameter, seed: int) -> torch.Tensor:
        full_shape = placement(p).full_shape
        if name == "lm_head.weight" and self.cfg.tie_embeddings:
            name = "transformer.wte.weight"  # identical to the first stage's copy
        if ".ln_" in name or name.startswith("transformer.ln_f") or name.endswith(("attn.q_norm.weight",
                                                                                    "attn.k_norm.weight")):
            ones = name.endswith("weight") and not self.cfg.zero_centered_norm  # 1 + w starts at 1 either way
            return (torch.ones if ones else torch.zeros)(full_shape, device="cpu")
        if name.endswith("bias"):
            return torch.zeros(full_shape, device="cpu")
        std = self.cfg.init_std
        if name.endswith("c_proj.weight"):  # residual projections, scaled as in GPT-2
            std /= math.sqrt(2 * self.cfg.num_layers)
        shape = full_shape
        if name in ("transformer.wte.weight", "lm_head.weight"):
            assert isinstance(self.cfg.vocab_size, int)
            shape = (self.cfg.vocab_size, shape[1])  # padding rows stay zero
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(shape, device="cpu").normal_(0.0, std, generator=g)  # the same draws on any device
        if shape != full_shape:
            full = torch.cat([full, full.new_zeros(full_shape[0] - shape[0], shape[1])])
        return full

    def tied_weight(self) -> Optional[nn.Parameter]:
        """The embedding copy whose gradient must be summed over the embedding group (None
        when the output layer is untied)."""
        if not self.cfg.tie_embeddings:
            return None
        if self.pre_process:
            return self.transformer.wte.weight
        return self.lm_head.weight if self.post_process else None

    def no_weight_decay(self) -> set[str]:
        """Parameters not decayed (GPT-2 / Megatron practice): biases and LayerNorm weights,
        the one-dimensional ones."""
        return {n for n, p in self.named_parameters() if len(placement(p).full_shape) < 2}

    def units(self) -> list["ModelUnit"]:
        """The model in execution order as units of parameters used together (what ZeRO-3
        gathers and frees at once): token embedding, position embedding, each block, and the
        final norm with the head. The tied embedding weight is not in any unit's `named`."""
        t, out, tied = self.transformer, [], self.cfg.tie_embeddings
        if self.pre_process:  # separate outputs, separate units
            out.append(ModelUnit(t.wte, t.wte, [t.wte], [] if tied else _named(t.wte, "transformer.wte"), tied))
            if self.rotary is None:
                out.append(ModelUnit(t.wpe, t.wpe, [t.wpe], _named(t.wpe, "transformer.wpe"), False))
        for key, block in t.h.items():
            out.append(ModelUnit(block, block, [block], _named(block, f"transformer.h.{key}"), False))
        if self.post_process:
            # The head matmul runs in GPT.forward itself, after ln_f: the unit ends with the chunk.
            head = [] if tied else [("lm_head.weight", self.lm_head.weight)]
            out.append(ModelUnit(t.ln_f, self, [self], _named(t.ln_f, "transformer.ln_f") + head, tied))
        return out


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block `layer` is an MoE layer: every moe_layer_freq-th one from the first (Megatron's
    int form), or as the 0/1 list says."""
    if not cfg.num_experts:
        return False
    freq = cfg.moe_layer_freq
    return bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of a model (chunk), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def rotary_frequencies(cfg: ModelConfig) -> Optional[torch.Tensor]:
    """The rotary inverse frequencies of model.position_embedding rope (None: learned positions)."""
    if cfg.position_embedding != "rope":
        return None
    scaling = Llama3Scaling(cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                            cfg.rope_original_max_position) if cfg.rope_scaling == "llama3" else None
    return inverse_frequencies(cfg.head_dim, cfg.rope_base, scaling)


def apply_tensor_parallel(model: GPT, tp: Group) -> GPT:
    """Split `model` over the TP group, in place (a no-op at tp = 1); returns it. Values a
    materialized model holds are kept: each rank keeps its shard of them."""
    if tp.size > 1:
        for module in list(model.modules()):
            if hasattr(module, "apply_tp"):
                module.apply_tp(tp)  # type: ignore[operator]  # checked by hasattr above
    return model


class ModelUnit(NamedTuple):
    """Parameters used together, and the modules whose hooks bracket their use."""

    start: nn.Module
    """Runs first: its forward pre-hook may gather the parameters."""
    end: nn.Module
    """Runs last: its forward hook may free them."""
    outputs: list[nn.Module]
    """Modules whose outputs' gradients announce the unit's backward."""
    named: list[tuple[str, nn.Parameter]]
    """Its parameters (other than the tied embedding weight), by name in the model."""
    uses_tied: bool
    """Whether it uses the tied embedding weight (embedding or head)."""


def _named(module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    return [(f"{prefix}.{n}", p) for n, p in module.named_parameters()]


class LayerKV:
    """One layer's cached keys and values, [b, groups/tp, max_len, head_dim], and the
    attention mask of the current step (None: plain causal attention)."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.k = torch.zeros(batch, heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.mask: Optional[torch.Tensor] = None

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if pos > 0 and k.shape[2] != 1:
            raise ValueError("after the prompt, decode one token at a time")
        end = pos + k.shape[2]
        self.k[:, :, pos:end], self.v[:, :, pos:end] = k, v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of the positions generated so far, for every layer of a model.

    Prompts of different lengths share a batch left-padded: `pad[b]` tokens of padding
    precede row b's prompt. Its positions then start at 0 after the padding, and no real
    token attends to padding, so each row computes what it would alone."""

    def __init__(self, model: GPT, batch: int, max_len: int, pad: Optional[torch.Tensor] = None):
        if max_len > model.cfg.seq_length:
            raise ValueError(f"cannot cache {max_len} positions: model.seq_length is {model.cfg.seq_length}")
        p = next(model.parameters())
        heads = model.cfg.query_groups // model.tp.size  # K/V heads: one per query group
        self.layers = {i: LayerKV(batch, heads, max_len, model.cfg.head_dim, p.dtype, p.device) for i in model.layers}
        self.length = 0
        self.pad = None if pad is None else pad.to(p.device).view(batch, 1)

    def begin(self, start: int, pos: torch.Tensor) -> torch.Tensor:
        """Start a step over cache slots `pos` = start, start + 1, ...: set each layer's mask
        and return the position ids ([s], or [b, s] under padding)."""
        if self.pad is None:
            return pos
        keys = torch.arange(start + pos.numel(), device=pos.device)
        q, k = pos.view(1, -1, 1), keys.view(1, 1, -1)
        real = k >= self.pad.view(-1, 1, 1)
        # A padding query sees only itself: a row with every key masked would give NaN.
        mask = (k <= q) & (real | (k == q))
        for layer in self.layers.values():
            layer.mask = mask.unsqueeze(1)  # [b, 1, s, keys]: broadcast over the heads
        return (pos.view(1, -1) - self.pad).clamp(min=0)
