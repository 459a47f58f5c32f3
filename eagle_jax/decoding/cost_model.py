"""What a round of ``spec="auto"`` costs: ``CostModel``, seconds per round by rows and depth at one cache span,
measured and modelled, and ``span_levels``, the fit that reads costs measured at different spans as one table
(``autospec.SpanCosts``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator

import numpy as np

PLAIN = 0  # the depth of plain decoding (no drafts)
# A depth's cost per round is the median of its last COST_WINDOW measurements, weighted by their rounds
# (see CostModel): the lower one of two (optimism corrects itself), a spike's never.
COST_WINDOW = 8
# A cost measured over fewer rounds than this at a span is read through ``span_levels``' table of every span,
# which weighs it by its rounds against the same depth's other measurements (``SpanCosts.cost``): read as
# measured, one short chunk slowed by a busy moment (4 rounds at 1.3x) could price the depth above a deeper one
# at that span, where it then would not run to correct it.
SETTLED_ROUNDS = 8  # two exploring chunks, or one chunk of the chosen depth
MIN_ROUNDS_SHARE = 0.2  # a measurement's rounds are at least this share of its time, whatever overhead is fitted
# A probe round (one target position, one drafter step) does no more work than a chain round, so its cost is
# read as at most the cheapest chain's at the same rows. A generate call's probe measured on one chunk that
# costs more than this factor times a chain's is measured again, once per row count and span (``SpanCosts.observe_chunk``):
# one slow probe chunk (60 ms a round against a chain of 7's 34 ms, SmolLM2 at T=1, batch 1), as the base of the
# line in K, priced deeper chains below shallower ones and plain decoding above them all, and a chain of 7 ran
# every later call at 0.7x plain decoding's speed (the probe never ran again to correct it).
PROBE_CONTRADICTED = 1.25
# A round of K drafts is one target forward over 1 + K positions and K drafter steps: its cost is about linear in K
# (bfloat16 batch 1 on a CPU: chains of 1, 3, 5 and 7 at 4.6, 6.0, 7.0 and 8.4 ms, each within 1.07x of the line
# through its neighbours). A chain measured at more than this factor times that line (``contradicted_chains``) is
# measured again, once per process (``SpanCosts.forget_contradicted_chain``): a few short chunks in a busy moment,
# or an earlier process's, priced a chain of 7 at 9.95 ms (8.4 measured per round; 1.24x the line through chains
# of 3 and 5 as measured per round), so it was never within reach of a choice, never ran to correct it, and a chain
# of 5 ran every call of a sequence on which the chain of 7 was 1.14x faster (bfloat16, batch 1, greedy).
CHAIN_CONTRADICTED = 1.15


def weighted_median(values: Iterable[tuple[float, float]]) -> float:
    """The lower weighted median of (value, weight) pairs: the least value with at least half the weight at
    or below it."""
    ordered = sorted(values)
    half, run = sum(w for _, w in ordered) / 2, 0.0
    for v, w in ordered:
        run += w
        if run >= half:
            return v
    return ordered[-1][0]


def contradicted_chains(points: dict[int, float]) -> dict[int, float]:
    """Chains whose cost is above ``CHAIN_CONTRADICTED`` times the line through the others: ``points`` are seconds
    per round by depth (0: the probe round). The line runs between the nearest others around the chain, else through
    the two nearest other chains: not from the probe round, which is no chain (a line through it and a chain of 1,
    extrapolated, priced a chain of 7 at 0.8x its cost). Returns depth -> its cost over the line's."""
    out = {}
    for depth, seconds in points.items():
        if depth == 0:
            continue
        others = {d: s for d, s in points.items() if d != depth}
        chains = {d: s for d, s in others.items() if d > 0}
        if others and min(others) < depth < max(others):
            line = _along(others, depth)
        elif len(chains) >= 2:
            line = _along(chains, depth, extrapolate=True)
        else:
            continue
        if seconds > CHAIN_CONTRADICTED * line:
            out[depth] = seconds / line
    return out


def kept_measurement(seconds, rounds, first) -> tuple[float, int, bool]:
    """A kept measurement (seconds, rounds, first chunk after a prefill) as read back; ValueError where it is none
    that could have been taken (no rounds, no time, not a number)."""
    seconds, rounds = float(seconds), int(rounds)
    if not (rounds >= 1 and 0.0 < seconds < float("inf")):
        raise ValueError(f"a measurement of {rounds} rounds in {seconds} s")
    return seconds, rounds, bool(first)


