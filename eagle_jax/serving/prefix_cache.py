"""Which cache rows hold which tokens, so that a prompt's prefill can start from a prefix seen before
(automatic prefix caching, as vLLM's and SGLang's radix cache do it, at the granularity of whole rows).

The rows are the engine's slots (a busy slot holds its prompt; a freed one keeps its prompt and the
tokens it generated until a new request overwrites it) and a pool of rows beside them that keep what
freed slots held once the slots are needed again, least recently used first out. A row's tokens are
only ever committed ones (the prompt and the accepted tokens below its length), so a rejected draft
never enters a reused prefix.

A prompt that shares ``n`` leading tokens with a row reuses ``n - 1`` of them: the drafter's entry at the
last shared position pairs it with the next token, which the new prompt may not share.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Row = tuple[str, int]  # ("slot", i) or ("pool", j)
MIN_REUSE = 16  # fewer reused tokens are not worth a row copy


@dataclass
class _Entry:
    tokens: np.ndarray
    used: int  # the LRU clock at the last reuse or store


class PrefixIndex:
    def __init__(self, slots: int, pool_rows: int, min_reuse: int = MIN_REUSE):
        self.slots, self.pool_rows, self.min_reuse = slots, pool_rows, min_reuse
        self._rows: dict[Row, _Entry] = {}
        self._clock = itertools.count()

    def clear(self) -> None:
        self._rows.clear()

    def set(self, row: Row, tokens: Sequence[int]) -> None:
        """``row`` now holds the caches of ``tokens`` (nothing reusable when fewer than ``min_reuse``)."""
        if len(tokens) > self.min_reuse:
            self._rows[row] = _Entry(np.asarray(tokens, np.int64), next(self._clock))
        else:
            self._rows.pop(row, None)

    def tokens(self, row: Row) -> np.ndarray | None:
        entry = self._rows.get(row)
        return None if entry is None else entry.tokens

    def match(self, prompt: Sequence[int], prefer: Sequence[Row] = ()) -> tuple[Row | None, int]:
        """(the row with the longest reusable prefix of ``prompt``, the positions to reuse), or (None, 0)
        when no row gives ``min_reuse``. Ties go to a row in ``prefer`` (no copy needed), then to slots."""
        p = np.asarray(prompt, np.int64)
        best: tuple[Row | None, int] = (None, 0)
        rank = {row: i for i, row in enumerate(prefer)}
        for row, entry in self._rows.items():
            n = min(len(p), len(entry.tokens))
            diff = np.flatnonzero(entry.tokens[:n] != p[:n])
            reuse = (int(diff[0]) if diff.size else n) - 1
            if reuse < self.min_reuse:
                continue
            key = (reuse, row in rank, row[0] == "slot")
            if best[0] is None or key > (best[1], best[0] in rank, best[0][0] == "slot"):
                best = (row, reuse)
        if best[0] is not None:
            self._rows[best[0]].used = next(self._clock)
        return best

    def pool_victim(self, keep: Row | None = None) -> Row | None:
        """The pool row to overwrite next: an empty one, else the least recently used (never ``keep``)."""
        rows = [("pool", j) for j in range(self.pool_rows) if ("pool", j) != keep]
        if not rows:
            return None
        empty = [r for r in rows if r not in self._rows]
        return empty[0] if empty else min(rows, key=lambda r: self._rows[r].used)

    def worth_keeping(self, slot: int) -> bool:
        """The slot holds a reusable prefix that no pool row already holds whole."""
        entry = self._rows.get(("slot", slot))
        if entry is None or not self.pool_rows:
            return False
        return not any(
            row[0] == "pool"
            and len(e.tokens) >= len(entry.tokens)
            and np.array_equal(e.tokens[: len(entry.tokens)], entry.tokens)
            for row, e in self._rows.items()
        )
