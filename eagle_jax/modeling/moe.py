"""DeepSeek-V3 / Kimi-K2 mixture of experts: group-limited sigmoid routing, experts computed grouped by
expert, shared experts.

Expert compute: the (token, expert) assignments are sorted by expert and each projection is one
``jax.lax.ragged_dot`` over the sorted rows with per-expert group sizes: an assignment needs one
expert's matmuls, and no expert is asked to run on tokens not routed to it. How that runs is the
compiler's: TPU has a native grouped matmul, recent XLA GPU versions lower it to cuDNN's grouped
kernel, while XLA's CPU backend (and older GPU versions) expand it into a dense product over all
experts. Numerics follow HF transformers: routing in fp32 (the router weight upcast), the weighted sum
of a token's experts in fp32, cast back before the shared experts are added.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.config import MoEConfig
from eagle_jax.modeling.layers import MLP, KeySource

Array = jax.Array

# Variables kept in float32 whatever the model dtype, as HF keeps them (its _keep_in_fp32_modules):
# the selection bias decides routing, so it is never rounded.
FLOAT32_VARIABLES = ("e_score_correction_bias",)


class Router(nnx.Module):
    """HF's ``mlp.gate``: ``weight`` [E, H] (torch layout) and ``e_score_correction_bias`` [E]."""

    def __init__(self, hidden: int, moe: MoEConfig, *, dtype, rngs: KeySource):
        self.moe = moe
        e = moe.n_routed_experts
        self.weight = nnx.Param(
            (jax.random.normal(rngs.params(), (e, hidden), jnp.float32) / math.sqrt(hidden)).astype(dtype)
        )
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))

    def __call__(self, x: Array) -> tuple[Array, Array]:
        """x [N, H] -> (weights [N, k] fp32, expert ids [N, k] int32)."""
        m = self.moe
        n, e = x.shape[0], m.n_routed_experts
        # Full fp32 precision whatever the backend's default (TF32 on some GPUs): choices are discrete.
        logits = jnp.einsum(
            "nh,eh->ne",
            x.astype(jnp.float32),
            self.weight[...].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.e_score_correction_bias[...]  # the bias steers the choice, not the weights
        if m.topk_group < m.n_group:
            per_group = e // m.n_group
            group_scores = jax.lax.top_k(choice.reshape(n, m.n_group, per_group), 2)[0].sum(-1)
            _, kept = jax.lax.top_k(group_scores, m.topk_group)
            group_mask = jnp.zeros((n, m.n_group), bool).at[jnp.arange(n)[:, None], kept].set(True)
            choice = jnp.where(jnp.repeat(group_mask, per_group, axis=1), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, m.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, experts, axis=1)
        if m.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * m.routed_scaling_factor, experts.astype(jnp.int32)


class ExpertLinear(nnx.Module):
    """One [in, out] kernel per expert, stacked as ``kernel`` [E, in, out]."""

    def __init__(self, experts: int, d_in: int, d_out: int, *, dtype, rngs: KeySource):
        std = 1.0 / math.sqrt(d_in)
        self.kernel = nnx.Param(
            (jax.random.normal(rngs.params(), (experts, d_in, d_out), jnp.float32) * std).astype(dtype)
        )

    def __call__(self, x: Array, group_sizes: Array) -> Array:
        """x [M, in], rows sorted by expert, ``group_sizes`` [E] rows per expert -> [M, out]."""
        return jax.lax.ragged_dot(x, self.kernel[...].astype(x.dtype), group_sizes)


class Experts(nnx.Module):
    """The routed experts, SwiGLU each: HF's ``mlp.experts.{e}.{gate,up,down}_proj``, stacked."""

    def __init__(self, hidden: int, moe: MoEConfig, *, dtype, rngs: KeySource):
        e, inter = moe.n_routed_experts, moe.moe_intermediate_size
        self.gate_proj = ExpertLinear(e, hidden, inter, dtype=dtype, rngs=rngs)
        self.up_proj = ExpertLinear(e, hidden, inter, dtype=dtype, rngs=rngs)
        self.down_proj = ExpertLinear(e, inter, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: Array, group_sizes: Array) -> Array:
        act = jax.nn.silu(self.gate_proj(x, group_sizes).astype(jnp.float32)).astype(x.dtype)
        return self.down_proj(act * self.up_proj(x, group_sizes), group_sizes)


class MoE(nnx.Module):
    """Routed experts plus shared experts, for a layer past ``first_k_dense_replace``."""

    def __init__(self, hidden: int, moe: MoEConfig, *, dtype, rngs: KeySource):
        self.gate = Router(hidden, moe, dtype=dtype, rngs=rngs)
        self.experts = Experts(hidden, moe, dtype=dtype, rngs=rngs)
        shared = moe.moe_intermediate_size * moe.n_shared_experts
        self.shared_experts = MLP(hidden, shared, dtype=dtype, rngs=rngs) if shared else None

    def __call__(self, x: Array) -> Array:
        """x [..., H] -> [..., H]."""
        h = x.shape[-1]
        flat = x.reshape(-1, h)
        weights, experts = self.gate(flat)
        n, k = experts.shape
        assignments = experts.reshape(-1)
        order = jnp.argsort(assignments, stable=True)  # assignment slots grouped by expert
        group_sizes = jnp.bincount(assignments, length=self.gate.moe.n_routed_experts).astype(jnp.int32)
        rows = self.experts(flat[order // k], group_sizes)
        weighted = rows.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        routed = jnp.zeros((n * k, h), jnp.float32).at[order].set(weighted).reshape(n, k, h).sum(axis=1)
        out = routed.astype(x.dtype).reshape(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
