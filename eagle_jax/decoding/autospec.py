"""Speculation chosen by measurement: ``spec="auto"``, the default of ``generate`` with a drafter;
and the cost calibration of adaptive chains (``SpecConfig(adaptive=True)``).

**auto.** Whether speculation pays, and how deep, depends on the machine, the batch and the drafter's
acceptance on the traffic: with few rows a target step reads weights, so K+1 positions cost about
one and deep chains win; with many rows the step is compute-bound, each verified position costs
nearly a step, and plain decoding can win (what vLLM's ``disable_by_batch_size`` sets by hand). A
model of it, ``speedup ~ AL / (1 + K x t_draft / t_verify)``, needs AL, which only the traffic
tells. So the first call for a model pair, batch size and sampling mode runs each candidate
(``candidates``: plain decoding and chains of ``AUTO_CHAINS`` drafts), compiled at the call's own
shapes, on the call's own prompts, and keeps the one with the most tokens per second: the whole run
for short generations, the decode rate of the first rounds for long ones (``calibration_rounds``);
the fastest of ``AUTO_REPEATS`` interleaved passes. Later calls with that pair, batch size and mode
reuse the choice (``choose``). The cost: compiling the candidates once, and a few runs of each.

**adaptive chains.** ``calibrate`` times an adaptive program's parts (drafter step, each
verification width, a plain round) in the compiled loop itself; the rounds then draft while the
drafter's confidence is worth a step and verify the width with the most expected tokens per second
(engine ``_round_adaptive``). Measured on this project's CPU it runs 10-15% slower than the fixed
chain doing the same work (BENCHMARKS.md), so auto does not pick it; it stays opt-in.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

from eagle_jax.config import SpecConfig
from eagle_jax.decoding.engine import RoundCosts

AUTO_CHAINS = (1, 3, 5)  # auto's chain candidates (drafts per round), besides plain decoding
CAL_TOKENS = 32  # tokens per row a calibration run of a candidate emits at about AL = (width + 1) / 2
WHOLE_RUN_TOKENS = 128  # up to this max_new a calibration run is the whole generation
AUTO_REPEATS = 2

MAX_DRAFTS = 6  # an adaptive round's deepest chain
WIDTHS = (1, 2, 4)  # its verification widths (1 + drafts), and MAX_DRAFTS + 1: a compiled branch each
ROUNDS = 12  # rounds timed per forced configuration
REPEATS = 2
_BIG = 1e6  # a cost that is never chosen / a plain rate that never ends speculation

_COSTS: dict[Any, RoundCosts] = {}
_CHOICES: dict[Any, tuple[int, dict[str, float]]] = {}

# rounds limit -> (tokens emitted so far over all rows, seconds): one run of a compiled candidate.
Measure = Callable[[int], tuple[int, float]]

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


def candidates() -> list[SpecConfig | None]:
    """What auto chooses among: plain decoding (None) and chains of AUTO_CHAINS drafts."""
    return [None, *(SpecConfig(num_speculative_tokens=k) for k in AUTO_CHAINS)]


def candidate_name(spec: SpecConfig | None) -> str:
    return "plain" if spec is None else f"chain K={spec.num_speculative_tokens}"


def calibration_rounds(width: int, max_rounds: int, max_new: int) -> int | None:
    """Rounds of a calibration run for a candidate emitting up to ``width`` tokens per round, or
    None: time the whole run. Short generations (max_new <= WHOLE_RUN_TOKENS) are timed whole,
    prefill included, because there the prefill (the drafter's too) and the batch's tail (rows that
    finished waiting for the slowest) weigh as much as the rounds' rate; long ones by their first
    rounds' decode rate, which is what their time is made of."""
    if max_new <= WHOLE_RUN_TOKENS:
        return None
    return max(1, min(max_rounds, -(-2 * CAL_TOKENS // (width + 1))))


def chosen(key: Any) -> bool:
    return key in _CHOICES


def choose(key: Any, measures: dict[int, tuple[Measure, int | None]]) -> tuple[SpecConfig | None, dict[str, float]]:
    """The candidate with the most tokens/s and every candidate's rate, measured once per ``key``.
    ``measures[i]``: (a run of candidate i up to a rounds limit, its calibration rounds or None).
    With rounds R the rate is (tokens after R rounds - tokens after the prefill) / (the difference
    in seconds); with None, the whole run's tokens / seconds."""
    if key not in _CHOICES:
        whole = 1 << 30  # a rounds limit past any plan's max_rounds

        def timed(run: Measure, rounds: int | None) -> tuple[int, float]:
            if rounds is None:
                return run(whole)
            (n0, s0), (n1, s1) = run(0), run(rounds)
            return n1 - n0, max(s1 - s0, 1e-9)

        for run, rounds in measures.values():  # warm: first runs pay one-time costs
            timed(run, rounds)
        rates = {i: 0.0 for i in measures}
        for _ in range(AUTO_REPEATS):  # interleaved, so that a machine whose speed drifts biases none
            for i, (run, rounds) in measures.items():
                n, sec = timed(run, rounds)
                rates[i] = max(rates[i], n / sec)
        best = max(rates, key=rates.get)
        specs = candidates()
        _CHOICES[key] = (best, {candidate_name(specs[i]): r for i, r in rates.items()})
    best, rates = _CHOICES[key]
    return candidates()[best], rates
