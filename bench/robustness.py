"""Template and system-prompt robustness: the same held-out code tasks under five wrappings, AL per drafter.

EAGLE-3.1's claim is that its normalisations keep a drafter's acceptance when what precedes the
text changes (chat templates, system prompts, earlier turns), which shifts the target's hidden
states. Every condition here continues the SAME code prefix (the last --code-tokens tokens before a
held-out ``def``/``class`` line); only what comes before it differs:

(a) plain        the code alone, as a completion;
(b) chat         the tokenizer's chat template, a user turn asking for the code, no system prompt,
                 and the code as the start of the assistant's reply;
(c) short system (b) with a one-line system prompt;
(d) long system  (b) with a system prompt of --long-system-tokens tokens or more (coding guidelines
                 and a licence text: prose a code model rarely sees at length);
(e) multi-turn   (b) after an unrelated conversation: --turns general-knowledge questions (the
                 shared question sets) each answered by the target itself (greedy, plain decoding).

    python -m bench.robustness                                  # bundled target + both drafters
    python -m bench.robustness --n-prompts 24 --k 5 --max-new 96 --temperature 0 1
    python -m bench.robustness --n-prompts 2 --max-new 16 --turns 1 --long-system-tokens 64   # smoke test

Table: AL (mean over prompts ± 95% t-interval) per drafter and condition, its ratio to (a), and the
spread (max/min - 1 over the five conditions; the goal for EAGLE-3.1 is <= 10%). JSON to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench.common import (
    BUNDLED_DRAFTERS,
    BUNDLED_TARGET,
    TARGET_HELP,
    acceptance_stats,
    fmt_al,
    heldout_code_prompts,
    load_models,
    print_table,
    run_batched,
    stop_ids,
    write_json,
)
from bench.drift import LICENSE_TEXT
from eagle_jax.config import SpecConfig

CONDITIONS = ("plain", "chat", "short system", "long system", "multi-turn")
ASK = "Continue this Python code."
SHORT_SYSTEM = "You are a helpful coding assistant."
GUIDELINES = """\
You are a senior Python engineer reviewing and writing code for a large open-source project.
Follow these rules in every answer:
- Write idiomatic, readable Python 3 that follows PEP 8 and the project's existing style.
- Prefer the standard library; add a dependency only when it saves substantial code.
- Give public functions docstrings that say what they return and which errors they raise.
- Keep functions short; name things for what they mean, not for their type.
- Never swallow exceptions silently; raise errors that name the bad input.
- Keep backwards compatibility unless the user asks otherwise, and say when you break it.
- Comment on why, not on what; delete dead code instead of commenting it out.
"""
QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "qa.jsonl"


def long_system_prompt(tokenizer, min_tokens: int) -> str:
    """The guidelines followed by as much licence text as it takes to reach ``min_tokens`` tokens."""
    text = GUIDELINES + "\nThe project's licence, which your code must respect:\n\n"
    while len(tokenizer.encode(text, add_special_tokens=False)) < min_tokens:
        text += LICENSE_TEXT
    return text


def questions(path: Path, n: int) -> list[str]:
    """The first turns of ``n`` questions from a FastChat question file (the shared eval sets)."""
    if not path.exists():
        raise SystemExit(f"{path}: question file for the multi-turn condition not found (--questions)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def chat_prefix(tokenizer, system: str | None, history: list[dict]) -> list[int]:
    """Tokens of a chat up to the start of the assistant's reply to ``ASK``."""
    messages = (
        ([{"role": "system", "content": system}] if system else []) + history + [{"role": "user", "content": ASK}]
    )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def conversation(target, tokenizer, asked: list[str], max_reply: int) -> list[dict]:
    """An unrelated conversation: each question answered by the target itself (greedy, plain)."""
    import eagle_jax

    history: list[dict] = []
    for q in asked:
        history.append({"role": "user", "content": q})
        ids = tokenizer.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        reply = eagle_jax.generate(
            target, None, [ids], max_new_tokens=max_reply, eos_token_id=list(stop_ids(tokenizer))
        )
        history.append({"role": "assistant", "content": tokenizer.decode(reply.tokens[0], skip_special_tokens=True)})
    return history


