"""Regenerate the assistant turns of a chat dataset with the target model itself (SPEC 7).

Usage: ``eagle-jax-regenerate --target DIR --data in.jsonl --out out.jsonl --max-new-tokens 1024
[--drafter DIR] [--temperature 0] [--batch-size 16] [--tokenizer DIR] [--limit N]``

Input records: ``{"messages": [...]}`` or ShareGPT ``{"conversations": [...]}``; output records are
``{"messages": [...]}`` with every assistant turn replaced by the target's reply, ready for ``eagle-jax-train``.
A drafter (optional) only makes it faster: greedy output is the target's own either way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_jax import load_drafter, load_target
from eagle_jax.training.data import DataError, check_chat_template, messages_of, read_jsonl
from eagle_jax.training.regenerate import regenerate_conversations


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HF target checkpoint directory or Hub repo id")
    p.add_argument("--data", required=True, help="input JSONL (chat or ShareGPT records)")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--drafter", help="EAGLE drafter directory or Hub repo id, to speed generation up (optional)")
    p.add_argument("--tokenizer", help="default: the target directory")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default=None, help="target dtype (default: the checkpoint's)")
    p.add_argument("--limit", type=int, help="only the first N conversations")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer  # after parsing: --help stays fast

    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
    check_chat_template(tok, args.tokenizer or args.target)
    conversations = []
    for where, record in read_jsonl(args.data):
        msgs = messages_of(record, where) if isinstance(record, dict) else None
        if msgs is None:
            raise DataError(f"{where}: regeneration needs 'messages' or 'conversations' records")
        conversations.append(msgs)
        if args.limit and len(conversations) >= args.limit:
            break
    target = load_target(args.target, args.dtype)
    drafter = load_drafter(args.drafter, target) if args.drafter else None
    out, stats = regenerate_conversations(target, conversations, tok, max_new_tokens=args.max_new_tokens,
                                          temperature=args.temperature, drafter=drafter, batch_size=args.batch_size, seed=args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for msgs in out:
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
    print(f"{stats.summary()} -> {args.out}")


if __name__ == "__main__":
    main()
