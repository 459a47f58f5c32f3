"""What ``spec="auto"`` expects of the drafter (decoding/acceptance_estimate.py) and how it reads that against the
round costs (decoding/autospec.py): per-position acceptance, what a new prompt carries of the ones before, a batch's
slowest row, and the choices made on them."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax.decoding import adaptive_costs, autospec
from autospec_tables import FixedCosts


def test_acceptance_estimate_and_choice():
    """Per-position conditional acceptance from accepted counts; a prior for positions never reached;
    rounds without drafts observe the first draft; aging returns toward the prior."""
    est = autospec.AcceptanceEstimate(5)
    assert est.expected_tokens(0) == 1.0 and est.expected_tokens(3) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    est.observe([[3]] * 200, 3)  # every chain of 3 accepted: p -> 1 for positions 0..2
    # ~33 rounds of memory against the prior's 3
    assert est.p[:3] == pytest.approx(1.0, abs=0.04) and est.expected_tokens(3) == pytest.approx(4.0, abs=0.15)
    est.observe([[0]] * 200, 3)  # then none accepted: p[0] -> 0
    assert est.p[0] < 0.06
    table = FixedCosts({0: 1.0, 1: 1.1, 3: 1.3, 5: 1.6, 7: 1.9})
    assert autospec.choose_depth(table.at(0), 1, est.expected_tokens) == autospec.PLAIN
    est.observe_probe(0.9, 100)
    assert est.p[0] == pytest.approx(0.9, abs=0.08) and autospec.choose_depth(table.at(0), 1, est.expected_tokens) != autospec.PLAIN
    est.observe([[0]] * 200, 3)
    est.age(300)
    assert est.p[0] == pytest.approx(autospec.PRIOR, abs=0.01)
    # A batch ends with its slowest row: one row the drafter cannot follow makes plain decoding fastest.
    good, bad = autospec.AcceptanceEstimate(), autospec.AcceptanceEstimate()
    good.observe([[7]] * 100, 7)
    bad.observe([[0]] * 100, 7)

    def fastest(rows):
        times = autospec.finish_times(table.at(0), len(rows), rows)
        return min(times, key=times.get)

    assert fastest([(50, good)]) == 7 and fastest([(50, good), (50, bad)]) == autospec.PLAIN
    assert adaptive_costs.widths_for(6) == (1, 2, 4, 7) and adaptive_costs.widths_for(1) == (1, 2)


def _finished_prompts(pair: autospec.AcceptanceEstimate, rates, rounds: int = 48) -> None:
    """Prompts whose rows each ran ``rounds`` chain rounds at a first-draft rate of ``rates[i]``, ended."""
    for rate in rates:
        row = pair.for_new_prompt()
        hits = int(round(rate * rounds))
        row.observe([[1]] * hits + [[0]] * (rounds - hits), 1)
        pair.observe([[1]] * hits + [[0]] * (rounds - hits), 1)
        pair.finish_prompt(row)


def test_a_new_prompt_carries_as_much_of_the_pairs_evidence_as_the_prompts_likeness_warrants():
    """``carry_rounds``: prompts whose first-draft rates differ no more than their rounds' sampling explains
    (T=1 here: 0.44-0.58 over ~60 rounds each) make a new prompt start from the pair's whole evidence, so
    that its first lucky rounds do not pick a chain; prompts that differ (greedy: hard ones, loops) keep the
    CARRY_ROUNDS / CARRY_DEEP_ROUNDS caps; too few prompts tell nothing."""
    alike = autospec.AcceptanceEstimate()
    _finished_prompts(alike, [0.5] * (autospec.PROMPTS_TO_CARRY - 1))
    assert alike.carry_rounds() == 0.0  # too few prompts yet
    rng = np.random.default_rng(0)
    _finished_prompts(alike, rng.binomial(48, 0.55, 24) / 48)  # one rate, binomial noise only
    carry = alike.carry_rounds()
    assert 50 < carry < 1e3  # read one standard error of the spread high: alike, but only 27 prompts seen
    new = alike.for_new_prompt()
    assert new.trials[1:] == pytest.approx(alike.trials[1:]) and new.own.tolist() == [0.0, 0.0]
    hits, trials = np.array(alike.prompts).T  # the first draft: the finished prompts' mean rate, undecayed
    assert new.trials[0] == pytest.approx(carry) and new.p[0] == pytest.approx(np.mean(hits / trials)) == new.prior
    new.observe([[1]] * 4, 1)  # four lucky rounds
    assert new.p[0] < 0.65 and new.own.tolist() == [4.0, 4.0]
    differ = autospec.AcceptanceEstimate()
    _finished_prompts(differ, [0.1, 0.95, 0.3, 0.9, 0.2, 0.99])
    assert differ.carry_rounds() < autospec.CARRY_DEEP_ROUNDS
    assert differ.for_new_prompt().trials[0] == pytest.approx(autospec.CARRY_ROUNDS)
    short = differ.for_new_prompt()
    short.observe([[1]] * (autospec.PROMPT_MIN_ROUNDS - 1), 1)
    differ.finish_prompt(short)  # too few rounds of its own to tell its rate
    assert len(differ.prompts) == 6


def test_a_new_prompt_falls_back_to_the_finished_prompts_rate_not_the_prior():
    """A weak drafter (first drafts accepted ~12%, prompts differing): a new prompt carries CARRY_ROUNDS of the pair's
    evidence, and its first draft falls back to the finished prompts' mean rate, not to PRIOR, once one
    finished; so four probe rounds at its own rate read it, not ~0.2."""
    weak = autospec.AcceptanceEstimate()
    assert weak.for_new_prompt().prior == autospec.PRIOR  # nothing finished yet
    _finished_prompts(weak, [0.1])
    assert weak.for_new_prompt().prior == pytest.approx(0.1, abs=0.01)
    weak = autospec.AcceptanceEstimate()
    _finished_prompts(weak, [0.02, 0.3, 0.04, 0.25, 0.06, 0.05])
    assert weak.carry_rounds() <= autospec.CARRY_ROUNDS  # prompts differ
    new = weak.for_new_prompt()
    assert new.trials[0] == pytest.approx(autospec.CARRY_ROUNDS) and new.prior == pytest.approx(0.12, abs=0.01)
    new.observe_probe(0.12, autospec.PROBE_ROUNDS)
    as_before = new.copy()
    as_before.prior = autospec.PRIOR
    assert new.p[0] < 0.13 and as_before.p[0] > 0.18  # PRIOR's 3 rounds at 0.6 outweigh the carried and the own
    assert new.p[3] == pytest.approx(new.p[0], abs=0.06)  # the deeper drafts still follow the first


def test_a_new_prompt_weighs_its_own_probe_against_the_pairs_history():
    """A new prompt starts from the pair's rates with at most CARRY_ROUNDS rounds of their evidence for the
    first draft (CARRY_DEEP_ROUNDS for deeper ones): after many rounds the drafter could not follow, a
    prompt it follows shows so within one probe chunk, and its deeper drafts follow its first."""
    pair = autospec.AcceptanceEstimate()
    pair.observe([[0]] * 200, 7)  # a long hard prompt
    new = pair.for_new_prompt()
    assert new.trials.max() == pytest.approx(autospec.CARRY_ROUNDS) and new.hits == pytest.approx(pair.hits * new.trials.max() / pair.trials.max())
    deep = autospec.AcceptanceEstimate()
    deep.observe([[1]] * 200, 3)  # first drafts accepted, second ones never
    fresh = deep.for_new_prompt()
    assert fresh.trials[:2] == pytest.approx([autospec.CARRY_ROUNDS, autospec.CARRY_DEEP_ROUNDS])
    fresh.observe_probe(0.9, autospec.PROBE_ROUNDS)
    assert fresh.p[1] > 0.4 > deep.p[1] + 0.3  # the second draft follows this prompt's first more than the history
    assert new.p[0] < 0.25  # the rates kept, blended with the prior's PRIOR_ROUNDS
    table = FixedCosts({0: 1.0, 1: 1.3, 3: 1.6, 5: 2.0, 7: 2.4})
    for est in (pair, new):
        est.observe_probe(1.0, autospec.PROBE_ROUNDS)
    assert autospec.choose_depth(table.at(0), 1, pair.expected_tokens) == autospec.PLAIN
    assert autospec.choose_depth(table.at(0), 1, new.expected_tokens) != autospec.PLAIN


def test_a_batchs_slowest_row_is_read_with_the_batchs_pooled_evidence():
    """The slowest row sets a batch's end. Four rows that accept alike, one of which drew a low rate in its
    first rounds: read alone, that row makes plain decoding look fastest; with ROW_POOL_ROUNDS of the
    batch's pooled evidence, K=1 is (as it is for the rows' common rate). One row is left as it is."""

    def est(rate: float, rounds: int) -> autospec.AcceptanceEstimate:
        e = autospec.AcceptanceEstimate()
        e.observe([[1]] * round(rate * rounds) + [[0]] * (rounds - round(rate * rounds)), 1)
        return e

    costs = FixedCosts({0: 1.0, 1: 1.3}).at(0)
    rows = [(64, est(0.55, 8))] * 3 + [(64, est(0.125, 8))]  # the last row: 1 of 8 accepted
    alone = autospec.finish_times(costs, 4, rows, depths=(1,))
    pooled = autospec.finish_times(costs, 4, autospec.toward_the_batch(rows), depths=(1,))
    assert min(alone, key=alone.get) == autospec.PLAIN and min(pooled, key=pooled.get) == 1
    one = [(64, est(0.125, 8))]
    assert autospec.toward_the_batch(one)[0][1] is one[0][1]


def test_a_batch_ends_with_its_slowest_rows_rounds():
    """A call of 12 rows ends when its slowest row is done: the expected maximum of the rows' rounds, which the
    rounds' spread puts well past the mean (the more, the deeper the chain), as simulated rounds show."""
    est = autospec.AcceptanceEstimate()
    est.observe_probe(0.0, 0)
    rng = np.random.default_rng(0)
    for depth in (1, 3, 7):
        rows = [(64, est)] * 12
        mean = 64 / est.expected_tokens(depth)
        assert autospec.slowest_rounds(rows[:1], depth) == pytest.approx(mean)
        chances = np.cumprod(est.p[:depth])  # P(at least k drafts accepted)
        sims = []
        for _ in range(400):
            made = np.zeros(12)
            rounds = 0
            while (made < 64).any():
                u = rng.random(12)
                made += 1 + (u[:, None] < chances[None]).sum(axis=1)
                rounds += 1
            sims.append(rounds)
        assert autospec.slowest_rounds(rows, depth) == pytest.approx(np.mean(sims), rel=0.05)
        assert autospec.slowest_rounds(rows, depth) > mean + 2
    assert autospec.slowest_rounds([(64, est)] * 12, autospec.PLAIN) == 64