def wrapped_prompts(target, tokenizer, code: list[list[int]], args) -> dict[str, list[list[int]]]:
    """{condition: prompt ids} for every code prefix."""
    history = conversation(target, tokenizer, questions(Path(args.questions), args.turns), args.reply_tokens)
    prefixes = {
        "plain": [],
        "chat": chat_prefix(tokenizer, None, []),
        "short system": chat_prefix(tokenizer, SHORT_SYSTEM, []),
        "long system": chat_prefix(tokenizer, long_system_prompt(tokenizer, args.long_system_tokens), []),
        "multi-turn": chat_prefix(tokenizer, None, history),
    }
    return {name: [prefix + c for c in code] for name, prefix in prefixes.items()}


def spread(values: list[float]) -> float:
    """max / min - 1: how far apart the conditions are (0 = identical)."""
    return float(max(values) / min(values) - 1.0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help=TARGET_HELP)
    ap.add_argument("--drafters", nargs="+", default=list(BUNDLED_DRAFTERS))
    ap.add_argument("--n-prompts", type=int, default=24)
    ap.add_argument("--code-tokens", type=int, default=256, help="code prefix length (its last tokens)")
    ap.add_argument("--k", type=int, default=5, help="chain depth")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--long-system-tokens", type=int, default=512)
    ap.add_argument("--turns", type=int, default=3, help="questions in the unrelated conversation")
    ap.add_argument("--reply-tokens", type=int, default=48, help="the target's answer length per question")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/robustness.json")
    args = ap.parse_args(argv)

    target, drafters, tokenizer, source, is_random = load_models(args.target, args.drafters)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SystemExit("bench.robustness needs a tokenizer with a chat template (the bundled target has one)")
    picked = heldout_code_prompts(tokenizer, args.n_prompts, seed=args.seed, min_chars=4 * args.code_tokens)
    code = [p["ids"][-args.code_tokens :] for p in picked]
    prompts = wrapped_prompts(target, tokenizer, code, args)
    lengths = {c: int(np.mean([len(p) for p in ps])) for c, ps in prompts.items()}
    limit = target.config.max_position_embeddings
    if max(len(p) for ps in prompts.values() for p in ps) + args.max_new > limit:
        raise SystemExit(
            f"prompts + --max-new exceed the target's {limit} positions: lower --code-tokens or --long-system-tokens"
        )
    spec = SpecConfig(num_speculative_tokens=args.k)
    eos = stop_ids(tokenizer)
    results = {"models": source, "args": vars(args), "prompt_tokens": lengths, "runs": []}
    rows = []
    for temperature in args.temperature:
        for name, drafter in drafters.items():
            stats = {}
            for cond in CONDITIONS:
                out = run_batched(
                    target,
                    drafter,
                    prompts[cond],
                    spec=spec,
                    max_new=args.max_new,
                    temperature=temperature,
                    eos=eos,
                    seed=args.seed,
                    batch_size=args.batch_size,
                )
                stats[cond] = acceptance_stats(out["accepted"], args.k)
                results["runs"].append({"drafter": name, "temperature": temperature, "condition": cond, **stats[cond]})
            base = stats["plain"]["al_mean"]
            als = [stats[c]["al_mean"] for c in CONDITIONS]
            rows.append(
                [
                    name,
                    f"{temperature:g}",
                    *(f"{fmt_al(stats[c])} ({stats[c]['al_mean'] / base:.2f})" for c in CONDITIONS),
                    f"{spread(als):.0%}",
                ]
            )
    print(
        f"prompt tokens (mean): {lengths}; chain K={args.k}, {args.max_new} new tokens, {len(code)} held-out code "
        "prefixes" + ("  [RANDOM MODELS: meaningless]" if is_random else "")
    )
    print_table(["drafter", "T", *(f"{c} (/plain)" for c in CONDITIONS), "spread"], rows)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
