"""Logits processors written independently of the engine (numpy, one row at a time), as vLLM defines
them: what the engine's ``decoding/penalties.py`` and ``sampling.target_probs`` must match."""

from __future__ import annotations

import numpy as np


def processed(
    logits: np.ndarray,
    prompt,
    generated,
    *,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict | None = None,
    min_tokens: int = 0,
    stop_ids=(),
) -> np.ndarray:
    """One position's logits [V] after ``generated`` tokens (the prompt's excluded) under the processors."""
    x = np.asarray(logits, np.float64).copy()
    if len(generated) < min_tokens:
        x[list(stop_ids)] = -np.inf
    for t, b in (logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(x)).astype(np.float64)
    seen = counts > 0
    seen[list(prompt)] = True
    x = np.where(seen, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    return x - frequency_penalty * counts - presence_penalty * (counts > 0)


def probs(x: np.ndarray, temperature: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The sampling distribution of processed logits: temperature, then min-p."""
    z = x / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    p = np.where(p < min_p * p.max(), 0.0, p)
    return p / p.sum()