def test_a_close_race_keeps_the_running_depth():
    """A depth within WATCH_TOLERANCE of the fastest goes on running: the noise of the estimates would otherwise
    switch between near-equal chains every chunk, each switch a host round trip and a look."""
    times = {autospec.PLAIN: 1.0, 1: 0.80, 3: 0.81}
    assert autospec.keep_close(times, 3) == 3 and autospec.keep_close(times, 1) == 1
    assert autospec.keep_close(times, None) == 1 and autospec.keep_close({**times, 3: 0.83}, 3) == 1


def test_a_chain_hopes_its_deeper_drafts_do_as_its_own():
    """``deeper_unseen``: after a prompt whose second drafts were never accepted, a new prompt whose first drafts all
    are chooses a chain of 1, its deeper drafts still the earlier prompt's; read as accepted as often as its
    first, a deeper chain would finish the call sooner, and that is the one named. A prompt whose first drafts
    are rarely accepted has nothing deeper to hope for, nor has the deepest chain."""
    table = FixedCosts({0: 1.0, 1: 1.1, 3: 1.7, 5: 2.3, 7: 2.9}).at(0)
    earlier = autospec.AcceptanceEstimate()
    earlier.observe([[1]] * 200, autospec.DEEPEST)
    row = earlier.for_new_prompt()
    row.observe_probe(1.0, autospec.PROBE_ROUNDS)
    times = autospec.finish_times(table, 1, [(96, row)])
    assert autospec.keep_close(times, None) == 1
    hoped = autospec.finish_times(table, 1, [(96, row.seen_through(1))])
    assert row.seen_through(1).p == pytest.approx(np.full(autospec.DEEPEST, row.p[0]))
    assert autospec.deeper_unseen(table, 1, [(96, row)], 1) == min(hoped, key=hoped.get) == 5
    hard = earlier.for_new_prompt()
    hard.observe_probe(0.2, 16)
    assert autospec.deeper_unseen(table, 1, [(96, hard)], 1) is None
    assert autospec.deeper_unseen(table, 1, [(96, row)], autospec.DEEPEST) is None


