"""Speculation chosen by measurement: ``spec="auto"`` (the default of ``generate`` with a drafter, and
of the server), and the cost calibration of adaptive chains (``SpecConfig(adaptive=True)``).

**auto.** Whether speculation pays, and how deep, depends on the machine and the batch (what a round
of each depth costs) and on the traffic (how many drafts the target accepts). The two are learnt
apart, because they change at different speeds:

- ``SpanCosts``: seconds per round of each depth (0 = plain decoding, K = a chain of K drafts) at
  each number of rows and cache span (a round's attention reads the whole span: a ``generate``
  call's cache, the slots a server step covers), per model pair, sampling mode and device; measured
  from the rounds that ran, and modelled where they did not (``decoding/cost_model.py``: ``CostModel``,
  one per span, linear in K at these rows, else the same depth at the nearest row counts; a span
  without a depth's cost reads it through one table of every span's, ``span_levels``), so a new
  batch size, span or depth costs no exploration beyond one probe: only the deepest chain runs once (``EXPLORE_ROUNDS`` rounds of real work)
  before any choice, to measure what a drafter step costs, and a depth modelled or measured over few
  rounds, or long ago (``STALE_ROUNDS``), runs a few more where it is expected close to the best (``EXPLORE_CLOSE``),
  and as the choice, a few before the rest (``AutoRun._spend``); a chain measured
  far above the line through the others is forgotten, once a process, and so modelled and measured again
  (``CHAIN_CONTRADICTED``). A ``generate`` chunk's time apart from its
  rounds (dispatch, host sync, each execution's one-time work, more after a prefill) is fitted per batch size
  over its latest chunks (``decoding/chunk_overhead.py``) and left out of its rounds' costs, so short chunks
  and long ones compare. Kept on disk (``decoding/cost_cache.py``), so what a process measured, a later one
  on the same machine starts from.
- ``AcceptanceEstimate`` (``decoding/acceptance_estimate.py``): the chance that draft i is accepted once drafts 0..i-1 were, from the
  accepted counts of every round that ran (decaying with ``KEEP`` per round, so it follows a change
  of workload), blended with a prior. Rounds that make no drafts still observe the first draft
  (engine ``probe_acceptance``), so the estimate recovers while decoding plainly.

Each chunk of rounds (a ``generate`` call's; the server decides per step) runs the depth with the most
expected tokens per second, ``expected_tokens(K) / cost(K)`` (``choose_depth``), the running depth kept
where it is within ``WATCH_TOLERANCE`` of it (``keep_close``). A ``generate`` chunk at a depth chosen
anew runs ``CHUNK_ROUNDS`` (a look; none where prompts are alike); chosen again, it takes the rounds its
call is expected to need (up to ``MAX_CHUNK_ROUNDS``) and ends early in the compiled loop once its rows
accept drafts outside the band where its depth pays, or one row falls below it (``watch``, engine ``departed``). One bad prompt therefore
costs a few rounds, not the process: the choice is made again wherever what the current prompts do
says it may change. A chain observes only its own drafts, so where prompts differ a deeper chain that would win
were its deeper drafts accepted as the chain's deepest runs a few rounds first, once a call (``deeper_unseen``): the
deeper drafts' estimate is otherwise some earlier prompt's. Plain decoding proper (the drafter not fed, so no way back within the call) runs
only after a fresh look at the call's first drafts (``PROBE_ROUNDS`` rounds, or ``PLAIN_OWN_ROUNDS`` where prompts
differ: probe rounds, or a chain of 1 where its rounds cost about a probe's, ``AutoRun._look``) has
confirmed that speculation does not pay, and the chain that would pay were its drafts past the first accepted
as often as the first (the probe sees the first only) has run a few rounds, if there is one; or, to be measured where it may win, on a call's last few
rounds, where the call no longer needs the drafter (again once its measurement is ``STALE_ROUNDS`` old: the
depths that run follow the machine's speed, and the costs of those that do not must too); each call starts with the drafter
fed, so a later call speculates again as soon as its own prompts allow.

The opt-in adaptive chains calibrate their costs apart (``decoding/adaptive_costs.py``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Collection, Iterable, Sequence

import numpy as np
from scipy.special import ndtr

from eagle_jax.decoding import adaptive_costs, cost_cache
from eagle_jax.decoding.acceptance_estimate import (  # noqa: F401  (read as autospec.X by auto_run and the tests)
    CARRY_DEEP_ROUNDS,
    CARRY_ROUNDS,
    DEEPEST,
    PRIOR,
    PRIOR_ROUNDS,
    PROMPT_MIN_ROUNDS,
    PROMPTS_TO_CARRY,
    AcceptanceEstimate,
    prompts_alike,
)
from eagle_jax.decoding.chunk_overhead import ChunkOverhead
from eagle_jax.decoding.cost_model import (  # noqa: F401  (read as autospec.X by auto_run, the server and the tests)
    CHAIN_CONTRADICTED,
    COST_WINDOW,
    PLAIN,
    PROBE_CONTRADICTED,
    SETTLED_ROUNDS,
    CostModel,
    contradicted_chains,
    span_levels,
)


DEPTHS = (1, 3, 5, DEEPEST)  # chains auto chooses among, besides plain decoding (0)
CHUNK_ROUNDS = 8  # a generate chunk at a depth chosen anew (one host sync each) ...
MAX_CHUNK_ROUNDS = 64  # ... and the longest at a depth chosen again (ending sooner where its rows depart: ``watch``)
# A chunk's rows depart from its estimate where another depth would finish the call sooner by more than this
# share (``watch``): a closer race is not worth a new chunk's host round trip, nor its risk of a noisy switch.
WATCH_TOLERANCE = 0.02
EXPLORE_ROUNDS = 4  # rounds that measure a depth whose cost is not known yet
# Rounds that observe a call's first drafts before plain decoding: without drafts, the drafter fed (a probe), or a
# chain of 1 where it leaves the call sooner done (``AutoRun._look``)
PROBE_ROUNDS = 4
# ... and that start a call whose best depth, on the acceptance known before it, is not clearly ahead of
# plain decoding (expected to finish in more than this share of plain's time): the call's own rows then
# decide (in a batch the slowest row sets the end, and the pair's pooled estimate hides it), for the price
# of a drafter step on a few rounds instead of a chunk of drafts the batch cannot use.
PROBE_FIRST_BELOW = 0.8
# Plain decoding, which ends a call's speculation, is chosen after PROBE_ROUNDS of the call's own rounds where
# prompts are alike (they carry the pair's evidence) or no chain could beat it even with every draft accepted;
# else after this many: after a hard prompt, a new prompt's first 4 rounds left a call decoding plainly that a
# chain of 5 ran 1.7x faster (bfloat16, batch 1, greedy). A probe round emits a token, as a plain one does.
PLAIN_OWN_ROUNDS = 8
# A call skips the drafter altogether (its prefill and the probe) and decodes plainly from its start
# where plain decoding was fastest in hindsight, or within PLAIN_MARGIN of the fastest (the drafter's prefill counted:
# in a near tie plain decoding costs no look, no drafter and no chunks; REPROBE_ROUNDS keeps the tie from locking
# speculation out) on the last calls at its batch size, together at least PLAIN_EVIDENCE_ROWS prompts
# (one hard prompt must not decide the next call), and acceptance was observed within REPROBE_ROUNDS
# rounds: a batch size at which speculation does not pay then costs what plain decoding costs, and
# still probes about every REPROBE_ROUNDS rounds.
PLAIN_EVIDENCE_ROWS = 8
# ... or PROMPTS_TO_CARRY where the prompts were seen to be alike (``carry_rounds`` above CARRY_ROUNDS: at T=1
# every prompt accepts within its own noise), so that one prompt speaks for the next: else a batch of 1
# pays the drafter's prefill and a probe on every call of a short sequence that plain decoding wins. Two
# calls' prompts at least (``SpanCosts.plain_settled``).
PLAIN_MARGIN = 1.02
REPROBE_ROUNDS = 192  # about one call in four of ~64 tokens probes: the drafter's prefill and a probe cost ~5-10% of such a call
# ... twice as many after each further call in a row whose hindsight found plain decoding fastest again (past the
# two that settle it), up to REPROBE_BACKOFF times as many: where speculation keeps not paying (bfloat16 at T=1,
# batch 1 on a CPU: a call that probed took ~6% longer than plain decoding, one call in two or three), probing
# costs less the longer that holds, and a change of workload is still met within REPROBE_BACKOFF x REPROBE_ROUNDS.
REPROBE_BACKOFF = 4
# Plain decoding proper is measured only where it may win, on a call's last rounds (it ends a call's
# speculation): its cost is estimated by the probe rounds' (plain + a drafter step) until then, which
# flatters speculation.
# ... i.e. when that estimate finishes within this factor of the best depth. A probe round cost 1.2-1.45x a plain
# one (bfloat16, batch 1, the bundled pair): at 1.3 a fresh process at T=1, where a chain of 1 ties plain decoding,
# never measured plain decoding, so never chose it.
PLAIN_WORTH_TRYING = 1.5
# A depth that is not chosen runs no more, while the one that runs is measured as it runs and follows the machine,
# whose speed moves by up to ~20% over minutes here: plain decoding read at 13.6-14.4 ms a round, measured minutes
# before, ran at 11.6-12.2, and a chain of 3 ran every call of three sequences at 1.15x plain decoding's time
# (bfloat16, batch 12, greedy); a chain of 5 priced 8% above the line through chains of 3 and 7 by two short chunks
# at a call's end ran no more, while a chain of 3 ran in its place at 0.94x the fixed chain of 5 (float32, batch 4,
# greedy). So a depth's cost is stale after STALE_ROUNDS rounds at a batch size since it was last measured (of any
# depth, calls that decode plainly from their start included: their one program times no round apart; an earlier
# process's measurement counts as that old), and a stale one is measured again where it may win: plain decoding on
# a call's last rounds (below), its new measurement replacing the old ones at every span; a chain as one measured
# over too few rounds (``close_unsettled``), for as many rounds as a settled cost rests on, in one chunk, its
# measurement joining the old ones (replacing them, one busy moment's 4-round chunk priced a chain of 3 at 1.17x
# and one of 7 at 1.25x its cost until they were stale again) ...
STALE_ROUNDS = 128
# ... plain decoding where it is expected to finish within this factor of the best depth: past that, no drift makes
# it win ...
PLAIN_STALE_CLOSE = 1.25
# ... on this many last rounds, in one chunk: a short chunk's rounds are its time less the fitted overhead, and
# 4-round ones priced plain decoding below its long chunks' cost (float32 batch 4 T=1: plain decoding settled
# from the start where a chain of 1 was 12% faster).
PLAIN_TAIL_ROUNDS = 16
# Likewise a call stops speculating for good only after its own rows ran a chain, where one would win were its
# drafts past the first accepted as often as the first (``deeper_unseen`` from plain decoding): a probe sees the
# first draft only, and the deeper positions' estimate carries the prompts before (a hard prompt's). A fixed
# margin over plain decoding instead (a chain within 1.3x) tried chains where no deeper rate could make them
# pay (SmolLM2, first drafts accepted 10-25%: a chain of 3 for 4-13 rounds in most calls, 0.89-0.95x plain).
# A batch ends with its slowest row, priced from that row's own estimate; after a few rounds each such
# estimate is noisy, and the slowest of several noisy estimates is lower than the slowest row turns out to
# be (at T=1, batch 4, where rows accept alike, that priced K=1 below plain decoding though it was 5-7%
# faster). So each row's estimate is read with this many rounds of its batch's pooled evidence added where prompts
# were seen alike (``prompts_alike``): noise among rows shrinks. Where they differ, a row's own rounds speak: pooled, a
# row accepting 0.7 drafts a round at a chain of 5 among three accepting 2.4-4.9 read as ~2, and the chain ran 30-38
# rounds of its call where a chain of 1 finished 1.1-1.2x sooner (float32, batch 4, greedy).
ROW_POOL_ROUNDS = 8.0
# A chain depth whose cost at these rows is only modelled (a line in K through the depths that ran) or rests
# on fewer than SETTLED_ROUNDS measured rounds, and that is expected to finish within this factor of the
# best choice (plain decoding included), runs EXPLORE_ROUNDS rounds to be measured: a close choice is
# settled by the clock, not by the line (verifying 1 + K positions is not linear in K on every device), nor
# by one short chunk that a busy moment made dear (the depth would then never run again to correct it).
EXPLORE_CLOSE = 1.1
# A call of one prompt, before its own evidence and where prompts differ, reads its time at each depth as the mean
# over this many latest finished prompts (``AutoRun._times``): not the last one's alone, one hard prompt.
FIRST_CHOICE_ROWS = 4
REFIT_CHANGES = 16  # cost changes after which ``SpanCosts`` fits its table of every span's costs anew


class SpanCosts:
    """Seconds per round by cache span: a ``CostModel`` (by rows and depth) per span, since a round's
    attention reads the whole span (a ``generate`` call's cache, the slots a server step covers) and its
    cost grows with it. A cost measured at the span over ``SETTLED_ROUNDS`` rounds or more is read as measured;
    one measured over fewer, or only at other spans, is read through one table of every span's measurements
    (``span_levels``: a level per depth and rows, a level per span, each measurement weighed by its rounds), at
    this span's level, or at the nearest measured span's (the shorter of two as near:
    optimism corrects itself, as the depth then runs and is measured); failing that, modelled at these rows
    (a line in K) where most chains ran, then across row counts, scaled to that level. One per model pair,
    sampling mode and device (``cost_model``).

    It also keeps, per batch size, what ``generate``'s calls showed in hindsight (``record_hindsight``)."""

    def __init__(self):
        self.by_span: dict[int, CostModel] = {}
        self.overhead = ChunkOverhead()  # a generate chunk's time apart from its rounds, per batch size
        self.plain_rows: dict[int, int] = {}  # per batch: prompts of the latest calls in a row that plain decoding finished soonest
        # per batch: the rows' own estimates at the end of the last call that observed acceptance. A call's
        # first choice reads them: its slowest row sets its end, and the pooled estimate hides the spread.
        self.last_call: dict[int, list[AcceptanceEstimate]] = {}
        # (changes and measurements fitted, log level per (rows, depth), log level per span)
        self._table: tuple[int, int, dict, dict] = (0, 0, {}, {})
        self.cache_name: str | None = None  # the file these costs are kept in (``keep``): "" none, None not asked yet
        self.forgotten: set[tuple[int, int]] = set()  # (rows, depth) of chains measured anew (``forget_contradicted_chain``)
        self.drafter_prefill_share: Callable[[int], float] | None = None  # by prompt length: ``flops.prefill_drafter_share``
        self.since: dict[tuple[int, int], int] = {}  # (rows, depth): rounds at those rows since the depth was measured (``stale``)
        self.recent_rows: deque[AcceptanceEstimate] = deque(maxlen=FIRST_CHOICE_ROWS)  # the latest finished rows' estimates
        self.acceptance: AcceptanceEstimate | None = None  # the pair's acceptance, kept on disk with these costs (``keep``)

    def keep(self, name: Callable[[], str], acceptance: AcceptanceEstimate | None = None) -> None:
        """Keeps these costs on disk under ``name()`` (``cost_cache``), starting from the ones kept there, unless the
        cache is off; asked once, by the first call that meets these costs. ``acceptance``: the pair's estimate for
        this sampling mode, kept with them together with the hindsight on plain decoding (``plain_rows``), and both
        started from the ones kept where the estimate observed nothing yet (the hindsight only where the kept prompts
        were alike): a fresh process otherwise learns its
        traffic anew from ``PRIOR``, and at T=1 (bfloat16 batch 1 on a CPU, costs kept) calls among its first four
        that ran chains of 3-7 and then decoded plainly made ~85% of what auto lost to plain decoding over sequences
        of eight calls. Probing goes on where the earlier process left it (``REPROBE_ROUNDS``): a process's traffic may differ
        from the last one's as a process's own traffic may change, and is met the same way."""
        self.acceptance = acceptance
        self.cache_name = name() if cost_cache.directory() is not None else ""
        data = cost_cache.load(self.cache_name) if self.cache_name and not self.by_span else None
        if data is None:
            return
        try:
            self.overhead.restore(data["overhead"])
            for span, measured in data["spans"]:
                self.model(int(span)).restore(measured)
            if acceptance is not None and acceptance.fresh and "acceptance" in data:
                plain_rows = {int(batch): int(n) for batch, n in data["plain_rows"]}
                if any(batch < 1 or n < 0 for batch, n in plain_rows.items()):
                    raise ValueError(f"plain decoding's prompts in a row {plain_rows} below 0, or at a batch size below 1")
                acceptance.restore(data["acceptance"])  # checked whole before it changes anything
                # A verdict of plain decoding on earlier prompts speaks for a later process's only where prompts were seen
                # alike (sampling); where they differ (greedy) the later process's prompts are new ones, for its own calls'
                # hindsight to judge: kept, an earlier process's last hard calls and one more settled plain decoding for
                # the next three calls, where a chain of 5 or 7 was 1.5-2x faster (bfloat16, batch 4).
                self.plain_rows = plain_rows if prompts_alike(acceptance.carry_rounds()) else {}
        except (KeyError, TypeError, ValueError, IndexError) as err:
            kept = self.cache_name
            self.__init__()  # measured anew: nothing of a file read halfway stays
            self.cache_name, self.acceptance = kept, acceptance
            cost_cache.unreadable(kept, err)
            return
        for rows in {r for m in self.by_span.values() for r, _ in m.window}:  # an earlier process's busy moments
            self.forget_contradicted_chain(rows)

    def kept(self) -> None:
        """Writes these costs to their file (``keep``), now or at a later call's end or the process's exit."""
        if self.cache_name:
            cost_cache.save(self.cache_name, self)

    def to_dict(self) -> dict:
        """What was measured (every span's measurements, the chunks' overhead), and the traffic's acceptance with
        what hindsight found of plain decoding (``keep``)."""
        kept = {"spans": [[span, m.to_dict()] for span, m in self.by_span.items()], "overhead": self.overhead.to_dict()}
        if self.acceptance is None:
            return kept
        return kept | {"acceptance": self.acceptance.to_dict(), "plain_rows": [[b, n] for b, n in self.plain_rows.items()]}

    def model(self, span: int) -> CostModel:
        if span not in self.by_span:
            self.by_span[span] = CostModel(overhead=lambda rows, depth, first: self.overhead.seconds(rows, first, (span, depth)))
        return self.by_span[span]

    def observe_chunk(self, span: int, depth: int | None, rows: int, rounds: int, seconds: float, first: bool) -> None:
        """A ``generate`` chunk of ``rounds`` rounds at ``depth`` (None: probe rounds) over ``rows`` rows and ``span``
        cache slots took ``seconds``; ``first``: the first after its call's prefill. Its rounds' cost is its time
        less the chunk's overhead, which this chunk may refit: every cost is then derived anew with it."""
        refitted = self.overhead.observe(rows, (span, depth), rounds, seconds, first)
        if depth == PLAIN and self.stale(depth, rows):  # measured anew: what was measured before read another state of the machine
            for m in self.by_span.values():
                m.forget(rows, depth)
        self.aged(rows, rounds, depth)
        self.model(span).update(depth, rows, seconds, rounds, first)
        for m in self.by_span.values():
            if refitted:
                m.reprice()
            m.forget_contradicted_probe(rows)
        self.forget_contradicted_chain(rows)

    def forget_contradicted_chain(self, rows: int) -> int | None:
        """Forgets, at every span, the measurements of the chain at ``rows`` rows furthest above the line through the
        others (``CHAIN_CONTRADICTED``, read on the table of every span: ``span_levels``), once per chain and row count
        in a process. Its cost is then modelled from the others', which makes it run and be measured again where that
        puts it close to the best (``EXPLORE_CLOSE``). Returns the depth forgotten, or None."""
        depth_level, _ = self._levels()
        points = {d or 0: math.exp(level) for (r, d), level in depth_level.items() if r == rows and d != PLAIN}
        above = {d: x for d, x in contradicted_chains(points).items() if (rows, d) not in self.forgotten}
        if not above:
            return None
        depth = max(above, key=above.get)
        self.forgotten.add((rows, depth))
        for m in self.by_span.values():
            m.forget(rows, depth)
        return depth

    def probed(self, rows: int) -> bool:
        """Whether a probe round's cost at ``rows`` was measured at some span."""
        return any(m.probed(rows) for m in self.by_span.values())

    def measured(self, depth: int, rows: int) -> bool:
        """Whether ``depth`` ran at ``rows`` rows at some span."""
        return any(m.measured(depth, rows) for m in self.by_span.values())

    def aged(self, rows: int, rounds: int, measured: int | None = None) -> None:
        """``rounds`` rounds at ``rows`` rows ran that measured ``measured`` (None: no depth's cost) and no other (``stale``)."""
        for depth in (PLAIN, *DEPTHS):
            self.since[rows, depth] = 0 if depth == measured else self.since.get((rows, depth), STALE_ROUNDS) + rounds

    def stale(self, depth: int, rows: int) -> bool:
        """Whether ``depth``'s cost at ``rows`` rows is measured, but ``STALE_ROUNDS`` rounds or more ago (of any depth,
        plain decoding's own program's included), or by an earlier process."""
        return self.measured(depth, rows) and self.since.get((rows, depth), STALE_ROUNDS) >= STALE_ROUNDS

    def settled(self, depth: int, rows: int) -> bool:
        """Whether ``depth`` ran at least ``SETTLED_ROUNDS`` measured rounds at ``rows`` rows (over every span)."""
        return sum(m.rounds.get((rows, depth), 0) for m in self.by_span.values()) >= SETTLED_ROUNDS

    def _levels(self) -> tuple[dict, dict]:
        """(log level per (rows, depth), per span) of ``span_levels`` over every span's measurements, fitted anew
        (from the last fit's span levels: a few sweeps) where a measurement was added or dropped or a cost read from the
        table (under ``SETTLED_ROUNDS`` rounds at its span) was measured again, or after
        ``REFIT_CHANGES`` changes of a cost: a server step changes one, and a fit on every step cost ~0.1 ms
        (16 spans, on a CPU), while a cost measured at the span read over ``SETTLED_ROUNDS`` rounds is read as measured,
        never from the table."""
        changes = sum(m.changes for m in self.by_span.values())
        kept = sum(len(m.window) + m.thin_updates for m in self.by_span.values())
        fitted_changes, fitted_kept, depth_level, span_level = self._table
        if kept != fitted_kept or changes - fitted_changes >= REFIT_CHANGES:
            cells = ((key, span, seconds, weight) for span, m in self.by_span.items() for key, seconds, weight in m.cells())
            depth_level, span_level = span_levels(cells, span_level)
            self._table = (changes, kept, depth_level, span_level)
        return depth_level, span_level

    def cost(self, depth: int, rows: int, span: int) -> float | None:
        """Seconds per round at ``depth`` over ``rows`` rows reading ``span`` cache slots; None: nothing to go on."""
        here = self.by_span.get(span)
        if here is not None and (rows, depth) in here.seconds and here.window_rounds(rows, depth) >= SETTLED_ROUNDS:
            return here.seconds[rows, depth]
        depth_level, span_level = self._levels()
        if not span_level:
            return None
        distance = lambda s: span_distance(s, span)  # noqa: E731
        level = span_level[nearest_span(span_level, span)]
        if (rows, depth) in depth_level:  # measured at other spans (plain decoding before the probe round standing in for it)
            return math.exp(depth_level[rows, depth] + level)
        # Modelled where most chains ran at these rows: a line through the probe round and one chain priced a chain
        # of 7 at 1.8x what the next span, which ran three, measured, so it never ran there to correct it. Then these
        # rows at any span before other rows at this one.
        chains = lambda s: sum(r == rows and d != PLAIN for r, d in self.by_span[s].seconds)  # noqa: E731
        for read, order in ((CostModel.at_rows, lambda s: (-chains(s), *distance(s))), (CostModel.cost, distance)):
            for s in sorted(span_level, key=order):
                if (c := read(self.by_span[s], depth, rows)) is not None:
                    return c * math.exp(level - span_level[s])
        return None

    def probe_cost(self, rows: int, span: int) -> float | None:
        """Seconds per probe round (no drafts, the drafter fed) over ``rows`` rows reading ``span`` cache slots:
        measured at the span, else read through the table of every span's (``span_levels``); None: never probed at
        these rows."""
        here = self.by_span.get(span)
        if here is not None and rows in here.probe:
            return here.probe[rows]
        depth_level, span_level = self._levels()
        if (rows, None) not in depth_level:
            return None
        return math.exp(depth_level[rows, None] + span_level[nearest_span(span_level, span)])

    def at(self, span_of: int | Callable[[int], int]) -> "AtSpan":
        """These costs read as ``cost(depth, rows)`` at one span, or at ``span_of(depth)`` (a server step's
        span depends on its depth)."""
        return AtSpan(self, span_of if callable(span_of) else (lambda _d, s=span_of: s))

    def record_hindsight(self, span: int, rows: Sequence[tuple[int, AcceptanceEstimate]], drafter_prefill_s: float = 0.0,
                         chunks: Sequence[tuple[int | None, int]] = (), judged: Sequence[tuple[int, AcceptanceEstimate]] | None = None) -> None:
        """A call of ``len(rows)`` prompts over ``span`` cache slots that observed acceptance ended: ``rows``
        = (tokens it made, the row's estimate); ``drafter_prefill_s``: the drafter's part of its prefill
        (``flops.prefill_drafter_share`` of it); ``chunks``: the (depth, rounds) it ran (depth None: probe rounds);
        ``judged``: the rows the verdict reads, if not ``rows`` (``AcceptanceEstimate.judged_over_prompts``).
        Speculating pays what plain decoding from the start does not: the drafter's part of the prefill, the probe
        rounds' excess over plain ones, and the overhead of every chunk past one (``chunk_overhead``: ~1 round each
        at bfloat16 batch 12 on a CPU before its cache writes were scattered as bits, where a call that probes, looks
        and runs on paid 5% over plain decoding's time in a near tie). The drafter's part of the prefill was read as
        the share of a round that feeding the drafter adds (the probe round's cost over plain decoding's): ~19% of a
        prefill at float32 batch 4, where a prefill with the drafter took 0-2% longer than one without (it runs the
        drafter's layer at the prompt's last position only), and a chain of 1, 4.5% faster than plain decoding
        there, read as no faster and stopped running (T=1)."""
        batch, here = len(rows), self.at(span)
        self.last_call[batch] = [est.copy() for _, est in rows]
        self.recent_rows.extend(self.last_call[batch])
        times = finish_times(here, batch, toward_the_batch(rows if judged is None else judged))
        plain, probe = self.model(span).at_rows(PLAIN, batch), self.model(span).probe.get(batch)
        extra = drafter_prefill_s + max(len(chunks) - 1, 0) * self.overhead.seconds(batch)
        if plain and probe:
            extra += sum(n for d, n in chunks if d is None) * max(probe - plain, 0.0)
        spec = min((t + extra for d, t in times.items() if d != PLAIN), default=None)
        clear = self.measured(PLAIN, batch) and spec is not None and times[PLAIN] <= PLAIN_MARGIN * spec
        self.plain_rows[batch] = self.plain_rows.get(batch, 0) + batch if clear else 0

    def reprobe_rounds(self, batch: int) -> int:
        """Rounds a call at this batch size may decode plainly from its start after acceptance was last observed
        (past them, a call probes): ``REPROBE_ROUNDS``, backed off while probes keep finding plain decoding fastest."""
        in_a_row = self.plain_rows.get(batch, 0) // batch
        return REPROBE_ROUNDS * min(2 ** max(in_a_row - 2, 0), REPROBE_BACKOFF)

    def plain_settled(self, batch: int, alike: bool = False) -> bool:
        """Whether plain decoding was fastest on enough recent prompts at this batch size to start a call
        without the drafter; ``alike``: the prompts were seen to accept alike, so fewer suffice, but from two
        calls at least: one call's rows may be alike by how they were grouped (greedy, batch 4, the four
        hardest prompts in one call settled plain decoding for the next two, where a chain of 3 was
        1.2-1.6x faster)."""
        needed = max(PROMPTS_TO_CARRY, min(PLAIN_EVIDENCE_ROWS, 2 * batch)) if alike else PLAIN_EVIDENCE_ROWS
        return self.measured(PLAIN, batch) and self.plain_rows.get(batch, 0) >= needed


def span_distance(other: int, span: int) -> tuple[float, int]:
    """How far cache span ``other`` is from ``span``, as a sort key: by ratio, the shorter of two as near."""
    return abs(math.log2(other / span)), other


def nearest_span(spans: Collection[int], span: int) -> int:
    """``span`` if among ``spans``, else the nearest of them (``span_distance``)."""
    return span if span in spans else min(spans, key=lambda s: span_distance(s, span))


class AtSpan:
    """``SpanCosts`` read as a cost model of one span: ``cost(depth, rows)`` at ``span_of(depth)``."""

    def __init__(self, costs: SpanCosts, span_of: Callable[[int], int]):
        self.costs, self.span_of = costs, span_of

    def cost(self, depth: int, rows: int) -> float | None:
        return self.costs.cost(depth, rows, self.span_of(depth))


def token_seconds(costs: CostModel | AtSpan, rows: int, expected: Callable[[int], float], depths: Iterable[int] = DEPTHS) -> dict[int, float]:
    """Expected seconds per token over ``rows`` rows at ``PLAIN`` and each of ``depths`` whose cost is known;
    ``expected(d)``: tokens one round of depth d emits over them."""
    return {d: c / e for d in (PLAIN, *depths) if (c := costs.cost(d, rows)) and (e := expected(d)) > 0}


def choose_depth(costs: CostModel | AtSpan, rows: int, expected: Callable[[int], float], depths: Iterable[int] = DEPTHS) -> int:
    """The depth (``PLAIN`` or one of ``depths``) with the most expected tokens per second over ``rows``
    rows. Depths of unknown cost are left out (the caller explores first)."""
    times = token_seconds(costs, rows, expected, depths)
    return min(times, key=times.get, default=PLAIN)


def finish_times(costs: CostModel | AtSpan, batch: int, rows: Sequence[tuple[int, AcceptanceEstimate]],
                 depths: Iterable[int] = DEPTHS) -> dict[int, float]:
    """Expected seconds to finish a call of ``batch`` rows at each depth of known cost (``PLAIN`` and
    ``depths``): rows = (tokens still to make, that row's estimate) of the rows not done. A batch call ends with
    its slowest row, and every round costs the whole batch, so the time at depth d is ``cost(d)`` times the
    rounds its slowest row takes (``slowest_rounds``), not the batch's tokens per second: rows the drafter
    follows well finish early and then only wait."""
    return {d: c * slowest_rounds(rows, d) for d in (PLAIN, *depths) if (c := costs.cost(d, batch))}


def slowest_rounds(rows: Sequence[tuple[int, AcceptanceEstimate]], depth: int) -> float:
    """Expected rounds of ``depth`` drafts until every row of ``rows`` (tokens left, estimate) is done: the
    expected maximum over the rows of each row's rounds, approximately normal (a renewal count: mean n/mu,
    variance n sigma^2/mu^3 for the tokens a round emits, mu and sigma^2 their mean and variance). Not the
    maximum of the means: a round's emitted tokens vary more the deeper the chain, so of 12 rows one lags
    by ~1.6 standard deviations (bfloat16, batch 12, greedy: the means priced a chain of 3 at 31 rounds
    where it took 38, and it ran in place of a chain of 1, 10% faster)."""
    if depth == PLAIN or not rows:
        return float(max((n for n, _ in rows), default=0))
    mean, sd = np.zeros(len(rows)), np.zeros(len(rows))
    for i, (n, est) in enumerate(rows):
        drafts, var = est.accepted_moments(depth)
        mu = 1.0 + drafts
        mean[i], sd[i] = n / mu, math.sqrt(max(n * var, 0.0) / mu**3)
    if len(rows) == 1 or not sd.any():
        return float(mean.max())
    # E[max] = lo + integral over x >= lo of P(max > x), on a grid past every row's spread
    lo, hi = float((mean - 6 * sd).max()), float((mean + 6 * sd).max())
    x = np.linspace(lo, hi, 257)
    below = np.prod(ndtr((x[:, None] - mean[None]) / np.maximum(sd[None], 1e-9)), axis=1)
    above = 1.0 - below
    return lo + float((above.sum() - (above[0] + above[-1]) / 2) * (x[1] - x[0]))


def keep_close(times: dict[int, float], current: int | None) -> int:
    """The depth expected soonest in ``times`` (depth -> expected seconds), or ``current`` (the depth of the chunk
    that just ran) where it is within ``WATCH_TOLERANCE`` of it: the watch ends a chunk at that tolerance, and a
    closer race is not worth a switch, whose winner the estimates' noise picks (at T=1 a chain of 1 and one of
    3 are that close, and an estimate over ~30 rounds swung between them every chunk)."""
    best = min(times, key=times.get)
    return current if current in times and times[current] <= (1 + WATCH_TOLERANCE) * times[best] else best


def toward_the_batch(rows: Sequence[tuple[int, AcceptanceEstimate]], pool: float = ROW_POOL_ROUNDS) -> list[tuple[int, AcceptanceEstimate]]:
    """``rows`` (tokens left, estimate) with ``pool`` rounds of the rows' pooled evidence added to each estimate
    (unchanged for one row, or none)."""
    if len(rows) < 2 or not pool:
        return list(rows)
    trials = sum(est.trials for _, est in rows)
    hits = sum(est.hits for _, est in rows)
    scale = pool / max(float(trials[0]), 1e-12)
    out = []
    for n, est in rows:
        new = est.copy()
        new.trials = new.trials + scale * trials
        new.hits = new.hits + scale * hits
        out.append((n, new))
    return out


_UNWATCHED = np.array([-np.inf, np.inf, 0.0], np.float32)  # a band no rounds depart from
_SCALES = np.geomspace(1 / 8, 8, 49)  # acceptance scaled by these to find where a choice stops paying


def never(batch: int) -> np.ndarray:
    """A watch (``watch``) that no rounds of a ``batch``-row chunk depart from."""
    return np.tile(_UNWATCHED, (1 + batch, 1))


def watch(costs: CostModel | AtSpan, batch: int, rows: Sequence[tuple[int, AcceptanceEstimate]], depth: int | None,
          switch_s: float = 0.0, active: Sequence[int] | None = None, pool: float = ROW_POOL_ROUNDS) -> np.ndarray:
    """What a ``generate`` chunk of ``depth`` drafts over ``rows`` (tokens left, estimate: the rows of its ``batch``
    not done, at indices ``active``, by default the first ones) is watched with (engine ``departed``): [1 + batch, 3].
    Its first line (lo, hi, sd): the band of drafts accepted per row and round within which ``depth`` stays within
    ``WATCH_TOLERANCE`` of the best choice, and ``switch_s`` more (what a new chunk costs apart from its rounds: ~1
    round at bfloat16 batch 12 on a CPU before its cache writes were scattered as bits, where ending chunks on 2%
    turned a call into five chunks), and the standard deviation of one row-round's count. The band scales every row's
    acceptance alike (all drafts, all rows: what a prompt unlike the ones before does) and reads where another depth
    would finish the call sooner by more than the tolerance. Line 1 + b: (lo, inf, sd) of row b alone, at the band's
    lower end: a batch ends with its slowest row, whose shortfall the rows' mean hides while the others accept well
    (float32, batch 4, greedy: one row accepting 0.7 drafts a round at a chain of 5, three 2.4-4.9, and the chain ran
    38 rounds where a chain of 1 finished 1.2x sooner). A chunk whose rows leave their band ends early, so its
    choice is made again; ``never`` for rounds without drafts and for a depth run to be measured (not the choice)."""
    price = {d: c for d in (PLAIN, *DEPTHS) if (c := costs.cost(d, batch))}
    out = never(batch)
    if depth in (None, PLAIN) or depth not in price or len(price) < 2 or not rows:
        return out  # nothing to compare with: no band
    rows = toward_the_batch(rows, pool)
    left = np.array([n for n, _ in rows], float)
    p = np.stack([est.p for _, est in rows])
    reach = np.cumsum(np.cumprod(np.minimum(_SCALES[:, None, None] * p[None], 1.0), axis=2), axis=2)  # [scale, row, k]: drafts accepted at depth k+1
    ds = sorted(price)
    tokens = np.stack([np.ones(reach.shape[:2]) if d == PLAIN else 1.0 + reach[..., d - 1] for d in ds], axis=-1)
    finish = np.array([price[d] for d in ds]) * (left[None, :, None] / tokens).max(axis=1)  # [scale, depth]
    mine = finish[:, ds.index(depth)]
    fine = mine <= (1.0 + WATCH_TOLERANCE) * np.delete(finish, ds.index(depth), axis=1).min(axis=1) + switch_s
    at = len(_SCALES) // 2  # the scale 1: the rows as estimated
    if not fine[at]:
        return out
    lo, hi = at, at
    while lo > 0 and fine[lo - 1]:
        lo -= 1
    while hi < len(_SCALES) - 1 and fine[hi + 1]:
        hi += 1
    mean = reach[:, :, depth - 1].mean(axis=1)
    moments = np.array([est.accepted_moments(depth) for _, est in rows])
    sd = math.sqrt(float(moments[:, 1].mean() + moments[:, 0].var()))
    out[0] = [mean[lo] if lo > 0 else -np.inf, mean[hi] if hi < len(_SCALES) - 1 else np.inf, sd]
    if lo > 0:
        lines = 1 + (np.arange(len(rows)) if active is None else np.asarray(active))
        out[lines, 0] = reach[lo, :, depth - 1]
        out[lines, 2] = np.sqrt(np.maximum(moments[:, 1], 0.0))
    return out


def close_unsettled(times: dict[int, float], settled: Callable[[int], bool]) -> int | None:
    """Among chain depths (not ``PLAIN``, not the best) whose cost is not ``settled`` (modelled, or measured
    over fewer than ``SETTLED_ROUNDS`` rounds), the one expected soonest, if within ``EXPLORE_CLOSE`` of the
    best of ``times`` (depth -> expected seconds, lower is better, ``PLAIN`` included); else None."""
    if not times:
        return None
    best = min(times, key=times.get)
    rivals = [d for d, t in times.items() if d not in (PLAIN, best) and not settled(d) and t <= EXPLORE_CLOSE * times[best]]
    return min(rivals, key=times.get, default=None)


def deeper_unseen(costs: CostModel | AtSpan, batch: int, rows: Sequence[tuple[int, AcceptanceEstimate]], depth: int) -> int | None:
    """A chain deeper than ``depth`` (the choice on ``rows``: tokens left, estimate; ``PLAIN`` chosen on probe rounds, which
    see the first draft) that would finish the call sooner, by more than ``WATCH_TOLERANCE``, were the drafts past the
    deepest one ``depth`` observes accepted as often as that one (``AcceptanceEstimate.seen_through``), or None. A chain
    of ``depth`` observes only its own drafts, so the deeper ones keep what earlier prompts did: after a hard prompt, a
    chain of 1 chosen on the next one's probe ran 38 rounds where a chain of 5 was 1.54x faster on it (float32, batch 1,
    greedy)."""
    if depth is None or depth >= max(DEPTHS):
        return None
    times = finish_times(costs, batch, [(n, est.seen_through(max(depth, 1))) for n, est in rows])
    best = keep_close(times, depth) if depth in times else None
    return best if best is not None and best > depth else None


def unexplored(costs: CostModel | AtSpan, rows: int, depths: Iterable[int] = DEPTHS) -> list[int]:
    """Depths to run before choosing (the deepest, if no depth was ever measured at any row count: the
    others are modelled from it), or none."""
    depths = tuple(depths)
    return [] if any(costs.cost(d, rows) is not None for d in depths) else [max(depths)]


_MODELS: dict[Any, SpanCosts] = {}
_ESTIMATES: dict[Any, AcceptanceEstimate] = {}


def cost_model(key: Any) -> SpanCosts:
    """The process's costs for ``key`` (pair, sampling mode, dtype mode, mesh, device): every span and batch size."""
    return _MODELS.setdefault(key, SpanCosts())


def acceptance_estimate(key: Any) -> AcceptanceEstimate:
    """The process's acceptance estimate for ``key`` (pair, sampling mode)."""
    return _ESTIMATES.setdefault(key, AcceptanceEstimate())


def reset() -> None:
    """Forgets every cost and estimate (tests, benchmarks), as a new process would: costs kept on disk
    (``cost_cache``) are written first, and found again by the next call."""
    cost_cache.flush()
    _MODELS.clear()
    _ESTIMATES.clear()
    adaptive_costs.forget()
