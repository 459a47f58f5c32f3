"""Target decoders with KV cache and aux-state capture: the Llama family (Llama 3.x, Mistral, Qwen2,
Qwen3; GQA + dense MLP), Gemma 3 (the same with sandwich norms and sliding-window layers) and
DeepSeek-V3 / Kimi-K2 (multi-head latent attention + mixture of experts). Each decoder layer picks its
attention, MLP, norms, window and rope from the config; everything else is shared.

Sliding windows are applied here, per layer, to whatever mask a caller passes (``Target.forward``):
every decoding path (prefill, chunks, verification, trees, serving slots) gets them without building
windowed masks itself. The cache keeps every position for every layer (sliding layers included)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.config import TargetConfig, default_aux_layer_ids
from eagle_jax.modeling.layers import (
    MLP,
    Attention,
    InitKeys,
    KeySource,
    Linear,
    RMSNorm,
    attends_block,
    causal_mask,
    document_mask,
    project,
    rope_cos_sin,
    weight_matrix,
    window_mask,
)
from eagle_jax.modeling.mla import MLAttention
from eagle_jax.modeling.moe import MoE

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Per-layer caches ``k`` [B, Hkv, S, Dk] and ``v`` [B, Hkv, S, Dv], head-major (attention reads
    them without a transpose). Slot s of a row holds position s of that row. GQA: keys and values.
    MLA: ``k`` the latents [B, 1, S, kv_lora_rank], ``v`` the shared rope keys [B, 1, S, qk_rope_head_dim]."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]

    @classmethod
    def zeros(
        cls, layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype, v_head_dim: int | None = None
    ) -> "KVCache":
        k_shape = (batch, kv_heads, length, head_dim)
        v_shape = (batch, kv_heads, length, head_dim if v_head_dim is None else v_head_dim)
        return cls(
            tuple(jnp.zeros(k_shape, dtype) for _ in range(layers)),
            tuple(jnp.zeros(v_shape, dtype) for _ in range(layers)),
        )

    @classmethod
    def for_config(cls, c: TargetConfig, batch: int, length: int, dtype) -> "KVCache":
        """Zeroed caches of a target: keys and values per kv head, or for MLA the latent and the shared rope key."""
        if c.mla is not None:
            return cls.zeros(
                c.num_layers, batch, length, 1, c.mla.kv_lora_rank, dtype, v_head_dim=c.mla.qk_rope_head_dim
            )
        return cls.zeros(c.num_layers, batch, length, c.num_kv_heads, c.head_dim, dtype)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def key_positions(positions: Array, mask_width: int, cache_len: int | None, write_index: Array | None) -> Array:
    """[B, S'] the position each key column of a mask holds, for the sliding windows: the block's own
    positions when attention is over the block itself (``attends_block``); over a cache, slot s holds
    position s, except the block's slots ``write_index + j``, which hold ``positions[:, j]`` (a tree's
    nodes sit at their depth, not their slot)."""
    t = positions.shape[1]
    if attends_block(t, mask_width, cache_len):
        return positions
    slots = jnp.arange(mask_width, dtype=jnp.int32)[None, :]
    rel = slots - write_index[:, None]
    in_block = (rel >= 0) & (rel < t)
    return jnp.where(in_block, jnp.take_along_axis(positions, jnp.clip(rel, 0, t - 1), axis=1), slots)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block; attention GQA or MLA and MLP dense or MoE, as the config says for layer ``index``."""

    def __init__(self, c: TargetConfig, index: int, *, dtype, rngs: KeySource):
        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, c.rms_norm_eps, unit_offset=c.norm_unit_offset, dtype=dtype)

        self.input_layernorm = norm(c.hidden_size)
        if c.mla is not None:
            self.self_attn = MLAttention(
                c.hidden_size, c.hidden_size, c.num_heads, c.mla, c.rope, bias=c.attention_bias, dtype=dtype, rngs=rngs
            )
        else:
            self.self_attn = Attention(
                c.hidden_size,
                c.hidden_size,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                bias=c.attention_bias,
                qk_norm_eps=c.rms_norm_eps if c.qk_norm else None,
                norm_unit_offset=c.norm_unit_offset,
                score_dim=c.query_pre_attn_scalar,
                dtype=dtype,
                rngs=rngs,
            )
        # HF's names: in the Llama layout post_attention_layernorm is the MLP's input norm; with sandwich
        # norms (Gemma) it normalises the attention's output, and pre_feedforward_layernorm the MLP's input.
        self.post_attention_layernorm = norm(c.hidden_size)
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = norm(c.hidden_size)
            self.post_feedforward_layernorm = norm(c.hidden_size)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if c.moe is not None and c.moe.is_moe_layer(index):
            self.mlp = MoE(c.hidden_size, c.moe, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, act=c.hidden_act, dtype=dtype, rngs=rngs)

    def __call__(self, h, cos, sin, mask, kv=None, write_index=None):
        attn, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, kv, write_index)
        if self.post_feedforward_layernorm is None:
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h)), kv
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), kv


