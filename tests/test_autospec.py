"""Speculation chosen by measurement (decoding/autospec.py: ``spec="auto"``, the default) and adaptive
chains (engine._round_adaptive).

Greedy output is plain decoding's whatever auto or the costs make a round choose: the costs are forced here
(``adaptive_costs.calibrate`` patched) to make rounds verify everything, nothing, or a width below the
drafts made, and then left to this machine's measurement. The sampling law under adaptive rounds is
checked in test_engine.py (SAMPLING_CASES "adaptive-*").
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import eagle_jax
from eagle_jax import SpecConfig
from eagle_jax.config import ConfigError
from eagle_jax.decoding import adaptive_costs, autospec
from eagle_jax.decoding.engine import WATCH_MIN_ROUNDS, RoundCosts, draft_confidence
from eagle_jax.decoding.penalties import Penalties
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.auto_run import AutoRun
from autospec_tables import FixedCosts, measured_now
from engine_models import markov_drafter, markov_pair, markov_target

PROMPTS = [list(np.random.default_rng(7).integers(0, 32, n)) for n in (4, 11, 19)]
K = 4
_AUTO_KW = dict(sampling=SamplingParams(0.0), penalties=Penalties(), eos_token_id=[], seed=0, tokenizer=None, mesh=None, exact=False)
ADAPTIVE = SpecConfig(num_speculative_tokens=K, adaptive=True)


def costs(verify_s, draft_s=0.0, plain_s=1.0):
    return RoundCosts(adaptive_costs.widths_for(K), tuple(verify_s), draft_s, plain_s)


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


@pytest.fixture(scope="module")
def plain(pair):
    return eagle_jax.generate(pair[0], None, PROMPTS, max_new_tokens=24, eos_token_id=[])


def run_with(monkeypatch, pair, forced: RoundCosts | None, spec=ADAPTIVE):
    if forced is not None:
        monkeypatch.setattr(adaptive_costs, "calibrate", lambda *a, **k: forced)
    return eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, spec=spec, eos_token_id=[])


def test_flat_costs_verify_every_draft(monkeypatch, pair, plain):
    """Drafting free and every width costing the same: each round drafts and verifies all K, so the
    run is the fixed chain's, round for round."""
    out = run_with(monkeypatch, pair, costs([1.0, 1.0, 1.0, 1.0]))
    fixed = eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, spec=SpecConfig(num_speculative_tokens=K), eos_token_id=[])
    assert out.tokens == plain.tokens == fixed.tokens
    assert out.accepted == fixed.accepted and max(a for row in out.accepted for a in row) == K


def test_costly_widths_verify_no_draft(monkeypatch, pair, plain):
    out = run_with(monkeypatch, pair, costs([1.0, 50.0, 50.0, 50.0]))
    assert out.tokens == plain.tokens
    assert {a for row in out.accepted for a in row} == {0}


def test_width_below_the_drafts_made(monkeypatch, pair, plain):
    """Widths 1, 2, 4, 5: width 2 (one draft) far cheaper than 4 and 5, drafting free, so every round
    drafts K but proposes one: rounds accept 0 or 1, never more."""
    out = run_with(monkeypatch, pair, costs([1.0, 1.0, 50.0, 50.0]))
    assert out.tokens == plain.tokens
    assert {a for row in out.accepted for a in row} == {0, 1}


def test_costly_drafter_steps_stop_drafting(monkeypatch, pair, plain):
    """A drafter step dearer than any draft can repay: only the free first draft is ever proposed."""
    out = run_with(monkeypatch, pair, costs([1.0, 1.0, 1.0, 1.0], draft_s=100.0))
    assert out.tokens == plain.tokens
    assert max(a for row in out.accepted for a in row) == 1


@pytest.fixture
def fixed_costs(monkeypatch):
    """Rounds cost what a weight-bound device charges (drafts nearly free); the estimates start empty."""
    autospec.reset()
    table = FixedCosts({0: 1.0, 1: 1.1, 3: 1.3, 5: 1.6, 7: 1.9})
    monkeypatch.setattr(autospec, "cost_model", lambda key: table)
    yield table
    autospec.reset()


def test_auto_output_is_plain_decodings(pair, plain):
    """The default with a drafter, costs measured on this machine: whatever depths the chunks run,
    generate and generate_stream return plain decoding's tokens; the first call measures a round without drafts, then the deepest chain first."""
    autospec.reset()
    out = eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, eos_token_id=[])
    assert out.tokens == plain.tokens and out.stats["spec"] == "auto" and out.stats["round_ms"] == {}  # nothing measured yet
    # probes (a program's first run is not timed: measured again), then the deepest chain
    ds = [d for d, _ in out.stats["chunks"]]
    assert ds[0] is None and next(d for d in ds if d is not None) == max(autospec.DEPTHS)
    streamed = list(eagle_jax.generate_stream(pair[0], pair[1], PROMPTS, max_new_tokens=24, eos_token_id=[]))
    assert [sum((c[b] for c in streamed), []) for b in range(len(PROMPTS))] == plain.tokens
    # A stream's chunks (what its reader waits for) stay within rounds_per_chunk, bar a probe's or a measuring
    # run's few rounds (unbounded, this call would run chunks of 8 rounds or more).
    run = AutoRun(pair[0], pair[1], PROMPTS, 24, _AUTO_KW, most_rounds=2)
    for _ in run:
        pass
    assert all(n <= max(2, autospec.EXPLORE_ROUNDS, autospec.PROBE_ROUNDS) for _, n in run.chunks), run.chunks


