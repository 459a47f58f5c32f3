"""What a ``generate`` chunk of ``spec="auto"`` costs apart from its rounds (``ChunkOverhead``), so that the
round costs read from short chunks and from long ones compare.

A chunk's time is ``fixed + rounds x per-round``, plus ``first`` more for the first chunk after a prefill.
The fixed part is at least the chunk's dispatch and host sync (~1 ms on a CPU). The first chunk's extra
depends on what runs: after a benchmark's other programs, a chain of 1's first chunk at bfloat16 batch 12
on a CPU paid ~40 ms more while a probe's paid ~3 ms, so one extra for every depth priced the probe,
whose chunks are all first ones, at a quarter of a plain round. Both parts depend on the batch size,
so they are fitted per batch size, jointly over the batch size's latest chunks: ``time = fixed +
first(span, depth) x is_first + rounds x cost(span, depth)`` by least squares, robust to a busy moment's
chunk (Huber weights). Where the chunks cannot tell a part apart (one length per depth, a depth's first
chunks only), a weak prior holds it at the dispatch (fixed) and at 0 (a first extra).

The parts are fitted anew with every chunk that tells something the fit did not (a key or a first chunk it has
not seen, a time beyond the robust bound of its prediction, ``REFIT_EVERY`` chunks since): a fit costs ~0.3-0.5 ms
on a CPU, which after every chunk was ~1.4 ms of an auto call's host time at bfloat16 batch 1, where a chunk that
agrees with the fit moves it little. So a cost derived from a chunk early on (a probe's 4 rounds,
the first after a prefill, measured while the fixed part looked like the dispatch alone: it priced plain
decoding at 1.5x its cost at bfloat16 batch 12) is re-derived as the parts become known
(``CostModel.reprice``)."""

from __future__ import annotations

from collections import deque
from typing import Hashable

import numpy as np

from eagle_jax.decoding.cost_model import kept_measurement

FIT_CHUNKS = 48  # a batch size's latest chunks the parts are fitted over
PRIOR_WEIGHT = 0.3  # the prior's weight against one chunk's (a chunk's time is ~0.05-1 s; the parts are fitted in ms)
HUBER = 2.0  # residuals beyond this many robust standard deviations count linearly, not squared ...
TUKEY = 4.685  # ... and then, from a fit so weighted, beyond this many not at all
MIN_SPREAD_S = 1e-4  # the least spread a chunk's time is read with (a timer's and a dispatch's jitter)
REFIT_EVERY = 8  # chunks after which the parts are fitted anew though each agreed with the fit