class Target(nnx.Module):
    """The target model. ``target(input_ids, aux_layer_ids) -> (logits [B,T,V], aux [B,T,N*H])``.

    aux = the residual streams ENTERING layers ``aux_layer_ids`` (HF ``hidden_states[i]``), raw, in
    ascending layer order, concatenated on the feature axis. The ids belong to the drafter that reads
    them (``config.aux_layer_ids_for``): the target itself holds none, so one target serves any number
    of drafters, each program capturing the layers its drafter asks for.
    """

    def __init__(self, config: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        c = config
        keys = InitKeys(rngs)
        # A weight matrix (gathered, and the lm_head when tied): float32-stored on CPU for bf16 (layers.weight_matrix).
        self.embed_tokens = weight_matrix(jax.random.normal(keys.params(), (c.vocab_size, c.hidden_size)) * 0.02, dtype)
        self.layers = nnx.List([DecoderLayer(c, i, dtype=dtype, rngs=keys) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, unit_offset=c.norm_unit_offset, dtype=dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size, dtype=dtype, rngs=keys)
        keys.commit()

    def embed(self, input_ids: Array) -> Array:
        h = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        if self.config.scale_embeddings:  # Gemma: times sqrt(H) rounded to the embedding's dtype, as HF does
            h = h * jnp.asarray(math.sqrt(self.config.hidden_size), self.dtype)
        return h

    def logits(self, hidden: Array) -> Array:
        """Final-normed hidden [..., H] -> logits [..., V] (fp32 accumulation, model dtype out)."""
        if self.lm_head is None:
            out = project("...h,vh->...v", hidden, self.embed_tokens[...])
        else:
            out = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return out if cap is None else (jnp.tanh(out / cap) * cap).astype(out.dtype)

    def forward(
        self,
        input_ids: Array,
        positions: Array,
        mask: Array,
        cache: KVCache | None = None,
        write_index: Array | None = None,
        aux_layer_ids: tuple[int, ...] = (),
        compute_dtype=None,
    ) -> tuple[Array, Array | None, KVCache | None]:
        """The decoder stack. Returns (final-normed hidden [B,T,H], aux [B,T,N*H] or None when no
        ``aux_layer_ids`` are asked for, updated cache).

        ``compute_dtype``: the activations' dtype (default: the weights'); float32 over bf16 weights is
        the exact mode, whose results do not depend on the batch or the verification width.

        input_ids, positions: [B, T]. Without ``cache``, ``mask`` is [B, T, T] over the block itself. With
        a cache, the block's keys/values are written at slots ``write_index + 0..T-1`` and ``mask`` is
        [B, T, S] over all cache slots: any pattern (causal decode, tree verification). Sliding layers
        also mask keys ``config.sliding_window`` or more positions back (``key_positions``): callers
        pass the mask without windows.
        """
        c = self.config
        h = self.embed(input_ids)
        if compute_dtype is not None:
            h = h.astype(compute_dtype)  # every matmul, norm and cache write follows the activations
        ropes: dict = {}  # one cos/sin per distinct rope, one mask per distinct window
        masks: dict = {None: mask}
        keys = None
        aux, ks, vs = [], [], []
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                aux.append(h)
            rope, window = c.layer_rope(i), c.layer_window(i)
            if rope not in ropes:
                ropes[rope] = rope_cos_sin(rope, c.rope_dim, positions, h.dtype)
            if window not in masks:
                if keys is None:
                    keys = key_positions(
                        positions, mask.shape[-1], None if cache is None else cache.max_len, write_index
                    )
                masks[window] = mask & window_mask(positions, keys, window)
            kv = None if cache is None else (cache.k[i], cache.v[i])
            h, kv = layer(h, *ropes[rope], masks[window], kv, write_index)
            if kv is not None:
                ks.append(kv[0])
                vs.append(kv[1])
        new_cache = None if cache is None else KVCache(tuple(ks), tuple(vs))
        return self.norm(h), (jnp.concatenate(aux, axis=-1) if aux else None), new_cache

    def __call__(
        self,
        input_ids: Array,
        aux_layer_ids: tuple[int, ...] | None = None,
        positions: Array | None = None,
        segment_ids: Array | None = None,
    ) -> tuple[Array, Array]:
        """Whole sequences from position 0; ``aux_layer_ids`` None = EAGLE's default (2, L/2, L-3).

        Packed training rows (several documents per row): ``positions`` [B, T] restart at 0 at each
        document and ``segment_ids`` [B, T] number the documents (0 = padding); a token then attends
        only within its own document, causally, at its restarted RoPE position. None = one sequence
        per row at positions 0..T-1.
        """
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layer_ids(self.config.num_layers)
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is not None:
            mask = document_mask(positions, segment_ids)
        else:
            mask = causal_mask(b, t)
        hidden, aux, _ = self.forward(input_ids, positions, mask, aux_layer_ids=tuple(aux_layer_ids))
        return self.logits(hidden), aux

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        return KVCache.for_config(self.config, batch, max_len, dtype or self.dtype)