def test_a_warmed_calls_probe_compiles_nothing(pair):
    """Once ``warm`` ran a call's programs, the call compiles nothing, its probe's reset included: an eager
    ``jnp.zeros_like`` compiled on a process's first call, ~85 ms at batch 1 outside the compile time a call
    reports. Seven rows: a shape no other test gives the probe's counts."""
    import jax

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(7)]
    AutoRun(pair[0], pair[1], prompts, 12, _AUTO_KW).warm()
    autospec.reset()
    compiles = []

    def listen(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run = AutoRun(pair[0], pair[1], prompts, 12, _AUTO_KW)
        for _ in run:
            pass
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert run.chunks[0][0] is None and not compiles, (run.chunks, compiles)


def test_a_hard_first_prompt_does_not_switch_speculation_off(fixed_costs):
    """A drafter that never predicts prompt A's continuation (its tokens lie outside the draft vocabulary)
    and often predicts B's. A first call on A decodes plainly after measuring that; the calls on B that
    follow probe, find acceptance again and speculate, and every output is plain decoding's."""
    target, succ = markov_target(vocab=32, hidden=64, seed=0, eps=0.1)
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.25, draft_vocab=list(range(0, 32, 2)))
    hard, easy = [[1, 1]], [[25, 25]]
    calls = [(hard, 64), (easy, 32), (easy, 32), (easy, 32)]  # the hard call long enough to see plain decoding win
    runs = [eagle_jax.generate(target, drafter, p, max_new_tokens=n, eos_token_id=[]) for p, n in calls]
    for (p, n), r in zip(calls, runs):
        assert r.tokens == eagle_jax.generate(target, None, p, max_new_tokens=n, eos_token_id=[]).tokens
    depths = [[d for d, n in r.stats["chunks"] for _ in range(n)] for r in runs]
    assert depths[0][-1] == autospec.PLAIN  # the hard prompt ends in plain decoding
    assert all(any(d not in (None, autospec.PLAIN) for d in ds) for ds in depths[1:])  # every later call speculates
    assert sum(d not in (None, autospec.PLAIN) for d in depths[-1]) >= len(depths[-1]) // 2
    assert runs[-1].stats["round_ms"] == {0: 1e3, 1: 1.1e3, 3: 1.3e3, 5: 1.6e3, 7: 1.9e3}  # the costs its choice read


def test_a_batch_starts_from_its_last_calls_rows_and_a_choice_made_again_runs_the_rest(fixed_costs):
    """A batch ends with its slowest row. After a call of one prompt the drafter follows and one it never
    does, the next such call starts with a probe (the last call's rows: plain decoding is fastest), not
    with the chain the pooled estimate of both would pick. A prompt the drafter always follows runs its
    chain in two chunks: 8 rounds, then, chosen again, the rounds it needs (one more host round trip).
    Outputs are plain decoding's."""
    target, succ = markov_target(vocab=32, hidden=64, seed=0, eps=0.1)
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.0, draft_vocab=list(range(0, 32, 2)))
    mixed = [[1, 1], [25, 25]]
    fixed_costs.fixed[1] = 1.05  # a chain of 1 cheaper still: the pooled estimate picks it by far
    runs = [eagle_jax.generate(target, drafter, mixed, max_new_tokens=32, eos_token_id=[])]
    (key,) = autospec._ESTIMATES
    pooled = autospec.finish_times(fixed_costs.at(0), 2, [(32, autospec.acceptance_estimate(key).for_new_prompt())])
    best = min(pooled, key=pooled.get)  # what the second call would run on the pooled estimate alone: clearly a chain
    assert best != autospec.PLAIN and pooled[best] < autospec.PROBE_FIRST_BELOW * pooled[autospec.PLAIN]
    runs.append(eagle_jax.generate(target, drafter, mixed, max_new_tokens=32, eos_token_id=[]))
    assert all(r.tokens == eagle_jax.generate(target, None, mixed, max_new_tokens=32, eos_token_id=[]).tokens for r in runs)
    assert runs[1].stats["chunks"][0] == (None, autospec.PROBE_ROUNDS)

    sure, _ = markov_drafter(target, succ, seed=0, disagree=0.0)
    easy = [[25, 25]]
    fixed_costs.fixed.update({5: 2.6, 7: 3.4})  # deep chains dear: K=3 chosen
    for _ in range(3):  # a call of one prompt reads the recent prompts (``AutoRun._times``): the hard one among them first
        out = eagle_jax.generate(target, sure, easy, max_new_tokens=160, eos_token_id=[])
        assert out.tokens == eagle_jax.generate(target, None, easy, max_new_tokens=160, eos_token_id=[]).tokens
    (d1, n1), (d2, n2) = out.stats["chunks"]  # 160 tokens, ~45 rounds: a look, then the rest in one chunk
    assert d1 == d2 == 3 and n1 == autospec.CHUNK_ROUNDS, out.stats["chunks"]


def test_a_single_prompts_first_choice_reads_the_recent_prompts_not_the_last_alone(pair, fixed_costs):
    """Before a call of one prompt has evidence of its own, where prompts differ, its time at each depth is the mean
    over the recent finished prompts (``SpanCosts.recent_rows``): after one hard prompt among easy ones it runs a
    chain at once. With fewer recent prompts than FIRST_CHOICE_ROWS it reads the last call's row, as a batch reads
    its last call's rows: the hard prompt's, on which it looks first."""
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 64, _AUTO_KW)
    hard, easy = autospec.AcceptanceEstimate(), autospec.AcceptanceEstimate()
    hard.observe([[0]] * 50, autospec.DEEPEST)
    easy.observe([[autospec.DEEPEST]] * 50, autospec.DEEPEST)
    new = easy.for_new_prompt(0.0)
    fixed_costs.last_call[1] = [hard]
    fixed_costs.recent_rows.extend([easy] * (autospec.FIRST_CHOICE_ROWS - 1) + [hard])
    depth, _ = run._next(True, [(64, new)], observed=0)
    assert depth in (3, 5, 7) and not run._unwatched and run._read_rows == [(64, new)]
    fixed_costs.recent_rows.popleft()  # too few recent prompts: the last call's row, which looks first
    assert run._next(True, [(64, new)], observed=0) in ((1, autospec.PROBE_ROUNDS), (None, autospec.PROBE_ROUNDS))


