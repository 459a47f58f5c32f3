"""Gemma 3's sliding windows in every decoding path: speculative greedy decoding (chains, trees) and
the server's slots (prompts prefilled in chunks) give plain greedy decoding's tokens past the window.

The target is the near-bigram Markov target of engine_models.py in the Gemma 3 layout (sandwich norms,
(1 + w) norms, scaled embedding, gelu-tanh, a global layer between two sliding ones with their own
rope base, window 6); its post-sublayer norms scale by 0.5 and its bigram margin is 0.6, so that the
bigram decides most choices (drafts are often accepted) while the context, within each layer's window,
changes some (~7% past the window). Plain
greedy decoding is checked against full forwards in parity_tests/test_gemma3.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from engine_models import markov_drafter, markov_target
from flax import nnx

import eagle_jax
from eagle_jax import RopeConfig, SpecConfig
from eagle_jax.config import FULL_LAYER, SLIDING_LAYER, TargetConfig
from eagle_jax.serving import Request, Scheduler, SlotEngine, SpecSchedule

VOCAB, HIDDEN, WINDOW, MAX_NEW = 32, 64, 6, 24
PROMPTS = [[3, 1, 4, 1, 5], list(np.random.default_rng(2).integers(0, VOCAB, size=13))]
SPECS = {
    "chain3": SpecConfig(num_speculative_tokens=3),
    "tree3x3x8": SpecConfig(method="tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8),
}


def gemma3_config(**kw) -> TargetConfig:
    return TargetConfig(
        architecture="gemma3",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope=RopeConfig(theta=10000.0),
        local_rope=RopeConfig(theta=100.0),
        sliding_window=WINDOW,
        layer_types=(SLIDING_LAYER, FULL_LAYER, SLIDING_LAYER),
        norm_unit_offset=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=24.0,
        qk_norm=True,
        max_position_embeddings=256,
        **kw,
    )


@pytest.fixture(scope="module")
def pair():
    target, succ = markov_target(VOCAB, HIDDEN, seed=0, eps=0.1, margin=0.6, config=gemma3_config())
    for layer in target.layers:  # (1 + w) = 0.5: the sublayers add half a normalised stream each
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            norm.weight.set_value(jnp.full_like(norm.weight[...], -0.5))
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.25)
    return target, drafter


@pytest.fixture(scope="module")
def plain(pair):
    return eagle_jax.generate(pair[0], None, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[]).tokens


def test_the_window_changes_the_markov_targets_choices(pair):
    """Without this the equalities below would not show that every path honours the window."""
    target, _ = pair
    ids = jnp.asarray([list(range(VOCAB)) + list(range(VOCAB))[::-1]], jnp.int32)
    narrow, _ = target(ids)
    wide = nnx.clone(target)
    wide.config = target.config.replace(sliding_window=1 << 20)
    broad, _ = wide(ids)
    assert np.array_equal(np.asarray(narrow[0, :WINDOW]), np.asarray(broad[0, :WINDOW]))
    assert (np.argmax(narrow[0, WINDOW:], -1) != np.argmax(broad[0, WINDOW:], -1)).any()


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_speculation_equals_plain_past_the_window(pair, plain, name):
    target, drafter = pair
    out = eagle_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, spec=SPECS[name], eos_token_id=[])
    assert out.tokens == plain
    assert (
        out.acceptance_length > 1.1
    )  # drafts were accepted (measured 1.24 with the chain): the accepted-path moves ran
    assert all(len(p) + MAX_NEW > 3 * WINDOW for p in PROMPTS)


def test_server_slots_with_chunked_prefill_equal_plain(pair):
    """A 70-token prompt prefilled in chunks of 32 (each chunk's window reaching into the one before) and
    a short one, in the slot engine with speculation: plain greedy decoding's tokens."""
    target, drafter = pair
    schedule = SpecSchedule.fixed(SPECS["chain3"])
    engine = SlotEngine(
        target, drafter, slots=2, max_len=128, specs=schedule.specs, rounds_per_step=3, eos_ids=(), chunk=32
    )
    prompts = [PROMPTS[0], [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, size=70)]]
    sched = Scheduler(engine, schedule).start()
    try:
        handles = [sched.submit(Request(tuple(p), 16)) for p in prompts]
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    for p, h in zip(prompts, handles):
        assert h.tokens == eagle_jax.generate(target, None, [p], max_new_tokens=16, eos_token_id=[]).tokens[0]
