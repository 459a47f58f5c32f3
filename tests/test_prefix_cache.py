"""Chunked prefill and prefix reuse in the slot engine and the scheduler: a prompt computed in chunks,
or from a prefix another request left in the caches, gives the tokens and the per-round acceptance of
a whole-prompt prefill (so the reused drafter cache is the drafter's own, not just a lossless guess)."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax import ConfigError, SpecConfig
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.serving import Request, Scheduler, SlotEngine, SpecSchedule
from engine_models import markov_pair

SPEC = SpecConfig(num_speculative_tokens=3)
MAX_LEN = 160


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


def _engine(pair, **kw) -> SlotEngine:
    target, drafter = pair
    return SlotEngine(target, drafter, slots=2, max_len=MAX_LEN, specs=(SPEC,), rounds_per_step=2, **kw)


def _decode(engine: SlotEngine, slot: int, first: int, new: int) -> tuple[list[int], list[int]]:
    """Steps until ``slot`` is done: (its tokens, the drafts accepted per round)."""
    tokens, accepted = [first], []
    while True:
        out = engine.step(SPEC, True, engine.spans[-1])
        tokens += out.tokens[slot]
        accepted += out.accepted[slot]
        if out.done[slot]:
            return tokens[:new], accepted


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 32, n).tolist()


def test_chunks_and_reused_prefixes_equal_a_whole_prefill(pair):
    prompt, new = _prompt(0, 70), 24
    whole = _engine(pair)
    ref = _decode(whole, 0, whole.insert(0, prompt, new, SamplingParams(), 0)[0], new)
    assert len(ref[1]) > 3

    chunked = _engine(pair, chunk=32)
    for start in range(0, 70, 13):  # uneven pieces, none a chunk size
        got = chunked.prefill_chunk(0, prompt, start, min(start + 13, 70), new, SamplingParams(), 0)
        assert (got is None) == (start + 13 < 70)
    assert _decode(chunked, 0, got[0], new) == ref

    # Another request left the first 50 tokens (and its own continuation) in slot 0: slot 1 starts
    # from a copy of that row and computes positions 49.. (the drafter's entry 49 needs token 50).
    reuse = _engine(pair, prefix_cache=True, pool_rows=1)
    other = prompt[:50] + _prompt(1, 30)
    _decode(reuse, 0, reuse.insert(0, other, 20, SamplingParams(), 0)[0], 20)
    reuse.copy_row(("slot", 0), ("pool", 0))  # through the pool and back, as an evicted slot's prefix would
    reuse.copy_row(("pool", 0), ("slot", 1))
    first, _ = reuse.prefill_chunk(1, prompt, 49, 70, new, SamplingParams(), 0)
    assert _decode(reuse, 1, first, new) == ref


def test_chunk_errors(pair):
    engine = _engine(pair, chunk=32)
    with pytest.raises(ConfigError, match="must lie in the prompt"):
        engine.prefill_chunk(0, [1, 2, 3], 2, 5, 4, SamplingParams(), 0)
    with pytest.raises(ConfigError, match="1..32"):
        engine.prefill_chunk(0, list(range(1, 31)) * 2, 0, 40, 4, SamplingParams(), 0)
    with pytest.raises(ConfigError, match="no cache row"):
        engine.copy_row(("slot", 0), ("pool", 0))
    with pytest.raises(ConfigError, match="need prefix_cache"):
        _engine(pair, pool_rows=2)
