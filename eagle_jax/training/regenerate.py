"""Regeneration: every assistant turn of a conversation written by the target itself.

A conversation that ends with a user turn (a prompt-only record, the usual starting point) gets a
reply appended; existing assistant turns are replaced. Turns are generated in order, each conditioned
on the target's own earlier replies (the context the drafter will see at inference). Prompts are
rendered with the target's chat template and its generation prompt, and answered by a
``training.replies.ReplyWriter`` (continuous batching; plain, or speculative with a drafter: same output
when greedy, same distribution when sampling), stopping at the template's end-of-turn tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from eagle_jax.training.chat import DataError, end_of_turn_ids, messages_of
from eagle_jax.training.replies import ReplyWriter

NO_USER_TURN = "no user turn to answer"
ASSISTANT_FIRST = "an assistant turn before any user turn"


@dataclass
class RegenStats:
    conversations: int = 0
    turns: int = 0
    truncated: int = 0  # conversations cut before a turn whose prompt + reply would not fit
    dropped_at_limit: int = 0  # of those, cut before their first turn: nothing left to write
    unfinished: int = 0  # replies that reached max_new_tokens without an end-of-turn token
    generated_tokens: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> conversations with nothing to answer

    @property
    def written(self) -> int:
        return self.conversations - sum(self.skipped.values()) - self.dropped_at_limit

    def summary(self) -> str:
        skipped = "".join(f"; {n} skipped ({why})" for why, n in sorted(self.skipped.items()))
        return (
            f"{self.turns} assistant turns generated in {self.written}/{self.conversations} conversations "
            f"({self.generated_tokens} tokens, {self.unfinished} replies cut at max_new_tokens); "
            f"{self.truncated} conversations cut at the context limit ({self.dropped_at_limit} of them before "
            f"their first reply){skipped}"
        )


def conversation_of(record: Any, where: str) -> list[dict[str, str]]:
    """The chat of a ``messages`` / ShareGPT ``conversations`` record, or a ``{"prompt": str}`` record
    as one user turn."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    msgs = messages_of(record, where)
    if msgs is not None:
        return msgs
    if "text" not in record and "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise DataError(f"{where}: 'prompt' must be a string")
        return [{"role": "user", "content": record["prompt"]}]
    raise DataError(
        f"{where}: regeneration needs 'messages', 'conversations' or 'prompt' (a user turn to answer) records; "
        f"has keys {sorted(record)}"
    )


def unanswerable(conversation: list[dict[str, str]]) -> str | None:
    """Why the target has nothing to answer in this conversation (None: it has)."""
    roles = [m["role"] for m in conversation]
    if "user" not in roles:
        return NO_USER_TURN
    if "assistant" in roles and roles.index("assistant") < roles.index("user"):
        return ASSISTANT_FIRST
    if "assistant" not in roles and roles[-1] != "user":
        return NO_USER_TURN  # e.g. [user, system]: no reply expected
    return None


def regenerate_conversations(
    writer: ReplyWriter,
    conversations: list[list[dict[str, str]]],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[list[dict[str, str]]], RegenStats]:
    """Returns the conversations with every assistant ``content`` produced by the writer's target, a reply
    appended to each that ends with a user turn (reply i of a turn draws with seed ``seed + 1000 * turn + i``).

    Conversations with nothing to answer (``unanswerable``) are left out and counted. A conversation
    whose prompt plus ``max_new_tokens`` would exceed the target's context is cut before that turn
    (kept if an assistant turn survives, left out otherwise).
    """
    stats = RegenStats(conversations=len(conversations))
    convs: list[list[dict[str, str]] | None] = []
    for conv in conversations:
        why = unanswerable(conv)
        if why is not None:
            stats.skipped[why] += 1
            convs.append(None)
            continue
        conv = list(conv)
        if conv[-1]["role"] == "user":
            conv.append({"role": "assistant", "content": ""})  # filled below
        convs.append(conv)
    stops = sorted(set(writer.eos_ids) | end_of_turn_ids(tokenizer))
    alive = [c is not None for c in convs]
    limit = writer.target.config.max_position_embeddings
    turns = [[i for i, m in enumerate(c) if m["role"] == "assistant"] if c else [] for c in convs]
    bar = tqdm(total=sum(map(len, turns)), desc="regenerating", unit=" turn", disable=not progress)
    for k in range(max(map(len, turns), default=0)):
        jobs = []  # (conversation, message index, prompt ids)
        for ci, conv in enumerate(convs):
            if not alive[ci] or len(turns[ci]) <= k:
                continue
            at = turns[ci][k]
            ids = tokenizer.apply_chat_template(conv[:at], tokenize=True, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
            if len(ids) + max_new_tokens > limit:
                alive[ci] = False
                stats.truncated += 1
                bar.update(len(turns[ci]) - k)
                if k > 0:
                    convs[ci] = conv[:at]
                else:
                    convs[ci] = None
                    stats.dropped_at_limit += 1
                continue
            jobs.append((ci, at, list(ids)))
        replies = writer.write(
            [j[2] for j in jobs],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed + 1000 * k,
            stop_ids=stops,
            on_reply=lambda: bar.update(1),
        )
        for (ci, at, _), toks in zip(jobs, replies):
            convs[ci][at] = {"role": "assistant", "content": tokenizer.decode(toks, skip_special_tokens=True)}
            stats.turns += 1
            stats.generated_tokens += len(toks)
            stats.unfinished += not (toks and toks[-1] in stops)
    bar.close()
    return [c for c in convs if c is not None], stats


def prompt_of(record: Any, where: str) -> str:
    """The text a ``{"prompt": str}`` record asks the target to continue."""
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: continuation needs {{'prompt': str}} records with some text, got {keys}")
    return record["prompt"]


def continue_prompts(
    writer: ReplyWriter,
    prompts: list[str],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[dict[str, str]], RegenStats]:
    """``{"prompt": p, "text": continuation}`` for each prompt: the target's own continuation of the raw text
    (no chat template: base models), up to ``max_new_tokens`` or its end-of-sequence token. Training reads
    these records with the prompt as context and learns the continuation (``training.data.encode_text``).

    A prompt whose tokens plus ``max_new_tokens`` exceed the target's context is left out and counted
    (``dropped_at_limit``)."""
    stats = RegenStats(conversations=len(prompts))
    stops = sorted(writer.eos_ids)
    limit = writer.target.config.max_position_embeddings
    jobs = []  # (prompt index, prompt ids)
    for i, text in enumerate(prompts):
        ids = list(tokenizer(text)["input_ids"])
        if len(ids) + max_new_tokens > limit:
            stats.truncated += 1
            stats.dropped_at_limit += 1
            continue
        jobs.append((i, ids))
    bar = tqdm(total=len(jobs), desc="continuing", unit=" prompt", disable=not progress)
    replies = writer.write(
        [j[1] for j in jobs],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        on_reply=lambda: bar.update(1),
    )
    texts: dict[int, str] = {}
    for (i, _), toks in zip(jobs, replies):
        texts[i] = tokenizer.decode(toks, skip_special_tokens=True)
        stats.turns += 1
        stats.generated_tokens += len(toks)
        stats.unfinished += not (toks and toks[-1] in stops)
    bar.close()
    return [{"prompt": prompts[i], "text": texts[i]} for i in sorted(texts)], stats
