"""``spec="auto"``'s round costs kept on disk (decoding/cost_cache.py): measured once per machine, found again by a
later process (``autospec.reset`` stands in for a new process: it writes what is pending and forgets the rest)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import eagle_jax
from eagle_jax.decoding import autospec, cost_cache
from eagle_jax.decoding.acceptance_estimate import AcceptanceEstimate
from eagle_jax.serving import Request, Scheduler, SlotEngine
from eagle_jax.serving.depth import AutoDepth
from engine_models import markov_pair

PROMPTS = [list(np.random.default_rng(7).integers(0, 32, n)) for n in (4, 11, 19)]


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache in a directory of this test's own; nothing pending is left for the next test."""
    monkeypatch.setenv(cost_cache.ENV, str(tmp_path / "costs"))
    autospec.reset()
    yield tmp_path / "costs"
    autospec.reset()


def auto(pair, **kw):
    return eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, eos_token_id=[], **kw)


def measured_costs() -> autospec.SpanCosts:
    costs = autospec.SpanCosts()
    costs.overhead.set_dispatch(0.001)
    for span, scale in ((128, 1.0), (512, 1.3)):
        for rows in (1, 4):
            costs.observe_chunk(span, None, rows, 4, scale * rows * 0.040, first=True)
            costs.observe_chunk(span, 7, rows, 4, scale * rows * 0.090, first=False)
            costs.observe_chunk(span, 3, rows, 20, scale * rows * 0.300, first=False)
            costs.observe_chunk(span, autospec.PLAIN, rows, 16, scale * rows * 0.150, first=False)
    return costs


def test_costs_read_back_as_measured(cache):
    """Every cost a later process reads (measured, modelled, at a span measured or not, the chunks' overhead) is the
    one the process that measured it read."""
    costs = measured_costs()
    costs.keep(lambda: "pair")
    cost_cache.save("pair", costs, now=True)
    assert json.loads((cache / "pair.json").read_text())["format"] == cost_cache.FORMAT
    again = autospec.SpanCosts()
    again.keep(lambda: "pair")
    for rows in (1, 4, 2):
        assert again.probed(rows) == costs.probed(rows)
        assert again.overhead.seconds(rows) == pytest.approx(costs.overhead.seconds(rows))
        for depth in (autospec.PLAIN, *autospec.DEPTHS):
            assert again.settled(depth, rows) == costs.settled(depth, rows)
            for span in (128, 300, 512):
                assert again.cost(depth, rows, span) == pytest.approx(costs.cost(depth, rows, span), rel=1e-9)


def test_a_later_process_starts_from_the_costs_an_earlier_one_measured(cache, pair, monkeypatch):
    """The first process's first call measures (a round without drafts, then the deepest chain) and knows no cost
    at its start; a later process's first call starts from every cost the first process knew at its end (which
    depths those are depends on this machine's timings: a probe round measured above a chain is forgotten). Either
    way the output is plain decoding's."""
    read_at = []  # (costs, span) of each call's start
    at = autospec.SpanCosts.at
    monkeypatch.setattr(autospec.SpanCosts, "at", lambda self, span: read_at.append((self, span)) or at(self, span))
    plain = eagle_jax.generate(pair[0], None, PROMPTS, max_new_tokens=24, eos_token_id=[])
    first = auto(pair)
    assert first.stats["round_ms"] == {} and first.stats["chunks"][0][0] is None
    assert any(depth == max(autospec.DEPTHS) for depth, _ in first.stats["chunks"])
    assert [p.suffix for p in cache.iterdir()] == [".json"]
    costs, span = read_at[-1]
    known = {d: 1e3 * c for d in (autospec.PLAIN, *autospec.DEPTHS) if (c := costs.cost(d, len(PROMPTS), span)) is not None}
    assert max(autospec.DEPTHS) in known
    autospec.reset()  # a new process
    later = auto(pair)
    assert later.stats["round_ms"] == pytest.approx(known, abs=1e-3)
    assert later.tokens == first.tokens == plain.tokens


def seen_estimate() -> AcceptanceEstimate:
    """A pair's estimate after a few prompts: rounds at two depths and finished prompts."""
    est = AcceptanceEstimate()
    rng = np.random.default_rng(3)
    for _ in range(5):
        row = est.for_new_prompt()
        row.observe(rng.integers(0, 4, (12, 1)), 3)
        est.observe(rng.integers(0, 4, (12, 1)), 3)
        est.finish_prompt(row)
    est.observe_probe(0.4, 6)
    return est


