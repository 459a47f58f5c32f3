"""The default speculation (``spec="auto"``, ``decoding/chooser.py``): its choice on synthetic costs and acceptance,
and what a user of ``generate`` sees of it: plain decoding's output whatever runs, nothing compiled after a first
call."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_models import markov_pair

import eagle_jax
from eagle_jax.decoding import auto_run, chooser
from eagle_jax.decoding.chooser import PLAIN, Acceptance, Chooser, CostTable

SPAN = 512
# A round's seconds on a weight-bound device: drafts nearly free next to the verification.
COSTS = {0: 1.0, 1: 1.15, 3: 1.45, 5: 1.75, 7: 2.05}


def true_rate(p: float, depth: int) -> float:
    """Tokens per second at ``depth`` when every draft is accepted with chance ``p`` once its predecessors were."""
    return (1 + sum(p**k for k in range(1, depth + 1))) / COSTS[depth]


def serve(ch: Chooser, p: float, chunks: int, rng, rows: int = 1, estimates=None, every: int = 8) -> list[int]:
    """``chunks`` choices of ``every`` rounds each on rows whose drafts are accepted with chance ``p``: the depths
    run."""
    estimates = estimates or [ch.new_row(True) for _ in range(rows)]
    ran = []
    for _ in range(chunks):
        depth = ch.choose(rows, True, estimates, lambda d: SPAN)
        if depth == PLAIN:  # rounds without drafts score the first draft
            hits = [(float(rng.binomial(every, p)), float(every)) for _ in estimates]
            ch.observe(
                PLAIN, rows, SPAN, True, COSTS[0] * every, every, estimates, [[0] * every] * len(estimates), hits
            )
        else:
            accepted = [
                [int(np.argmin(np.append(rng.random(depth) < p, False))) for _ in range(every)] for _ in estimates
            ]
            ch.observe(depth, rows, SPAN, True, COSTS[depth] * every, every, estimates, accepted)
        ran.append(depth)
    return ran


@pytest.mark.parametrize("p", [0.02, 0.3, 0.6, 0.8, 0.95])
def test_the_choice_converges_to_the_best_fixed_depth(p):
    """Settled, it runs the best depth or one within 5% of it (where two depths are that close, acceptance measured
    over a few dozen rounds cannot tell them apart); over the whole run, the warm-up profile included, within 10%."""
    best = max(true_rate(p, d) for d in COSTS)
    for seed in range(3):
        ran = serve(Chooser(), p, 40, np.random.default_rng(seed))
        assert np.mean([true_rate(p, d) for d in ran[-20:]]) >= 0.95 * best, (p, ran)
        assert np.mean([true_rate(p, d) for d in ran]) >= 0.9 * best, (p, ran)


def test_a_hard_first_prompt_does_not_lock_speculation_out():
    """A prompt the drafter cannot follow decodes without drafts; the next, which it follows, speculates again
    within a few chunks (its rounds without drafts score the first draft) and reaches deep chains."""
    ch, rng = Chooser(), np.random.default_rng(1)
    hard = serve(ch, 0.02, 12, rng)
    assert hard[-4:] == [PLAIN] * 4
    easy = serve(ch, 0.95, 12, rng)
    assert easy[:4] != [PLAIN] * 4 and easy[-1] == max(COSTS, key=lambda d: true_rate(0.95, d)), easy


def test_a_row_starts_from_the_pooled_estimate_and_follows_its_own():
    ch = Chooser()
    pooled = ch.pooled[True]
    ch.observe(3, 1, SPAN, True, None, 30, [ch.new_row(True)], [[3] * 30])  # traffic so far: every draft accepted
    row = ch.new_row(True)
    np.testing.assert_allclose(row.p(), pooled.p())
    assert row.expected_tokens(3) > 3.5
    row.observe([0] * 20, 3)  # this prompt's first drafts are all rejected
    assert row.p()[0] < 0.3 < pooled.p()[0]


def test_an_unobserved_position_leans_on_the_one_before_it():
    est = Acceptance()
    est.observe([1] * 30, 1)  # a chain of 1, every draft accepted: position 0 is well known, the others never ran
    p = est.p()
    assert p[0] > 0.9 and np.all(np.diff(p) <= 1e-12) and p[-1] > chooser.PRIOR
    est.observe([0] * 100, 1)  # old evidence fades (KEEP per round): the estimate follows the traffic
    assert est.p()[0] < 0.1


def test_costs_are_measured_interpolated_and_bucketed_by_span():
    table = CostTable()
    assert table.profile_next(4, SPAN) == PLAIN
    table.observe(4, PLAIN, SPAN, 8.0, 8)
    assert table.profile_next(4, SPAN) == chooser.DEEPEST and table.cost(4, 3, SPAN) is None  # not bracketed yet
    table.observe(4, chooser.DEEPEST, SPAN, 16.0, 8)
    assert table.profile_next(4, SPAN) is None
    assert table.cost(4, 3, SPAN) == pytest.approx(1.0 + 3 / 7)
    table.observe(4, 3, SPAN, 4.0, 2)  # measured: its own cost replaces the line
    assert table.cost(4, 3, SPAN) == pytest.approx(2.0)
    assert table.cost(4, 3, SPAN - 100) == pytest.approx(2.0)  # the same bucket
    assert table.cost(4, 3, 4 * SPAN) == pytest.approx(2.0)  # a bucket it never ran in: the nearest one's
    assert table.cost(2, 3, SPAN) is None  # other rows: nothing known
    for _ in range(40):  # a running mean: it follows the machine
        table.observe(4, 3, SPAN, 8.0, 2)
    assert table.cost(4, 3, SPAN) == pytest.approx(4.0, rel=0.01)


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


PROMPTS = [list(np.random.default_rng(7).integers(0, 32, n)) for n in (4, 11, 19)]


def test_greedy_output_is_plain_decodings_whatever_runs(pair, monkeypatch):
    """Chosen depths, or any sequence of them forced chunk by chunk: the tokens of plain decoding, generated or
    streamed."""
    target, drafter = pair
    plain = eagle_jax.generate(target, None, PROMPTS, max_new_tokens=24, eos_token_id=[]).tokens
    chooser.reset()
    out = eagle_jax.generate(target, drafter, PROMPTS, max_new_tokens=24, eos_token_id=[])
    assert out.tokens == plain and out.stats["spec"] == "auto"
    assert [d for d, _ in out.stats["chunks"][:2]] == [PLAIN, chooser.DEEPEST]  # the warm-up profile's two ends
    streamed = list(
        eagle_jax.generate_stream(target, drafter, PROMPTS, max_new_tokens=24, eos_token_id=[], rounds_per_chunk=2)
    )
    assert [sum((c[b] for c in streamed), []) for b in range(len(PROMPTS))] == plain
    turns = iter([7, 0, 1, 5, 0, 3, 7, 1] * 10)
    monkeypatch.setattr(Chooser, "choose", lambda *a, **k: next(turns))
    monkeypatch.setattr(auto_run, "CHOOSE_EVERY", 2)
    monkeypatch.setattr(auto_run, "PROFILE_ROUNDS", 2)
    forced = eagle_jax.generate(target, drafter, PROMPTS, max_new_tokens=24, eos_token_id=[])
    assert forced.tokens == plain and len({d for d, _ in forced.stats["chunks"]}) >= 4


def test_a_call_that_never_speculates_drops_the_drafter(pair, monkeypatch):
    """Chunks without drafts ``PLAIN_LOOKS`` times in a row: the rest of the call is plain decoding proper."""
    target, drafter = pair
    monkeypatch.setattr(Chooser, "choose", lambda *a, **k: PLAIN)
    fed = []
    run = auto_run.AutoRun._run
    monkeypatch.setattr(
        auto_run.AutoRun,
        "_run",
        lambda self, program, st, limit: (fed.append(st.d_cache is not None), run(self, program, st, limit))[1],
    )
    out = eagle_jax.generate(target, drafter, PROMPTS, max_new_tokens=40, eos_token_id=[])
    assert out.tokens == eagle_jax.generate(target, None, PROMPTS, max_new_tokens=40, eos_token_id=[]).tokens
    assert fed[0] and not fed[-1], fed


def test_nothing_compiles_after_the_first_call(pair):
    """The first call at a batch size and prompt bucket compiles every program auto may run there; later calls,
    whatever they choose and even from an empty chooser, compile nothing."""
    target, drafter = pair
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 32, 9 + i)] for i in range(5)]
    eagle_jax.generate(target, drafter, prompts[:2], max_new_tokens=20, eos_token_id=[])
    compiles = []

    def listen(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for i in range(3):
            if i == 1:
                chooser.reset()
            r = eagle_jax.generate(
                target, drafter, [prompts[2 + i], prompts[i]], max_new_tokens=20, eos_token_id=[], temperature=0.0
            )
            assert r.compile_s == 0.0
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert not compiles, compiles