def test_a_settled_chains_first_chunk_runs_with_the_prefill(monkeypatch, fixed_costs):
    """Where a call's first choice is a chain whose cost is settled, the prefill and its first chunk run as one
    program: no prefill apart (an execution and a host round trip more). A depth still being measured, and a
    stream (its reader takes the first token from the prefill), run the prefill apart. Outputs are plain
    decoding's either way."""
    target, succ = markov_target(vocab=32, hidden=64, seed=0, eps=0.1)
    sure, _ = markov_drafter(target, succ, seed=0, disagree=0.0)
    easy = [[25, 25]]
    expect = eagle_jax.generate(target, None, easy, max_new_tokens=48, eos_token_id=[]).tokens
    eagle_jax.generate(target, sure, easy, max_new_tokens=48, eos_token_id=[])  # the drafter's acceptance observed
    apart: list[bool] = []
    begin = AutoRun._begin
    monkeypatch.setattr(AutoRun, "_begin", lambda self, fed: apart.append(fed) or begin(self, fed))
    out = eagle_jax.generate(target, sure, easy, max_new_tokens=48, eos_token_id=[])
    assert out.tokens == expect and out.stats["chunks"][0][0] in autospec.DEPTHS and apart == []
    # rows that end with their first token (a stop token, or one token asked for): the fused chunk runs no round
    for stop, n in (([expect[0][0]], 48), ([], 1)):
        one = eagle_jax.generate(target, sure, easy, max_new_tokens=n, eos_token_id=stop)
        assert one.tokens == [expect[0][:1]] and one.rounds == 0
    apart.clear()
    streamed = [t for step in eagle_jax.generate_stream(target, sure, easy, max_new_tokens=48, eos_token_id=[]) for t in step[0]]
    assert streamed == expect[0] and apart == [True]
    monkeypatch.setattr(fixed_costs, "settled", lambda depth, rows: False)
    assert eagle_jax.generate(target, sure, easy, max_new_tokens=48, eos_token_id=[]).tokens == expect and apart == [True, True]


def test_plain_decoding_is_tried_only_on_the_calls_own_evidence(monkeypatch, pair):
    """Plain decoding, once a call runs it, ends the call's speculation (the drafter is no longer fed).
    While its cost is unknown (the probe's stands in) and the last call's hard rows make it look close,
    a new call first probes its own rows; only if they too leave plain decoding close is it tried."""
    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    model = costs.model(run.plan.cache_len)
    model.update(None, 1, 1.2, 1)  # probe rounds 1.2 s, K=3 1.5 s: plain decoding not measured
    model.update(3, 1, 1.5, 1)
    hard, easy = autospec.AcceptanceEstimate(), autospec.AcceptanceEstimate()
    hard.observe([[0]] * 50, 3)
    easy.observe([[3]] * 50, 3)
    costs.last_call[1] = [hard]
    assert run._next(True, [(32, easy)], observed=0) == (None, autospec.PROBE_ROUNDS)  # the last call's rows: probe first
    assert run._next(True, [(32, easy)], observed=autospec.PROBE_ROUNDS)[0] in (3, 7)  # its own rows speculate
    assert run._next(True, [(32, hard)], observed=autospec.PROBE_ROUNDS) == (None, autospec.PROBE_ROUNDS)  # prompts differ: more
    assert run._next(True, [(32, hard)], observed=autospec.PLAIN_OWN_ROUNDS) == (autospec.PLAIN, autospec.EXPLORE_ROUNDS)


def test_a_look_at_a_calls_first_drafts_runs_a_chain_of_1_where_it_costs_about_a_probe(monkeypatch, pair):
    """A look at a call's own first drafts runs PROBE_ROUNDS rounds of a chain of 1, unwatched, where a round of it
    costs little more than a probe round (both feed the drafter and see the first draft; the chain also emits it where
    accepted), and probe rounds where verifying the draft costs more than the drafts it is expected to emit save."""
    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    at = costs.at(run.plan.cache_len)
    settle = lambda table: [costs.model(run.plan.cache_len).update(d, 1, c * autospec.SETTLED_ROUNDS, autospec.SETTLED_ROUNDS)  # noqa: E731
                            for d, c in table.items()]
    fair = autospec.AcceptanceEstimate()
    fair.observe_probe(0.5, 50)
    settle({None: 1.0, autospec.PLAIN: 0.75, 1: 1.07, 3: 1.6})  # a round of K=1 0.07 s dearer than a probe round, 0.5 tokens more
    assert run._look(at, [(32, fair)]) == (1, autospec.PROBE_ROUNDS) and run._unwatched
    # the first chunk of a close call, and the call's own evidence before plain decoding, are such looks
    costs.last_call[1] = [fair]
    assert run._next(True, [(32, fair)], observed=0) == (1, autospec.PROBE_ROUNDS)
    run._unwatched = False
    costs.by_span.clear()
    settle({None: 1.0, autospec.PLAIN: 0.75, 1: 1.6, 3: 2.2})  # verifying the draft costs 0.6 s: probe rounds
    assert run._look(at, [(32, fair)]) == (None, autospec.PROBE_ROUNDS) and not run._unwatched
    hard = autospec.AcceptanceEstimate()
    hard.observe_probe(0.02, 50)
    costs.by_span.clear()
    settle({None: 1.0, autospec.PLAIN: 0.75, 1: 1.07, 3: 1.6})  # first drafts almost never accepted: probe rounds
    assert run._look(at, [(32, hard)]) == (None, autospec.PROBE_ROUNDS)