def _along(points: dict[int, float], x: int, extrapolate: bool = False) -> float | None:
    """``points`` (x -> seconds) read at ``x``: exact, linear between the nearest points around it, else
    the nearest point's value, or (``extrapolate``) the line through the two nearest."""
    if not points:
        return None
    if x in points:
        return points[x]
    xs = sorted(points)
    lo = max((p for p in xs if p < x), default=None)
    hi = min((p for p in xs if p > x), default=None)
    if lo is not None and hi is not None:
        return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    near = [p for p in xs if p < x][-2:] if hi is None else [p for p in xs if p > x][:2]
    if not extrapolate or len(near) < 2:
        return points[lo if hi is None else hi]
    a, b = near
    return max(points[a] + (points[b] - points[a]) * (x - a) / (b - a), 1e-9)


@dataclass
class CostModel:
    """Seconds per round by (rows, depth): ``PLAIN`` = 0 is plain decoding, ``probe`` a round without
    drafts that feeds the drafter (its cost stands in for plain decoding's until plain decoding has
    run). One model serves every batch size of a pair (``rows``: a ``generate`` call's batch, the
    rows a server step computes), so that a new batch size or depth need not be explored:

    - measured: the median of the last ``COST_WINDOW`` measurements, weighted by their rounds, the
      lower one of two (a measurement is its rounds plus whatever else the machine did meanwhile: one
      slow chunk cannot make a depth look dear, as it might never run again to correct it, while a
      machine that really slowed down raises its costs within a few chunks). Not the lowest seen: at
      T=1 a chain of 1 and one of 3 are within a few percent, and the lowest of a rarely run depth's
      few chunks priced it ~9% below what it ran at, against a cost of the running depth read from
      many; it won the race and ran, call after call;
    - the probe round: at most the cheapest chain measured at these rows (``PROBE_CONTRADICTED``);
    - a depth not measured at these rows: a round is one target forward over 1 + K positions and K
      drafter steps, so its cost is linear in K: between the depths measured at these rows, from the
      probe round (K = 0) on, and extrapolated past the deepest;
    - no depth measured at these rows: the probe's cost here (or at the nearest row counts) plus K
      times the per-draft slope of the nearest row counts (linear between them, else the nearest:
      rows above every measured count then look cheap, so the depth chosen there runs and is
      measured; optimism corrects itself, pessimism would not).

    Only one depth needs exploring per pair (the deepest: it measures the drafter's step cost)."""

    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    probe: dict[int, float] = field(default_factory=dict)  # as read: at most the cheapest chain's at the rows
    probe_measured: dict[int, float] = field(default_factory=dict)  # as measured
    reprobed: set[int] = field(default_factory=set)  # rows whose contradicted probe was measured again
    rounds: dict[tuple[int, int], int] = field(default_factory=dict)  # rounds measured per (rows, depth)
    # the last COST_WINDOW measurements (seconds, rounds, first chunk after a prefill) per (rows, depth), depth None = probe
    window: dict[tuple[int, int | None], deque] = field(default_factory=dict)
    # seconds of a measurement that are not its rounds, by (rows, depth, first): a generate chunk's fixed part
    # (``ChunkOverhead.seconds``, re-read by ``reprice`` as it is fitted); none for a server step
    overhead: Callable[[int, int | None, bool], float] | None = None
    changes: int = 0  # counts every change of a cost read from it (``SpanCosts`` refits its table after ``REFIT_CHANGES``)
    thin_updates: int = 0  # measurements added to a cost of fewer than SETTLED_ROUNDS rounds (read from the table: refit at once)

    def update(self, depth: int | None, rows: int, seconds: float, rounds: int, first: bool = False) -> None:
        """``rounds`` rounds of ``rows`` rows at ``depth`` (None: probe rounds) took ``seconds``; ``first``: in the
        first chunk after a prefill."""
        if rounds < 1 or seconds <= 0:
            return
        if self.window_rounds(rows, depth) < SETTLED_ROUNDS:
            self.thin_updates += 1
        self.window.setdefault((rows, depth), deque(maxlen=COST_WINDOW)).append((seconds, rounds, first))
        self._price(rows, depth)
        if depth is not None:
            self.rounds[rows, depth] = self.rounds.get((rows, depth), 0) + rounds

    def reprice(self) -> None:
        """Every cost derived anew from its measurements, with the overhead as it is now known."""
        for rows, depth in self.window:
            self._price(rows, depth)

    def _price(self, rows: int, depth: int | None) -> None:
        self.changes += 1
        fixed = self.overhead or (lambda _rows, _depth, _first: 0.0)
        per = [(max(s - fixed(rows, depth, first), MIN_ROUNDS_SHARE * s) / n, n) for s, n, first in self.window[rows, depth]]
        if depth is None:
            self.probe_measured[rows] = weighted_median(per)
        else:
            self.seconds[rows, depth] = weighted_median(per)
        self._read_probe(rows)

    def _read_probe(self, rows: int) -> None:
        if rows in self.probe_measured:  # ``PROBE_CONTRADICTED``
            self.probe[rows] = min([self.probe_measured[rows], *self._chains(rows).values()])

    def _chains(self, rows: int) -> dict[int, float]:
        """The chains measured at ``rows``: depth -> seconds per round."""
        return {d: s for (r, d), s in self.seconds.items() if r == rows and d != PLAIN}

    def forget_contradicted_probe(self, rows: int) -> bool:
        """Forgets the probe's cost at ``rows`` where it rests on one measurement that costs more than
        ``PROBE_CONTRADICTED`` times a chain measured there, once per row count (the next chunk probes again);
        returns whether it did."""
        chains = self._chains(rows)
        window = self.window.get((rows, None), ())
        if rows in self.reprobed or len(window) != 1 or not chains or self.probe_measured[rows] <= PROBE_CONTRADICTED * min(chains.values()):
            return False
        self.reprobed.add(rows)
        self.changes += 1
        del self.window[rows, None], self.probe_measured[rows], self.probe[rows]
        return True

    def forget(self, rows: int, depth: int) -> None:
        """Forgets every measurement of ``depth`` at ``rows`` (measured anew from here on)."""
        if self.window.pop((rows, depth), None) is None:
            return
        self.changes += 1
        self.seconds.pop((rows, depth), None)
        self.rounds.pop((rows, depth), None)
        self._read_probe(rows)

    def to_dict(self) -> dict:
        """What was measured here (the windows, the rounds, the probes measured again), for ``restore``."""
        return {"window": [[rows, depth, [list(m) for m in w]] for (rows, depth), w in self.window.items()],
                "rounds": [[rows, depth, n] for (rows, depth), n in self.rounds.items()], "reprobed": sorted(self.reprobed)}

    def restore(self, data: dict) -> None:
        """Takes ``to_dict``'s measurements as its own (a model that has measured nothing), every cost derived from them."""
        for rows, depth, window in data["window"]:
            self.window[int(rows), None if depth is None else int(depth)] = deque(
                (kept_measurement(s, n, first) for s, n, first in window), maxlen=COST_WINDOW)
        self.rounds.update({(int(rows), int(depth)): int(n) for rows, depth, n in data["rounds"]})
        self.reprobed.update(int(r) for r in data["reprobed"])
        self.reprice()

    def cells(self) -> Iterator[tuple[tuple[int, int | None], float, float]]:
        """What was measured here, for ``span_levels``: ((rows, depth), seconds per round, rounds in its window);
        depth None: the probe round, as measured."""
        for (rows, depth), window in self.window.items():
            seconds = self.probe_measured.get(rows) if depth is None else self.seconds.get((rows, depth))
            if seconds is not None:
                yield (rows, depth), seconds, float(self.window_rounds(rows, depth))

    def window_rounds(self, rows: int, depth: int | None) -> int:
        """Rounds of the measurements that ``(rows, depth)``'s cost is read from (depth None: the probe round)."""
        return sum(n for _, n, _ in self.window.get((rows, depth), ()))

    def measured(self, depth: int, rows: int) -> bool:
        return (rows, depth) in self.seconds

    def probed(self, rows: int) -> bool:
        """Whether a probe round's cost at ``rows`` is measured (the base of the depths modelled there)."""
        return rows in self.probe

    def _base(self, rows: int) -> float | None:
        """A round of no drafts that feeds the drafter, at ``rows`` (or the nearest row counts)."""
        return _along(self.probe, rows)

    def _slope(self, rows: int) -> float | None:
        """Seconds per draft over the probe round, from the deepest chain measured at ``rows``."""
        base = self._base(rows)
        measured = self._chains(rows)
        if base is None or not measured:
            return None
        d = max(measured)
        return max((measured[d] - base) / d, 0.0)

    def at_rows(self, depth: int, rows: int) -> float | None:
        """Seconds per round at ``depth`` from what ran at exactly ``rows`` rows: measured, or linear in K
        between the chains measured there (past the deepest, the line through the nearest two, never below a
        plain round's cost), or below the shallowest, between the probe round and it; None where these
        rows do not tell. The probe round is the line's base only while one chain ran: it is no chain
        (it feeds and probes the drafter in full), so two chains' costs draw the line better."""
        if (rows, depth) in self.seconds:
            return self.seconds[rows, depth]
        base = self.probe.get(rows)
        if depth == PLAIN or base is None:
            return base
        here = self._chains(rows)
        if len(here) >= 2 and depth > min(here):
            return max(_along(here, depth, extrapolate=True), self.seconds.get((rows, PLAIN), 0.0))
        # Below the shallowest chain measured: from the probe round on. The line through two deeper chains
        # overprices a shallow one where verification's cost is concave in K (a CPU: K=1 read off chains of 3
        # and 5 at ~1.25x its cost), and a depth priced too dear never runs to correct it.
        return _along({0: base, **here}, depth, extrapolate=True) if here else None

    def cost(self, depth: int, rows: int) -> float | None:
        """Seconds per round at ``depth`` over ``rows`` rows, measured or modelled; None: nothing to go on."""
        here = self.at_rows(depth, rows)
        if here is not None:
            return here
        base = self._base(rows)
        if depth == PLAIN or base is None:
            return base
        slopes = {r: s for r in {r for r, d in self.seconds if d != PLAIN} if (s := self._slope(r)) is not None}
        return None if not slopes else base + _along(slopes, rows) * depth


