"""A cost table for ``spec="auto"``'s tests: round costs fixed by depth, so a choice does not depend on the clock."""

from __future__ import annotations

from eagle_jax.decoding import autospec


class FixedCosts(autospec.SpanCosts):
    """Costs that do not learn from the clock: per-round seconds by depth (0 = plain), at any rows and span."""

    def __init__(self, seconds):
        super().__init__()
        self.fixed = dict(seconds)

    def model(self, span):
        return autospec.CostModel()  # measurements go nowhere

    def measured(self, depth, rows):
        return depth in self.fixed

    def settled(self, depth, rows):
        return depth in self.fixed

    def stale(self, depth, rows):
        return False  # fixed: never measured again

    def probed(self, rows):
        return True

    def cost(self, depth, rows, span):
        return self.fixed.get(depth)


def measured_now(costs: autospec.SpanCosts, rows: int) -> None:
    """Reads ``costs`` at ``rows`` rows as measured by this process just now: none stale (``SpanCosts.stale``), as
    costs put into its models directly would otherwise be (an earlier process's)."""
    for depth in (autospec.PLAIN, *autospec.DEPTHS):
        costs.since[rows, depth] = 0