def test_a_call_runs_a_chain_before_it_stops_speculating_only_where_deeper_drafts_could_make_one_pay(monkeypatch, pair):
    """Plain decoding chosen on a call's probe rounds (which see the first draft) ends its speculation. Where a chain
    would win were its deeper drafts accepted as often as the first (they read low: an earlier prompt's), the call's
    rows run that chain first, then stop speculating if it did not pay; where no deeper rate could make a chain pay
    (first drafts accepted ~20%), they stop at once, though a chain is within 1.3x of plain decoding."""
    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    for d, c in {None: 1.1, autospec.PLAIN: 1.0, 1: 1.4, 3: 1.5, 5: 1.6, 7: 1.7}.items():
        costs.model(run.plan.cache_len).update(d, 1, c * autospec.SETTLED_ROUNDS, autospec.SETTLED_ROUNDS)
    measured_now(costs, 1)
    run.chunks.append((None, autospec.PLAIN_OWN_ROUNDS))
    promising = autospec.AcceptanceEstimate()  # its first draft accepted ~38%, the deeper ones 5% (an earlier prompt)
    promising.trials, promising.hits = np.full(7, 50.0), np.array([19.0, *[2.5] * 6])
    times = autospec.finish_times(costs.at(run.plan.cache_len), 1, [(32, promising)])
    assert min(times, key=times.get) == autospec.PLAIN
    chain, n = run._next(True, [(32, promising)], observed=autospec.PLAIN_OWN_ROUNDS)
    assert chain == 3 and n == autospec.EXPLORE_ROUNDS  # ~1 + 0.39 + 0.15 + 0.06 tokens a round for 1.5 s: the best hope
    run.chunks.append((chain, n))
    assert run._next(True, [(32, promising)], observed=autospec.PLAIN_OWN_ROUNDS + n)[0] == autospec.PLAIN  # it did not pay
    run.chunks[:] = [(1, autospec.PLAIN_OWN_ROUNDS)]  # a look that ran a chain of 1: the deeper drafts are still unseen
    assert run._next(True, [(32, promising)], observed=autospec.PLAIN_OWN_ROUNDS)[0] == 3
    run.chunks[:] = [(None, autospec.PLAIN_OWN_ROUNDS)]
    fair = autospec.AcceptanceEstimate()
    fair.observe_probe(0.2, 50)  # a chain of 1: ~1.2 tokens for 1.4 s, within 1.3x of plain decoding's 1 for 1.0 s
    assert run._next(True, [(32, fair)], observed=autospec.PLAIN_OWN_ROUNDS)[0] == autospec.PLAIN


def test_plain_decoding_waits_for_enough_of_a_calls_own_rounds_where_prompts_differ(monkeypatch, pair):
    """Plain decoding ends a call's speculation. Where prompts differ, a new prompt's first probe rounds after a
    hard one are too few to end it on: the call probes again, and decodes plainly only if PLAIN_OWN_ROUNDS of its
    own still say so. Where prompts are alike (they carry the pair's evidence), or no chain could beat plain
    decoding even with every draft accepted, PROBE_ROUNDS suffice."""
    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    settle = lambda table: [costs.model(run.plan.cache_len).update(d, 1, c * autospec.SETTLED_ROUNDS, autospec.SETTLED_ROUNDS)  # noqa: E731
                            for d, c in table.items()]
    settle({None: 1.1, autospec.PLAIN: 1.0, 1: 1.6, 3: 2.0})  # no chain could pay at these probes' rate
    hard = autospec.AcceptanceEstimate()
    hard.observe_probe(0.05, 50)
    run.chunks.append((None, autospec.PROBE_ROUNDS))
    assert run._next(True, [(32, hard)], observed=autospec.PROBE_ROUNDS) == (None, autospec.PROBE_ROUNDS)
    assert run._next(True, [(32, hard)], observed=autospec.PLAIN_OWN_ROUNDS)[0] == autospec.PLAIN
    run.carry = 2 * autospec.CARRY_ROUNDS  # prompts seen to be alike
    assert run._next(True, [(32, hard)], observed=autospec.PROBE_ROUNDS)[0] == autospec.PLAIN
    run.carry = 0.0
    costs.by_span.clear()
    settle({None: 1.1, autospec.PLAIN: 1.0, 1: 2.5, 3: 4.5})  # no chain could pay, every draft accepted
    assert run._next(True, [(32, hard)], observed=autospec.PROBE_ROUNDS)[0] == autospec.PLAIN


def test_plain_decoding_is_first_measured_on_a_calls_last_rounds(monkeypatch, pair):
    """While plain decoding's cost is unknown and it may win, a call whose best choice is a chain runs the chain
    until its last few tokens and measures plain decoding on them, where dropping the drafter costs nothing;
    measured in the middle, plain decoding would take the rest of the call."""
    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    model = costs.model(run.plan.cache_len)
    model.update(None, 1, 1.0, 1)  # probe rounds 1.0 s, K=3 1.5 s, K=1 ~1.17 s, emitting ~1.3 tokens
    model.update(3, 1, 1.5, 1)
    model.update(1, 1, (1.0 + 0.5 / 3) * autospec.SETTLED_ROUNDS, autospec.SETTLED_ROUNDS)
    fair = autospec.AcceptanceEstimate()
    fair.observe_probe(0.3, 50)
    tail = autospec.PLAIN_TAIL_ROUNDS
    depth, n = run._next(True, [(32, fair)], observed=autospec.PROBE_ROUNDS)
    assert depth == 1 and n == autospec.CHUNK_ROUNDS  # a look at the chain, far from the end
    depth, n = run._next(True, [(tail + 4, fair)], observed=autospec.PROBE_ROUNDS)
    assert depth == 1 and n == math.ceil(4 / fair.expected_tokens(1))  # stops short of the tail
    assert run._next(True, [(tail + 1, fair)], observed=autospec.PROBE_ROUNDS) == (autospec.PLAIN, tail)
    # The stand-in (a probe round, a drafter step dearer than a plain one) 1.45x the best chain's time: still tried,
    # as plain decoding itself may tie the chain (a probe round cost up to ~1.45x a plain one)
    keen = autospec.AcceptanceEstimate()
    keen.observe_probe(0.6, 50)
    times = autospec.finish_times(costs.at(run.plan.cache_len), 1, [(tail + 1, keen)])
    assert 1.4 < times[autospec.PLAIN] / min(t for d, t in times.items() if d != autospec.PLAIN) < autospec.PLAIN_WORTH_TRYING
    assert run._next(True, [(tail + 1, keen)], observed=autospec.PROBE_ROUNDS) == (autospec.PLAIN, tail)
    model.update(autospec.PLAIN, 1, 1.0, 1)  # measured, as an earlier process left it: measured again on a tail
    assert costs.stale(autospec.PLAIN, 1) and run._next(True, [(tail + 1, fair)], observed=autospec.PROBE_ROUNDS) == (autospec.PLAIN, tail)
    costs.observe_chunk(run.plan.cache_len, autospec.PLAIN, 1, tail, tail * 1.0, first=False)  # measured here: no tail
    assert not costs.stale(autospec.PLAIN, 1) and run._next(True, [(tail + 1, fair)], observed=autospec.PROBE_ROUNDS)[0] == 1
    # STALE_ROUNDS rounds of speculation later, measured again where it is within PLAIN_STALE_CLOSE of the best
    costs.observe_chunk(run.plan.cache_len, 3, 1, autospec.STALE_ROUNDS, autospec.STALE_ROUNDS * 1.5, first=False)
    assert costs.stale(autospec.PLAIN, 1) and run._next(True, [(tail + 1, fair)], observed=autospec.PROBE_ROUNDS) == (autospec.PLAIN, tail)
    far = autospec.AcceptanceEstimate()  # first drafts accepted 90%: plain decoding 1.6x a chain of 3's time
    far.observe_probe(0.9, 50)
    times = autospec.finish_times(costs.at(run.plan.cache_len), 1, [(tail + 1, far)])
    assert min(t for d, t in times.items() if d != autospec.PLAIN) * autospec.PLAIN_STALE_CLOSE < times[autospec.PLAIN]
    assert run._next(True, [(tail + 1, far)], observed=autospec.PROBE_ROUNDS)[0] != autospec.PLAIN


