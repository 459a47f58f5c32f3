"""The ``logprobs`` objects of OpenAI's two endpoints, from the target's scores of a choice's tokens.

Completions (OpenAI's legacy format, as vLLM answers it): ``tokens``, ``token_logprobs``,
``top_logprobs`` (per token a dict of the ``logprobs`` most likely tokens, plus the chosen one when it is
not among them) and ``text_offset`` (each token's start in the choice's text). With ``echo`` the prompt's
tokens come first, the very first with null (it has no context). Chat: ``content``, a list of
``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``.

The numbers are the target's raw log-softmax (``decoding.scoring``), so they are the same with and
without speculation. A log-probability of -inf is written as -9999.0, as vLLM does (JSON has no -inf).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from eagle_jax.decoding.scoring import TokenLogprobs

NEG_INF = -9999.0


def _number(x: float) -> float | None:
    if math.isnan(x):
        return None
    return NEG_INF if x == -math.inf else float(x)


class TokenNames:
    """Token ids -> the strings logprobs show: each token decoded alone (special tokens included), or
    ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``, unambiguous where bytes split a character)."""

    def __init__(self, tokenizer: Any, as_ids: bool):
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        missing = sorted({int(t) for t in ids} - self._cache.keys())
        if missing:
            names = (
                [f"token_id:{t}" for t in missing]
                if self.as_ids
                else self.tokenizer.batch_decode([[t] for t in missing])
            )
            self._cache.update(zip(missing, names))
        return [self._cache[int(t)] for t in ids]


def completion_logprobs(
    scores: TokenLogprobs,
    ids: Sequence[int],
    start: int,
    top_n: int,
    names: TokenNames,
    end: int | None = None,
    offset: int = 0,
) -> dict:
    """Entries ``start..end`` of a scored sequence (from 0 with echo, else from the prompt's length; a
    streamed chunk's tokens), their ``text_offset`` counted from ``offset`` (the choice's text before them)."""
    end = len(ids) if end is None else end
    chosen = names(ids[start:end])
    tops: list[dict[str, float] | None] = []
    for i in range(start, end):
        if math.isnan(scores.logprob[i]):
            tops.append(None)
            continue
        alt = [int(t) for t in scores.top_ids[i, :top_n]]
        vals = [float(v) for v in scores.top_logprobs[i, :top_n]]
        if int(ids[i]) not in alt:
            alt.append(int(ids[i]))
            vals.append(float(scores.logprob[i]))
        tops.append({name: _number(v) for name, v in zip(names(alt), vals)})
    offsets, at = [], offset
    for s in chosen:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": chosen,
        "token_logprobs": [_number(float(x)) for x in scores.logprob[start:end]],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    scores: TokenLogprobs, ids: Sequence[int], start: int, top_n: int, names: TokenNames, end: int | None = None
) -> dict:
    """The generated entries ``start..end`` (from the prompt's length; a streamed chunk's tokens) as chat's
    ``logprobs.content``."""
    end = len(ids) if end is None else end

    def entry(name: str, value: float) -> dict:
        return {"token": name, "logprob": _number(value), "bytes": list(name.encode("utf-8"))}

    content = []
    for i, name in zip(range(start, end), names(ids[start:end])):
        alt = [int(t) for t in scores.top_ids[i, :top_n]]
        vals = [float(v) for v in scores.top_logprobs[i, :top_n]]
        content.append(
            {**entry(name, float(scores.logprob[i])), "top_logprobs": [entry(n, v) for n, v in zip(names(alt), vals)]}
        )
    return {"content": content}
