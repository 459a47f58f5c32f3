"""Modules draw their init keys through ``layers.InitKeys``: the same values and the same ``nnx.Rngs`` state
as drawing from the Rngs itself, and abstract builds of a large model stay linear in its weight count."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import Target, TargetConfig
from eagle_jax.modeling.layers import InitKeys

TINY = TargetConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def test_same_keys_and_rngs_state_as_drawing_from_rngs():
    direct, counted = nnx.Rngs(3), nnx.Rngs(3)
    keys = InitKeys(counted)
    for _ in range(5):
        np.testing.assert_array_equal(jax.random.key_data(direct.params()), jax.random.key_data(keys.params()))
    keys.commit()
    np.testing.assert_array_equal(jax.random.key_data(direct.params()), jax.random.key_data(counted.params()))

    # A Target built from an Rngs leaves it where 1 + 2 x 7 + 1 draws (embed, 7 matrices a layer, lm_head) would.
    rngs = nnx.Rngs(5)
    t = Target(TINY, rngs=rngs)
    assert int(rngs.params.count[...]) == 16
    np.testing.assert_array_equal(np.asarray(t.embed_tokens[...]),
                                  np.asarray(jax.random.normal(jax.random.fold_in(jax.random.key(5), 0), (64, 32)) * 0.02))


def test_abstract_build_is_linear_in_layers():
    """Before InitKeys, each draw under nnx.eval_shape cost time proportional to the trace so far."""
    def build(layers):
        cfg = TargetConfig(**{**TINY.__dict__, "num_layers": layers})
        t0 = time.perf_counter()
        nnx.eval_shape(lambda: Target(cfg, dtype=jnp.bfloat16))
        return time.perf_counter() - t0

    build(2)  # warm-up
    small, large = min(build(8) for _ in range(2)), min(build(64) for _ in range(2))
    assert large < 8 * small * 3, (small, large)  # 8x the layers: ~8-14x measured; the quadratic build was ~50x
