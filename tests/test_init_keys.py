"""Modules draw their init keys through ``layers.InitKeys``: the same values and the same ``nnx.Rngs`` state
as drawing from the Rngs itself, and abstract builds of a large model stay linear in its weight count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import Target, TargetConfig
from eagle_jax.modeling.layers import InitKeys

TINY = TargetConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
)


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
    np.testing.assert_array_equal(
        np.asarray(t.embed_tokens[...]),
        np.asarray(jax.random.normal(jax.random.fold_in(jax.random.key(5), 0), (64, 32)) * 0.02),
    )


def test_abstract_build_draws_nothing_from_the_traced_rngs(monkeypatch):
    """Under nnx.eval_shape every nnx.Rngs draw updated a traced counter, and JAX's sharding lookup on it
    walked the whole trace: quadratic builds (Kimi-K2: 30 s). InitKeys draws none of them."""
    from flax.nnx import rnglib

    draws = []
    real = rnglib.RngStream.__call__
    monkeypatch.setattr(rnglib.RngStream, "__call__", lambda self: draws.append(1) or real(self))
    cfg = TargetConfig(**{**TINY.__dict__, "num_layers": 8})
    abstract = nnx.eval_shape(lambda: Target(cfg, dtype=jnp.bfloat16))
    assert draws == [] and abstract.layers[7].mlp.down_proj.kernel.shape == (48, 32)