class ChunkOverhead:
    """Per batch size: the fixed part of a chunk's time and the first chunk's extra, fitted from the chunks
    that ran (``observe``); ``dispatch_s`` (an empty chunk's time) is the least either part's sum can be."""

    def __init__(self):
        self.dispatch_s: float | None = None
        self._chunks: dict[int, deque] = {}  # rows -> (key, rounds, seconds, first)
        self._parts: dict[int, tuple[float, dict]] = {}  # rows -> (fixed, key -> the first chunk's extra)
        self._fits: dict[int, _Fit] = {}  # rows -> what the parts' fit predicts a chunk's time from

    def set_dispatch(self, seconds: float) -> None:
        self.dispatch_s = seconds
        self._fits.clear()  # the prior moved: the next chunk refits

    def observe(self, rows: int, key: Hashable, rounds: int, seconds: float, first: bool) -> bool:
        """A chunk of ``rounds`` rounds over ``rows`` rows took ``seconds``; ``key``: what sets its cost per round
        and its first extra (span, depth); ``first``: the first chunk after its call's prefill. Returns whether
        this batch size's parts were fitted anew (else the chunk agreed with them and waits for the next fit)."""
        if rounds < 1 or seconds <= 0:
            return False
        self._chunks.setdefault(rows, deque(maxlen=FIT_CHUNKS)).append((key, rounds, seconds, first))
        fit = self._fits.get(rows)
        if fit is not None and fit.agrees(key, rounds, seconds, first):
            fit.since += 1
            return False
        self._refit(rows)
        return True

    def to_dict(self) -> dict:
        """The dispatch and the chunks the parts are fitted over (keys as lists), for ``restore``."""
        return {"dispatch_s": self.dispatch_s,
                "chunks": [[rows, [[list(k) if isinstance(k, tuple) else k, n, s, first] for k, n, s, first in chunks]]
                           for rows, chunks in self._chunks.items()]}

    def restore(self, data: dict) -> None:
        """Takes ``to_dict``'s chunks as its own (one that has seen none) and fits its parts on them."""
        self.dispatch_s = None if data["dispatch_s"] is None else float(data["dispatch_s"])
        for rows, chunks in data["chunks"]:
            kept = deque((_kept_chunk(*chunk) for chunk in chunks), maxlen=FIT_CHUNKS)
            self._chunks[int(rows)] = kept
            if kept:
                self._refit(int(rows))

    def seconds(self, rows: int, first: bool = False, key: Hashable = None) -> float:
        """The part of a chunk's time over ``rows`` rows that is not its rounds, for a chunk of ``key`` where
        ``first`` (the dispatch where no chunk ran at these rows: none of their rounds is priced yet)."""
        floor = self.dispatch_s or 0.0
        if rows not in self._parts:
            return floor
        fixed, extra = self._parts[rows]
        return max(floor, fixed) + (max(extra.get(key, 0.0), 0.0) if first else 0.0)

    def _refit(self, rows: int) -> None:
        fit = self._fit(self._chunks[rows])
        self._parts[rows] = (fit.fixed, fit.first)
        self._fits[rows] = fit

    def _fit(self, chunks) -> _Fit:
        keys = list(dict.fromkeys(k for k, *_ in chunks))
        firsts = list(dict.fromkeys(k for k, _, _, first in chunks if first))
        ncol = 1 + len(firsts) + len(keys)
        a = np.zeros((len(chunks) + 1 + len(firsts), ncol))
        t = np.zeros(len(a))
        for i, (k, n, s, first) in enumerate(chunks):
            a[i, 0], a[i, 1 + len(firsts) + keys.index(k)], t[i] = 1.0, n, s
            if first:
                a[i, 1 + firsts.index(k)] = 1.0
        # the priors: fixed = the dispatch, each first extra = 0 (what an unidentified part falls back to)
        m = len(chunks)
        a[m, 0], t[m] = PRIOR_WEIGHT, PRIOR_WEIGHT * (self.dispatch_s or 0.0)
        for j in range(len(firsts)):
            a[m + 1 + j, 1 + j] = PRIOR_WEIGHT
        # Huber weights from the residuals' robust spread, read over the chunks the fit does not pass through by
        # construction: a depth's only chunk has its own cost per round, so its residual is 0 whatever the
        # parts (leverage 1). Counted in, those zeros made the spread 0 and every other chunk an outlier,
        # which left a cold call's parts at the prior (bfloat16 batch 12: 1 ms fitted, 21 ms paid).
        gram = _ridged(a.T @ a)
        leverage = np.einsum("ij,ji->i", a[:m], np.linalg.solve(gram, a[:m].T))
        free = leverage < 1.0 - 1e-6
        x = np.linalg.solve(gram, a.T @ t)  # least squares
        if free.sum() < 3:  # too few chunks to tell a busy one: least squares, refitted with the next chunk
            return _Fit.of(x, firsts, keys, None)
        w = np.ones(len(t))
        for step in range(7):  # iteratively reweighted: Huber's weights, then Tukey's (a busy chunk drops out)
            r = (t - a @ x)[:m]
            spread = np.abs(r[free]) / np.sqrt(1.0 - leverage[free])
            scale = 1.4826 * float(np.median(spread)) + MIN_SPREAD_S
            u = np.abs(r) / scale
            weight = np.minimum(1.0, HUBER / np.maximum(u, 1e-12)) if step < 4 else np.clip(1.0 - (u / TUKEY) ** 2, 0.0, 1.0) ** 2
            if np.array_equal(weight, w[:m]):  # the same fit again (no chunk past Huber's bound): fixed while Tukey's
                if step >= 4:
                    break
                continue
            w[:m] = weight
            x = _weighted_lstsq(a, t, w)
        return _Fit.of(x, firsts, keys, scale)


class _Fit:
    """A fit of a batch size's chunks: the fixed part, each key's first extra and cost per round, and the robust
    spread of a chunk's time about it (None: too few chunks to read one)."""

    def __init__(self, fixed: float, first: dict, per_round: dict, scale: float | None):
        self.fixed, self.first, self.per_round, self.scale = fixed, first, per_round, scale
        self.since = 0  # chunks that agreed with it since it was fitted

    @classmethod
    def of(cls, x: np.ndarray, firsts: list, keys: list, scale: float | None) -> "_Fit":
        return cls(float(x[0]), {k: float(x[1 + j]) for j, k in enumerate(firsts)},
                   {k: float(x[1 + len(firsts) + j]) for j, k in enumerate(keys)}, scale)

    def agrees(self, key: Hashable, rounds: int, seconds: float, first: bool) -> bool:
        """Whether a new chunk would leave this fit about as it is: of a key (and a first extra) it has, within
        Huber's bound of its prediction, and fewer than ``REFIT_EVERY`` such chunks since it was fitted."""
        if self.scale is None or self.since + 1 >= REFIT_EVERY or key not in self.per_round or (first and key not in self.first):
            return False
        predicted = self.fixed + (self.first[key] if first else 0.0) + rounds * self.per_round[key]
        return abs(seconds - predicted) <= HUBER * self.scale


def _kept_chunk(key, rounds, seconds, first) -> tuple:
    """A chunk as ``ChunkOverhead.to_dict`` wrote it, read back (a key written as a list is a tuple again)."""
    seconds, rounds, first = kept_measurement(seconds, rounds, first)
    return (tuple(key) if isinstance(key, list) else key), rounds, seconds, first


def _weighted_lstsq(a: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
    """argmin_x sum w (t - a x)^2, by the normal equations (a few columns; an SVD per iteration took 1.5x as
    long). A column every chunk of which weighs 0 is held at 0 (``_ridged``)."""
    aw = a * w[:, None]
    return np.linalg.solve(_ridged(aw.T @ a), aw.T @ t)


def _ridged(gram: np.ndarray) -> np.ndarray:
    """``gram`` with a ridge of 1e-12 of its trace: solvable where a column's every chunk weighs 0."""
    return gram + 1e-12 * np.trace(gram) * np.eye(len(gram))
