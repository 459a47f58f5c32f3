"""Speculation chosen by measured cost: ``spec="auto"``, the default of ``generate`` with a drafter.

A round of K chain drafts costs K drafter steps plus one target forward of K+1 positions (and the
drafter's extension over them), and emits 1 + (accepted drafts) tokens; plain decoding costs one
target step per token. How those costs relate depends on the machine and the batch: with few rows a
step reads weights and K+1 positions cost about as much as one (speculation pays); with many rows it
is compute-bound and each verified position costs nearly a full step (it does not). So the first
call for a pair and shape times the compiled loop itself (``calibrate``: a few rounds forced to each
verification width, to one draft, and to plain rounds, on the caller's own prompts; results
discarded), and

- ``choose`` keeps the adaptive chain (``SpecConfig(adaptive=True)``): each round drafts while the
  drafter's cumulative confidence, in tokens, is worth a drafter step, verifies the static width with
  the most expected tokens per second (engine ``_round_adaptive``), and the run falls back to plain
  rounds once speculation stops paying (``_round_auto``); or
- declines, when even drafts that are always accepted could not beat plain decoding:
  ``max_w w x plain_s / (verify_s(w) + (w-1) x draft_s) < 1 + MARGIN`` (what vLLM's
  ``disable_by_batch_size`` does by hand); the caller then decodes without the drafter.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

from eagle_jax.config import SpecConfig
from eagle_jax.decoding.engine import RoundCosts

MAX_DRAFTS = 6  # an adaptive round's deepest chain
WIDTHS = (1, 2, 4)  # its verification widths (1 + drafts), and MAX_DRAFTS + 1: a compiled branch each
MARGIN = 0.05  # speculation must promise at least this much to be chosen at all
ROUNDS = 12  # rounds timed per forced configuration
REPEATS = 2
_BIG = 1e6  # a cost that is never chosen / a plain rate that never ends speculation

_COSTS: dict[Any, RoundCosts] = {}

# (costs array, rounds limit) -> (state after the run, blocked on); the compiled generate program.
Runner = Callable[[jax.Array, int], Any]


def widths_for(k: int) -> tuple[int, ...]:
    """Verification widths of an adaptive chain of at most ``k`` drafts: WIDTHS up to k + 1, and k + 1."""
    return tuple(sorted({w for w in WIDTHS if w <= k} | {k + 1}))


def spec(max_drafts: int = MAX_DRAFTS) -> SpecConfig:
    return SpecConfig(num_speculative_tokens=max_drafts, adaptive=True)


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


def best_case_speedup(costs: RoundCosts) -> float:
    """Speedup over plain decoding if every draft were accepted, at the best width."""
    return max(w * costs.plain_s / (v + (w - 1) * costs.draft_s) for w, v in zip(costs.widths, costs.verify_s))


def worth_speculating(costs: RoundCosts) -> bool:
    return best_case_speedup(costs) >= 1 + MARGIN
