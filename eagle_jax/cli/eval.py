"""Measure a drafter's REAL acceptance length with the engine on a held-out set.

Usage: ``eagle-jax-eval --target T --drafter DIR --data heldout.jsonl [--k 5] [--tree 8,5,48]
[--max-new-tokens 128] [--temperature 0] [--limit 64] [--batch-size 16] [--out result.json]``

T: an HF checkpoint directory or Hub repo id, a .gguf file, or a named model (``smollm2-135m-instruct``,
``gemma-3-270m``).

Records: chats (``messages`` / ShareGPT ``conversations``: the conversation up to its first
assistant turn, rendered with the chat template and a generation prompt) or ``{"prompt": ...}`` /
``{"text": ...}`` (the prompt, else the text, as a completion prompt). Simulated AL (from training
accuracies) picks checkpoints cheaply; this is the number users get.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eagle_jax import SpecConfig, generate, load_drafter, load_target, load_tokenizer
from eagle_jax.training.data import DataError, messages_of, read_jsonl


def eval_prompts(path: str, tokenizer, limit: int | None) -> list[list[int]]:
    """Token ids of the first ``limit`` records' prompts (chat records: up to the first assistant turn)."""
    prompts = []
    for where, record in read_jsonl(path):
        messages = messages_of(record, where)
        if messages is not None:
            first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
            ids = tokenizer.apply_chat_template(
                messages[:first], tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        elif isinstance(record.get("prompt") or record.get("text"), str):
            ids = tokenizer.encode(record.get("prompt") or record["text"], add_special_tokens=False)
        else:
            raise DataError(f"{where}: needs 'messages', 'conversations', 'prompt' or 'text'")
        prompts.append(list(ids))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise DataError(f"{path}: no records")
    return prompts


def evaluate(
    target, drafter, prompts, spec: SpecConfig, *, max_new_tokens: int, temperature: float, batch_size: int, eos
) -> dict:
    """AL (tokens per target forward, bonus counted once) pooled over rounds and its per-prompt mean."""
    accepted, per_prompt = [], []
    for start in range(0, len(prompts), batch_size):
        res = generate(
            target,
            drafter,
            prompts[start : start + batch_size],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            spec=spec,
            eos_token_id=eos,
            seed=start,
        )
        for row in res.accepted:
            if row:
                accepted.extend(row)
                per_prompt.append(float(np.mean(row)) + 1)
    k = spec.max_emitted - 1
    return {
        "spec": spec.__dict__,
        "acceptance_length": float(np.mean(accepted)) + 1,
        "acceptance_length_per_prompt_mean": float(np.mean(per_prompt)),
        "position_acceptance": [float(np.mean([a > i for a in accepted])) for i in range(k)],
        "rounds": len(accepted),
        "prompts": len(per_prompt),
    }


def run(argv: list[str] | None = None) -> dict:
    """The command; returns what it writes to ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--target",
        required=True,
        help="HF target checkpoint directory or Hub repo id, a .gguf file, or a named model (eagle-jax-fetch --list)",
    )
    p.add_argument("--drafter", required=True, help="drafter checkpoint directory or Hub repo id")
    p.add_argument("--data", required=True)
    p.add_argument("--tokenizer", help="a directory, Hub repo id, .gguf file or named model (default: the target's)")
    p.add_argument("--k", type=int, default=5, help="chain speculation depth")
    p.add_argument("--tree", help="also a tree: top_k,depth,total_tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out")
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer or args.target)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    prompts = eval_prompts(args.data, tok, args.limit)
    specs = [SpecConfig(num_speculative_tokens=args.k)]
    if args.tree:
        k, d, n = (int(x) for x in args.tree.split(","))
        specs.append(SpecConfig(method="tree", tree_top_k=k, tree_depth=d, tree_total_tokens=n))
    results = []
    for spec in specs:
        r = evaluate(
            target,
            drafter,
            prompts,
            spec,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            batch_size=args.batch_size,
            eos=tok.eos_token_id,
        )
        results.append(r)
        acc = " ".join(f"{a:.2f}" for a in r["position_acceptance"])
        print(
            f"{spec.method} {'K=' + str(spec.num_speculative_tokens) if spec.method == 'chain' else args.tree}: "
            f"AL {r['acceptance_length']:.3f} over {r['rounds']} rounds of {r['prompts']} prompts; per position {acc}"
        )
    out = {
        "target": args.target,
        "drafter": args.drafter,
        "data": args.data,
        "temperature": args.temperature,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    """The console script (which exits with what ``main`` returns: nothing, so status 0)."""
    run(argv)


if __name__ == "__main__":
    main()
