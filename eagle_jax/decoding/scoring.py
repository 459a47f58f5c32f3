"""Log-probabilities of a token sequence under the target: the numbers behind ``logprobs`` and ``echo``.

Entry i describes token i given tokens 0..i-1: its log-probability and the ``top_n`` most likely tokens
at that position with theirs (entry 0 has no context: NaN and -1). They are the target's raw
log-softmax (before temperature, top-k/top-p or any logits processor: vLLM's default
``raw_logprobs``), computed by one forward over the whole sequence. A generated token's numbers are
therefore the same whether speculation produced it or plain decoding did, and equal what a full
forward of the same model in PyTorch gives (lm-evaluation-harness's ``hf`` backend).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eagle_jax.modeling.layers import causal_mask
from eagle_jax.modeling.target import Target

Array = jax.Array

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's bound, vLLM's default)


class TokenLogprobs(NamedTuple):
    """Per position of a [B, T] sequence: ``logprob`` [B, T], ``top_ids`` / ``top_logprobs`` [B, T, n],
    best first; position 0 is NaN / -1 (no context)."""

    logprob: Array
    top_ids: Array
    top_logprobs: Array


def token_logprobs(target: Target, ids: Array, top_n: int = MAX_TOP_LOGPROBS, compute_dtype=None) -> TokenLogprobs:
    """The target's log-probability of every token of ``ids`` [B, T] given the ones before it (padding
    after a row's end only affects entries past it: attention is causal)."""
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, _ = target.forward(ids, positions, causal_mask(b, t), compute_dtype=compute_dtype)
    logp = jax.nn.log_softmax(target.logits(hidden[:, :-1]).astype(jnp.float32), axis=-1)  # predicts tokens 1..T-1
    lp = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logp, top_n)
    first = jnp.full((b, 1), jnp.nan, jnp.float32)
    return TokenLogprobs(
        jnp.concatenate([first, lp], axis=1),
        jnp.concatenate([jnp.full((b, 1, top_n), -1, jnp.int32), top_ids.astype(jnp.int32)], axis=1),
        jnp.concatenate([jnp.full((b, 1, top_n), jnp.nan, jnp.float32), top_lp], axis=1),
    )