def test_deeper_drafts_fade_only_in_a_prompts_own_estimate_where_prompts_differ():
    """A drafter whose second and third drafts are accepted whenever its first is (the first half the time). While
    a chain of 1 runs, the pair's estimate keeps what the deeper drafts did, so a chain of 3 stays its choice where it
    pays; faded, they fell back to the first draft's rate and a chain of 1 ran on, call after call (T=1). A prompt's
    own estimate lets them fade where prompts differ (an earlier prompt's deeper rates say little about it), and
    keeps them where prompts were seen alike."""
    table = FixedCosts({0: 1.0, 1: 1.1, 3: 1.5}).at(0)
    chain_of_3 = [[3], [0]] * 20
    chain_of_1 = [[1], [0]] * 10
    pair = autospec.AcceptanceEstimate()
    pair.observe(chain_of_3, 3)
    pair.prompts.extend([(24.0, 48.0)] * autospec.PROMPTS_TO_CARRY)  # finished prompts alike: half their first drafts
    differ, alike = pair.for_new_prompt(carry=0.0), pair.for_new_prompt()
    pair.observe(chain_of_1, 1)
    assert pair.p[1:3].min() > 0.8
    assert autospec.choose_depth(table, 1, pair.expected_tokens, depths=(1, 3)) == 3
    for row, kept in ((differ, False), (alike, True)):
        row.observe(chain_of_1, 1)
        assert (row.p[1] > 0.8) == kept, row.p


