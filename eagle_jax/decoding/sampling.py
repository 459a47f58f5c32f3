"""Token selection and the lossless acceptance rules of speculative sampling (SPEC 6).

All functions are batched over leading axes and traceable under jit. ``temperature == 0`` is greedy and
is resolved statically (Python float), so greedy programs contain no sampling code at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from eagle_jax.config import ConfigError

Array = jax.Array
NEG_INF = -jnp.inf


@dataclass(frozen=True)
class SamplingParams:
    """The request's sampling rule; the target's distribution p carries all of it."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: Array, sp: SamplingParams) -> Array:
    """p over the vocabulary after temperature, top-k and top-p (fp32). logits: [..., V]."""
    x = logits.astype(jnp.float32) / sp.temperature
    if sp.top_k > 0 and sp.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sp.top_k)[0][..., -1:]
        x = jnp.where(x < kth, NEG_INF, x)
    if sp.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        sorted_p = jax.nn.softmax(sorted_x, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold included).
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        cutoff = jnp.min(jnp.where(mass_before < sp.top_p, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, NEG_INF, x)
    return jax.nn.softmax(x, axis=-1)


def draft_probs(draft_logits: Array, sp: SamplingParams) -> Array:
    """q over the draft vocabulary: the drafter's logits at the request temperature (fp32)."""
    return jax.nn.softmax(draft_logits.astype(jnp.float32) / sp.temperature, axis=-1)


def sample(key: Array, probs: Array) -> Array:
    """One categorical sample per row of probs [..., V] (zero-probability entries never drawn)."""
    return jax.random.categorical(key, jnp.log(jnp.maximum(probs, 0.0)), axis=-1).astype(jnp.int32)


def accept_chain(
    key: Array, p: Array, q: Array, draft_tokens: Array, draft_ids: Array, t2d_index: Array
) -> tuple[Array, Array]:
    """Chain speculative sampling with draft distributions q (min(1, p/q) + residual, SPEC 6).

    p: [B, K+1, V] target probs at the K+1 verified positions; q: [B, K, Vd] the drafter's distributions
    the drafts were sampled from; draft_tokens: [B, K] target ids; draft_ids: [B, K] draft-vocab ids;
    t2d_index: [Vd] target id of each draft id. Returns (n accepted [B], next token [B]): the residual
    sample at the first rejection, or the bonus sample from p[K] when all K are accepted.
    """
    b, k1, v = p.shape
    k = k1 - 1
    k_acc, k_res = jax.random.split(key)
    px = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, draft_ids[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_acc, (b, k))
    ok = u * qx < px  # u < p/q without dividing by a possibly tiny q
    n = jnp.argmin(jnp.concatenate([ok, jnp.zeros((b, 1), bool)], axis=1), axis=1).astype(jnp.int32)
    # Residual at the first rejected position n (or p itself at n == K: the bonus token).
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1), n[:, None, None], axis=1)[:, 0]
    q_full = jnp.zeros((b, v), jnp.float32).at[:, t2d_index].set(q_n)  # only Vd entries move
    resid = jnp.maximum(p_n - q_full, 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    # p == q exactly leaves no residual mass; any token from p is then correct.
    resid = jnp.where(total > 0, resid / jnp.maximum(total, 1e-30), p_n)
    return n, sample(k_res, resid)


def accept_siblings(key: Array, p: Array, candidates: Array, valid: Array) -> tuple[Array, Array]:
    """Multi-draft rule for one tree node with deterministic (one-hot) drafts (SPEC 6).

    p: [B, V] target probs at the node; candidates: [B, C] child tokens in order; valid: [B, C].
    Tries children in order: accept child c with prob p(x_c) / (remaining mass); on rejection zero
    p(x_c) and renormalise. Returns (index of the accepted child or -1 [B], token [B]: the accepted
    child's token, or a sample from what is left of p when every child was rejected).
    """
    b, c = candidates.shape
    keys = jax.random.split(key, c + 1)
    chosen = jnp.full((b,), -1, jnp.int32)
    residual = p
    for i in range(c):
        x = candidates[:, i]
        mass = jnp.sum(residual, axis=-1)
        px = jnp.take_along_axis(residual, x[:, None], axis=-1)[:, 0]
        u = jax.random.uniform(keys[i], (b,))
        take = valid[:, i] & (chosen < 0) & (u * mass < px)
        chosen = jnp.where(take, i, chosen)
        reject = valid[:, i] & (chosen < 0)
        residual = jnp.where(reject[:, None], residual.at[jnp.arange(b), x].set(0.0), residual)
    token = jnp.where(
        chosen >= 0,
        jnp.take_along_axis(candidates, jnp.maximum(chosen, 0)[:, None], axis=1)[:, 0],
        sample(keys[c], residual),
    )
    return chosen, token
