"""The KV cache write (``write_kv``): every row's new positions land at its own slot, bit for bit, in every
dtype and in each of its forms (all rows, the leading rows of a larger cache, one row); and on a CPU a
bfloat16 scatter needs no float32 copy of the cache (XLA's CPU backend would make one, every layer and
round: ~20 ms per execution and 1.25x a round at bfloat16 batch 12 on the bundled pair)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.modeling.layers import write_kv


def _reference(cache: np.ndarray, new: np.ndarray, start: np.ndarray) -> np.ndarray:
    out = cache.copy()
    for r in range(new.shape[0]):
        out[r, :, start[r] : start[r] + new.shape[1]] = new[r].transpose(1, 0, 2)
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("rows, cache_rows", [(4, 4), (2, 4), (1, 4), (1, 1)])
def test_each_rows_positions_land_at_its_slot_bit_for_bit(dtype, rows, cache_rows):
    rng = np.random.default_rng(rows * 10 + cache_rows)
    cache = jnp.asarray(rng.standard_normal((cache_rows, 2, 16, 8)), dtype)
    new = jnp.asarray(rng.standard_normal((rows, 3, 2, 8)), dtype)
    start = jnp.asarray(rng.integers(0, 13, rows), jnp.int32)
    got = jax.jit(write_kv)(cache, new, start)
    assert got.dtype == cache.dtype
    want = _reference(np.asarray(cache), np.asarray(new), np.asarray(start))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the float32 copy is XLA's CPU backend's")
@pytest.mark.parametrize("rows", [12, 4])
def test_a_bfloat16_scatter_makes_no_float32_copy_of_the_cache(rows):
    cache = jnp.zeros((12, 2, 512, 64), jnp.bfloat16)
    new = jnp.ones((rows, 1, 2, 64), jnp.bfloat16)
    start = jnp.arange(rows, dtype=jnp.int32)
    compiled = jax.jit(write_kv, donate_argnums=0).lower(cache, new, start).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < cache.nbytes  # a float32 copy alone is 2x