def test_a_calls_costs_are_read_at_its_cache_span(monkeypatch, pair):
    """A round reads the call's whole cache, so its cost grows with the prompt: a call over a new cache
    span reads the costs of the nearest span (all scaled alike: the same choice, no probe needed), and
    once a depth ran at its span, the depths measured only at another are scaled by how the two spans'
    common costs compare, so a long first prompt's costs do not price a short one's."""
    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    short = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    long = AutoRun(pair[0], pair[1], [PROMPTS[0] * 40], 32, _AUTO_KW)
    assert long.plan.cache_len > short.plan.cache_len
    slow = costs.model(long.plan.cache_len)
    slow.update(None, 1, 5.0, 1)  # at the long span: probe 5 s, K=1 5.6 s, K=7 9.2 s, plain 4.8 s
    slow.update(7, 1, 9.2, 1)
    slow.update(autospec.PLAIN, 1, 4.8, 1)
    ok = autospec.AcceptanceEstimate()
    ok.observe([[1]] * 50, 1)
    first = short._next(True, [(32, ok)], observed=8)
    assert first == long._next(True, [(32, ok)], observed=8) and first[0] not in (None, autospec.PLAIN)
    costs.model(short.plan.cache_len).update(7, 1, 4.6, 1)  # half the long span's cost
    here = costs.at(short.plan.cache_len)
    assert [here.cost(d, 1) for d in (autospec.PLAIN, 1, 7)] == pytest.approx([2.4, 2.8, 4.6])
    assert costs.at(long.plan.cache_len).cost(1, 1) == pytest.approx(5.6)


def test_close_depths_are_measured_not_modelled(monkeypatch, pair):
    """A depth whose cost is only modelled (linear in K between the probe round and the chains that ran), or
    measured over fewer than SETTLED_ROUNDS rounds, runs EXPLORE_ROUNDS rounds where it is expected within
    EXPLORE_CLOSE of the best (plain decoding included), in ``generate`` and in the server's chooser; once
    settled, the clock decides, and a distant depth is never tried."""
    from eagle_jax.serving.depth import AutoDepth

    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    model = costs.model(run.plan.cache_len)
    settled = autospec.SETTLED_ROUNDS
    # probe 1.05 s, K=3 1.6 s, K=7 2.4 s: K=1 modelled at 1.23 s (from the probe round to the shallowest chain;
    # the chains' line would price it at 1.2), K=5 at 2.0 s (between the chains)
    model.update(None, 1, 1.05, 1)
    model.update(3, 1, 1.6 * settled, settled)
    model.update(7, 1, 2.4 * settled, settled)
    model.update(autospec.PLAIN, 1, 0.95 * settled, settled)
    measured_now(costs, 1)
    assert [costs.at(run.plan.cache_len).cost(d, 1) for d in (1, 5)] == pytest.approx([1.05 + 0.55 / 3, 2.0])
    half = autospec.AcceptanceEstimate()
    half.observe(([[0]] * 8 + [[1]] * 4 + [[2]] * 2 + [[3]] * 2) * 5, 3)  # each draft accepted one time in two: K=1 and K=3 close, K=5 not
    depth, n = run._next(True, [(32, half)], observed=8)
    assert (depth, n) == (1, autospec.EXPLORE_ROUNDS)  # the best, modelled: measured before it takes a long chunk
    model.update(1, 1, 1.35, 1)  # dearer than modelled: K=3 (settled) wins, K=1 is 5% behind on one round: it runs again
    assert run._next(True, [(32, half)], observed=8) == (1, autospec.EXPLORE_ROUNDS)
    model.update(1, 1, 1.45 * (settled - 1), settled - 1)  # settled, 13% behind; K=5 (19% behind) never ran
    assert run._next(True, [(32, half)], observed=8)[0] == 3

    auto = AutoDepth()
    auto.models[True] = costs
    assert auto.choose([half], 1, True, lambda d: run.plan.cache_len).num_speculative_tokens == 3
    del model.seconds[1, 1], model.window[1, 1]  # K=1's measurements forgotten
    assert auto.choose([half], 1, True, lambda d: run.plan.cache_len).num_speculative_tokens == 1

    # Plain decoding best, K=1 close to it on one short chunk that a busy moment made dear: K=1 runs again
    # until SETTLED_ROUNDS rounds of it were measured, then the clock decides.
    autospec.reset()
    run.costs = costs = autospec.SpanCosts()
    run.chunks[:] = [(3, settled)]  # this call ran a chain already
    model = costs.model(run.plan.cache_len)
    model.update(None, 1, 1.3, 1)
    model.update(7, 1, 4.0 * settled, settled)
    model.update(autospec.PLAIN, 1, 1.0 * settled, settled)
    model.update(1, 1, 1.6, 1)  # 1.6 s per 1.56 tokens: 2% behind plain decoding; K=3 (modelled) 19% behind
    measured_now(costs, 1)
    auto.models[True] = costs
    assert auto.choose([half], 1, True, lambda d: run.plan.cache_len).num_speculative_tokens == 1
    assert run._next(True, [(32, half)], observed=8) == (1, autospec.EXPLORE_ROUNDS)
    model.update(1, 1, 1.6 * (settled - 1), settled - 1)
    assert costs.settled(1, 1) and auto.choose([half], 1, True, lambda d: run.plan.cache_len) is None
    assert run._next(True, [(32, half)], observed=8)[0] == autospec.PLAIN


