"""Speculation chosen by measured cost (decoding/autospec.py) and adaptive chains (engine._round_adaptive).

Greedy output is plain decoding's whatever the costs make a round choose: the costs are forced here
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
    out = eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, spec="auto", eos_token_id=[])
    assert out.tokens == plain.tokens
    spec = out.stats["spec"]
    assert spec is None or (spec.adaptive and spec.num_speculative_tokens == autospec.MAX_DRAFTS)
    again = eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, spec="auto", eos_token_id=[])
    assert again.stats["spec"] == spec  # the calibration is cached per pair and shape


def test_auto_declines_when_speculation_cannot_pay(monkeypatch, pair, plain):
    """Verification cost growing with width like a compute-bound batch: even always-accepted drafts lose."""
    widths = autospec.widths_for(autospec.MAX_DRAFTS)
    monkeypatch.setattr(autospec, "calibrate", lambda *a, **k: RoundCosts(widths, tuple(float(w) for w in widths), 0.1, 1.0))
    default = eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, eos_token_id=[])
    assert default.stats["spec"] == SpecConfig()  # auto is opt-in
    out = eagle_jax.generate(pair[0], pair[1], PROMPTS, max_new_tokens=24, spec="auto", eos_token_id=[])
    assert out.stats["spec"] is None and out.tokens == plain.tokens and out.acceptance_length == 1.0


def test_best_case_speedup_rule():
    assert autospec.best_case_speedup(RoundCosts((1, 2, 4), (1.0, 1.0, 1.2), 0.1, 1.0)) == pytest.approx(4 / 1.5)
    assert autospec.best_case_speedup(RoundCosts((1, 2, 4), (1.1, 2.2, 4.4), 0.1, 1.0)) < 1
    assert autospec.widths_for(6) == (1, 2, 4, 7) and autospec.widths_for(1) == (1, 2)


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