def test_the_pairs_acceptance_is_kept_with_its_costs(cache):
    """A later process starts from the acceptance an earlier one saw (its rates per position, how alike its prompts
    were, the rounds since it was last observed, after which a call probes) and from what hindsight found of plain
    decoding, not from the prior. An estimate that observed something already keeps its own, and its costs their
    own hindsight."""
    costs, seen = measured_costs(), seen_estimate()
    seen.prompts.clear()
    seen.prompts.extend([(6.0, 12.0)] * 5)  # prompts alike: half their first drafts each
    assert autospec.prompts_alike(seen.carry_rounds())
    costs.keep(lambda: "pair", seen)
    costs.plain_rows = {1: 5, 4: 0}
    cost_cache.save("pair", costs, now=True)
    fresh, later = AcceptanceEstimate(), autospec.SpanCosts()
    later.keep(lambda: "pair", fresh)
    np.testing.assert_allclose(fresh.p, seen.p)
    np.testing.assert_allclose(np.asarray(fresh.carry_rounds()), np.asarray(seen.carry_rounds()))
    np.testing.assert_allclose(np.asarray(fresh.prompts), np.asarray(seen.prompts))  # [prompts, 2]: approx takes no nesting
    assert fresh.unobserved == seen.unobserved == 0 and later.plain_rows == {1: 5, 4: 0} and later.plain_settled(1, alike=True)
    assert fresh.for_new_prompt().prior == pytest.approx(seen.for_new_prompt().prior) != autospec.PRIOR
    for unobserved in (150, float("inf")):  # rounds decoded plainly since, or never observed
        seen.unobserved = unobserved
        costs.kept()
        cost_cache.flush()
        fresh = AcceptanceEstimate()
        autospec.SpanCosts().keep(lambda: "pair", fresh)
        assert fresh.unobserved == unobserved
    busy, other = AcceptanceEstimate(), autospec.SpanCosts()
    busy.observe([[0]] * 4, 1)
    before = busy.to_dict()
    other.keep(lambda: "pair", busy)
    assert busy.to_dict() == before and other.plain_rows == {} and other.measured(autospec.PLAIN, 1)
    # The verdict on plain decoding is kept only where the prompts were seen alike (as ``seen``'s): where they differ
    # (greedy), a later process's prompts are new ones.
    differ, costs = seen.copy(), measured_costs()
    differ.prompts.extend([(1.0, 12.0), (11.0, 12.0)] * 2)
    assert not autospec.prompts_alike(differ.carry_rounds())
    costs.keep(lambda: "differ", differ)
    costs.plain_rows = {1: 5}
    cost_cache.save("differ", costs, now=True)
    judged = autospec.SpanCosts()
    judged.keep(lambda: "differ", AcceptanceEstimate())
    assert judged.plain_rows == {} and judged.measured(autospec.PLAIN, 1) and judged.acceptance.prompts


def test_a_later_generate_process_starts_from_the_acceptance_an_earlier_one_saw(cache, pair, monkeypatch):
    """``generate``'s calls keep the pair's estimate with its costs; a later process's first call reads it before it
    chooses anything."""
    auto(pair)
    auto(pair)
    (left,) = autospec._ESTIMATES.values()
    left = left.to_dict()
    autospec.reset()  # a new process
    read = []
    keep = autospec.SpanCosts.keep

    def recording_keep(self, name, acceptance=None):
        keep(self, name, acceptance)
        read.append(acceptance.to_dict())

    monkeypatch.setattr(autospec.SpanCosts, "keep", recording_keep)
    auto(pair)
    assert len(read) == 1 and read[0]["prompts"] == left["prompts"]
    np.testing.assert_allclose(read[0]["trials"], left["trials"])
    np.testing.assert_allclose(read[0]["hits"], left["hits"])


ONE = [1.0] * autospec.DEEPEST


