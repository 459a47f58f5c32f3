"""Token selection and the lossless acceptance rules of speculative sampling.

All functions are batched over a leading row axis and traceable under jit; sampling parameters and
random keys are per row (``RowSampling``, key arrays [B]), so requests with different settings share
one program and a row's draws do not depend on the other rows. A program whose rows are all greedy is
built without any of this code (``Plan.greedy``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import ConfigError
from eagle_jax.decoding.penalties import Penalties, RowPenalties

Array = jax.Array
NEG_INF = -jnp.inf


@dataclass(frozen=True)
class SamplingParams:
    """One request's (or ``generate`` call's) sampling rule and logits processors, named as vLLM's: what
    ``generate`` / ``generate_stream`` take as keywords and the server's requests carry, down to the engine's rows.
    The target's distribution p carries all of it; ``stop_ids`` (what ``min_tokens`` holds back: EOS and the
    request's stop tokens) is set where they are known."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability (vLLM's min_p)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a {id: bias} dict is taken too
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in bias))
        self.penalties  # noqa: B018  (validates the processors)

    @property
    def penalties(self) -> Penalties:
        """The logits processors (``decoding/penalties.py``)."""
        return Penalties(
            float(self.presence_penalty),
            float(self.frequency_penalty),
            float(self.repetition_penalty),
            self.logit_bias,
            int(self.min_tokens),
            tuple(self.stop_ids),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@jax.tree_util.register_dataclass
@dataclass
class RowSampling:
    """Per-row sampling parameters as arrays [B], so rows with different requests share one program.

    A row with ``temperature == 0`` is greedy: its p and q are one-hot at the argmax, under which the
    lossless rules below reduce exactly to greedy verification (accept iff the draft is the argmax).
    """

    temperature: Array  # [B] float32; 0 = greedy
    top_k: Array  # [B] int32; 0 = off
    top_p: Array  # [B] float32 in (0, 1]
    min_p: Array  # [B] float32 in [0, 1]; 0 = off
    # Presence / frequency / repetition penalties, logit_bias, min_tokens (``penalties.py``); None: a
    # program without them. They act on greedy rows too.
    penalties: RowPenalties | None = None

    @classmethod
    def fill(cls, sp: SamplingParams, batch: int, penalties: RowPenalties | None = None) -> "RowSampling":
        return cls(  # host arrays, as RowPenalties.build's
            np.full((batch,), sp.temperature, np.float32),
            np.full((batch,), sp.top_k, np.int32),
            np.full((batch,), sp.top_p, np.float32),
            np.full((batch,), sp.min_p, np.float32),
            penalties,
        )


def _per_row(value: Array, like: Array) -> Array:
    """[B] -> [B, 1, ..., 1] broadcastable against ``like`` [B, ..., V]."""
    return value.reshape(value.shape + (1,) * (like.ndim - 1))


def _truncate(x: Array, top_k: Array, top_p: Array) -> Array:
    """Top-k then top-p on scaled logits x [B, ..., V] with per-row k / p, from one descending sort."""
    v = x.shape[-1]
    sorted_x = -jnp.sort(-x, axis=-1)
    k = _per_row(top_k, x)
    kth = jnp.take_along_axis(sorted_x, jnp.broadcast_to(jnp.clip(k - 1, 0, v - 1), x.shape[:-1] + (1,)), axis=-1)
    use_k = k > 0
    x = jnp.where(use_k & (x < kth), NEG_INF, x)
    sorted_x = jnp.where(use_k & (sorted_x < kth), NEG_INF, sorted_x)
    # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold included).
    sorted_p = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    cutoff = jnp.min(jnp.where(mass_before < _per_row(top_p, x), sorted_x, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < cutoff, NEG_INF, x)


def _min_p(x: Array, min_p: Array) -> Array:
    """Drops tokens whose probability is below min_p x the largest (x: scaled logits; log 0 keeps all)."""
    return jnp.where(x < jnp.max(x, axis=-1, keepdims=True) + jnp.log(_per_row(min_p, x)), NEG_INF, x)


def target_probs(logits: Array, rs: RowSampling) -> Array:
    """p over the vocabulary after temperature, min-p, top-k and top-p (fp32), per row. logits: [B, ..., V]."""
    t = _per_row(rs.temperature, logits)
    greedy = t == 0
    x = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, t)
    x = jax.lax.cond(jnp.any(rs.min_p > 0), _min_p, lambda x, m: x, x, rs.min_p)
    # The sort only runs when some row truncates (a runtime branch, not a recompile).
    x = jax.lax.cond(jnp.any((rs.top_k > 0) | (rs.top_p < 1.0)), _truncate, lambda x, k, p: x, x, rs.top_k, rs.top_p)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, one_hot, jax.nn.softmax(x, axis=-1))