def test_a_hard_prompt_priced_alone_stops_speculating_sooner_than_a_batchs_row():
    """Greedy, after easy prompts, prompts differing: a hard prompt (a quarter of its first drafts accepted, no
    deeper one) carries, priced alone, only what the prompts' spread warrants beyond the prior's rounds, so two
    chunks of a chain of 7 tell it to decode plainly (bfloat16-like costs, where a round feeding the drafter costs
    1.5x a plain one); as one of a batch's rows it carries CARRY_ROUNDS, whose noise the slowest row's pricing
    would read low, and still chooses a chain after three."""
    pair = autospec.AcceptanceEstimate()
    _finished_prompts(pair, [0.95, 0.9, 0.3, 0.97, 0.92, 0.35])
    pair.observe([[7]] * 60, 7)  # the last prompts easy
    carry = pair.carry_rounds()
    assert carry <= autospec.CARRY_ROUNDS  # prompts differ
    table = FixedCosts({0: 1.0, 1: 1.5, 3: 1.7, 5: 1.9, 7: 2.1}).at(0)
    alone, row = pair.for_new_prompt(alone=True), pair.for_new_prompt()
    assert alone.trials == pytest.approx([max(carry - autospec.PRIOR_ROUNDS, 0.0)] + [autospec.CARRY_DEEP_ROUNDS] * 6)
    assert row.trials == pytest.approx([autospec.CARRY_ROUNDS] + [autospec.CARRY_DEEP_ROUNDS] * 6)

    def choice(est):
        times = autospec.finish_times(table, 1, [(96, est)])
        return min(times, key=times.get)

    hard = [[0], [0], [1], [0]]
    assert choice(alone) == choice(row) == 7  # the easy prompts' rates
    for est in (alone, row):
        est.observe(hard * 2, 7)
    assert choice(alone) == autospec.PLAIN and choice(row) != autospec.PLAIN
    row.observe(hard, 7)
    assert choice(row) != autospec.PLAIN
    fresh = autospec.AcceptanceEstimate()  # the prompts' spread not known yet: CARRY_ROUNDS either way
    assert fresh.for_new_prompt(alone=True).trials[0] == fresh.for_new_prompt().trials[0] == 0.0
    _finished_prompts(fresh, [0.9])
    assert fresh.for_new_prompt(alone=True).trials[0] == pytest.approx(autospec.CARRY_ROUNDS)
