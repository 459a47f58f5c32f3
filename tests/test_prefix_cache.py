"""Chunked prefill and prefix reuse in the slot engine and the scheduler: a prompt computed in chunks, beside
other prompts, or from a prefix another request left in the caches, gives the tokens and the per-round
acceptance of a whole-prompt prefill (so the reused drafter cache is the drafter's own, not just a
lossless guess)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_models import markov_pair, random_pair

from eagle_jax import ConfigError, SpecConfig
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.serving import Request, Scheduler, SlotEngine, SpecSchedule

SPEC = SpecConfig(num_speculative_tokens=3)
MAX_LEN = 160


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


@pytest.fixture(scope="module")
def attending():
    """A pair whose target's tokens depend on the whole context (the near-bigram one hardly reads its cache)."""
    return random_pair(vocab=64, hidden=32, logit_scale=4.0)


_ENGINES: dict = {}


def _engine(pair, slots: int = 2, rounds: int = 2, **kw) -> SlotEngine:
    """A reset engine (one per configuration for the module: its programs compile once). By default
    32-token chunks and prefix caching with one pool row."""
    kw = {"chunk": 32, "prefix_cache": True, "pool_rows": 1, **kw}
    key = (id(pair), slots, rounds, tuple(sorted(kw.items())))
    if key not in _ENGINES:
        _ENGINES[key] = SlotEngine(*pair, slots=slots, max_len=MAX_LEN, specs=(SPEC,), rounds_per_step=rounds, **kw)
    _ENGINES[key].reset()
    return _ENGINES[key]


def _decode(engine: SlotEngine, slot: int, first: int, new: int) -> tuple[list[int], list[int]]:
    """Steps until ``slot`` is done: (its tokens, the drafts accepted per round)."""
    tokens, accepted = [first], []
    while True:
        out = engine.step(SPEC, True)
        tokens += out.tokens[slot]
        accepted += out.accepted[slot]
        if out.done[slot]:
            return tokens[:new], accepted


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 32, n).tolist()


def test_chunks_and_reused_prefixes_equal_a_whole_prefill(pair):
    prompt, new = _prompt(0, 70), 24
    whole = _engine(pair)  # one engine, reset: the prefill paths below share its programs
    ref = _decode(whole, 0, whole.insert(0, prompt, new, SamplingParams(), 0)[0], new)
    assert len(ref[1]) > 3

    chunked = _engine(pair)
    for start in range(0, 70, 13):  # uneven pieces, none a chunk size
        got = chunked.prefill(0, prompt, start, min(start + 13, 70), new, SamplingParams(), 0)
        assert (got is None) == (start + 13 < 70)
    assert _decode(chunked, 0, got[0], new) == ref

    # Another request left the first 50 tokens (and its own continuation) in slot 0: slot 1 starts
    # from a copy of that row and computes positions 49.. (the drafter's entry 49 needs token 50).
    reuse = _engine(pair)
    other = prompt[:50] + _prompt(1, 30)
    _decode(reuse, 0, reuse.insert(0, other, 20, SamplingParams(), 0)[0], 20)
    reuse.copy_row(("slot", 0), ("pool", 0))  # through the pool and back, as an evicted slot's prefix would
    reuse.copy_row(("pool", 0), ("slot", 1), held=49)
    first, _ = reuse.prefill(1, prompt, 49, 70, new, SamplingParams(), 0)
    assert _decode(reuse, 1, first, new) == ref


def test_a_stopped_row_never_writes_into_what_its_slot_holds(attending):
    """Rounds write cache slots past a stopped row's length: a slot between two chunks, or holding a prefix
    copied in, is stopped at the end of what it holds, not at the length of the request it held before,
    while another request's steps run."""
    prompt, new = _prompt(20, 100), 16
    engine = _engine(attending)
    ref = _decode(engine, 0, engine.insert(0, prompt, new, SamplingParams(), 0)[0], new)

    def after_short_request(engine):  # slot 0 finished a 10-token request; slot 1 decodes meanwhile
        _decode(engine, 0, engine.insert(0, _prompt(21, 10), 4, SamplingParams(), 0)[0], 4)
        engine.insert(1, prompt, 50, SamplingParams(), 0)

    engine = _engine(attending)
    after_short_request(engine)
    for start in range(0, 100, 32):
        got = engine.prefill(0, prompt, start, min(start + 32, 100), new, SamplingParams(), 0)
        if got is None:
            engine.step(SPEC, True)
    assert _decode(engine, 0, got[0], new) == ref

    engine = _engine(attending)
    after_short_request(engine)
    engine.copy_row(("slot", 1), ("slot", 0), held=99)
    engine.step(SPEC, True)
    assert _decode(engine, 0, engine.prefill(0, prompt, 99, 100, new, SamplingParams(), 0)[0], new) == ref


