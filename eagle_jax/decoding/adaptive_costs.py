"""Cost calibration of adaptive chains (``SpecConfig(adaptive=True)``, opt-in).

``calibrate`` times an adaptive program's parts (drafter step, each verification width, a plain round)
in the compiled loop itself; the rounds then draft while the drafter's confidence is worth a step and
verify the width with the most expected tokens per second (engine ``_round_adaptive``). Measured on
this project's CPU it runs 10-15% slower than the fixed chain doing the same work (BENCHMARKS.md), so
``spec="auto"`` (``decoding/autospec.py``) does not pick it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

from eagle_jax.decoding.engine import RoundCosts

MAX_DRAFTS = 6  # an adaptive round's deepest chain
WIDTHS = (1, 2, 4)  # its verification widths (1 + drafts), and MAX_DRAFTS + 1: a compiled branch each
ROUNDS = 12  # rounds timed per forced configuration
REPEATS = 2
_BIG = 1e6  # a cost that is never chosen / a plain rate that never ends speculation

_COSTS: dict[Any, RoundCosts] = {}

# (costs array, rounds limit) -> (state after the run, blocked on); the compiled generate program.
Runner = Callable[[jax.Array, int], Any]


def widths_for(k: int) -> tuple[int, ...]:
    """Verification widths of an adaptive chain of at most ``k`` drafts: WIDTHS up to k + 1, and k + 1."""
    return tuple(sorted({w for w in WIDTHS if w <= k} | {k + 1}))


def _forced(widths: tuple[int, ...], j: int, draft_s: float = 0.0, worth_start: float = 2.0) -> RoundCosts:
    """Costs under which every round verifies widths[j] (drafting all K when ``draft_s`` is 0, one
    when it is huge), and speculation never stops (or, with ``worth_start`` 0, never starts)."""
    return RoundCosts(widths, tuple(1.0 if i == j else _BIG for i in range(len(widths))), draft_s, _BIG, worth_start)


def calibrate(key: Any, run: Runner, widths: tuple[int, ...], max_drafts: int) -> RoundCosts:
    """Round costs measured in the compiled loop ``run`` (cached under ``key``: the pair and plan).

    Each configuration runs the prefill plus ROUNDS rounds, minus the prefill alone, per round run;
    the fastest of REPEATS passes over all configurations in turn (interleaved, so that a machine
    whose speed drifts biases none of them). T_j (all K drafts, width j), T_min (one draft, width 1)
    and a plain round give draft_s = (T_0 - T_min) / (K - 1) and verify_s[j] = T_j - K x draft_s."""
    if key in _COSTS:
        return _COSTS[key]
    configs = [_forced(widths, j) for j in range(len(widths))]
    configs += [_forced(widths, 0, draft_s=_BIG), _forced(widths, 0, worth_start=0.0)]
    arrays = [c.as_array() for c in configs]
    jax.block_until_ready(run(arrays[0], 0).out)  # warm
    base = float("inf")
    best = [float("inf")] * len(configs)
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(run(arrays[0], 0).out)
        base = min(base, time.perf_counter() - t0)
        for i, a in enumerate(arrays):
            t0 = time.perf_counter()
            st = run(a, ROUNDS)
            jax.block_until_ready(st.out)
            best[i] = min(best[i], (time.perf_counter() - t0) / max(int(st.rounds), 1))
    # The prefill's share of a run, spread over its rounds, is taken out of every per-round time.
    per_round = [max(t - base / ROUNDS, 1e-9) for t in best]
    full, one_draft, plain = per_round[: len(widths)], per_round[-2], per_round[-1]
    draft_s = max((full[0] - one_draft) / max(max_drafts - 1, 1), 1e-9)
    costs = RoundCosts(widths, tuple(max(t - max_drafts * draft_s, 1e-9) for t in full), draft_s, plain)
    _COSTS[key] = costs
    return costs


def forget() -> None:
    """Forgets every calibration (tests, benchmarks)."""
    _COSTS.clear()