def test_a_call_explores_one_close_depth(monkeypatch, pair):
    """Of the close depths whose costs are not settled, a call runs one to measure it (again until settled, if
    still close), not one after another: the next waits for a later call (at bfloat16 batch 12 a call explored
    K=3 and then K=5, each worse than plain decoding, and took 1.31x plain decoding's time)."""
    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    run.chunks[:] = [(3, 4)]  # this call ran a chain past the first draft already
    model = costs.model(run.plan.cache_len)
    settled = autospec.SETTLED_ROUNDS
    likely = autospec.AcceptanceEstimate()
    likely.observe(([[1]] * 2 + [[2]] * 2 + [[3]] * 4 + [[0]]) * 8, 3)
    rows = [(32, likely)]
    tokens = {d: likely.expected_tokens(d) for d in autospec.DEPTHS}
    model.update(None, 1, 1.05, 1)
    model.update(autospec.PLAIN, 1, 1.0 * settled, settled)
    model.update(7, 1, 1.5 * tokens[7] * settled, settled)
    model.update(1, 1, 1.03 * tokens[1], 1)  # per token 1.03x plain decoding's, not settled
    model.update(3, 1, 1.04 * tokens[3], 1)  # per token 1.04x, not settled; K=5 (between K=3 and K=7) further
    assert run._next(True, rows, observed=8) == (1, autospec.EXPLORE_ROUNDS)
    model.update(1, 1, 1.3 * tokens[1] * 3, 3)  # K=1 measured dearer: no longer close
    depth, n = run._next(True, rows, observed=8)
    assert depth == autospec.PLAIN  # not K=3: this call explored K=1 already
    run._explored = None  # a later call explores K=3
    assert run._next(True, rows, observed=8) == (3, autospec.EXPLORE_ROUNDS)


def test_a_close_chain_measured_long_ago_is_measured_again(monkeypatch, pair):
    """A chain not chosen does not run, so a cost that a busy moment made dear would stay: a chain of 5 priced 8%
    above its neighbours' line by two short chunks ran no more, while a chain of 3 ran in its place at 0.94x the fixed
    chain of 5 (float32, batch 4, greedy). Once its cost is ``STALE_ROUNDS`` rounds old, a close chain runs again to be
    measured, ``SETTLED_ROUNDS`` rounds in one chunk, and the clock decides."""
    autospec.reset()
    costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: costs)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 64, _AUTO_KW)
    run.chunks[:] = [(7, 4), (3, 8)]  # this call's rows ran the deepest chain already (no look deeper: ``deeper_unseen``)
    span, settled = run.plan.cache_len, autospec.SETTLED_ROUNDS
    for d, c in {None: 1.05, autospec.PLAIN: 1.0, 1: 1.2, 3: 1.5, 5: 1.9, 7: 2.3}.items():
        costs.model(span).update(d, 1, c * settled, settled)
    measured_now(costs, 1)
    likely = autospec.AcceptanceEstimate()  # every draft accepted ~80%: a chain of 5 within 1.5% of a chain of 3
    likely.trials, likely.hits = np.full(7, 50.0), np.full(7, 40.0)
    times = autospec.finish_times(costs.at(span), 1, [(64, likely)])
    assert min(times, key=times.get) == 3 and times[5] < autospec.EXPLORE_CLOSE * times[3]
    assert run._next(True, [(64, likely)], observed=8)[0] == 3  # settled: the clock decided
    costs.observe_chunk(span, 3, 1, autospec.STALE_ROUNDS, autospec.STALE_ROUNDS * 1.5, first=False)
    assert costs.stale(5, 1) and not costs.stale(3, 1)
    assert run._next(True, [(64, likely)], observed=8) == (5, settled)  # as many rounds as its cost rests on: one chunk
    costs.observe_chunk(span, 5, 1, settled, settled * 1.75, first=False)
    assert costs.cost(5, 1, span) == pytest.approx(1.75, rel=0.05) and not costs.stale(5, 1)
    assert run._next(True, [(64, likely)], observed=8)[0] == 5
    far = autospec.AcceptanceEstimate()  # drafts past the third rarely accepted: only a chain of 3 pays
    far.trials, far.hits = np.full(7, 50.0), np.array([40.0, 40.0, 40.0, 5.0, 5.0, 5.0, 5.0])
    costs.observe_chunk(span, 3, 1, autospec.STALE_ROUNDS, autospec.STALE_ROUNDS * 1.5, first=False)
    run._explored = None
    assert costs.stale(1, 1) and run._next(True, [(64, far)], observed=8)[0] == 3  # a chain of 1 stale, but far from the best


