"""The server's default speculation (``--spec auto``): per step, the depth with the most expected
tokens per second, from the round costs at this number of computed rows (``CostModel``: measured, or
modelled from the other depths and row counts) and the live acceptance of the requests in the slots
(``decoding/autospec.py``, which ``generate``'s default uses too).

Every request keeps its own acceptance estimate, started from the server's (all traffic so far, weighing
a few rounds: ``AcceptanceEstimate.for_new_prompt``) and updated from its own rounds; a step's expected
tokens at depth K are the sum over its requests of ``expected_tokens(K)``. Steps without drafts keep feeding the drafter and observe its first draft
(engine ``probe_acceptance``; lazily fed, in their first round only, and their other rounds fade the
requests' evidence toward the prior), so a batch of requests the drafter cannot follow decodes plainly and
speculation returns as soon as the requests change. Nothing is explored per row count but one step
without drafts; the deepest chain runs once, every depth chosen is measured as it runs, and
a depth modelled or measured over few rounds at these rows, but expected close to the best, runs (``autospec.EXPLORE_CLOSE``).
The costs are kept on disk (``decoding/cost_cache.py``, under the engine's ``cost_key``), so a restarted server
measures none of them again; the server's acceptance is kept with them, where a restarted server's starts (its
evidence then decays as the new traffic comes).

A step's cost also grows with the cache span its attention reads (``SlotEngine.spans``), which rises as
the requests grow: costs are kept per span (``SpanCosts``), so that depths are compared at the span
they would run at, not one depth's cost at a short span against another's at a long one.
"""

from __future__ import annotations

from typing import Callable, Sequence

from eagle_jax.config import SpecConfig
from eagle_jax.decoding import autospec
from eagle_jax.decoding.acceptance_estimate import AcceptanceEstimate
from eagle_jax.decoding.autospec import SpanCosts


