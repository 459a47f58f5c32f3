"""What a ``generate`` chunk of ``spec="auto"`` costs apart from its rounds (``ChunkOverhead``), so that the
round costs read from short chunks and from long ones compare.

A chunk's time is ``fixed + rounds x per-round``, plus ``first`` more for the first chunk after a prefill.
The fixed part is at least the chunk's dispatch and host sync (~1 ms on a CPU), and can be far more: on a
CPU, a bfloat16 batch of 12 pays ~20 ms per chunk (about one round), a batch of 1 ~1.6 ms, float32 ~1.3 ms
at both (one-time work of each execution, outside its loop). The first chunk after a prefill pays ~10 ms
more there. Both depend on the batch size, so they are fitted per batch size, jointly over the batch
size's latest chunks: ``time = fixed + first x is_first + rounds x cost(span, depth)`` by least squares,
a cost per (span, depth) and robust to a busy moment's chunk (Huber weights). Where the chunks cannot tell
a part apart (one length per depth, no first chunk beside a later one of its depth), a weak prior holds it
at the dispatch (fixed) and at 0 (first).

The parts are fitted anew with every chunk, so a cost derived from a chunk early on (a probe's 4 rounds,
the first after a prefill, measured while the fixed part looked like the dispatch alone: it priced plain
decoding at 1.5x its cost at bfloat16 batch 12) is re-derived as the parts become known
(``CostModel.reprice``)."""

from __future__ import annotations

from collections import deque
from typing import Hashable

import numpy as np

FIT_CHUNKS = 48  # a batch size's latest chunks the parts are fitted over
PRIOR_WEIGHT = 0.3  # the prior's weight against one chunk's (a chunk's time is ~0.05-1 s; the parts are fitted in ms)
HUBER = 2.0  # residuals beyond this many robust standard deviations count linearly, not squared
MIN_SPREAD_S = 1e-4  # the least spread a chunk's time is read with (a timer's and a dispatch's jitter)


class ChunkOverhead:
    """Per batch size: the fixed part of a chunk's time and the first chunk's extra, fitted from the chunks
    that ran (``observe``); ``dispatch_s`` (an empty chunk's time) is the least either part's sum can be."""

    def __init__(self):
        self.dispatch_s: float | None = None
        self._chunks: dict[int, deque] = {}  # rows -> (key, rounds, seconds, first)
        self._parts: dict[int, tuple[float, float]] = {}  # rows -> (fixed, first)

    def set_dispatch(self, seconds: float) -> None:
        self.dispatch_s = seconds

    def observe(self, rows: int, key: Hashable, rounds: int, seconds: float, first: bool) -> None:
        """A chunk of ``rounds`` rounds over ``rows`` rows took ``seconds``; ``key``: what sets its cost per round
        (span, depth); ``first``: the first chunk after its call's prefill. Refits this batch size's parts."""
        if rounds < 1 or seconds <= 0:
            return
        self._chunks.setdefault(rows, deque(maxlen=FIT_CHUNKS)).append((key, rounds, seconds, first))
        self._parts[rows] = self._fit(self._chunks[rows])

    def seconds(self, rows: int, first: bool = False) -> float:
        """The part of a chunk's time over ``rows`` rows that is not its rounds (the dispatch where no chunk ran
        at these rows: none of their rounds is priced yet)."""
        floor = self.dispatch_s or 0.0
        if rows not in self._parts:
            return floor
        fixed, extra = self._parts[rows]
        return max(floor, fixed) + (max(extra, 0.0) if first else 0.0)

    def _fit(self, chunks) -> tuple[float, float]:
        keys = list(dict.fromkeys(k for k, *_ in chunks))
        a = np.zeros((len(chunks) + 2, 2 + len(keys)))
        t = np.zeros(len(chunks) + 2)
        for i, (k, n, s, first) in enumerate(chunks):
            a[i, 0], a[i, 1], a[i, 2 + keys.index(k)], t[i] = 1.0, float(first), n, s
        # the prior: fixed = the dispatch, first = 0 (what an unidentified part falls back to)
        a[-2, 0], t[-2] = PRIOR_WEIGHT, PRIOR_WEIGHT * (self.dispatch_s or 0.0)
        a[-1, 1] = PRIOR_WEIGHT
        # Huber weights from the residuals' robust spread, read over the chunks the fit does not pass through by
        # construction: a depth's only chunk has its own cost per round, so its residual is 0 whatever the
        # parts (leverage 1). Counted in, those zeros made the spread 0 and every other chunk an outlier,
        # which left a cold call's parts at the prior (bfloat16 batch 12: 1 ms fitted, 21 ms paid).
        leverage = np.einsum("ij,ji->i", a, np.linalg.pinv(a))[:-2]
        free = leverage < 1.0 - 1e-6
        w = np.ones(len(t))
        for _ in range(4):  # iteratively reweighted: a busy moment's chunk counts less
            x, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
            if free.sum() < 3:  # too few chunks to tell a busy one: least squares
                break
            r = (t - a @ x)[:-2]
            spread = np.abs(r[free]) / np.sqrt(1.0 - leverage[free])
            scale = 1.4826 * float(np.median(spread)) + MIN_SPREAD_S
            w[:-2] = np.sqrt(np.minimum(1.0, HUBER * scale / np.maximum(np.abs(r), 1e-12)))
        return float(x[0]), float(x[1])
