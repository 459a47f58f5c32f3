"""Regeneration (SPEC 7): replace every assistant turn of a conversation by the target's own reply.

Turns are regenerated in order, each conditioned on the regenerated turns before it (the context the
drafter will see at inference). Prompts are rendered with the target's chat template and a generation
prompt, and run through ``eagle_jax.generate`` (plain, or speculative with a drafter: same output
when greedy, same distribution when sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target


@dataclass
class RegenStats:
    conversations: int = 0
    turns: int = 0
    truncated: int = 0  # conversations cut before a turn whose prompt + reply would not fit
    generated_tokens: int = 0

    def summary(self) -> str:
        return (
            f"{self.turns} assistant turns regenerated in {self.conversations} conversations "
            f"({self.generated_tokens} tokens); {self.truncated} conversations cut at the context limit"
        )


def regenerate_conversations(
    target: Target,
    conversations: list[list[dict[str, str]]],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    drafter: Drafter | None = None,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[list[dict[str, str]]], RegenStats]:
    """Returns the conversations with every assistant ``content`` produced by ``target``.

    A conversation whose prompt plus ``max_new_tokens`` would exceed the target's context is cut before
    that turn (kept if an assistant turn survives, dropped otherwise).
    """
    from eagle_jax.generate import generate

    convs = [list(c) for c in conversations]
    alive = [True] * len(convs)
    stats = RegenStats(conversations=len(convs))
    limit = target.config.max_position_embeddings
    n_turns = max((sum(m["role"] == "assistant" for m in c) for c in convs), default=0)
    bar = tqdm(total=sum(sum(m["role"] == "assistant" for m in c) for c in convs), desc="regenerating", unit=" turn", disable=not progress)
    for k in range(n_turns):
        jobs = []  # (conversation, message index, prompt ids)
        for ci, conv in enumerate(convs):
            idx = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
            if not alive[ci] or len(idx) <= k:
                continue
            at = idx[k]
            ids = tokenizer.apply_chat_template(conv[:at], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
            if len(ids) + max_new_tokens > limit:
                alive[ci] = False
                stats.truncated += 1
                convs[ci] = conv[:at] if k > 0 else []
                continue
            jobs.append((ci, at, list(ids)))
        jobs.sort(key=lambda j: len(j[2]))  # similar lengths share a prompt bucket
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            res = generate(target, drafter, [j[2] for j in chunk], max_new_tokens=max_new_tokens, temperature=temperature,
                           seed=seed + start + 1000 * k, tokenizer=tokenizer)
            for (ci, at, _), text, toks in zip(chunk, res.text, res.tokens):
                convs[ci][at] = {"role": "assistant", "content": text}
                stats.turns += 1
                stats.generated_tokens += len(toks)
            bar.update(len(chunk))
    bar.close()
    return [c for c in convs if any(m["role"] == "assistant" for m in c)], stats
