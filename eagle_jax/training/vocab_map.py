"""The draft vocabulary: d2t / t2d from loss-masked token frequencies of the training data.

Count how often each target token id appears at loss-masked positions, keep the ``draft_vocab_size``
most frequent (ties broken by the smaller id, so the result is deterministic), sort them ascending
(``used``) and store ``d2t[i] = used[i] - i`` (offsets: target_id = i + d2t[i]) and
``t2d[j] = j in used``. With Vd == V the map is the identity (all-zero d2t).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from eagle_jax.checkpoint.eagle_drafter import validate_d2t
from eagle_jax.training.data import Sample


def token_counts(samples: Iterable[Sample], vocab_size: int) -> np.ndarray:
    """int64 [V]: occurrences of each id at positions with loss_mask == 1."""
    counts = np.zeros((vocab_size,), np.int64)
    for s in samples:
        ids = s.input_ids[s.loss_mask.astype(bool)]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token id {int(ids.max())} outside the vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab_map(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [Vd], t2d bool [V]) keeping the ``draft_vocab_size`` most frequent ids."""
    counts = np.asarray(counts)
    v = counts.shape[0]
    if not 0 < draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..{v}")
    order = np.lexsort((np.arange(v), -counts))  # by count descending, then id ascending
    used = np.sort(order[:draft_vocab_size]).astype(np.int64)
    d2t = used - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros((v,), bool)
    t2d[used] = True
    return d2t, t2d


def coverage(counts: np.ndarray, t2d: np.ndarray) -> float:
    """Fraction of loss-masked tokens whose id is in the draft vocabulary (the best possible step-0 hit rate)."""
    total = counts.sum()
    return float(counts[t2d].sum() / total) if total else 0.0


def save_vocab_map(path: str | Path, d2t: np.ndarray, t2d: np.ndarray) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # a file object: np.savez would otherwise append ".npz"
        np.savez(f, d2t=np.asarray(d2t, np.int64), t2d=np.asarray(t2d, bool))


def load_vocab_map(path: str | Path, vocab_size: int, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Reads and validates a map written by ``save_vocab_map`` for this (V, Vd)."""
    with np.load(path) as f:
        if "d2t" not in f:
            raise ValueError(f"{path}: no 'd2t' array")
        d2t = validate_d2t(f["d2t"], vocab_size, str(path))
        t2d = f["t2d"].astype(bool) if "t2d" in f else None
    if d2t.shape[0] != draft_vocab_size:
        raise ValueError(f"{path}: d2t has {d2t.shape[0]} entries, draft_vocab_size is {draft_vocab_size}")
    derived = np.zeros((vocab_size,), bool)
    derived[np.arange(draft_vocab_size) + d2t] = True
    if t2d is not None and not np.array_equal(t2d, derived):
        raise ValueError(f"{path}: 't2d' disagrees with 'd2t'")
    return d2t, derived
