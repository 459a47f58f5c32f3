"""Prompts without a dataset: user turns sampled from the target itself (the Magpie method).

An aligned chat model given only its template's "pre-query" text (BOS, system prompt, user header:
everything a user turn's content follows) writes a plausible user query and closes the turn with its
end-of-turn token. Those queries, answered by the same model (``regenerate_conversations``), are
training conversations drawn from the target's own distribution, with no dataset at all.

Defaults follow Magpie (Xu et al., 2024): temperature 1.0, top_p 1.0 (the full distribution, for
variety). Sampled turns are dropped when they did not end (hit the token cap), are too short, or
repeat an earlier one: same text after normalising whitespace and case, or the same first 8 words
(a cheap near-duplicate rule: the many "Write a short story about ..." openings). Batches are drawn
until N distinct queries or the sample cap; each batch has its own seed derived from (seed, batch),
and each row its own random stream, so the same seed gives the same queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
from tqdm.auto import tqdm

from eagle_jax.config import ConfigError
from eagle_jax.training.chat import DataError, end_of_turn_ids, pre_query
from eagle_jax.training.regenerate import RegenStats, regenerate_conversations
from eagle_jax.training.replies import ReplyWriter

NEAR_DUPLICATE_WORDS = 8


@dataclass
class SynthStats:
    wanted: int = 0
    sampled: int = 0  # user turns sampled
    kept: int = 0
    unfinished: int = 0  # reached the token cap without an end-of-turn token
    too_short: int = 0
    duplicates: int = 0  # the same text as a kept one (whitespace and case normalised)
    near_duplicates: int = 0  # the same first NEAR_DUPLICATE_WORDS words as a kept one

    def summary(self) -> str:
        return (
            f"{self.kept}/{self.wanted} user turns synthesised from {self.sampled} samples; dropped {self.unfinished} "
            f"unfinished (token cap), {self.too_short} too short, {self.duplicates} duplicates, "
            f"{self.near_duplicates} near-duplicates (same first {NEAR_DUPLICATE_WORDS} words)"
        )


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def batch_seed(seed: int, batch: int) -> int:
    """A distinct generation seed for each batch of a run."""
    return int(np.random.SeedSequence([seed, batch]).generate_state(1)[0])


def synthesize_prompts(
    writer: ReplyWriter,
    tokenizer: Any,
    n: int,
    *,
    system: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    min_chars: int = 10,
    max_samples: int | None = None,
    seed: int = 0,
    exclude: Iterable[str] = (),
    progress: bool = True,
) -> tuple[list[str], SynthStats]:
    """Up to ``n`` distinct user queries written by the writer's target, sampled a batch of the writer's slots at a
    time, after its template's pre-query text
    (``system``: a system message first, else the template's default). Samples at most
    ``max_samples`` (default ``10 * n``) turns; fewer than ``n`` come back when that cap is reached.
    ``exclude``: queries kept before (an earlier shard of the same run), which count as duplicates."""
    if n < 1:
        raise ConfigError(f"the number of prompts to synthesise must be >= 1, got {n}")
    if temperature <= 0:
        raise ConfigError(
            "synthesising prompts needs sampling (temperature > 0): greedy decoding writes the same query every time"
        )
    head = tokenizer(pre_query(tokenizer, system), add_special_tokens=False)["input_ids"]
    if not head:
        raise DataError(
            "chat template: the text before a user turn is empty; there is nothing to continue into a query"
        )
    stops = sorted(set(writer.eos_ids) | end_of_turn_ids(tokenizer))
    cap = max_samples if max_samples is not None else 10 * n
    stats = SynthStats(wanted=n)
    seen = {normalise(t) for t in exclude}
    seen_near = {" ".join(k.split()[:NEAR_DUPLICATE_WORDS]) for k in seen}
    out: list[str] = []
    bar = tqdm(total=n, desc="synthesising prompts", unit=" prompt", disable=not progress)
    batch = 0
    while len(out) < n and stats.sampled < cap:
        replies = writer.write(
            [head] * writer.slots,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=batch_seed(seed, batch),
            stop_ids=stops,
        )
        batch += 1
        for toks in replies:
            if len(out) == n or stats.sampled == cap:
                break
            stats.sampled += 1
            text = tokenizer.decode(toks, skip_special_tokens=True).strip()
            key = normalise(text)
            near = " ".join(key.split()[:NEAR_DUPLICATE_WORDS])
            if not toks or toks[-1] not in stops:
                stats.unfinished += 1
            elif len(text) < min_chars:
                stats.too_short += 1
            elif key in seen:
                stats.duplicates += 1
            elif near in seen_near:
                stats.near_duplicates += 1
            else:
                seen.add(key)
                seen_near.add(near)
                out.append(text)
                bar.update(1)
        bar.set_postfix(sampled=stats.sampled, dropped=stats.sampled - len(out))
    bar.close()
    stats.kept = len(out)
    return out, stats


def synthesize_conversations(
    writer: ReplyWriter,
    tokenizer: Any,
    n: int,
    *,
    system: str | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    query_max_tokens: int = 256,
    query_temperature: float = 1.0,
    query_top_p: float = 1.0,
    min_chars: int = 10,
    max_samples: int | None = None,
    seed: int = 0,
    exclude: Iterable[str] = (),
    progress: bool = True,
) -> tuple[list[list[dict[str, str]]], SynthStats, RegenStats]:
    """``n`` conversations [system?, user, assistant], both turns written by the writer's target: the queries by
    ``synthesize_prompts`` (``query_*`` settings), the replies by ``regenerate_conversations``
    (``max_new_tokens``, ``temperature``, ``top_p``)."""
    prompts, synth = synthesize_prompts(
        writer,
        tokenizer,
        n,
        system=system,
        max_new_tokens=query_max_tokens,
        temperature=query_temperature,
        top_p=query_top_p,
        min_chars=min_chars,
        max_samples=max_samples,
        seed=seed,
        exclude=exclude,
        progress=progress,
    )
    first = [{"role": "system", "content": system}] if system is not None else []
    convs, regen = regenerate_conversations(
        writer,
        [first + [{"role": "user", "content": p}] for p in prompts],
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        progress=progress,
    )
    return convs, synth, regen
