"""Long multi-turn conversations stitched from short ones, so that a drafter trains on long contexts.

A drafter that only ever saw a few hundred tokens of history has never had to attend across thousands
(the attention drift EAGLE-3.1 addresses shows there). Regenerating replies at 2-8k tokens of context is
slow on a small machine; the target's own short conversations, chained turn after turn until a drawn
length is reached, give long histories whose every assistant turn is still the target's own reply.
Each stitched record keeps the first record's system message (if any) and the user/assistant turns of
the rest in order; a record is used at most once.

    python -m eagle_jax.training.long_context IN.jsonl [IN2.jsonl ...] --tokenizer T --out OUT.jsonl \
        --count 64 --min-tokens 1024 --max-tokens 2048
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from eagle_jax.training.chat import DataError
from eagle_jax.training.data import read_jsonl
from eagle_jax.training.regenerate import conversation_of


def stitch(
    conversations: Sequence[list[dict[str, str]]],
    lengths: Sequence[int],
    *,
    count: int,
    min_tokens: int,
    max_tokens: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Up to ``count`` records ``{"messages": [...]}`` of about ``min_tokens``-``max_tokens`` tokens,
    chaining conversations (token length ``lengths[i]`` each, rendered alone) in a seeded random order
    until a length drawn uniformly in that range is reached; stops when the conversations run out."""
    if not 0 < min_tokens <= max_tokens:
        raise DataError(f"need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    rng = np.random.default_rng(seed)
    order = list(rng.permutation(len(conversations)))
    out = []
    while order and len(out) < count:
        goal = int(rng.integers(min_tokens, max_tokens + 1))
        messages: list[dict[str, str]] = []
        total, skipped = 0, []
        while order and total < goal:
            i = order.pop()
            if total + lengths[i] > max_tokens:
                skipped.append(i)  # does not fit this record: left for the next ones
                continue
            turns = conversations[i]
            if messages:
                turns = [m for m in turns if m["role"] != "system"]
            messages += turns
            total += lengths[i]
        order = skipped[::-1] + order if total >= min_tokens else order
        if total >= min_tokens:
            out.append({"messages": messages})
    return out


def load_conversations(paths: Iterable[str | Path]) -> list[list[dict[str, str]]]:
    return [conversation_of(record, where) for path in paths for where, record in read_jsonl(path)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="JSONL conversations (chat / ShareGPT records)")
    ap.add_argument("--tokenizer", required=True, help="a directory, Hub repo id, .gguf file or named model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from eagle_jax.checkpoint.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    convs = load_conversations(args.inputs)
    lengths = [len(tok.encode(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)) for c in convs]
    records = stitch(
        convs, lengths, count=args.count, min_tokens=args.min_tokens, max_tokens=args.max_tokens, seed=args.seed
    )
    if not records:
        raise SystemExit(
            f"no conversation of {args.min_tokens}-{args.max_tokens} tokens could be stitched from {len(convs)}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(records)} conversations of {args.min_tokens}-{args.max_tokens} tokens from {len(convs)} -> {args.out}")


if __name__ == "__main__":
    main()
