"""The engine with a DeepSeek-V3-style target (MLA latent cache + MoE): greedy speculative decoding (chain
and tree) equals plain decoding token for token, in ``generate`` and in the slot engine's leading-row
programs, with a GQA drafter and with an MLA drafter (its own latent cache, absorbed attention in the
drafting steps and tree expansions). The target is the near-bigram construction of engine_models
(damped attention and experts), so the hand-built drafters are often right and multi-token rounds,
i.e. accepted tree paths gathered in the latent cache, really happen.
"""

from __future__ import annotations

import pytest
from engine_models import deepseek_config, markov_drafter, markov_mla_drafter, markov_target

import eagle_jax
from eagle_jax import SpecConfig
from eagle_jax.serving import Request, Scheduler, SlotEngine, SpecSchedule

PROMPTS = [[1, 2, 3], [9, 8], list(range(5, 25))]
CHAIN = SpecConfig(num_speculative_tokens=3)
TREE = SpecConfig(method="tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)


@pytest.fixture(scope="module")
def target_succ():
    return markov_target(vocab=32, hidden=64, seed=0, eps=0.1, config=deepseek_config(32, 64))


@pytest.fixture(scope="module")
def pair(target_succ):
    target, succ = target_succ
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.25)
    return target, drafter


@pytest.fixture(scope="module")
def mla_pair(target_succ):
    target, succ = target_succ
    drafter, _ = markov_mla_drafter(target, succ, seed=0, disagree=0.25)
    return target, drafter


@pytest.fixture(scope="module")
def plain(pair):
    return eagle_jax.generate(pair[0], None, PROMPTS, max_new_tokens=24, eos_token_id=[])


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain3", "tree8"])
def test_greedy_speculative_equals_plain(pair, plain, spec):
    target, drafter = pair
    out = eagle_jax.generate(target, drafter, PROMPTS, max_new_tokens=24, spec=spec, eos_token_id=[])
    assert out.tokens == plain.tokens
    assert max(a for row in out.accepted for a in row) >= 2  # multi-token rounds happened


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain3", "tree8"])
def test_mla_drafter_greedy_speculative_equals_plain(mla_pair, plain, spec):
    target, drafter = mla_pair
    assert drafter.config.mla is not None and drafter.init_cache(1, 4)[0].shape == (1, 1, 4, 64)
    out = eagle_jax.generate(target, drafter, PROMPTS, max_new_tokens=24, spec=spec, eos_token_id=[])
    assert out.tokens == plain.tokens
    assert out.acceptance_length > 2.0  # the drafter's latent cache is read right: it is often right


def test_slot_engine_equals_generate(mla_pair, plain):
    """Three requests in four slots: every program runs on the leading rows of the shared latent caches
    (the MLA drafter's included; a GQA drafter's cache in the slot engine: tests/test_serving.py). Steps
    without drafts while all three run feed the drafter lazily (``Plan.lazy_feed``); trees take over as
    requests finish."""
    target, drafter = mla_pair
    schedule = SpecSchedule(((1, TREE), (3, None)))
    engine = SlotEngine(target, drafter, slots=4, max_len=64, specs=schedule.specs, rounds_per_step=2, eos_ids=())
    sched = Scheduler(engine, schedule).start()
    limits = (8, 16, 24)
    try:
        handles = [sched.submit(Request(tuple(p), m)) for p, m in zip(PROMPTS, limits)]
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    assert [h.tokens for h in handles] == [t[:m] for t, m in zip(plain.tokens, limits)]
    assert max(a for h in handles for a in h.accepted[4:]) >= 2  # the trees after the plain steps drafted well