class AutoDepth:
    def __init__(self, depths: Sequence[int] = autospec.DEPTHS):
        self.depths = tuple(depths)
        self.models: dict[bool, SpanCosts] = {}  # by greedy: one per sampling mode, over every span and row count
        self.estimate = AcceptanceEstimate(max(self.depths))  # all traffic: where a new request's estimate starts
        self._kept_as: Callable[[bool], str] | None = None  # the costs' file on disk by greedy (``keep_costs``)

    def keep_costs(self, name_of: Callable[[bool], str]) -> None:
        """Keeps the step costs on disk (``cost_cache``) under ``name_of(greedy)`` (the engine's ``cost_key``), and the
        server's acceptance with them: a restarted server starts from what this one measured, and measures none of it
        again."""
        self._kept_as = name_of

    def costs(self, greedy: bool) -> SpanCosts:
        """The step costs of one sampling mode: those kept on disk (``keep_costs``), else none yet."""
        if greedy not in self.models:
            costs = self.models[greedy] = SpanCosts()
            if self._kept_as is not None:
                costs.keep(lambda: self._kept_as(greedy), self.estimate)
        return self.models[greedy]

    @property
    def specs(self) -> tuple[SpecConfig | None, ...]:
        return (None, *(self.spec_of(d) for d in self.depths))

    @staticmethod
    def spec_of(depth: int) -> SpecConfig | None:
        return None if depth == autospec.PLAIN else SpecConfig(num_speculative_tokens=depth)

    @staticmethod
    def depth_of(spec: SpecConfig | None) -> int:
        return autospec.PLAIN if spec is None else spec.num_speculative_tokens

    def describe(self) -> str:
        return f"auto (per step: no drafts or a chain of {'/'.join(map(str, self.depths))}, from measured costs and live acceptance)"

    def new_estimate(self) -> AcceptanceEstimate:
        return self.estimate.for_new_prompt()

    def finish_request(self, estimate: AcceptanceEstimate) -> None:
        """A request ended: its own acceptance joins the spread that sets how much a new one carries (kept on disk
        with the costs)."""
        self.estimate.finish_prompt(estimate)
        for costs in self.models.values():
            costs.kept()

    def choose(self, estimates: Sequence[AcceptanceEstimate], rows: int, greedy: bool,
               span_of: Callable[[int], int]) -> SpecConfig | None:
        """The next step's spec for requests with these estimates, computed over ``rows`` rows; ``span_of(depth)``:
        the cache span a step of that depth would read. At a row count not seen yet a step without drafts
        runs first (the base of the modelled costs); the deepest chain runs once (the drafter step's cost; kept
        on disk with the rest: ``keep_costs``); every other cost is modelled."""
        costs = self.costs(greedy)
        if not costs.probed(rows):
            return None
        view = costs.at(span_of)
        todo = autospec.unexplored(view, rows, self.depths)
        if todo:
            return self.spec_of(todo[0])
        expected = lambda d: sum(e.expected_tokens(d) for e in estimates)  # noqa: E731
        times = autospec.token_seconds(view, rows, expected, self.depths)
        best = min(times, key=times.get, default=autospec.PLAIN)
        # A close depth whose cost at these rows is modelled or measured over few rounds runs (``EXPLORE_CLOSE``).
        return self.spec_of(autospec.close_unsettled(times, lambda d: costs.settled(d, rows)) or best)

    def snapshot(self) -> dict:
        """What the chooser goes on, for reports: ms per round by sampling mode, span, rows and depth
        (measured; "probe": steps without drafts) and the server-wide acceptance per draft position."""
        models = {("greedy" if g else "sampling"): {span: {
            "probe_ms": {r: round(1e3 * s, 3) for r, s in sorted(m.probe.items())},
            "depth_ms": {f"{r}x{d}": round(1e3 * s, 3) for (r, d), s in sorted(m.seconds.items())}}
            for span, m in sorted(c.by_span.items())} for g, c in self.models.items()}
        return {"costs": models, "acceptance": [round(float(x), 3) for x in self.estimate.p]}

    def observe(self, spec: SpecConfig | None, rows: int, span: int, greedy: bool, seconds: float | None,
                per_request: Sequence[tuple[AcceptanceEstimate, list[int], tuple[float, float] | None]]) -> None:
        """After a step over ``rows`` rows and ``span`` cache slots: its cost (None: not a round cost to
        learn from, e.g. a one-round step while prompts are prefilled, whose time is mostly the step's
        fixed costs), and per request (its estimate, drafts accepted per round, (summed first-draft
        acceptance, rounds) of a step without drafts)."""
        depth = self.depth_of(spec)
        ran = max((len(acc) for _, acc, _ in per_request), default=0)
        # The server's steps without drafts feed the drafter: they are the cost model's probe rounds.
        if seconds is not None:
            costs = self.costs(greedy)
            costs.model(span).update(None if depth == autospec.PLAIN else depth, rows, seconds, ran)
            costs.forget_contradicted_chain(rows)
            costs.kept()  # written now and then (``cost_cache.SAVE_EVERY_S``) and at exit
        if depth == autospec.PLAIN:
            total = [p for _, _, p in per_request if p is not None and p[1] > 0]
            for est, acc, p in per_request:
                probed = p[1] if p is not None and p[1] > 0 else 0.0
                if probed:
                    est.observe_probe(p[0] / p[1], p[1])
                # Lazily fed, a step probes its first round only: the rest fade the request's evidence toward the
                # prior, as ``generate``'s plain rounds do, or a request whose estimate dipped stays without drafts
                # for many steps at one observation each.
                est.age(max(len(acc) - round(probed), 0))
            if total:  # weighed by the rounds probed (under lazy feeding one per step), not the step's rounds
                self.estimate.observe_probe(sum(p[0] for p in total) / sum(p[1] for p in total), max(p[1] for p in total))
            return
        for est, acc, _ in per_request:
            est.observe([[a] for a in acc], depth)
        self.estimate.observe([[acc[r] for _, acc, _ in per_request if r < len(acc)] for r in range(ran)], depth)