@pytest.mark.parametrize("traffic", [{"acceptance": {"trials": [1.0] * 3, "hits": [0.5] * 3, "prompts": [], "unobserved": None}},
                                     {"acceptance": {"trials": ONE, "hits": [2.0] * autospec.DEEPEST, "prompts": [], "unobserved": None}},
                                     {"acceptance": {"trials": ONE, "hits": ONE, "prompts": [[9.0, 8.0]], "unobserved": None}},
                                     {"acceptance": {"trials": ONE, "hits": [None] * autospec.DEEPEST, "prompts": [], "unobserved": None}},
                                     {"acceptance": {"trials": ONE}},
                                     {"acceptance": {"trials": ONE, "hits": ONE, "prompts": [], "unobserved": -1}},
                                     {"plain_rows": [[1, -2]]}, {"plain_rows": [[0, 3]]}, {"plain_rows": [1, 3]}])
def test_kept_acceptance_that_cannot_be_read_is_reported_and_nothing_of_it_kept(cache, traffic):
    """Acceptance of another depth, more hits than trials, a prompt accepting more drafts than it made, not numbers,
    half a record, rounds since it was observed below zero, or plain decoding's hindsight below zero, at no batch size
    or not pairs: the file is reported and measured anew, and the estimate stays a fresh process's."""
    costs = measured_costs()
    costs.keep(lambda: "pair", seen_estimate())
    cost_cache.save("pair", costs, now=True)
    path = cache / "pair.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | traffic))
    fresh, again = AcceptanceEstimate(), autospec.SpanCosts()
    with pytest.warns(RuntimeWarning, match=f"round costs in {path}.*cannot be read"):
        again.keep(lambda: "pair", fresh)
    assert fresh.fresh and not again.by_span and not again.plain_rows and again.acceptance is fresh


NEGATIVE_TIME = json.dumps({"format": cost_cache.FORMAT, "overhead": {"dispatch_s": None, "chunks": []},
                            "spans": [[128, {"window": [[1, 3, [[-0.5, 4, False]]]], "rounds": [], "reprobed": []}]]})


@pytest.mark.parametrize("text", ["{not json", '{"format": 1, "spans": [[128, {"window": [[1, 3]]}]], "overhead": {}}',
                                  '{"format": 99}', "[1, 2]", NEGATIVE_TIME])
def test_a_file_that_cannot_be_read_is_reported_and_measured_anew(cache, pair, text):
    """Malformed, of another layout, half readable, or holding a measurement no chunk could have made: a warning naming
    the file, the costs measured anew as a fresh process's (nothing of the file kept), and the file then replaced by
    what was measured."""
    auto(pair)
    (path,) = cache.iterdir()
    path.write_text(text)
    autospec.reset()
    with pytest.warns(RuntimeWarning, match=f"round costs in {path}.*cannot be read"):
        again = auto(pair)
    assert again.stats["round_ms"] == {}  # measured anew
    autospec.reset()
    assert json.loads(path.read_text())["format"] == cost_cache.FORMAT


def test_a_cache_that_cannot_be_written_is_reported_and_the_call_goes_on(tmp_path, monkeypatch, pair):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(cost_cache.ENV, str(blocker / "costs"))
    autospec.reset()
    with pytest.warns(RuntimeWarning, match="cannot keep the round costs"):
        out = auto(pair)
    assert out.num_generated == 3 * 24
    monkeypatch.setenv(cost_cache.ENV, "off")
    autospec.reset()