def draft_probs(draft_logits: Array, rs: RowSampling) -> Array:
    """q over the draft vocabulary: the drafter's logits at the row's temperature (fp32); one-hot if greedy."""
    t = _per_row(rs.temperature, draft_logits)
    greedy = t == 0
    q = jax.nn.softmax(draft_logits.astype(jnp.float32) / jnp.where(greedy, 1.0, t), axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(draft_logits, axis=-1), draft_logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, one_hot, q)


def split_rows(keys: Array, n: int) -> Array:
    """Per-row keys [B] -> [B, n] independent subkeys."""
    return jax.vmap(lambda k: jax.random.split(k, n))(keys)


def sample(keys: Array, probs: Array) -> Array:
    """One categorical sample per row of probs [B, ..., V] with the row's key (zero-probability entries never drawn)."""
    return jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(jnp.maximum(p, 0.0)), axis=-1))(keys, probs).astype(
        jnp.int32
    )


def uniform(keys: Array, shape: tuple[int, ...] = ()) -> Array:
    """Uniform [0, 1) draws of ``shape`` per row key: [B, *shape]."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape))(keys)


def accept_chain(
    keys: Array, p: Array, q: Array, draft_tokens: Array, draft_ids: Array, t2d_index: Array
) -> tuple[Array, Array]:
    """Chain speculative sampling with draft distributions q (min(1, p/q) + residual).

    p: [B, K+1, V] target probs at the K+1 verified positions; q: [B, K, Vd] the drafter's distributions
    the drafts were sampled from; draft_tokens: [B, K] target ids; draft_ids: [B, K] draft-vocab ids;
    t2d_index: [Vd] target id of each draft id; keys: [B] one key per row. Returns (n accepted [B], next token [B]):
    the residual sample at the first rejection, or the bonus sample from p[K] when all K are accepted.
    """
    b, k1, v = p.shape
    k = k1 - 1
    sub = split_rows(keys, 2)
    px = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, draft_ids[..., None], axis=-1)[..., 0]
    u = uniform(sub[:, 0], (k,))
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
    return n, sample(sub[:, 1], resid)


def accept_siblings(keys: Array, p: Array, candidates: Array, valid: Array) -> tuple[Array, Array]:
    """Multi-draft rule for one tree node with deterministic (one-hot) drafts.

    p: [B, V] target probs at the node; candidates: [B, C] child tokens in order; valid: [B, C].
    Tries children in order: accept child c with prob p(x_c) / (remaining mass); on rejection zero
    p(x_c) and renormalise. Returns (index of the accepted child or -1 [B], token [B]: the accepted
    child's token, or a sample from what is left of p when every child was rejected).
    """
    b, c = candidates.shape
    sub = split_rows(keys, c + 1)
    chosen = jnp.full((b,), -1, jnp.int32)
    residual = p
    for i in range(c):
        x = candidates[:, i]
        mass = jnp.sum(residual, axis=-1)
        px = jnp.take_along_axis(residual, x[:, None], axis=-1)[:, 0]
        u = uniform(sub[:, i])
        take = valid[:, i] & (chosen < 0) & (u * mass < px)
        chosen = jnp.where(take, i, chosen)
        reject = valid[:, i] & (chosen < 0)
        residual = jnp.where(reject[:, None], residual.at[jnp.arange(b), x].set(0.0), residual)
    token = jnp.where(
        chosen >= 0,
        jnp.take_along_axis(candidates, jnp.maximum(chosen, 0)[:, None], axis=1)[:, 0],
        sample(sub[:, c], residual),
    )
    return chosen, token