def test_prompts_beside_others_equal_prompts_alone(attending):
    """Three prompts (greedy and seeded sampling, one with a penalty) prefilled into slots 0, 2 and 3 of one
    engine and decoded together: each gets the tokens, acceptance and penalties it gets alone."""
    rows = [
        (0, tuple(_prompt(30, 37)), SamplingParams(), 0),
        (2, tuple(_prompt(31, 5)), SamplingParams(temperature=1.0, presence_penalty=1.5), 7),
        (3, tuple(_prompt(32, 60)), SamplingParams(temperature=1.0), 8),
    ]

    def run(rows):
        engine = _engine(attending, slots=4)
        got = {slot: ([engine.insert(slot, prompt, 12, sp, seed)[0]], []) for slot, prompt, sp, seed in rows}
        while not all(len(t) >= 12 for t, _ in got.values()):
            out = engine.step(SPEC, False)
            for slot, (tokens, accepted) in got.items():
                tokens += out.tokens[slot]
                accepted += out.accepted[slot]
        return got

    alone = {}
    for r in rows:
        alone.update(run([r]))
    assert run(rows) == alone


def test_chunk_errors(pair):
    engine = _engine(pair)
    with pytest.raises(ConfigError, match="must lie in the prompt"):
        engine.prefill(0, [1, 2, 3], 2, 5, 4, SamplingParams(), 0)
    with pytest.raises(ConfigError, match="no cache row"):
        engine.copy_row(("slot", 0), ("pool", 1))  # one pool row
    with pytest.raises(ConfigError, match="holds 0.."):
        engine.copy_row(("pool", 0), ("slot", 1), held=-1)
    with pytest.raises(ConfigError, match="need prefix_cache"):
        SlotEngine(*pair, slots=2, max_len=MAX_LEN, specs=(SPEC,), pool_rows=2)


def test_a_prompt_is_cut_into_the_cheapest_chunks(pair):
    """Chunks cover start..end back to back inside the cache, and no other choice of chunk sizes costs
    less (positions computed + CHUNK_OVERHEAD per chunk; checked against every choice of up to 4 chunks)."""
    import itertools

    from eagle_jax.serving.slots import CHUNK_OVERHEAD

    engine = _engine(pair, chunk=128)
    sizes = engine.chunk_sizes
    assert len(sizes) >= 3
    cost = lambda cs: sum(cs) + CHUNK_OVERHEAD * len(cs)  # noqa: E731
    for n in range(1, 300):
        chosen = [c for _, c in engine.chunks(0, n)]
        assert sum(chosen) >= n and sum(chosen) - min(chosen) < n, (n, chosen)
        rivals = [cs for k in range(1, 5) for cs in itertools.combinations_with_replacement(sizes, k) if sum(cs) >= n]
        assert cost(chosen) <= min(map(cost, rivals)), (n, chosen)
    one = engine.chunks(MAX_LEN - 1, MAX_LEN)  # a prefix hit's last position: the smallest chunk, kept inside the cache
    assert [c for _, c in one] == [sizes[0]] and one[0][0] + sizes[0] <= engine.cache_len
    spans = engine.chunks(5, 150)
    assert spans[0][0] == 5 and all(a + c == b for (a, c), (b, _) in zip(spans, spans[1:]))


def _serve(pair, requests: list[Request], **kw) -> list:
    """The requests one after another through a scheduler (one slot: the same steps with or without reuse)."""
    engine = _engine(pair, slots=1, **{"chunk": 512, "prefix_cache": False, "pool_rows": 0, **kw})
    sched = Scheduler(engine, SpecSchedule.fixed(SPEC)).start()
    try:
        return [sched.submit(r).wait(300) for r in requests]
    finally:
        sched.stop()


