"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) over a latent KV cache.

Per token, ``kv_a_proj_with_mqa`` gives a latent ``c`` of ``kv_lora_rank`` numbers (RMS-normed by
``kv_a_layernorm``) and one rope key ``k_rot`` of ``qk_rope_head_dim`` numbers shared by every head.
Head h's key is ``[W_UK[h] c, k_rot]`` and its value ``W_UV[h] c``, with W_UK / W_UV the two halves of
``kv_b_proj``. The cache therefore holds only ``c`` and ``k_rot`` (``KVCache.k`` = latents
[B, 1, S, kv_lora_rank], ``KVCache.v`` = rope keys [B, 1, S, qk_rope_head_dim]), and attention over
it uses the absorbed form: W_UK is folded into the query, so scores are taken against the latents
directly,

    score[h, s] = (q_nope[h] W_UK[h]) . c[s] + q_rot[h] . k_rot[s]
    out[h]      = W_UV[h] sum_s p[h, s] c[s]

and no per-head key or value is ever built for the cached tokens. A block attending only to itself
(a prefill) uses the expanded form, cheaper there: its T x T scores are then dot products of
qk_head_dim numbers rather than kv_lora_rank + qk_rope_head_dim.

Cache size per token and layer: ``(kv_lora_rank + qk_rope_head_dim) * bytes``, against
``num_heads * (qk_head_dim + v_head_dim) * bytes`` for the per-head keys and values the same model
would cache as multi-head attention (one kv head per query head, as it computes). bf16, 61 layers:

    model        heads  latent + rope   MLA per layer  MHA per layer  MLA per token  MHA per token  ratio
    DeepSeek-V3   128     512 + 64         1,152 B       81,920 B       68.6 KiB       4.77 MiB      71x
    Kimi-K2        64     512 + 64         1,152 B       40,960 B       68.6 KiB       2.38 MiB      36x

For scale, a GQA model with 8 kv heads of 128 caches 4,096 B per token and layer.

Numerics follow HF transformers' DeepseekV3Attention: scores ``q.k * scale`` in the activation dtype,
softmax in fp32, probabilities cast back before the value product. ``q_a_layernorm`` and
``kv_a_layernorm`` take their eps from the caller: a target uses 1e-6 whatever ``rms_norm_eps`` says
(HF builds them with the default), an EAGLE drafter its ``rms_norm_eps`` (as vLLM, SGLang and TorchSpec,
which trains the published MLA drafters, build theirs).

The same module is the attention of MLA EAGLE-3 drafters, whose layer input is ``cat(embedding,
feature)`` of width 2H: only the projections that read the layer input (``q_a_proj`` or ``q_proj``,
and ``kv_a_proj_with_mqa``) take ``d_in``; ``o_proj`` writes ``d_out``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.config import MLAConfig, RopeConfig, TargetConfig
from eagle_jax.modeling.layers import KV_BLOCK, KeySource, Linear, RMSNorm, apply_rope, softmax_over_blocks, write_kv

Array = jax.Array

LATENT_NORM_EPS = 1e-6