def test_off_keeps_costs_in_the_process(tmp_path, monkeypatch, pair):
    monkeypatch.delenv("EAGLE_JAX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(cost_cache.ENV, "off")
    autospec.reset()
    auto(pair)
    autospec.reset()
    assert cost_cache.directory() is None and list(tmp_path.iterdir()) == []
    monkeypatch.delenv(cost_cache.ENV)
    assert cost_cache.directory() == tmp_path / "eagle_jax" / "costs"


def test_the_key_is_what_sets_a_rounds_cost():
    """The same configs, shapes and modes give the same file; another dtype, sampling mode or exact mode another."""
    base = dict(target_config="t", drafter_config="d", shapes=[((4, 8), "float32")], greedy=True, exact=False, mesh=None)
    assert cost_cache.key(**base) == cost_cache.key(**base)
    for change in ({"shapes": [((4, 8), "bfloat16")]}, {"greedy": False}, {"exact": True}, {"drafter_config": "d2"},
                   {"runner": ("serve", 4, 128, 3)}):
        assert cost_cache.key(**(base | change)) != cost_cache.key(**base)


def serve(pair, prompts, slots=2):
    """A server's scheduler (``--spec auto``) run through ``prompts``, greedy: (its chooser, outputs, specs stepped)."""
    chooser, steps = AutoDepth(), []
    engine = SlotEngine(pair[0], pair[1], slots=slots, max_len=96, specs=chooser.specs, rounds_per_step=3)
    sched = Scheduler(engine, chooser, on_step=lambda active, spec, out: steps.append(spec))
    sched.start()
    try:
        handles = [sched.submit(Request(tuple(int(t) for t in p), 24)) for p in prompts]
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    return chooser, [h.tokens for h in handles], steps


def test_a_restarted_server_starts_from_the_step_costs_it_measured(cache, pair):
    """A server's step costs are kept under a key of their own (a step over slots is another program than a
    ``generate`` call's rounds, and its settings are in the key): a restarted server knows, before its first step,
    every cost the first measured, so it has nothing to measure first that the first had measured (no step without
    drafts at a row count it served, no deepest chain), and the acceptance it saw. Its outputs equal plain decoding's
    either way."""
    plain = eagle_jax.generate(pair[0], None, PROMPTS, max_new_tokens=24, eos_token_id=[]).tokens
    first, out, steps = serve(pair, PROMPTS)
    assert steps[0] is None and max(AutoDepth.depth_of(s) for s in steps) == max(autospec.DEPTHS)  # measured first
    cost_cache.flush()  # the process's exit
    engine = SlotEngine(pair[0], pair[1], slots=2, max_len=96, specs=first.specs, rounds_per_step=3)
    assert (cache / f"{engine.cost_key(True)}.json").exists() and len(list(cache.iterdir())) == 1
    assert engine.cost_key(True) != SlotEngine(pair[0], pair[1], slots=2, max_len=96, specs=first.specs, rounds_per_step=2).cost_key(True)
    restarted = AutoDepth()
    Scheduler(engine, restarted)  # binds the chooser to the engine's key
    costs = restarted.costs(True)
    measured = first.costs(True)
    for rows in (1, 2):
        assert costs.probed(rows) == measured.probed(rows)
    span = engine.span_for([30], None)
    # Nothing left to measure first that the first server had measured (a probe measured above a chain in a busy
    # moment is forgotten, and then both measure it again).
    left = autospec.unexplored(measured.at(span), 1, restarted.depths)
    assert autospec.unexplored(costs.at(span), 1, restarted.depths) == left
    assert costs.at(span).cost(max(autospec.DEPTHS), 1) == pytest.approx(measured.at(span).cost(max(autospec.DEPTHS), 1))
    assert len(restarted.estimate.prompts) == len(first.estimate.prompts) == len(PROMPTS)  # the acceptance it saw
    np.testing.assert_allclose(restarted.estimate.p, first.estimate.p)
    _, out_again, _ = serve(pair, PROMPTS)
    assert out == out_again == plain


def test_a_kept_chain_far_above_the_line_is_measured_again_by_the_next_process(cache):
    """Costs an earlier process kept that price a chain far above the line through the others (its few chunks ran in
    a busy moment) are not the next process's last word: that chain is forgotten when they are read, and modelled
    from the others until it runs again (``CHAIN_CONTRADICTED``)."""
    costs = measured_costs()
    costs.observe_chunk(512, 5, 1, 8, 1.3 * 8 * 0.040, first=False)  # 40 ms a round at 1.3x: far above K=3 and K=7
    assert costs.forgotten == {(1, 5)} and not costs.measured(5, 1)
    costs.observe_chunk(512, 5, 1, 8, 1.3 * 8 * 0.040, first=False)  # measured as dear again: kept this time
    assert costs.measured(5, 1)
    costs.keep(lambda: "pair")
    cost_cache.save("pair", costs, now=True)
    again = autospec.SpanCosts()
    again.keep(lambda: "pair")
    assert again.forgotten == {(1, 5)} and not again.measured(5, 1) and again.measured(7, 1) and again.measured(3, 1)
    assert again.at(512).cost(5, 1) < costs.at(512).cost(5, 1) / autospec.CHAIN_CONTRADICTED
