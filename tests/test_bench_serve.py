"""bench.serve's pooling of repeated measured passes (``--repeats``)."""

from __future__ import annotations

import pytest

from bench.serve import pooled


def _pass(per_user: float, ttft: float, sha: str, steps: dict) -> dict:
    return {
        "per_user_tok_s": per_user,
        "per_user_tok_s_min": per_user - 1,
        "total_tok_s": 4 * per_user,
        "tokens": 100,
        "wall_s": 2.0,
        "ttft_p50": ttft,
        "ttft_p90": ttft,
        "ttft_p99": ttft,
        "ttft_steady_p50": None,
        "itl_p50": 0.01,
        "itl_p90": 0.02,
        "itl_p99": 0.03,
        "compiles_while_measured": 0,
        "steps_by_depth": steps,
        "texts_sha": sha,
    }


def test_repeated_passes_pool_into_one_row():
    """Tokens/s are the mean over the passes, latencies the median, steps summed; each pass is kept; texts that
    differ between passes are flagged (greedy passes must agree)."""
    passes = [_pass(100.0, 0.1, "a", {1: 10}), _pass(110.0, 0.3, "a", {1: 8, 3: 2}), _pass(120.0, 0.2, "a", {3: 9})]
    row = pooled(passes)
    assert row["per_user_tok_s"] == pytest.approx(110.0) and row["total_tok_s"] == pytest.approx(440.0)
    assert row["ttft_p50"] == pytest.approx(0.2) and row["ttft_steady_p50"] is None
    assert row["steps_by_depth"] == {1: 18, 3: 11} and row["tokens"] == 300
    assert [p["per_user_tok_s"] for p in row["passes"]] == [100.0, 110.0, 120.0] and row["texts_equal"]
    assert not pooled([_pass(1.0, 0.1, "a", {}), _pass(1.0, 0.1, "b", {})])["texts_equal"]
    assert pooled(passes[:1])["per_user_tok_s"] == 100.0 and "passes" not in pooled(passes[:1])