def test_plain_where_speculation_never_pays_skips_the_drafter(monkeypatch, fixed_costs, pair):
    """Where drafts cost more than any acceptance repays (a large batch), once plain decoding was fastest
    in hindsight on PLAIN_EVIDENCE_ROWS prompts, a call decodes plainly from its start without the
    drafter (no drafter prefill, no probe); once REPROBE_ROUNDS rounds passed unobserved, a call probes
    again."""
    fixed_costs.fixed.update({1: 3.0, 3: 5.0, 5: 8.0, 7: 11.0})
    monkeypatch.setattr(autospec, "REPROBE_ROUNDS", 64)
    monkeypatch.setattr(autospec, "PLAIN_EVIDENCE_ROWS", 3)
    runs = [eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=32, eos_token_id=[]) for _ in range(4)]
    expect = eagle_jax.generate(pair[0], None, PROMPTS, max_new_tokens=32, eos_token_id=[]).tokens
    assert all(r.tokens == expect for r in runs)
    probed = [r.stats["chunks"][0][0] is None for r in runs]
    assert probed == [True, False, False, True]  # never fresh at first; then 27 + 31 < 64 <= 27 + 62 plain rounds
    assert runs[1].stats["chunks"] == [(autospec.PLAIN, 31)]
    # chosen after a probe, plain decoding proper (no way back within the call) runs the rest in one chunk
    assert runs[0].stats["chunks"] == [(None, autospec.PROBE_ROUNDS), (autospec.PLAIN, 27)]


def test_a_probe_round_costs_no_more_than_a_chain_and_a_contradicted_one_is_measured_again(monkeypatch, pair):
    """A probe round does no more work than a chain round: it is read as at most the cheapest chain's cost, and a
    generate call's probe measured on one chunk that costs more than PROBE_CONTRADICTED times a chain's is
    measured again, once: one slow probe chunk, the base of the line in K, priced deeper chains below
    shallower ones and plain decoding above them all, and was never run again to correct it."""
    m = autospec.CostModel()
    m.update(None, 1, 0.060, 1)  # a slow probe chunk: 60 ms a round, a chain of 7 34 ms
    m.update(7, 1, 0.034, 1)
    costs = [m.cost(d, 1) for d in (autospec.PLAIN, *autospec.DEPTHS)]
    assert costs == sorted(costs) and costs[0] == pytest.approx(0.034)
    assert m.forget_contradicted_probe(1) and not m.probed(1)
    m.update(None, 1, 0.050, 1)  # as slow again: read as the chain's, not measured a third time
    assert not m.forget_contradicted_probe(1) and m.cost(autospec.PLAIN, 1) == pytest.approx(0.034)

    # In a call: the chunk after the first chain's probes again where the first probe chunk was slow.
    autospec.reset()
    span_costs = autospec.SpanCosts()
    monkeypatch.setattr(autospec, "cost_model", lambda key: span_costs)
    observe, slowed = span_costs.observe_chunk, []

    def slow_first_probe(span, depth, rows, rounds, seconds, first):
        if depth is None and not slowed:
            slowed.append(seconds)
            seconds *= 100.0
        observe(span, depth, rows, rounds, seconds, first)

    monkeypatch.setattr(span_costs, "observe_chunk", slow_first_probe)
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 40, _AUTO_KW)
    run.warm()
    run.result(None)
    assert [d for d, _ in run.chunks[:3]] == [None, max(autospec.DEPTHS), None] and run.chunks[2][1] == autospec.PROBE_ROUNDS
    autospec.reset()


def test_draft_confidence_is_the_top2_share():
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], np.float32))
    np.testing.assert_allclose(np.asarray(draft_confidence(logits)), [0.5 / 0.8, 0.8 / 0.9], rtol=1e-6)


def test_spec_errors(pair):
    with pytest.raises(ConfigError, match="adaptive applies to chains only"):
        SpecConfig(method="tree", adaptive=True)
    with pytest.raises(ConfigError, match="'auto' or None"):
        eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=4, spec="fast")


def test_stream_with_adaptive(monkeypatch, pair, plain):
    monkeypatch.setattr(adaptive_costs, "calibrate", lambda *a, **k: costs([1.0, 1.0, 50.0, 50.0]))
    chunks = list(eagle_jax.generate_stream(pair[0], pair[1], PROMPTS, max_new_tokens=24, spec=ADAPTIVE, eos_token_id=[]))
    assert [sum((c[b] for c in chunks), []) for b in range(len(PROMPTS))] == plain.tokens


def test_a_chunks_watch_is_the_band_of_acceptance_where_its_choice_pays(fixed_costs):
    """``watch``: the drafts accepted per round within which a chunk's depth stays within WATCH_TOLERANCE
    of the best choice. With K=1 costing 1.1 plain rounds, it pays down to ~0.08 drafts a round (1.1 / 1.02
    tokens); rounds without drafts, and plain decoding, are never watched."""
    fixed_costs.fixed.update({3: 1.6, 5: 2.2, 7: 2.8})  # K=1 the best choice
    half = autospec.AcceptanceEstimate()
    half.observe([[1], [0]] * 20, 1)
    mean, var = half.accepted_moments(1)
    (lo, hi, sd), row = autospec.watch(fixed_costs.at(0), 1, [(64, half)], 1)
    assert 1.1 / (1 + autospec.WATCH_TOLERANCE) - 1 <= lo <= 1.2 * (1.1 / (1 + autospec.WATCH_TOLERANCE) - 1)
    assert lo < mean < hi and sd == pytest.approx(var**0.5, rel=1e-5)
    assert row[0] == pytest.approx(lo) and row[1] == np.inf and row[2] == pytest.approx(sd)  # one row: the batch's band
    for depth in (None, autospec.PLAIN):
        assert np.array_equal(autospec.watch(fixed_costs.at(0), 1, [(64, half)], depth), autospec.never(1))
    # a depth whose cost is the only one known has nothing to be compared with: no band
    fixed_costs.fixed = {1: 1.1}
    assert np.array_equal(autospec.watch(fixed_costs.at(0), 1, [(64, half)], 1), autospec.never(1))


