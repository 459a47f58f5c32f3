"""EAGLE-3 / EAGLE-3.1 drafter: one decoder layer over fused target hidden states.

The layer's attention is GQA (the Llama layout of the EAGLE authors) or, with ``config.mla``, DeepSeek
multi-head latent attention (the Kimi-K2 / DeepSeek-V3 drafters of vLLM's and SGLang's deepseek_eagle3):
the same ``MLAttention`` as an MLA target, reading the 2H input ``cat(embedding, feature)`` in its
q_a_proj / q_proj and kv_a_proj_with_mqa, with a latent cache. Everything around it is shared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.config import DrafterConfig
from eagle_jax.modeling.layers import (
    MLP,
    Attention,
    Frozen,
    InitKeys,
    Linear,
    RMSNorm,
    causal_mask,
    rope_cos_sin,
    weight_matrix,
)
from eagle_jax.modeling.mla import MLAttention

Array = jax.Array


class Drafter(nnx.Module):
    """``drafter(features, input_ids) -> (draft_logits [B,T,Vd], next_features [B,T,H])``.

    The pair at position t is (feature g_t, token x_{t+1}). Features of width N*Ht (target aux states)
    go through ``fuse`` (fc, with the 3.1 per-chunk norms); features of width H (the drafter's own
    output from the previous step) are used as they are.
    """

    def __init__(
        self, config: DrafterConfig, embed: Array | None = None, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None
    ):
        keys = InitKeys(rngs or nnx.Rngs(0))
        c = config
        self.config = config
        self.dtype = dtype
        h = c.hidden_size
        if embed is None:
            embed = jax.random.normal(keys.params(), (c.vocab_size, h)) * 0.02
        # The target's embedding, frozen: absent from EAGLE checkpoints.
        self.embed_tokens = weight_matrix(embed, dtype, Frozen)  # float32-stored on CPU for bf16, as the target's
        self.fc = Linear(c.fc_in_features, h, dtype=dtype, rngs=keys)
        if c.fc_norm:
            self.fc_norm = nnx.List(
                [RMSNorm(c.target_hidden_size, c.rms_norm_eps, dtype=dtype) for _ in range(c.num_aux_hidden_states)]
            )
        else:
            self.fc_norm = None
        self.input_norm = RMSNorm(c.fc_in_features, c.rms_norm_eps, dtype=dtype) if c.norm_before_fc else None
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps, dtype=dtype)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype)
        if c.mla is not None:
            # Latent norms with the drafter's rms_norm_eps, as the engines and trainers of MLA drafters build them.
            self.self_attn = MLAttention(
                2 * h, h, c.num_heads, c.mla, c.rope, latent_eps=c.rms_norm_eps, dtype=dtype, rngs=keys
            )
        else:
            self.self_attn = Attention(2 * h, h, c.num_heads, c.num_kv_heads, c.head_dim, dtype=dtype, rngs=keys)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(h, c.intermediate_size, dtype=dtype, rngs=keys)
        self.norm = RMSNorm(h, c.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(h, c.draft_vocab_size, dtype=dtype, rngs=keys)
        keys.commit()
        # d2t holds offsets: target_id = draft_id + d2t[draft_id]. Identity when Vd == V.
        self.d2t = Frozen(jnp.zeros((c.draft_vocab_size,), jnp.int32))
        self.t2d = Frozen(
            jnp.ones((c.vocab_size,), bool) if c.draft_vocab_size == c.vocab_size else jnp.zeros((c.vocab_size,), bool)
        )

    # -- pieces used by the decoding loop and by training

    def fuse(self, aux: Array) -> Array:
        """Target aux states [..., N*Ht] -> feature g [..., H] (norms of 3.1 / norm_before_fc first)."""
        c = self.config
        if self.fc_norm is not None:
            chunks = jnp.split(aux, c.num_aux_hidden_states, axis=-1)
            aux = jnp.concatenate([n(x) for n, x in zip(self.fc_norm, chunks)], axis=-1)
        elif self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def set_vocab_map(self, d2t) -> None:
        """Sets d2t (offsets, [Vd]) and the t2d mask derived from it (validate with checkpoint.validate_d2t)."""
        c = self.config
        d2t = jnp.asarray(d2t, jnp.int32)
        if d2t.shape != (c.draft_vocab_size,):
            raise ValueError(f"d2t must have shape [{c.draft_vocab_size}], got {list(d2t.shape)}")
        self.d2t.set_value(d2t)
        self.t2d.set_value(jnp.zeros((c.vocab_size,), bool).at[jnp.arange(c.draft_vocab_size) + d2t].set(True))

    def draft_to_target(self, draft_ids: Array) -> Array:
        return draft_ids + self.d2t[...][draft_ids]

    def layer(
        self,
        g: Array,
        input_ids: Array,
        positions: Array,
        mask: Array,
        cache: tuple[Array, Array] | None = None,
        write_index: Array | None = None,
    ) -> tuple[Array, Array, tuple[Array, Array] | None]:
        """The decoder layer on a block of (feature, token) pairs, without the lm_head.

        g: [B, T, H] fused features; input_ids, positions: [B, T]. ``mask`` [B, T, T] without cache or
        [B, T, S] over the cache slots with one. Returns (normed h2 [B,T,H] for the lm_head, the feature
        fed to the next step [B,T,H]: post-norm with ``norm_output``, else pre-norm h2, cache).
        """
        u, cos, sin = self.attention_input(g, input_ids, positions)
        attn, cache = self.self_attn(u, cos, sin, mask, cache, write_index)
        return self.finish(g, attn) + (cache,)

    def write_cache(
        self, g: Array, input_ids: Array, positions: Array, cache: tuple[Array, Array], write_index: Array
    ) -> tuple[Array, Array]:
        """The cache after ``layer`` on this block, without the layer's outputs: a pair's keys and values
        need only its own embedding and feature, a small share of the layer's cost."""
        u, cos, sin = self.attention_input(g, input_ids, positions)
        return self.self_attn.write(u, cos, sin, cache, write_index)

    def read_cache(
        self, g: Array, input_ids: Array, positions: Array, mask: Array, cache: tuple[Array, Array]
    ) -> tuple[Array, Array]:
        """``layer``'s outputs (normed h2, next feature) for pairs whose keys and values ``cache`` already
        holds (``write_cache``), attending over its leading ``mask.shape[-1]`` slots; nothing written."""
        u, cos, sin = self.attention_input(g, input_ids, positions)
        return self.finish(g, self.self_attn.read(u, cos, sin, mask, cache))

    def attention_input(self, g: Array, input_ids: Array, positions: Array) -> tuple[Array, Array, Array]:
        """u = cat(input_layernorm(embedding), hidden_norm(g)) [B,T,2H] (embedding first) and RoPE cos/sin."""
        e = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(g.dtype)
        u = jnp.concatenate([self.input_layernorm(e), self.hidden_norm(g)], axis=-1)
        cos, sin = rope_cos_sin(self.config.rope, self.config.rope_dim, positions, g.dtype)
        return u, cos, sin

    def finish(self, g: Array, attn: Array) -> tuple[Array, Array]:
        """Attention output (after o_proj) -> (normed h2 for the lm_head, the feature fed forward)."""
        h1 = g + attn  # residual is the un-normed feature
        h2 = h1 + self.mlp(self.post_attention_layernorm(h1))
        normed = self.norm(h2)
        return normed, (normed if self.config.norm_output else h2)

    def step(
        self,
        g: Array,
        input_ids: Array,
        positions: Array,
        mask: Array,
        cache: tuple[Array, Array] | None = None,
        write_index: Array | None = None,
    ) -> tuple[Array, Array, Array, tuple[Array, Array] | None]:
        """``layer`` plus the lm_head: (logits [B,T,Vd], next feature, normed h2, cache)."""
        normed, nxt, cache = self.layer(g, input_ids, positions, mask, cache, write_index)
        return self.lm_head(normed), nxt, normed, cache

    def __call__(self, features: Array, input_ids: Array) -> tuple[Array, Array]:
        c = self.config
        if features.shape[-1] == c.fc_in_features:
            g = self.fuse(features)
        elif features.shape[-1] == c.hidden_size:
            g = features
        else:
            raise ValueError(
                f"drafter features have width {features.shape[-1]}; expected {c.fc_in_features} "
                f"(num_aux_hidden_states x target_hidden_size) or {c.hidden_size} (hidden_size)"
            )
        b, t = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, nxt, _, _ = self.step(g.astype(self.dtype), input_ids, positions, causal_mask(b, t))
        return logits, nxt

    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple[Array, Array]:
        """Zeroed head-major (k, v) caches [B, kv_heads, S, head_dim]; MLA: (latents [B, 1, S, kv_lora_rank],
        shared rope keys [B, 1, S, qk_rope_head_dim]), the target's latent cache layout."""
        c = self.config
        dtype = dtype or self.dtype
        if c.mla is not None:
            return jnp.zeros((batch, 1, max_len, c.mla.kv_lora_rank), dtype), jnp.zeros(
                (batch, 1, max_len, c.mla.qk_rope_head_dim), dtype
            )
        shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