FIT_SWEEPS = 256  # alternating sweeps of ``span_levels`` at most (a few where it starts from the last fit)
FIT_TOLERANCE = 1e-8  # ... stopped once no span's level moves by more than this (log seconds)


def span_levels(cells: Iterable[tuple[Hashable, int, float, float]], start: dict[int, float] | None = None
                ) -> tuple[dict[Hashable, float], dict[int, float]]:
    """Costs measured at several cache spans, read as ``cost(key, span) = a[key] x b[span]``: ``cells`` are (key, span,
    seconds, weight), a key what was measured (rows and depth, or the probe round at some rows). Returns (log a, log b),
    fitted to the logs by weighted least squares, by alternating means from ``start`` (log b of a previous fit).

    Why one table: a round's cost moves with the span its attention reads, and on a busy machine more between
    calls than between spans (a chain of 3 at batch 1: 7.8, 10.1, 10.1 and 8.6 ms a round at spans of 153, 169,
    201 and 489 slots, each span one call's), while one depth's cost over another's holds (a chain of 5 over one
    of 3: 1.14 and 1.18 at spans 153 and 489). Read each at the nearest span where it ran instead, a chain of 5
    measured on a quick call (8.8 ms) was compared with a chain of 3 measured on a slow one (10.1 ms), though a
    chain of 3 had cost 7.8 ms beside it; the chain of 5 ran that call at 0.86x a chain of 3's speed. Keys and spans
    that share no measurement (directly or through others) are not scaled against each other (b stays at its start)."""
    cells = list(cells)
    if not cells:
        return {}, {}
    keys = sorted({c[0] for c in cells}, key=repr)
    spans = sorted({c[1] for c in cells})
    k_of, s_of = {k: i for i, k in enumerate(keys)}, {s: i for i, s in enumerate(spans)}
    ki = np.array([k_of[c[0]] for c in cells])
    si = np.array([s_of[c[1]] for c in cells])
    y = np.log([c[2] for c in cells])
    w = np.array([c[3] for c in cells], float)
    wk, ws = np.bincount(ki, w, len(keys)), np.bincount(si, w, len(spans))
    b = np.array([(start or {}).get(s, 0.0) for s in spans])
    for _ in range(FIT_SWEEPS):
        a = np.bincount(ki, w * (y - b[si]), len(keys)) / wk
        moved, b = b, np.bincount(si, w * (y - a[ki]), len(spans)) / ws
        if np.max(np.abs(b - moved)) < FIT_TOLERANCE:
            break
    a = np.bincount(ki, w * (y - b[si]), len(keys)) / wk
    return dict(zip(keys, a.tolist())), dict(zip(spans, b.tolist()))