def test_each_row_of_a_batch_is_watched_at_the_bands_lower_end(fixed_costs):
    """A batch ends with its slowest row, whose shortfall the rows' mean hides while the others accept well. Each row
    not done is watched at the band's lower end (its own drafts accepted there, its own spread); a row done, not at
    all."""
    fixed_costs.fixed.update({3: 1.6, 5: 2.2, 7: 2.8})  # a chain of 1 the best choice
    slow, quick = autospec.AcceptanceEstimate(), autospec.AcceptanceEstimate()
    slow.observe([[1], [0]] * 20, 1)
    quick.observe([[1]] * 40, 1)
    rows = [(64, slow), (64, quick)]
    out = autospec.watch(fixed_costs.at(0), 3, rows, 1, active=[0, 2])
    assert out.shape == (4, 3) and np.array_equal(out[2], autospec.never(1)[0])  # row 1 is done
    lo, first, third = out[0, 0], out[1], out[3]
    assert 0 < first[0] < lo < third[0] and first[1] == third[1] == np.inf  # the slow row's band ends lower
    own = [est.accepted_moments(1)[1] ** 0.5 for _, est in autospec.toward_the_batch(rows)]
    assert [first[2], third[2]] == pytest.approx(own, rel=1e-5)  # each row's own spread, not the spread among rows


def test_a_batchs_rows_read_their_pooled_evidence_only_where_prompts_are_alike(pair, fixed_costs):
    """Where prompts were seen alike (sampling), each row's estimate is read with ``ROW_POOL_ROUNDS`` rounds of the
    batch's pooled evidence: the slowest of several noisy estimates reads low. Where they differ, a row's own rounds
    speak: pooled, a row that accepts little among rows that accept well reads as accepting well, and the batch's
    end (that row's) is priced too soon."""
    run = AutoRun(pair[0], pair[1], PROMPTS[:2], 64, _AUTO_KW)
    slow, quick = autospec.AcceptanceEstimate(), autospec.AcceptanceEstimate()
    slow.observe([[0]] * 12, 5)
    quick.observe([[5]] * 12, 5)
    rows = [(64, slow), (64, quick)]
    run.carry = autospec.CARRY_ROUNDS  # differ
    _, read = run._times(fixed_costs.at(0), rows, observed=12)
    assert [est.p[0] for _, est in read] == [slow.p[0], quick.p[0]]
    run.carry = 2 * autospec.CARRY_ROUNDS  # alike
    _, read = run._times(fixed_costs.at(0), rows, observed=12)
    assert slow.p[0] < read[0][1].p[0] and read[1][1].p[0] < quick.p[0]
    # the chunk's watch reads the rows its choice read, pooled once, not pooled again
    assert run._watched(rows, observed=12) == (read, 0.0)
    run._read_rows = None  # a chunk chosen without ``_times`` (a look, an exploration): its rows pooled for the watch
    watched, pool = run._watched(rows, observed=12)
    assert watched == rows and pool == autospec.ROW_POOL_ROUNDS


def test_a_watched_chunk_ends_once_its_rows_leave_the_band(pair):
    """Engine ``departed``: a chunk whose rows accept drafts below (or above) its watch's band, or one of whose rows
    accepts below its own end of it, stops after WATCH_MIN_ROUNDS rounds; unwatched, the same chunk runs to its limit.
    Its tokens are plain decoding's."""
    autospec.reset()
    run = AutoRun(pair[0], pair[1], PROMPTS[:1], 32, _AUTO_KW)
    plain = eagle_jax.generate(pair[0], None, PROMPTS[:1], max_new_tokens=32, eos_token_id=[]).tokens[0]
    unwatched = [-np.inf, np.inf, 0.0]
    for band, row, rounds in (((10.0, 20.0), unwatched, WATCH_MIN_ROUNDS), ((-np.inf, -1.0), unwatched, WATCH_MIN_ROUNDS),
                              ((-np.inf, np.inf), unwatched, 12), ((-np.inf, np.inf), [10.0, np.inf, 0.1], WATCH_MIN_ROUNDS)):
        st, _ = run._chunk(3, run._begin(True), 12, True, np.array([[*band, 0.1], row], np.float32))
        n = int(st.n_out[0])
        assert int(st.rounds) == rounds and n >= rounds and list(np.asarray(st.out[0, :n])) == plain[:n]




def test_a_chain_of_one_looks_deeper_once_where_its_deeper_drafts_are_an_earlier_prompts(fixed_costs):
    """The pair's history: first drafts accepted, second ones never. A prompt the drafter follows all the way
    chooses a chain of 1 on that history; its deeper drafts, which a chain of 1 never observes, would keep the
    earlier prompt's rates (a chain of 1 ran 38 rounds where a chain of 5 was 1.54x faster). It looks deeper
    first, finds them accepted and never runs a chain of 1 (before: 8 rounds of it, then a chain of 3, 31 rounds in
    all); the output is plain decoding's."""
    target, succ = markov_target(vocab=32, hidden=64, seed=0, eps=0.1)
    sure, _ = markov_drafter(target, succ, seed=0, disagree=0.0)
    easy = [[25, 25]]
    expect = eagle_jax.generate(target, None, easy, max_new_tokens=96, eos_token_id=[]).tokens
    fixed_costs.fixed.update({3: 1.7, 5: 2.3, 7: 2.9})  # deep chains dear: a chain of 1 chosen on that history
    eagle_jax.generate(target, sure, easy, max_new_tokens=8, eos_token_id=[])  # the pair's key
    (key,) = autospec._ESTIMATES
    history = autospec.acceptance_estimate(key)
    history.__init__()
    history.observe([[1]] * 200, autospec.DEEPEST)
    fixed_costs.last_call.clear()
    out = eagle_jax.generate(target, sure, easy, max_new_tokens=96, eos_token_id=[])
    depths = [d for d, _ in out.stats["chunks"]]
    assert out.tokens == expect and min(depths) > 1 and out.rounds < 31, out.stats["chunks"]
