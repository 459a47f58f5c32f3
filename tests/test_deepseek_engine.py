"""The engine with a DeepSeek-V3-style target (MLA latent cache + MoE): greedy speculative decoding (chain
and tree) equals plain decoding token for token, in ``generate`` and in the slot engine's leading-row
programs. The target is the near-bigram construction of engine_models (damped attention and experts),
so the hand-built drafter is often right and multi-token rounds, i.e. accepted tree paths gathered in
the latent cache, really happen.
"""

from __future__ import annotations

import pytest

import eagle_jax
from eagle_jax import SpecConfig
from eagle_jax.serving import Request, Scheduler, SlotEngine, SpecSchedule
from engine_models import deepseek_config, markov_drafter, markov_target

PROMPTS = [[1, 2, 3], [9, 8], list(range(5, 25))]
CHAIN = SpecConfig(num_speculative_tokens=3)
TREE = SpecConfig(method="tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)


@pytest.fixture(scope="module")
def pair():
    target, succ = markov_target(vocab=32, hidden=64, seed=0, eps=0.1, config=deepseek_config(32, 64))
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.25)
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


def test_slot_engine_equals_generate(pair, plain):
    """Three requests in four slots: every program runs on the leading rows of the shared latent caches."""
    target, drafter = pair
    engine = SlotEngine(target, drafter, slots=4, max_len=64, specs=(TREE,), rounds_per_step=2, eos_ids=())
    sched = Scheduler(engine, SpecSchedule.fixed(TREE)).start()
    try:
        handles = [sched.submit(Request(tuple(p), 24)) for p in PROMPTS]
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    assert [h.tokens for h in handles] == plain.tokens
