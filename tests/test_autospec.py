"""Speculation chosen by measurement (decoding/autospec.py: ``spec="auto"``, the default) and adaptive
chains (engine._round_adaptive).

Greedy output is plain decoding's whatever auto or the costs make a round choose: the costs are forced here
(``autospec.calibrate`` patched) to make rounds verify everything, nothing, or a width below the
drafts made, and then left to this machine's measurement. The sampling law under adaptive rounds is
checked in test_engine.py (SAMPLING_CASES "adaptive-*").
"""

from __future__ import annotations

import numpy as np
import pytest

import eagle_jax
from eagle_jax import SpecConfig
from eagle_jax.config import ConfigError
from eagle_jax.decoding import autospec
from eagle_jax.decoding.engine import RoundCosts, draft_confidence
from engine_models import markov_pair

PROMPTS = [list(np.random.default_rng(7).integers(0, 32, n)) for n in (4, 11, 19)]
K = 4
ADAPTIVE = SpecConfig(num_speculative_tokens=K, adaptive=True)


def costs(verify_s, draft_s=0.0, plain_s=1.0):
    return RoundCosts(autospec.widths_for(K), tuple(verify_s), draft_s, plain_s)


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


@pytest.fixture(scope="module")
def plain(pair):
    return eagle_jax.generate(pair[0], None, PROMPTS, max_new_tokens=24, eos_token_id=[])


def run_with(monkeypatch, pair, forced: RoundCosts | None, spec=ADAPTIVE):
    if forced is not None:
        monkeypatch.setattr(autospec, "calibrate", lambda *a, **k: forced)
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


def test_auto_measures_this_machine(pair, plain):
    """The default with a drafter: every candidate timed on these prompts, the fastest kept, and the
    choice reused by the next call of that pair and batch size (other prompts and lengths too)."""
    out = eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, eos_token_id=[])
    assert out.tokens == plain.tokens
    rates = out.stats["auto_rates"]
    assert set(rates) == {autospec.candidate_name(s) for s in autospec.candidates()} and min(rates.values()) > 0
    assert autospec.candidate_name(out.stats["spec"]) == max(rates, key=rates.get)
    again = eagle_jax.generate(pair[0], pair[1], [p[:3] for p in PROMPTS], max_new_tokens=9, spec="auto", eos_token_id=[])
    assert again.stats["spec"] == out.stats["spec"] and again.stats["auto_rates"] is rates  # not measured again
    assert again.tokens == [t[:9] for t in eagle_jax.generate(pair[0], None, [p[:3] for p in PROMPTS], max_new_tokens=9, eos_token_id=[]).tokens]
    streamed = list(eagle_jax.generate_stream(pair[0], pair[1], PROMPTS, max_new_tokens=24, eos_token_id=[]))
    assert [sum((c[b] for c in streamed), []) for b in range(len(PROMPTS))] == plain.tokens


def test_choose_keeps_the_most_tokens_per_second():
    """With calibration rounds the rate excludes the prefill (the run stopped after it is subtracted);
    without (short generations) it is the whole run's. Candidate i emits tokens[i] per round at
    seconds[i] per round after a prefill of 5 s; a whole run is 8 rounds."""

    def fake(tokens_per_round, seconds_per_round):
        return lambda limit: (3 + tokens_per_round * min(limit, 8), 5.0 + seconds_per_round * min(limit, 8))

    specs = autospec.candidates()
    fast_k3 = {0: (fake(1, 1.0), 8), 1: (fake(2, 1.5), 8), 2: (fake(4, 2.0), 8), 3: (fake(5, 3.0), 8)}
    chosen, rates = autospec.choose(("test", "k3"), fast_k3)
    assert chosen == specs[2] and rates["chain K=3"] == pytest.approx(2.0) and rates["plain"] == pytest.approx(1.0)
    plain_wins = {0: (fake(4, 1.0), 8), 1: (fake(2, 1.0), 8), 2: (fake(4, 2.0), 8), 3: (fake(5, 3.0), 8)}
    assert autospec.choose(("test", "plain"), plain_wins)[0] is None
    assert autospec.choose(("test", "k3"), {})[0] == specs[2]  # cached: nothing measured
    # Whole runs: the prefill counts, (3 + 8 t) / (5 + 8 s): plain 11/13, chain K=3 35/21.
    whole = {0: (fake(1, 1.0), None), 2: (fake(4, 2.0), None)}
    chosen, rates = autospec.choose(("test", "whole"), whole)
    assert chosen == specs[2] and rates["plain"] == pytest.approx(11 / 13) and rates["chain K=3"] == pytest.approx(35 / 21)
    assert autospec.calibration_rounds(1, 200, 200) == 32 and autospec.calibration_rounds(6, 200, 200) == 10
    assert autospec.calibration_rounds(6, 4, 129) == 4 and autospec.calibration_rounds(6, 64, 64) is None
    assert autospec.widths_for(6) == (1, 2, 4, 7) and autospec.widths_for(1) == (1, 2)


def test_auto_runs_plain_decoding_when_it_is_faster(monkeypatch, pair, plain):
    monkeypatch.setattr(autospec, "choose", lambda key, measures: (None, {"plain": 2.0, "chain K=5": 1.0}))
    out = eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, spec="auto", eos_token_id=[])
    assert out.stats["spec"] is None and out.tokens == plain.tokens and out.acceptance_length == 1.0


def test_draft_confidence_is_the_top2_share():
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], np.float32))
    np.testing.assert_allclose(np.asarray(draft_confidence(logits)), [0.5 / 0.8, 0.8 / 0.9], rtol=1e-6)


def test_spec_errors(pair):
    with pytest.raises(ConfigError, match="adaptive applies to chains only"):
        SpecConfig(method="tree", adaptive=True)
    with pytest.raises(ConfigError, match="'auto' or None"):
        eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=4, spec="fast")


def test_stream_with_adaptive(monkeypatch, pair, plain):
    monkeypatch.setattr(autospec, "calibrate", lambda *a, **k: costs([1.0, 1.0, 50.0, 50.0]))
    chunks = list(eagle_jax.generate_stream(pair[0], pair[1], PROMPTS, max_new_tokens=24, spec=ADAPTIVE, eos_token_id=[]))
    assert [sum((c[b] for c in chunks), []) for b in range(len(PROMPTS))] == plain.tokens
