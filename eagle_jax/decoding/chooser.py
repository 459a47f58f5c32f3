"""The default speculation (``spec="auto"``): one chooser for ``generate`` and the server.

Every few rounds the chooser runs the depth with the most expected tokens per second,

    sum over the rows of expected_tokens(K)  /  seconds per round at K,

over ``DEPTHS`` (chains of K drafts) and ``PLAIN`` (rounds without drafts). Both factors are measured:

- ``CostTable``: seconds per round by (rows, depth, cache-span bucket), a running mean of the rounds that ran.
  Where a depth has not run at these rows, its cost is interpolated linearly in K between the depths that have
  (a round's work is one verification of K + 1 positions and K drafter steps); a short warm-up profile first runs
  the two ends, ``PLAIN`` and the deepest chain, where the table is empty.
- ``Acceptance``: per draft position i, the chance that draft i is accepted once drafts 0..i-1 were, as decaying
  counts (``KEEP`` per round) over a prior. One estimate is pooled over the pair's traffic; each row (a prompt, a
  request) keeps its own counts over the pooled estimate as its prior. Unobserved positions lean on the position
  before them, so deeper chains are tried once the drafts they rest on are accepted.

Rounds without drafts keep the drafter fed and score its first draft (engine ``probe_acceptance``): a prompt the
drafter cannot follow decodes (about) plainly, and as soon as a row's first drafts would be accepted again the
chooser speculates again; one hard prompt does not lock speculation out for the process.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from eagle_jax.config import SpecConfig

PLAIN = 0  # rounds without drafts (the drafter fed, its first draft scored)
DEPTHS = (1, 3, 5, 7)  # chain lengths the chooser picks among, besides PLAIN
DEEPEST = max(DEPTHS)
PRIOR = 0.6  # acceptance of the first draft assumed before any is observed ...
PRIOR_ROUNDS = 2.0  # ... weighing this many rounds; a deeper position's prior is the position before it
POOL_ROUNDS = 4.0  # a row's prior: the pooled estimate, weighing this many rounds of the row's own
KEEP = 0.97  # weight of the past per round (a memory of ~30 rounds), so the estimate follows the traffic
COST_ROUNDS = 16.0  # rounds a cost's running mean remembers
SPAN_FLOOR = 256  # spans are bucketed by powers of two from here


def span_bucket(span: int) -> int:
    """The cache-span bucket a cost is kept under (a round's attention reads the span)."""
    return 1 << max(int(math.ceil(math.log2(max(span, 1)))), int(math.log2(SPAN_FLOOR)))


class Acceptance:
    """Per draft position, decaying (hits, trials) over a prior: ``PRIOR`` chained through the positions (the
    pooled estimate), or another ``Acceptance``'s live estimate (a row's, over the pooled one)."""

    def __init__(self, prior: "Acceptance | None" = None, depth: int = DEEPEST):
        self.prior = prior
        self.hits = np.zeros(depth)
        self.trials = np.zeros(depth)

    def p(self) -> np.ndarray:
        """[depth] the chance that draft i is accepted once drafts 0..i-1 were."""
        if self.prior is not None:
            base = self.prior.p()
            return (self.hits + POOL_ROUNDS * base) / (self.trials + POOL_ROUNDS)
        out = np.empty_like(self.hits)
        for i in range(len(out)):
            prior = PRIOR if i == 0 else out[i - 1]
            out[i] = (self.hits[i] + PRIOR_ROUNDS * prior) / (self.trials[i] + PRIOR_ROUNDS)
        return out

    def expected_tokens(self, depth: int) -> float:
        """Tokens a round at ``depth`` emits on average: the bonus token and each draft whose predecessors held."""
        return 1.0 + float(np.cumprod(self.p()[:depth]).sum())

    def age(self, rounds: float) -> None:
        self.hits *= KEEP**rounds
        self.trials *= KEEP**rounds

    def add(self, accepted: int, depth: int) -> None:
        """One row's round at ``depth`` that accepted ``accepted`` drafts: hits up to it, the next one missed."""
        self.hits[:accepted] += 1
        self.trials[: min(accepted + 1, depth)] += 1

    def add_first(self, hits: float, rounds: float) -> None:
        """Rounds without drafts: the summed chance that the first draft would have been accepted, over ``rounds``."""
        self.hits[0] += hits
        self.trials[0] += rounds

    def observe(self, accepted: Sequence[int], depth: int) -> None:
        """One row's rounds at ``depth``: drafts accepted per round (negative: the row did not run)."""
        for a in accepted:
            if a >= 0:
                self.age(1)
                self.add(a, depth)


class CostTable:
    """Seconds per round by (rows, depth, span bucket): measured where the depth ran, else interpolated."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, int, int], float] = {}
        self.rounds: dict[tuple[int, int, int], float] = {}

    def observe(self, rows: int, depth: int, span: int, seconds: float, rounds: int) -> None:
        if rounds <= 0 or seconds <= 0:
            return
        key = (rows, depth, span_bucket(span))
        per_round = seconds / rounds
        seen = self.rounds.get(key, 0.0)
        weight = rounds / min(seen + rounds, COST_ROUNDS)  # the mean of the first rounds, then a running one
        self.seconds[key] = (
            per_round if not seen else self.seconds[key] + min(weight, 1.0) * (per_round - self.seconds[key])
        )
        self.rounds[key] = seen + rounds

    def measured(self, rows: int, depth: int, span: int) -> float | None:
        """The cost at the nearest measured span bucket, None where the depth never ran at these rows."""
        spans = [s for (r, d, s) in self.seconds if (r, d) == (rows, depth)]
        if not spans:
            return None
        b = span_bucket(span)
        return self.seconds[rows, depth, min(spans, key=lambda s: (abs(math.log2(s / b)), s))]

    def cost(self, rows: int, depth: int, span: int) -> float | None:
        """Measured, else linear in K between the nearest measured depths around ``depth`` (None: not bracketed)."""
        own = self.measured(rows, depth, span)
        if own is not None:
            return own
        known = {d: c for d in (PLAIN, *DEPTHS) if (c := self.measured(rows, d, span)) is not None}
        below = [d for d in known if d < depth]
        above = [d for d in known if d > depth]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        return known[lo] + (known[hi] - known[lo]) * (depth - lo) / (hi - lo)

    def profile_next(self, rows: int, span: int) -> int | None:
        """The depth a warm-up profile runs next at these rows (the ends, ``PLAIN`` and the deepest), or None."""
        return next((d for d in (PLAIN, DEEPEST) if self.measured(rows, d, span) is None), None)


class Chooser:
    """Costs per sampling mode and one pooled acceptance per sampling mode: what a pair's traffic has shown."""

    def __init__(self, depths: Sequence[int] = DEPTHS):
        self.depths = tuple(depths)
        self.costs = {True: CostTable(), False: CostTable()}  # by greedy
        self.pooled = {True: Acceptance(), False: Acceptance()}

    @property
    def specs(self) -> tuple[SpecConfig | None, ...]:
        """What a server that runs this chooser compiles: no drafts and a chain of each depth."""
        return (None, *(spec_of(d) for d in self.depths))

    def describe(self) -> str:
        return (
            f"auto (no drafts or a chain of {'/'.join(map(str, self.depths))}, from measured costs and live acceptance)"
        )

    def new_row(self, greedy: bool) -> Acceptance:
        """A new prompt's (request's) estimate: its own counts over the pooled estimate."""
        return Acceptance(prior=self.pooled[greedy])

    def expected_rates(
        self, rows: int, greedy: bool, estimates: Sequence[Acceptance], span_of: Callable[[int], int]
    ) -> dict[int, float]:
        """Expected tokens per second at each depth whose cost is known (``PLAIN`` always among them once profiled)."""
        table, rates = self.costs[greedy], {}
        for d in (PLAIN, *self.depths):
            seconds = table.cost(rows, d, span_of(d))
            if seconds:
                rates[d] = sum(len(estimates) if d == PLAIN else e.expected_tokens(d) for e in estimates) / seconds
        return rates

    def choose(self, rows: int, greedy: bool, estimates: Sequence[Acceptance], span_of: Callable[[int], int]) -> int:
        """The next rounds' depth for the active rows' estimates, over ``rows`` computed rows; ``span_of(depth)``: the
        cache span those rounds would read. A depth the warm-up profile still needs runs first."""
        todo = self.costs[greedy].profile_next(rows, span_of(PLAIN))
        if todo is not None and (todo == PLAIN or todo in self.depths):
            return todo
        rates = self.expected_rates(rows, greedy, estimates, span_of)
        return max(rates, key=rates.get) if rates else PLAIN

    def observe(
        self,
        depth: int,
        rows: int,
        span: int,
        greedy: bool,
        seconds: float | None,
        rounds: int,
        estimates: Sequence[Acceptance],
        accepted: Sequence[Sequence[int]],
        first_hits: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        """After ``rounds`` rounds at ``depth`` over ``rows`` rows: their time (None: not a cost to learn from, e.g.
        a program's first run), and per active row its estimate, drafts accepted per round and (for ``PLAIN``)
        (summed first-draft acceptance, rounds scored)."""
        if seconds is not None:
            self.costs[greedy].observe(rows, depth, span, seconds, rounds)
        pooled = self.pooled[greedy]
        if (
            depth == PLAIN
        ):  # every round ages the evidence; those that scored the first draft (all, or a step's first) add to it
            for est, (hits, scored) in zip(estimates, first_hits or [(0.0, 0.0)] * len(estimates)):
                est.age(rounds)
                est.add_first(hits, scored)
            pooled.age(rounds)
            pooled.add_first(sum(h for h, _ in first_hits or []), sum(n for _, n in first_hits or []))
            return
        for est, acc in zip(estimates, accepted):
            est.observe(acc, depth)
        for r in range(max((len(a) for a in accepted), default=0)):  # the pool ages once per round of the batch
            pooled.age(1)
            for acc in accepted:
                if r < len(acc) and acc[r] >= 0:
                    pooled.add(acc[r], depth)

    def snapshot(self) -> dict:
        """What the chooser goes on, for reports: ms per round by mode and (rows, depth, span), pooled acceptance."""
        return {
            "costs": {
                ("greedy" if g else "sampling"): {
                    f"{r}x{d}@{s}": round(1e3 * c, 3) for (r, d, s), c in sorted(t.seconds.items())
                }
                for g, t in self.costs.items()
            },
            "acceptance": {
                ("greedy" if g else "sampling"): [round(float(x), 3) for x in a.p()] for g, a in self.pooled.items()
            },
        }


def spec_of(depth: int) -> SpecConfig | None:
    return None if depth == PLAIN else SpecConfig(num_speculative_tokens=depth)


def depth_of(spec: SpecConfig | None) -> int:
    return PLAIN if spec is None else spec.num_speculative_tokens


_BY_PAIR: dict[tuple, Chooser] = {}


def for_pair(key: tuple) -> Chooser:
    """``generate``'s chooser for one (programs, target, drafter, exact, mesh, backend): what its calls have
    measured."""
    return _BY_PAIR.setdefault(key, Chooser())


def reset() -> None:
    """Forgets every pair's costs and acceptance (benchmarks and tests start cold)."""
    _BY_PAIR.clear()
