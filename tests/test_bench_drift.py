"""The statistics of bench.drift / bench.target_quality: the loop detector, the bootstrap interval, and
the drafter-chain diagnostic against the engine's own chain (tiny random models)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.common import random_drafter
from bench.drift import _draft_chain_norms, _target_pass, bootstrap_ci, drafter_aux, position_counts
from bench.target_quality import loop_onset, smallest_period


def test_smallest_period():
    assert smallest_period([5] * 8) == 1
    assert smallest_period([1, 2, 3] * 4) == 3
    assert smallest_period([1, 2, 3, 1, 2]) is None  # fewer than two full periods of 3
    assert smallest_period(list(range(40)) * 2, max_period=32) is None  # period 40 > 32
    assert smallest_period(list(range(32)) * 2) == 32


def test_loop_onset():
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 1000, 50).tolist()  # distinct-ish tokens: no short period
    assert loop_onset(prefix) is None
    cycle = [7, 8, 9, 10, 11]
    seq = prefix + cycle * 30
    onset = loop_onset(seq)
    assert onset == 50 + 64  # the first window of 64 tokens lying wholly inside the cycle
    assert smallest_period(seq[onset - 64 : onset]) == 5
    assert loop_onset(seq[: onset - 1]) is None
    assert loop_onset([3] * 63) is None  # shorter than the window
    assert loop_onset([3] * 64) == 64
    assert loop_onset(list(range(33)) * 4) is None  # period 33 > 32: not a short loop


def test_bootstrap_ci_constant_and_deterministic():
    lo, hi = bootstrap_ci(np.full(10, 3.0), np.full(10, 4.0))
    assert lo == pytest.approx(0.75) and hi == pytest.approx(0.75)
    num = np.random.default_rng(1).random((20, 3))
    den = np.full(20, 2.0)
    a, b = bootstrap_ci(num, den, seed=5)
    c, d = bootstrap_ci(num, den, seed=5)
    assert a.shape == (3,) and np.array_equal(a, c) and np.array_equal(b, d)
    point = num.sum(0) / den.sum()
    assert np.all(a < point) and np.all(point < b)


def test_bootstrap_ci_matches_binomial_width():
    x = (np.random.default_rng(2).random(400) < 0.3).astype(float)
    lo, hi = bootstrap_ci(x, np.ones_like(x), n_boot=4000)
    half = 1.96 * np.sqrt(x.mean() * (1 - x.mean()) / len(x))
    assert lo < x.mean() < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.15)


def test_bootstrap_ci_empty():
    lo, hi = bootstrap_ci(np.zeros((0, 2)), np.zeros(0))
    assert np.isnan(lo).all() and np.isnan(hi).all()


def test_position_counts():
    rounds, per_pos, total = position_counts([[0, 2, 1], [3], []], k=3)
    assert rounds.tolist() == [3, 1, 0]
    assert per_pos.tolist() == [[2, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert total.tolist() == [3, 3, 0]


@pytest.mark.parametrize("eagle31", [False, True])
def test_chain_diagnostic_matches_engine(eagle31):
    """_draft_chain_norms drafts what the engine's prefill + _draft_chain draft, and its step-1 fed-back
    feature is the engine's carried d_feat."""
    from eagle_jax import Target, TargetConfig
    from eagle_jax.config import SpecConfig
    from eagle_jax.decoding.engine import Plan, _draft_chain
    from eagle_jax.decoding.prefill import start
    from eagle_jax.decoding.sampling import RowSampling, SamplingParams

    tc = TargetConfig(
        architecture="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    target = Target(tc, rngs=nnx.Rngs(0))
    drafter = random_drafter(target, eagle31, seed=3)
    k, b, t = 4, 2, 24
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 256, (b, t)), jnp.int32)
    _, aux_all, first = _target_pass(target, ids)
    _, raw, fed, drafts = _draft_chain_norms(drafter, drafter_aux(aux_all, target, drafter), ids, first, k)

    plan = Plan.one_shot(b, t, 8, SpecConfig(num_speculative_tokens=k), True, ())
    st = start(
        target,
        drafter,
        plan,
        ids,
        jnp.full((b,), t, jnp.int32),
        RowSampling.fill(SamplingParams(), b),
        jax.random.PRNGKey(0),
        8,
    )
    engine_drafts = _draft_chain(drafter, plan, st, None, k)[0]
    assert np.array_equal(np.asarray(drafts), np.asarray(engine_drafts))
    np.testing.assert_allclose(np.asarray(fed[:, 0]), np.sqrt(np.mean(np.asarray(st.d_feat) ** 2, -1)), rtol=1e-5)
    if eagle31:  # norm_output: the fed-back feature is RMS-normed, the raw h2 is not
        assert not np.allclose(np.asarray(raw), np.asarray(fed))
    else:
        np.testing.assert_allclose(np.asarray(raw), np.asarray(fed))