def test_scheduler_reuses_prefixes_through_slots_and_the_pool(pair):
    """A shared system prompt, a chat's next turn (prompt + reply + new text), and a prefix that only the
    pool still holds after another request took the slot: each reuses what it shares, and every request's
    tokens and per-round acceptance are those of a cold prefill. The LRU pool row goes first."""
    system, other = _prompt(2, 40), _prompt(3, 40)
    a = Request(tuple(system + _prompt(4, 10)), 12)
    prompts = [
        a,
        Request(tuple(system + _prompt(5, 12)), 12),
        None,
        Request(tuple(other + _prompt(6, 5)), 12),
        Request(tuple(system + _prompt(7, 3)), 12),
        Request(tuple(_prompt(8, 30)), 12),
        Request(tuple(_prompt(9, 30)), 12),
        Request(tuple(other + _prompt(10, 5)), 12),
    ]
    cold = _serve(pair, [r for r in prompts if r is not None])
    chat = Request(tuple([*a.prompt, *cold[0].tokens, *_prompt(11, 6)]), 12)  # the next turn of ``a``
    prompts[2] = chat
    cold = _serve(pair, prompts)
    warm = _serve(pair, prompts, prefix_cache=True, pool_rows=2)
    for c, w in zip(cold, warm):
        assert (w.tokens, w.accepted) == (c.tokens, c.accepted)
    cached = [w.cached_tokens for w in warm]
    n = len(a.prompt) + len(cold[0].tokens)
    # b: the system prompt from the slot; chat: a's prompt and reply, from the pool (b took the slot);
    # other: nothing; system again: from the pool; two unrelated prompts push the pool's LRU rows out
    # (system's and other's in that order of use), so the last ``other`` finds nothing
    assert cached[:2] == [0, 39] and cached[2] >= n - 2 and cached[3:] == [0, 39, 0, 0, 0], cached


def test_a_prefix_in_a_high_slot_is_copied_down_rather_than_widening_steps(pair):
    """After six requests at once filled slots 0..5, the prompt slot 5 held comes back alone: it reuses its
    prefix from a copy in slot 0, so its steps run one row (not the four a step over slot 5 would take),
    with the tokens and acceptance of a cold prefill."""
    engine = _engine(pair, slots=8, chunk=32, pool_rows=1)
    prompts = [Request(tuple(_prompt(20 + i, 30)), 8) for i in range(6)]
    sched = Scheduler(engine, SpecSchedule.fixed(SPEC)).start()
    rows_run = []
    step = engine.step
    try:
        first = [sched.submit(r) for r in prompts]
        [h.wait(300) for h in first]
        held = [s for s in range(6) if engine.prompt_of(s) == prompts[5].prompt]
        assert held and held[0] > 0, "the prompt should be held by a slot past the first"
        engine.step = lambda *a, **kw: rows_run.append(kw.get("rows", a[2] if len(a) > 2 else None)) or step(*a, **kw)
        again = sched.submit(Request(prompts[5].prompt, 8)).wait(300)
    finally:
        engine.step = step
        sched.stop()
    cold = _serve(pair, [prompts[5]])[0]
    assert again.cached_tokens == len(prompts[5].prompt) - 1
    assert (again.tokens, again.accepted) == (cold.tokens, cold.accepted)
    assert rows_run and set(rows_run) == {1}, rows_run


def test_long_prompts_prefill_in_chunks_between_steps(attending):
    """Chunk budget 32: a 120-token prompt takes four steps' budgets while a running request keeps
    getting tokens, and both equal their runs alone (on a target that reads its whole cache, in slots
    that finished requests used before)."""
    running, long = Request(tuple(_prompt(12, 8)), 60), Request(tuple(_prompt(20, 120)), 10)
    alone = [_serve(attending, [r])[0].tokens for r in (running, long)]
    engine = _engine(attending, rounds=1, prefix_cache=False, pool_rows=0)
    sched = Scheduler(engine, SpecSchedule.fixed(SPEC)).start()
    try:
        # A short request takes slot 0 and ends; the running one decodes in slot 1; the long prompt is
        # prefilled into slot 0 below it, so the steps between its chunks run that row too.
        short = sched.submit(Request(tuple(_prompt(14, 12)), 4))
        first = sched.submit(running)
        short.wait(300)
        assert len(first.tokens) < 40
        second = sched.submit(long)
        seen = len(first.tokens)
        second.wait(300)
        assert first.wait(300).tokens == alone[0] and second.tokens == alone[1]
        got_meanwhile = sum(n for t, n in first.chunk_times if t <= second.t_first) - seen
        assert got_meanwhile >= 3, got_meanwhile  # steps ran between the long prompt's chunks
    finally:
        sched.stop()
