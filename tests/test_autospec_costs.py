"""What ``spec="auto"`` learns of the machine (decoding/cost_model.py ``CostModel``, ``span_levels``;
decoding/autospec.py ``SpanCosts``; decoding/chunk_overhead.py): round costs by depth, rows and cache span,
a chunk's overhead, and what calls showed in hindsight."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eagle_jax.decoding import autospec


def test_hindsight_counts_the_drafters_prefill():
    """A chain of one draft finishes a call's rounds 3% sooner than plain decoding; counting what speculating
    paid besides (the drafter's part of the prefill; the probe rounds' excess; chunks' overheads) leaves plain
    decoding within ``PLAIN_MARGIN`` of it or faster, the better start in a near tie, so such calls go on to skip the
    drafter, and probe less often the longer that holds."""
    costs = autospec.SpanCosts()
    model = costs.model(256)
    model.update(autospec.PLAIN, 4, 1.0, 10)  # 0.1 s per round
    model.update(None, 4, 1.2, 10)  # probe rounds: 0.12 s (a sixth of it the drafter)
    est = autospec.AcceptanceEstimate()
    est.observe_probe(0.3, 1000)  # a chain of 1 emits 1.3 tokens per round, and its slowest of 4 rows ...
    model.update(1, 4, 10 * 3.1 / autospec.slowest_rounds([(32, est)] * 4, 1), 10)  # ... ends in 3.1 s, plain's in 3.2
    model.update(7, 4, 2.0, 10)  # deeper chains cost more than their drafts save
    assert autospec.PLAIN_MARGIN == 1.02
    costs.record_hindsight(256, [(32, est)] * 4)
    assert costs.plain_rows[4] == 0
    # what the call paid besides: 4 probe rounds' excess over plain ones (0.08 s), or a second chunk's overhead (0.1 s)
    costs.record_hindsight(256, [(32, est)] * 4, chunks=[(None, 4), (1, 28)])
    assert costs.plain_rows[4] == 4
    costs.overhead.set_dispatch(0.1)
    costs.record_hindsight(256, [(32, est)] * 4, chunks=[(1, 8), (1, 24)])
    assert costs.plain_rows[4] == 8
    costs.overhead.set_dispatch(0.0)
    costs.record_hindsight(256, [(32, est)] * 4, chunks=[(1, 8), (1, 24)])
    assert costs.plain_rows[4] == 0
    costs.record_hindsight(256, [(32, est)] * 4, drafter_prefill_s=0.34)
    assert costs.plain_rows[4] == 4
    # PLAIN_EVIDENCE_ROWS prompts settle plain decoding; PROMPTS_TO_CARRY where the prompts were seen to be alike,
    # from two calls at least (one call's rows may be alike by how they were grouped)
    assert autospec.PROMPTS_TO_CARRY == 4 < autospec.PLAIN_EVIDENCE_ROWS
    assert not costs.plain_settled(4) and not costs.plain_settled(4, alike=True)
    costs.record_hindsight(256, [(32, est)] * 4, drafter_prefill_s=0.34)
    assert costs.plain_settled(4, alike=True) and costs.plain_settled(4)
    # each further call in a row that finds plain decoding fastest doubles the rounds before the next probe, up to a cap
    assert costs.reprobe_rounds(4) == autospec.REPROBE_ROUNDS
    backoff = []
    for _ in range(4):
        costs.record_hindsight(256, [(32, est)] * 4, drafter_prefill_s=0.34)
        backoff.append(costs.reprobe_rounds(4) // autospec.REPROBE_ROUNDS)
    assert backoff == [2, 4, 4, 4] and autospec.REPROBE_BACKOFF == 4
    costs.record_hindsight(256, [(32, est)] * 4, chunks=[(1, 8), (1, 24)])  # speculation was faster: probes as often as at first
    assert costs.plain_rows[4] == 0 and costs.reprobe_rounds(4) == autospec.REPROBE_ROUNDS
    model.update(autospec.PLAIN, 2, 1.0, 10)  # batch 2: two calls are the 4 alike prompts, 8 otherwise
    model.update(None, 2, 1.2, 10)
    model.update(1, 2, 1.3, 10)
    for calls in range(1, 5):
        costs.record_hindsight(256, [(32, est)] * 2, drafter_prefill_s=0.34)
        assert costs.plain_settled(2, alike=True) == (calls >= 2) and costs.plain_settled(2) == (calls >= 4)


def test_a_cost_measured_long_ago_is_measured_anew():
    """The depths that run follow the machine's speed; a depth that is not chosen, measured once, would keep that
    moment's. After ``STALE_ROUNDS`` rounds at a batch size since it was measured (probe rounds count, and plain
    decoding's own program's, which times no round apart; other batch sizes' do not), or where an earlier process
    measured it, its cost is stale: plain decoding's next measurement replaces the old ones at every span."""
    costs = autospec.SpanCosts()
    assert not costs.stale(autospec.PLAIN, 4)  # never measured: measured as such, not as stale
    costs.model(512).update(autospec.PLAIN, 4, 16 * 0.012, 16)  # kept by an earlier process, at another span
    costs.model(512).update(5, 4, 16 * 0.030, 16)
    assert costs.stale(autospec.PLAIN, 4) and costs.stale(5, 4)
    costs.observe_chunk(256, autospec.PLAIN, 4, 16, 16 * 0.010, first=False)
    assert costs.cost(autospec.PLAIN, 4, 256) == pytest.approx(0.010) and not costs.model(512).measured(autospec.PLAIN, 4)
    assert not costs.stale(autospec.PLAIN, 4) and costs.stale(5, 4)
    costs.observe_chunk(256, None, 4, 4, 4 * 0.013, first=False)
    costs.observe_chunk(256, 3, 4, autospec.STALE_ROUNDS - 5, (autospec.STALE_ROUNDS - 5) * 0.020, first=False)
    costs.observe_chunk(256, 3, 1, 64, 64 * 0.006, first=False)  # batch 1's rounds
    assert not costs.stale(autospec.PLAIN, 4) and not costs.stale(3, 4)
    costs.observe_chunk(256, 3, 4, 1, 0.020, first=False)
    assert costs.stale(autospec.PLAIN, 4) and not costs.stale(3, 4)
    costs.observe_chunk(256, autospec.PLAIN, 4, 16, 16 * 0.012, first=False)  # the machine slowed down: 12 ms, not a median with 10
    assert costs.cost(autospec.PLAIN, 4, 256) == pytest.approx(0.012) and not costs.stale(autospec.PLAIN, 4)
    costs.observe_chunk(256, autospec.PLAIN, 4, 16, 16 * 0.010, first=False)  # measured again while fresh: both count
    assert costs.model(256).window_rounds(4, autospec.PLAIN) == 32
    costs.aged(4, autospec.STALE_ROUNDS - 1)  # rounds of plain decoding's own program: no round timed apart
    assert not costs.stale(autospec.PLAIN, 4)
    costs.aged(4, 1)
    assert costs.stale(autospec.PLAIN, 4)
    # a chain, likewise stale, but a new measurement joins the old ones (each busy chunk's would otherwise stay)
    costs.observe_chunk(256, 5, 4, 8, 8 * 0.025, first=False)
    assert costs.model(512).measured(5, 4) and not costs.stale(5, 4)


def test_hindsight_reads_a_rows_first_draft_over_the_prompts_seen_alike():
    """At T=1 plain decoding and a chain of 1 tie at a first-draft rate of 0.55. A row whose last rounds ran lucky (a
    row's estimate holds ~30 rounds) would read speculation faster; where the prompts were seen alike, hindsight reads
    its first draft at the finished prompts' mean rate (this row's included), so the tie counts for plain decoding.
    Where prompts differ, the row's own estimate is the verdict's."""
    pair = autospec.AcceptanceEstimate()
    rng = np.random.default_rng(0)
    for rate in rng.binomial(48, 0.55, 12) / 48:  # alike prompts, binomial noise only
        row = pair.for_new_prompt()
        hits = int(round(rate * 48))
        row.observe([[1]] * hits + [[0]] * (48 - hits), 1)
        pair.finish_prompt(row)
    assert pair.carry_rounds() > autospec.CARRY_ROUNDS  # alike
    carry = 30.0  # as few prompts read: a row's own rounds outweigh its start
    lucky = pair.for_new_prompt(carry)
    lucky.observe([[0]] * 26 + [[1]] * 24, 1)  # 0.48 over its 50 rounds, its last 24 all accepted
    pair.finish_prompt(lucky)
    judged = pair.judged_over_prompts(lucky, carry)
    hits, trials = np.array(pair.prompts).T
    assert lucky.p[0] > 0.62 and judged.p[0] == pytest.approx(np.mean(hits / trials), abs=0.01)
    assert judged.trials[1:] == pytest.approx(lucky.trials[1:]) and judged.p[0] < 0.58
    assert pair.judged_over_prompts(lucky, autospec.CARRY_ROUNDS).p == pytest.approx(lucky.p)  # prompts differ
    costs = autospec.SpanCosts()
    model = costs.model(256)
    model.update(autospec.PLAIN, 1, 1.0, 10)  # 0.1 s a round
    model.update(None, 1, 1.3, 10)
    model.update(1, 1, 1.55, 10)  # a chain of 1: 0.155 s a round, 1.55 tokens a round at 0.55
    model.update(7, 1, 4.0, 10)
    costs.record_hindsight(256, [(60, lucky)])
    assert costs.plain_rows[1] == 0  # the lucky rounds alone: the chain of 1 clearly faster
    costs.record_hindsight(256, [(60, lucky)], judged=[(60, judged)])
    assert costs.plain_rows[1] == 1


def test_cost_model_needs_one_depth_and_one_probe_per_row_count():
    """Costs never run are modelled: linear in K through the probe round and the depths measured at these
    rows, else the probe here plus the per-draft slope of the nearest row counts."""
    m = autospec.CostModel()
    assert m.cost(5, 1) is None and autospec.unexplored(m, 1) == [max(autospec.DEPTHS)]
    m.update(None, 1, 2.0, 2)  # probe rounds: 1.0 s each at one row
    m.update(5, 1, 2.0, 1)
    assert autospec.unexplored(m, 1) == [] and autospec.unexplored(m, 4) == []
    assert [m.cost(d, 1) for d in (0, 1, 3, 5, 7)] == pytest.approx([1.0, 1.2, 1.6, 2.0, 2.4])
    m.update(None, 4, 2.0, 1)  # a new batch size: its probe, and the slope of one row (0.2 s per draft)
    assert [m.cost(d, 4) for d in (0, 3, 7)] == pytest.approx([2.0, 2.6, 3.4])
    m.update(3, 4, 3.0, 1)
    assert [m.cost(d, 4) for d in (1, 3, 5)] == pytest.approx([2 + 1 / 3, 3.0, 2 + 5 / 3])
    # between measured row counts: probe and slope both interpolated (rows 2: 4/3 s + 0.244 s per draft)
    assert m.cost(5, 2) == pytest.approx(4 / 3 + 5 * (0.2 + (1 / 3 - 0.2) / 3))
    m.update(3, 4, 9.0, 1)  # one slow measurement does not make a depth dear ...
    assert m.cost(3, 4) == pytest.approx(3.0)
    m.update(3, 4, 8.0, 2)  # ... a machine that slowed down does, within a few: the median by rounds
    assert m.cost(3, 4) == pytest.approx(4.0)
    for _ in range(autospec.COST_WINDOW):  # and only the last COST_WINDOW measurements count
        m.update(3, 4, 2.5, 1)
    assert m.cost(3, 4) == pytest.approx(2.5)
    assert m.cost(autospec.PLAIN, 4) == 2.0 and not m.measured(autospec.PLAIN, 4)  # plain: the probe's until it runs


def test_a_chunks_overhead_is_fitted_per_batch_size_and_reprices_earlier_chunks():
    """A chunk costs a fixed part per batch size (dispatch, host sync, each execution's one-time work), more for the
    first chunk after a prefill (by depth: a chain of 1's paid ~40 ms at bfloat16 batch 12 where a probe's paid
    ~3), plus its rounds. Fitted jointly over the batch size's chunks (robust to a busy moment's chunk), the parts
    come out of every round cost, re-derived for chunks measured before they were known; one depth's first extra
    does not come off another's (the probe's chunks are all first ones: a shared extra priced it at a quarter of
    a plain round)."""
    costs = autospec.SpanCosts()
    costs.overhead.set_dispatch(0.001)
    fixed, per = {12: 0.020, 1: 0.0015}, {None: 0.016, 1: 0.018, 3: 0.025}
    first = {12: {None: 0.003, 1: 0.040, 3: 0.010}, 1: {None: 0.0, 1: 0.0, 3: 0.0}}

    def chunk(rows, depth, n, is_first, busy=0.0):
        scale = 1.0 if rows == 12 else 0.25
        t = fixed[rows] + (first[rows][depth] if is_first else 0.0) + n * per[depth] * scale + busy
        costs.observe_chunk(256, depth, rows, n, t, is_first)

    chunk(12, None, 4, True)  # the probe, before anything else is known: the dispatch alone comes off
    assert costs.model(256).probe[12] == pytest.approx((0.020 + 0.003 + 4 * 0.016 - 0.001) / 4)
    for depth, lengths in ((1, (8, 38)), (3, (8, 30)), (1, (8, 38)), (3, (8, 30))):
        chunk(12, depth, lengths[0], True)
        chunk(12, depth, lengths[1], False)
    chunk(12, 1, 4, False)
    chunk(12, 3, 4, False)
    chunk(12, 1, 16, False, busy=0.2)  # a busy moment: its chunk barely moves the fit
    chunk(1, 1, 8, True)  # another batch size keeps its own parts
    chunk(1, 1, 40, False)
    assert costs.overhead.seconds(12) == pytest.approx(0.020, abs=2e-3)
    assert costs.overhead.seconds(12, first=True, key=(256, 1)) == pytest.approx(0.060, abs=5e-3)  # the prior pulls a little
    assert costs.overhead.seconds(12, first=True, key=(256, 3)) == pytest.approx(0.030, abs=3e-3)
    assert costs.overhead.seconds(1) < 0.005 and costs.overhead.seconds(2) == 0.001  # nothing ran at 2 rows: the dispatch
    model = costs.model(256)
    assert model.probe[12] == pytest.approx(0.016, rel=0.06)  # its own small first extra stays in its rounds
    assert model.seconds[12, 1] == pytest.approx(0.018, rel=0.05) and model.seconds[12, 3] == pytest.approx(0.025, rel=0.05)
    assert model.seconds[1, 1] == pytest.approx(0.0045, rel=0.1)


def test_a_chunk_that_agrees_with_the_overhead_fit_waits_for_the_next_fit():
    """A fit after every chunk cost ~1.4 ms of an auto call's host time: a chunk of a key the fit has, within its
    robust bound, is kept for the next fit; a new key, a new first chunk, a time off the fit or ``REFIT_EVERY``
    chunks refit, and the parts come out as a fit after every chunk would have them."""
    from eagle_jax.decoding import chunk_overhead

    lazy, eager = chunk_overhead.ChunkOverhead(), chunk_overhead.ChunkOverhead()
    for o in (lazy, eager):
        o.set_dispatch(0.001)
    per = {1: 0.004, 3: 0.006}
    rng = np.random.default_rng(0)
    refits = []
    for i in range(40):
        depth, n, first = (1, 3)[i % 2], (8, 24, 16)[i % 3], i % 5 == 0
        t = 0.002 + (0.003 if first else 0.0) + n * per[depth] * rng.uniform(0.99, 1.01)
        refits.append(lazy.observe(1, depth, n, t, first))
        eager.observe(1, depth, n, t, first)
        eager._refit(1)
    assert all(refits[:4]) and refits.count(False) > 20  # the first chunks all refit; most later ones agree
    assert all(refits[i] for i in range(len(refits)) if i >= chunk_overhead.REFIT_EVERY and not any(refits[i - chunk_overhead.REFIT_EVERY + 1 : i]))
    assert lazy.seconds(1) == pytest.approx(eager.seconds(1), abs=2e-4)
    assert lazy.seconds(1, first=True, key=1) == pytest.approx(eager.seconds(1, first=True, key=1), abs=3e-4)
    assert lazy.observe(1, 5, 8, 0.05, False)  # a key the fit has not seen
    assert lazy.observe(1, 1, 8, 0.002 + 8 * 0.004 + 0.02, False)  # a busy moment's chunk, off the fit
    assert lazy.observe(2, 1, 8, 0.034, False)  # another batch size: its own fit


def test_a_cold_calls_chunks_fit_the_overhead_from_the_one_depth_that_ran_twice():
    """A call's first chunks run one depth each (the probe, the depths explored), each fitted exactly by its own
    cost per round: only plain decoding's two chunks (4 rounds measured, then the rest) tell the fixed part. Their
    residuals decide it; the others' zero residuals must not make the fit read every residual as an outlier."""
    costs = autospec.SpanCosts()
    costs.overhead.set_dispatch(0.001)
    per = {None: 0.0145, 7: 0.038, 5: 0.033, 1: 0.0175, autospec.PLAIN: 0.0135}
    for depth, n in ((None, 4), (7, 4), (5, 4), (1, 4), (autospec.PLAIN, 4), (autospec.PLAIN, 33)):
        costs.observe_chunk(256, depth, 12, n, 0.021 + n * per[depth], first=depth is None)
    assert costs.overhead.seconds(12) == pytest.approx(0.021, abs=2.5e-3)  # the prior (the dispatch) pulls a little
    model = costs.model(256)
    assert model.seconds[12, 1] == pytest.approx(0.0175, rel=0.05) and model.seconds[12, 7] == pytest.approx(0.038, rel=0.03)
    assert model.seconds[12, autospec.PLAIN] == pytest.approx(0.0135, rel=0.03)


def test_a_depth_below_the_shallowest_chain_is_priced_from_the_probe_round():
    """Verification's cost can be concave in K (a CPU: 1 -> 3 drafts costs more than 3 -> 5): a shallow depth read off
    the line through two deeper chains would be priced far above its cost and never run to correct it."""
    m = autospec.CostModel()
    m.update(None, 1, 1.0, 1)
    m.update(3, 1, 1.8, 1)
    m.update(5, 1, 2.0, 1)  # the line through 3 and 5 would price K=1 at 1.6
    assert m.cost(1, 1) == pytest.approx(1.0 + 0.8 / 3)
    assert m.cost(4, 1) == pytest.approx(1.9) and m.cost(7, 1) == pytest.approx(2.2)  # between and past them: the chains' line


def test_a_depth_measured_at_another_span_is_read_there_not_drawn_through_one_chain_here():
    """A line through the probe round and one shallow chain at a span overprices deep chains (verifying
    1 + K positions is not linear in K), so a depth measured at another span is read there, scaled by how
    the two spans compare, and one measured nowhere is read off the span where most chains ran."""
    costs = autospec.SpanCosts()
    far = costs.model(256)
    for depth, seconds in ((None, 4.0), (1, 4.6), (3, 5.4), (7, 6.4)):
        far.update(depth, 1, seconds, 1)
    here = costs.model(128)
    here.update(None, 1, 2.0, 1)  # half the far span's costs
    here.update(1, 1, 2.3, 1)
    at = costs.at(128)
    assert at.cost(7, 1) == pytest.approx(3.2)  # not 2.0 + 7 x 0.3 = 4.1 off the line through the probe and K=1
    assert at.cost(3, 1) == pytest.approx(2.7) and at.cost(1, 1) == pytest.approx(2.3)
    assert at.cost(5, 1) == pytest.approx(0.5 * 5.9)  # measured nowhere: the line where three chains ran


def test_depths_measured_at_different_spans_compare_as_measured_side_by_side():
    """Each call's span is new, and a busy machine moves a round's cost more between calls than between spans:
    a depth measured on a quick call must not look cheap beside one measured on a slow call. Every depth is read
    at one span's level, through how the depths compared where they ran side by side (float32, T=1, batch 1: read
    each at the nearest span where it ran, a chain of 5 looked cheaper than one of 3 at a new span and ran that
    call at 0.86x a chain of 3's speed)."""
    costs = autospec.SpanCosts()
    quick, slow = costs.model(153), costs.model(201)
    for depth, ms in ((None, 6.3), (3, 7.75), (5, 8.84), (7, 10.95)):
        quick.update(depth, 1, ms * 8, 8)
    for depth, ms in ((1, 7.63), (3, 10.05)):
        slow.update(depth, 1, ms * 8, 8)
    at = costs.at(233)  # nearest the slow call's span: its level
    assert at.cost(3, 1) == pytest.approx(10.05)
    assert at.cost(5, 1) == pytest.approx(8.84 * 10.05 / 7.75)  # not 8.84: dearer than a chain of 3, as it was beside it
    assert costs.at(153).cost(1, 1) == pytest.approx(7.63 * 7.75 / 10.05)  # and the other way
    assert costs.at(153).cost(5, 1) == 8.84  # measured at the span: as measured


def test_a_short_slow_chunk_at_a_span_is_read_through_the_table_until_settled_there():
    """A cost measured at the span over fewer than SETTLED_ROUNDS rounds is read through the table, which weighs
    it by its rounds against the depth's other measurements: read as measured, 4 rounds of a chain of 3 at 1.3x
    its cost (a busy moment) priced it above a chain of 5 at that span, where it then would not run to correct
    it. Measured again there, the read follows at once; settled there, it is read as measured."""
    costs = autospec.SpanCosts()
    for span, level in ((300, 1.0), (400, 1.1), (500, 1.2)):
        for depth, ms in ((3, 15.6), (5, 20.1)):
            costs.model(span).update(depth, 4, ms * level * 16, 16)
    new = costs.model(600)
    new.update(5, 4, 20.1 * 1.25 * 16, 16)
    new.update(3, 4, 15.6 * 1.25 * 1.3 * 4, 4)  # one short chunk in a busy moment
    at = costs.at(600)
    assert at.cost(5, 4) == pytest.approx(20.1 * 1.25)  # settled at the span: as measured
    assert at.cost(3, 4) < 0.9 * at.cost(5, 4)  # not 25.4 ms against 25.1: a chain of 3 stays the cheaper
    assert 15.6 * 1.25 <= at.cost(3, 4) < 1.1 * 15.6 * 1.25  # its 4 rounds weighed against the 48 elsewhere
    read = at.cost(3, 4)
    new.update(3, 4, 15.6 * 1.25 * 1.3 * 4, 4)  # slow again, now 8 rounds at the span: as measured, at once
    assert at.cost(3, 4) == pytest.approx(15.6 * 1.25 * 1.3) and at.cost(3, 4) > read


def test_span_levels_fit_one_table_and_leave_unrelated_spans_unscaled():
    """``span_levels`` recovers cost = depth level x span level where the measurements share depths, weighs a
    measurement by its rounds, and does not scale spans that share no measurement with the rest."""
    cells = [(d, s, c * f, 8.0) for s, f in ((100, 1.0), (200, 1.5), (300, 2.0)) for d, c in ((1, 2.0), (3, 3.0)) if (s, d) != (300, 3)]
    depth, span = autospec.span_levels(cells)
    assert math.exp(depth[3] + span[300]) == pytest.approx(6.0)
    noisy = autospec.span_levels([*cells, (1, 100, 2.4, 1.0)])  # a one-round reading barely moves an eight-round one
    assert math.exp(noisy[0][1] + noisy[1][100]) == pytest.approx(2.0, rel=0.05)
    apart = autospec.span_levels([*cells, (5, 400, 7.0, 8.0)])  # shares nothing: read as measured, unscaled
    assert apart[1][400] == pytest.approx(0.0) and math.exp(apart[0][5]) == pytest.approx(7.0)


def test_a_chain_priced_far_above_the_line_through_the_others_is_measured_again_once():
    """A round's cost is about linear in its drafts; a chain measured at more than CHAIN_CONTRADICTED times the line
    through the other chains (a few short chunks in a busy moment, or an earlier process's) is forgotten at every span
    and modelled from the others, so it runs again where that makes it close to the best. Once per chain and row
    count: measured as dear again, it is read as measured (bfloat16 batch 1: a chain of 7 kept at 9.95 ms a round
    against 8.36 measured per round, 1.24x the line through chains of 3 and 5, never ran again)."""
    per_round = {0: 4.3, 1: 4.63, 3: 6.03, 5: 7.02, 7: 8.36}  # ms, measured per round on a CPU: no chain contradicted
    assert autospec.contradicted_chains(per_round) == {}
    assert autospec.contradicted_chains(per_round | {7: 9.95}) == {7: pytest.approx(9.95 / 8.01)}
    assert autospec.contradicted_chains(per_round | {1: 6.0}) == {1: pytest.approx(6.0 / (4.3 + 1.73 / 3))}
    assert autospec.contradicted_chains({3: 6.0, 7: 20.0}) == {}  # one other: no line to read it against
    assert autospec.contradicted_chains({0: 4.3, 1: 4.63, 7: 8.36}) == {}  # no line out of the probe round: it is no chain

    costs = autospec.SpanCosts()
    costs.overhead.set_dispatch(0.001)
    for span in (160, 480):
        costs.observe_chunk(span, None, 1, 4, 0.001 + 4 * 0.0043, first=True)
        for depth in (1, 3, 5):
            costs.observe_chunk(span, depth, 1, 16, 0.001 + 16 * per_round[depth] / 1e3, first=False)
    assert costs.forgotten == set()
    costs.observe_chunk(480, 7, 1, 8, 0.001 + 8 * 0.00995, first=False)  # read as 9.95 ms: forgotten at once
    assert costs.forgotten == {(1, 7)} and not costs.measured(7, 1) and not costs.settled(7, 1)
    line = 7.02 + (7.02 - 6.03)  # modelled from the chains around it
    assert costs.at(480).cost(7, 1) == pytest.approx(line / 1e3, rel=0.02)
    assert costs.at(160).cost(5, 1) == pytest.approx(7.02e-3, rel=0.02)  # the others untouched
    costs.observe_chunk(160, 7, 1, 8, 0.001 + 8 * 0.0105, first=False)  # as dear again: kept, as measured
    assert costs.forget_contradicted_chain(1) is None and costs.settled(7, 1)
    assert costs.at(160).cost(7, 1) == pytest.approx(0.0105, rel=0.02)


def test_the_drafters_share_of_a_prefill_is_its_prompt_work():
    """A prefill runs the drafter's ``fc`` and key/value projections over the prompt, its layer at the last position
    only: the share ``spec="auto"``'s hindsight charges speculation with is that work's FLOPs over the prefill's, a
    few percent for an EAGLE-3 drafter, falling as the target's attention over a longer prompt grows; an MLA + MoE
    target and its drafter are counted alike."""
    import jax
    from flax import nnx

    from eagle_jax import Drafter, Target
    from eagle_jax.modeling import flops
    from engine_models import deepseek_config, drafter_config, target_config

    config = target_config(96, layers=4)
    target = Target(config, rngs=nnx.Rngs(0))
    drafter = Drafter(drafter_config(config), rngs=nnx.Rngs(1))
    share = flops.prefill_drafter_share(target, drafter)
    attn = drafter.self_attn
    mine = 2 * (drafter.fc.kernel.size + attn.k_proj.kernel.size + attn.v_proj.kernel.size)
    layers = 2 * sum(x.size for x in jax.tree.leaves(nnx.state(target.layers, nnx.Param)) if x.ndim == 2)
    attention = 2 * (16 + 1) / 2 * 4 * (16 + 16) * 4  # per position: half of 16 + 1 keys, 4 heads of 16 + 16, 4 layers
    assert share(16) == pytest.approx(mine / (mine + layers + attention))
    assert 0.0 < share(512) < share(16) < 0.2
    moe = Target(deepseek_config(96), rngs=nnx.Rngs(0))
    assert 0.0 < flops.prefill_drafter_share(moe, Drafter(drafter_config(moe.config), rngs=nnx.Rngs(1)))(16) < 0.5