def softmax_scale(mla: MLAConfig, rope: RopeConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under scaled RoPE, as HF's
    ``yarn_apply_mscale`` (the cos/sin carry the other part, mscale / mscale_all_dim)."""
    scale = mla.qk_head_dim**-0.5
    if rope.type != "default" and rope.mscale_all_dim:
        m = 1.0 if rope.factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


def latent_cache_bytes_per_token(config: TargetConfig, itemsize: int = 2) -> int:
    """Bytes an MLA target caches per token over all layers (latent + shared rope key)."""
    mla = config.mla
    return config.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * itemsize


def expanded_cache_bytes_per_token(config: TargetConfig, itemsize: int = 2) -> int:
    """Bytes the same model would cache per token as multi-head attention (per-head keys and values)."""
    mla = config.mla
    return config.num_layers * config.num_heads * (mla.qk_head_dim + mla.v_head_dim) * itemsize


def _softmax(scores: Array, mask: Array, dtype) -> Array:
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


class MLAttention(nnx.Module):
    """MLA with HF's parameter names; called like ``layers.Attention`` (same cache contract).

    ``d_in`` is the input width (H for a target layer, 2H for a drafter), ``d_out`` the output width.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        mla: MLAConfig,
        rope: RopeConfig,
        *,
        bias: bool = False,
        latent_eps: float = LATENT_NORM_EPS,
        dtype,
        rngs: KeySource,
    ):
        self.num_heads, self.mla = num_heads, mla
        self.scale = softmax_scale(mla, rope)
        qk = num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(d_in, qk, dtype=dtype, rngs=rngs)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(d_in, mla.q_lora_rank, bias=bias, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, latent_eps, dtype=dtype)
            self.q_b_proj = Linear(mla.q_lora_rank, qk, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(
            d_in, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias, dtype=dtype, rngs=rngs
        )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, latent_eps, dtype=dtype)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), dtype=dtype, rngs=rngs
        )
        self.o_proj = Linear(num_heads * mla.v_head_dim, d_out, bias=bias, dtype=dtype, rngs=rngs)

    def _rope(self, x: Array, cos: Array, sin: Array) -> Array:
        if self.mla.rope_interleave:
            # Pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...), (x1, x3, ...): then it is rotate-half
            # RoPE, exactly as HF's apply_rotary_pos_emb_interleave computes it (queries and keys alike).
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, cos, sin)

    def _up_kernels(self, dtype) -> tuple[Array, Array]:
        """kv_b_proj split per head: W_UK [R, heads, nope], W_UV [R, heads, v]."""
        m = self.mla
        w = (
            self.kv_b_proj.kernel[...]
            .astype(dtype)
            .reshape(m.kv_lora_rank, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        )
        return w[..., : m.qk_nope_head_dim], w[..., m.qk_nope_head_dim :]

    def _expand(self, latent: Array, k_rot: Array) -> tuple[Array, Array]:
        """Per-head keys [B, S, heads, qk_head_dim] (``[W_UK c, k_rot]``) and values [B, S, heads, v_head_dim]."""
        w_uk, w_uv = self._up_kernels(latent.dtype)
        k_nope = jnp.einsum("bsr,rhd->bshd", latent, w_uk)
        v = jnp.einsum("bsr,rhd->bshd", latent, w_uv)
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_rot[:, :, None], (*k_nope.shape[:3], k_rot.shape[-1]))], axis=-1
        )
        return k, v

    def _expanded(self, q_nope: Array, q_rot: Array, latent: Array, k_rot: Array, mask: Array) -> Array:
        """Per-head keys and values built from the latents: for a block attending to itself."""
        k, v = self._expand(latent, k_rot)
        scores = jnp.einsum("bthd,bshd->bhts", jnp.concatenate([q_nope, q_rot], axis=-1), k)
        probs = _softmax(scores * self.scale, mask[:, None], v.dtype)
        return jnp.einsum("bhts,bshd->bthd", probs, v)

    def _project(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array, Array]:
        """x [B, T, d_in] -> q_nope [B,T,heads,nope], rotated q_rot [B,T,heads,rope], normed latents
        [B,T,kv_lora_rank], rotated shared rope keys [B,T,rope]."""
        m = self.mla
        b, t, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, self.num_heads, m.qk_head_dim)
        q_nope, q_rot = q[..., : m.qk_nope_head_dim], self._rope(q[..., m.qk_nope_head_dim :], cos, sin)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., : m.kv_lora_rank])
        k_rot = self._rope(compressed[..., None, m.kv_lora_rank :], cos, sin)[:, :, 0]  # one head, shared
        return q_nope, q_rot, latent, k_rot

    def heads(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """Per-head q, k [B, T, heads, qk_head_dim] (rotated) and v [B, T, heads, v_head_dim] of a block:
        the expanded form, for attention patterns outside the cache contract (the TTT unroll)."""
        q_nope, q_rot, latent, k_rot = self._project(x, cos, sin)
        k, v = self._expand(latent, k_rot)
        return jnp.concatenate([q_nope, q_rot], axis=-1), k, v

    @staticmethod
    def _written(kv: tuple[Array, Array], latent: Array, k_rot: Array, write_index: Array) -> tuple[Array, Array]:
        return write_kv(kv[0], latent[:, :, None], write_index), write_kv(kv[1], k_rot[:, :, None], write_index)

    def _over_cache(self, q_nope: Array, q_rot: Array, kv: tuple[Array, Array], mask: Array) -> Array:
        """Absorbed attention (W_UK folded into the query, W_UV after the average) over the cache's leading
        ``mask.shape[-1]`` slots of its leading rows, reading only the blocks the mask reaches
        (``layers.softmax_over_blocks``)."""
        b, t, h, _ = q_nope.shape
        dtype = q_nope.dtype
        w_uk, w_uv = self._up_kernels(dtype)
        latent, k_rot = (c[:b, 0, : mask.shape[-1]] for c in kv)
        block = min(KV_BLOCK, latent.shape[1])
        q_lat = jnp.einsum("bthd,rhd->bhtr", q_nope, w_uk).reshape(b, h * t, -1)
        q_rope = q_rot.transpose(0, 2, 1, 3).reshape(b, h * t, -1)

        def scores_of(start, block_mask):
            lat = jax.lax.dynamic_slice_in_dim(latent, start, block, axis=1).astype(dtype)
            rot = jax.lax.dynamic_slice_in_dim(k_rot, start, block, axis=1).astype(dtype)
            scores = jnp.einsum("bqr,bsr->bqs", q_lat, lat) + jnp.einsum("bqd,bsd->bqs", q_rope, rot)
            scores = (scores * self.scale).astype(jnp.float32).reshape(b, h, t, block)
            return jnp.where(block_mask[:, None], scores, jnp.finfo(jnp.float32).min)

        def values_of(probs, start):
            lat = jax.lax.dynamic_slice_in_dim(latent, start, block, axis=1).astype(dtype)
            out = jnp.einsum(
                "bqs,bsr->bqr", probs.astype(dtype).reshape(b, h * t, block), lat, preferred_element_type=jnp.float32
            )
            return out.reshape(b, h, t, -1)

        o_lat = softmax_over_blocks(scores_of, values_of, mask, latent.shape[-1]).astype(dtype)
        return self.o_proj(jnp.einsum("bhtr,rhd->bthd", o_lat, w_uv).reshape(b, t, -1))

    def read(self, x: Array, cos: Array, sin: Array, mask: Array, kv: tuple[Array, Array]) -> Array:
        """``layers.Attention.read`` for the latent cache: x attends (absorbed) over the leading
        ``mask.shape[-1]`` slots, which already hold what it needs; nothing written."""
        q_nope, q_rot, _, _ = self._project(x, cos, sin)
        return self._over_cache(q_nope, q_rot, kv, mask)

    def write(
        self, x: Array, cos: Array, sin: Array, kv: tuple[Array, Array], write_index: Array
    ) -> tuple[Array, Array]:
        """Writes the block's latents and rope keys into ``kv`` at slots ``write_index`` [B] without
        attending (what ``__call__`` writes first)."""
        _, _, latent, k_rot = self._project(x, cos, sin)
        return self._written(kv, latent, k_rot, write_index)

    def __call__(
        self,
        x: Array,
        cos: Array,
        sin: Array,
        mask: Array,
        kv: tuple[Array, Array] | None = None,
        write_index: Array | None = None,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        """x: [B, T, d_in]; cos/sin: [B, T, qk_rope_head_dim]. The cache contract of ``layers.Attention``
        with ``kv`` = (latents [B, 1, S, kv_lora_rank], rope keys [B, 1, S, qk_rope_head_dim]): this
        block's entries are written at slots ``write_index`` [B], then the block attends over the first
        ``mask.shape[-1]`` slots of the leading B rows (absorbed), or, when ``mask`` is [B, T, T] with
        T < S, over itself (expanded)."""
        b, t, _ = x.shape
        q_nope, q_rot, latent, k_rot = self._project(x, cos, sin)
        if kv is None:
            return self.o_proj(self._expanded(q_nope, q_rot, latent, k_rot, mask).reshape(b, t, -1)), None
        kv = self._written(kv, latent, k_rot, write_index)
        if mask.shape[-1] == t and t < kv[0].shape[2]:  # a prefill from an empty cache: over the block itself
            return self.o_proj(self._expanded(q_nope, q_rot, latent, k_rot, mask).reshape(b, t, -1)), kv
        return self._over_cache(q_nope, q_rot, kv, mask), kv
