"""``attend``'s and ``attend_cache``'s forms agree: the few-query one (a few queries over several rows' caches, on a
CPU: whole spans up to ``WHOLE_SPAN_SLOTS``, block by block past them) and the dot one, on decode, verification and
prefill shapes, with masks that leave slots out.

Both are the same sums in another order: fp32 agreement to 1e-6 relative (observed ~3e-7)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.modeling import layers


def query_first(q, k, v, mask):
    """The reference: scores [B, Hkv, g, T, S], fp32 softmax over S."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k) / math.sqrt(d)
    s = jnp.where(mask[:, None, None], s.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(b, t, hq * d)


# (4,1), (3,5), (2,16): the few-query form on a CPU; (1,1) and (2,24): the dot one
@pytest.mark.parametrize("b, t, s", [(4, 1, 40), (3, 5, 33), (2, 16, 64), (1, 1, 40), (2, 24, 24)])
def test_both_forms_of_attention_agree(b, t, s):
    q, k, v, mask = _case(b, t, s)
    got = jax.jit(layers.attend)(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(query_first(q, k, v, mask)), rtol=1e-6, atol=1e-6)


# Several cache blocks (the last one overlapping the one before), rows that end in different blocks; the
# few-query form for (4,1), (3,5) (whole spans) and (3,4,1300) (block by block), the dot one for (1,1) and (2,24).
@pytest.mark.parametrize("b, t, s", [(4, 1, 600), (3, 5, 520), (3, 4, 1300), (1, 1, 300), (2, 24, 600)])
def test_attention_over_the_cache_block_by_block_agrees(b, t, s):
    q, k, v, mask = _case(b, t, s)
    assert (s > layers.WHOLE_SPAN_SLOTS) == (s == 1300)
    got = jax.jit(layers.attend_cache)(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(query_first(q, k, v, mask)), rtol=1e-5, atol=1e-6)


def _case(b, t, s):
    rng = np.random.default_rng(b * 100 + t)
    q = jnp.asarray(rng.normal(size=(b, t, 6, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, 2, s, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, 2, s, 8)), jnp.float32)
    lengths = rng.integers(t, s + 1, b)  # rows of different lengths: the cache's tail is masked
    q_pos = lengths[:, None] - t + np.arange(t)[None]
    return q, k, v, jnp.asarray((np.arange(s)[None, None] <= q_pos[:, :, None]))
