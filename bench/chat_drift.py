"""Long-context and template drift on a real chat model: EAGLE-3 vs EAGLE-3.1 drafters (chain K).

Drafters learn from conversations rendered with the target's default chat template. Two studies measure
how much acceptance each keeps when the prompt moves away from that (far longer prompts, other
renderings), on SmolLM2-135M-Instruct by default (AL: mean over prompts of the per-prompt acceptance
length, ± 95% Student-t interval):

1. long: AL vs prompt length. For each of --n-prompts end articles of the shared ``sum.jsonl``
   (a news article after "Summarize: "), the user message ENDS with that same turn, unchanged; before
   it come other sum.jsonl articles ("Background document i:", a fixed per-article order drawn from
   --seed) until the rendered prompt (the tokenizer's chat template with its default system prompt,
   add_generation_prompt=True) reaches L tokens for each L in --contexts, the last background article
   cut at a word boundary so the total lands a few tokens under L. "short" is the end turn alone.
   End articles are drawn among those whose short prompt fits the smallest L, so every length
   continues the same prompts and only the amount of history differs. Greedy; the table gives each
   drafter's AL, AL(EAGLE-3.1) / AL(EAGLE-3) and each drafter's AL relative to its own short AL;
   --plot draws AL vs prompt tokens.
2. robustness: --n-questions first turns taken in turn from mt_bench, alpaca and qa, each under four
   renderings: (a) default: the chat template with its default system prompt; (b) long_system: the
   template with an assistant policy of >= --long-system-tokens tokens as the system prompt; (c)
   no_template: the question and a blank line, no special tokens; (d) paraphrased: template-shaped
   but reworded (another system prompt, "Question: ... Please answer."). The continuation is the
   target's own reply in each case. AL per variant at each --temperatures, and worst/best variant
   ratio per drafter (the goal for EAGLE-3.1: >= 0.85).

    python -m bench.chat_drift                                                     # full run, both studies
    python -m bench.chat_drift --target smollm2-135m-instruct \\
        --drafters assets/smollm2/drafter-eagle3 assets/smollm2/drafter-eagle3.1 --k 5 --max-new 96 \\
        --contexts 1024 2048 4096 8000 --n-prompts 8 --n-questions 16 --temperatures 0 1 \\
        --out bench/results/chat_drift.json --plot bench/results/chat_long.png
    python -m bench.chat_drift --n-prompts 2 --contexts 1024 --n-questions 2 --max-new 8 --temperatures 0 \\
        --out /tmp/chat_drift_smoke.json --plot ''                                 # smoke test

Rows stop at the tokenizer's eos. Prompts longer than the target's context minus --max-new are
dropped with a message. JSON to --out (per-prompt ALs and prompt lengths included).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from bench.common import (
    EVAL,
    acceptance_stats,
    drafter_label,
    fit_prompts,
    fmt_al,
    load_models,
    print_table,
    pyplot,
    round_robin,
    run_batched,
    save_plot,
    stop_ids,
    write_json,
)
from eagle_jax.config import SpecConfig

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFTERS = ("assets/smollm2/drafter-eagle3", "assets/smollm2/drafter-eagle3.1")
SUMMARY_PREFIX = "Summarize: "  # how every sum.jsonl first turn starts
VARIANTS = ("default", "long_system", "no_template", "paraphrased")
ROBUSTNESS_SETS = ("mt_bench", "alpaca", "qa")
PARAPHRASED_SYSTEM = "You are a friendly AI model. Answer the user."
GOAL = 0.85  # EAGLE-3.1's worst variant AL / best variant AL

# A system prompt of the kind deployed assistants carry: several hundred tokens of policy, where the
# default template has a one-line system prompt.
POLICY = """\
You are Aria, the virtual assistant of Northwind Outfitters, an online retailer of outdoor clothing and \
camping equipment. You help customers and staff with product questions, orders, general knowledge and \
everyday writing tasks. Follow the guidelines below in every conversation.

Tone and style:
- Be warm, patient and professional. Address the user directly and never talk down to them.
- Lead with the answer, then give the reasoning or the details that support it.
- Prefer short paragraphs and plain words; explain any technical term the first time you use it.
- Match the user's language. If they write informally, you may be a little more relaxed, but stay polite.
- Do not use emojis unless the user uses them first.

Formatting:
- Use bullet points for lists of three or more items and numbered steps for procedures.
- Use Markdown headings only for answers longer than about three hundred words.
- Put code, commands and configuration snippets in fenced code blocks with a language tag.
- When you give measurements, include metric units and, where useful, imperial ones in brackets.
- Keep answers to everyday questions under two hundred words unless the user asks for more detail.

Accuracy and honesty:
- If you are not sure of a fact, say so and suggest how the user could check it.
- Never invent order numbers, prices, delivery dates, store opening hours or policy details.
- When a question depends on information you do not have, ask one short clarifying question.
- Correct your own earlier mistakes as soon as you notice them.

Safety:
- Do not give instructions that could cause serious harm, including the misuse of stoves, fuel or knives.
- For medical, legal or financial questions, give general information only and recommend a qualified professional.
- For outdoor trips, remind users to check the weather forecast and to tell someone their route.
- Refuse requests for hateful, harassing or sexually explicit content, briefly and without lecturing.

Privacy:
- Never ask for full card numbers, passwords or security codes.
- Do not repeat personal data such as addresses or phone numbers back to the user unless it is needed.
- If a user shares someone else's personal information, do not store or reuse it.

Customer service:
- For returns, explain that unused items can be returned within thirty days with the receipt.
- For damaged goods, apologise once, then explain how to request a replacement.
- Escalate to a human agent when the user asks for one or is clearly frustrated after two attempts.
"""


# ---------------------------------------------------------------------------------------------------
# Prompt building (no model needed)


def first_turns(path: str | Path) -> list[str]:
    """The first turns of a FastChat question file, in file order."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["turns"][0] for r in rows]


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's rendering of ``messages`` with the generation prompt, tokenised as text:
    exactly what the prompt-length budget counts."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def background_doc(i: int, text: str) -> str:
    return f"Background document {i}:\n{text}\n\n"


def article_body(turn: str) -> str:
    """A sum.jsonl turn without its summarisation request: the text used as background."""
    return turn[len(SUMMARY_PREFIX) :] if turn.startswith(SUMMARY_PREFIX) else turn


def long_prompt(tokenizer, end_turn: str, fillers: list[str], length: int) -> dict:
    """A user message of background documents (``fillers`` in order, the last one cut at a word
    boundary) followed by ``end_turn``, whose rendered prompt is at most ``length`` tokens and as close
    to it as a word allows. Returns {"ids", "content", "docs": background documents used}."""

    def build(full: list[str], partial: str | None) -> tuple[list[int], str]:
        docs = full + ([partial] if partial else [])
        content = "".join(background_doc(i + 1, d) for i, d in enumerate(docs)) + end_turn
        return render_ids(tokenizer, [{"role": "user", "content": content}]), content

    ids, content = build([], None)
    if len(ids) > length:
        raise ValueError(f"the end turn alone is {len(ids)} tokens > {length}")
    used: list[str] = []
    for doc in fillers:
        cand = build(used + [doc], None)
        if len(cand[0]) <= length:
            used.append(doc)
            ids, content = cand
            if len(ids) < length:
                continue
            return {"ids": ids, "content": content, "docs": len(used)}
        # Token counts grow with the cut (up to BPE merges at the cut), so a binary search over word
        # ends finds the longest prefix of this document that still fits.
        cuts = [m.start() for m in re.finditer(r"\s+", doc)]
        lo, hi, best = 0, len(cuts) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            cand = build(used, doc[: cuts[mid]])
            if len(cand[0]) <= length:
                (ids, content), best, lo = cand, mid, mid + 1
            else:
                hi = mid - 1
        if best is not None:
            used.append(doc[: cuts[best]])
        return {"ids": ids, "content": content, "docs": len(used)}
    raise ValueError(f"background documents run out at {len(ids)} tokens < {length}")


def long_prompts(tokenizer, turns: list[str], contexts: list[int], n: int, seed: int = 0) -> dict:
    """{"short" or L: [{"ids", "content", "docs", "name"}] for the same ``n`` end turns}.

    End turns are drawn (``seed``) among those whose short prompt fits min(contexts); each one's
    background is the other turns' articles in an order drawn from (seed, its index), the same for
    every L, so a longer context extends a shorter one's history."""
    short_len = [len(render_ids(tokenizer, [{"role": "user", "content": t}])) for t in turns]
    fits = [i for i, s in enumerate(short_len) if s <= min(contexts)]
    if len(fits) < n:
        print(f"only {len(fits)} end articles fit {min(contexts)} tokens (asked for {n})")
    ends = sorted(np.random.default_rng(seed).choice(fits, min(n, len(fits)), replace=False).tolist())
    out: dict = {"short": []}
    out.update({L: [] for L in contexts})
    for e in ends:
        others = [j for j in range(len(turns)) if j != e]
        order = np.random.default_rng([seed, e]).permutation(others)
        fillers = [article_body(turns[j]) for j in order]
        out["short"].append(
            {
                "ids": render_ids(tokenizer, [{"role": "user", "content": turns[e]}]),
                "content": turns[e],
                "docs": 0,
                "name": e,
            }
        )
        for L in contexts:
            out[L].append({**long_prompt(tokenizer, turns[e], fillers, L), "name": e})
    return out


def long_system_prompt(tokenizer, min_tokens: int) -> str:
    """POLICY, its sections repeated in turn as "Reminder" paragraphs until ``min_tokens`` tokens."""
    text = POLICY
    sections = POLICY.split("\n\n")[1:]
    i = 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < min_tokens:
        text += "\nReminder. " + sections[i % len(sections)]
        i += 1
    return text.rstrip("\n")


def is_chatml(tokenizer) -> bool:
    return "<|im_start|>" in (getattr(tokenizer, "chat_template", None) or "")


def chatml(messages: list[dict]) -> str:
    """ChatML text with the generation prompt, rendered by hand (no default system prompt added)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def variant_texts(tokenizer, question: str, long_system: str) -> dict[str, str]:
    """{variant: prompt text} for one question (the four renderings of the module docstring)."""

    def template(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    paraphrased = [
        {"role": "system", "content": PARAPHRASED_SYSTEM},
        {"role": "user", "content": f"Question: {question}\nPlease answer."},
    ]
    return {
        "default": template([{"role": "user", "content": question}]),
        "long_system": template([{"role": "system", "content": long_system}, {"role": "user", "content": question}]),
        "no_template": question + "\n\n",
        "paraphrased": chatml(paraphrased) if is_chatml(tokenizer) else template(paraphrased),
    }


def robustness_prompts(tokenizer, questions: list[str], long_system: str) -> dict[str, list[dict]]:
    """{variant: [{"ids", "text", "name"}]}, one entry per question in every variant."""
    out: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i, q in enumerate(questions):
        for v, text in variant_texts(tokenizer, q, long_system).items():
            out[v].append({"ids": tokenizer.encode(text, add_special_tokens=False), "text": text, "name": i})
    return out


# ---------------------------------------------------------------------------------------------------
# Measurements


def eagle_pair(drafters: dict) -> tuple[str, str] | None:
    """(EAGLE-3 name, EAGLE-3.1 name) when both kinds are among ``drafters``, else None."""
    by_label = {drafter_label(d): name for name, d in drafters.items()}
    return (by_label["EAGLE-3"], by_label["EAGLE-3.1"]) if {"EAGLE-3", "EAGLE-3.1"} <= by_label.keys() else None


def long_study(target, drafters: dict, tokenizer, args, kw: dict) -> tuple[dict, list[list], list[str]]:
    """Study 1: (results, table rows, table header)."""
    limit = target.config.max_position_embeddings
    contexts = sorted(args.contexts)
    try:
        prompts = long_prompts(tokenizer, first_turns(EVAL / "sum.jsonl"), contexts, args.n_prompts, args.seed)
    except ValueError as e:
        raise SystemExit(f"--contexts {max(contexts)}: {e}") from e
    runs, stats = [], {}
    for key, ps in prompts.items():
        ps = fit_prompts(ps, args.max_new, limit)
        prompts[key] = ps
        if not ps:
            print(f"  context {key}: no prompts left")
            continue
        tokens = float(np.mean([len(p["ids"]) for p in ps]))
        for dname, drafter in drafters.items():
            # generate's prefill holds a [rows, heads, L, L] score block: rows shrink as prompts grow.
            rows = max(1, min(args.batch_size, args.batch_tokens // max(len(p["ids"]) for p in ps)))
            st = acceptance_stats(
                run_batched(target, drafter, [p["ids"] for p in ps], **{**kw, "batch_size": rows})["accepted"], args.k
            )
            stats[key, dname] = st
            runs.append(
                {
                    "drafter": dname,
                    "context": key,
                    "mean_prompt_tokens": tokens,
                    "prompt_tokens": [len(p["ids"]) for p in ps],
                    "background_docs": [p["docs"] for p in ps],
                    "end_articles": [p["name"] for p in ps],
                    **st,
                }
            )
            print(f"  context {key} ({tokens:.0f} tokens) | {dname}: AL {fmt_al(st)}", flush=True)
    pair = eagle_pair(drafters)
    names = list(drafters)
    header = (
        ["context", "tokens", "prompts", *(f"AL {n}" for n in names)]
        + (["AL 3.1 / AL 3"] if pair else [])
        + [f"{n} / short" for n in names]
    )
    rows = []
    for key in prompts:
        if (key, names[0]) not in stats:
            continue
        row = [key, f"{np.mean([len(p['ids']) for p in prompts[key]]):.0f}", stats[key, names[0]]["prompts"]]
        row += [fmt_al(stats[key, n]) for n in names]
        if pair:
            row.append(f"{stats[key, pair[1]]['al_mean'] / stats[key, pair[0]]['al_mean']:.2f}")
        row += [
            f"{stats[key, n]['al_mean'] / stats['short', n]['al_mean']:.2f}" if ("short", n) in stats else "-"
            for n in names
        ]
        rows.append(row)
    return {"contexts": contexts, "runs": runs}, rows, header


def robustness_study(target, drafters: dict, tokenizer, args, kw: dict) -> tuple[dict, list[list], list[str]]:
    """Study 2: (results, table rows, table header)."""
    limit = target.config.max_position_embeddings
    questions = round_robin([first_turns(EVAL / f"{s}.jsonl") for s in ROBUSTNESS_SETS], args.n_questions)
    system = long_system_prompt(tokenizer, args.long_system_tokens)
    prompts = robustness_prompts(tokenizer, questions, system)
    # Keep a question only if it fits in every variant, so the variants compare the same questions.
    keep = {
        p["name"]
        for p in fit_prompts(
            [
                {"ids": max((ps[i]["ids"] for ps in prompts.values()), key=len), "name": i}
                for i in range(len(questions))
            ],
            args.max_new,
            limit,
        )
    }
    prompts = {v: [p for p in ps if p["name"] in keep] for v, ps in prompts.items()}
    out = {
        "questions": [questions[i] for i in sorted(keep)],
        "sets": list(ROBUSTNESS_SETS),
        "long_system_tokens": len(tokenizer.encode(system, add_special_tokens=False)),
        "prompt_tokens": {v: float(np.mean([len(p["ids"]) for p in ps])) if ps else 0.0 for v, ps in prompts.items()},
        "runs": [],
        "summary": [],
    }
    rows = []
    for temp in args.temperatures:
        for dname, drafter in drafters.items():
            stats = {}
            for v in VARIANTS:
                r = run_batched(target, drafter, [p["ids"] for p in prompts[v]], **{**kw, "temperature": temp})
                stats[v] = acceptance_stats(r["accepted"], args.k)
                out["runs"].append({"drafter": dname, "temperature": temp, "variant": v, **stats[v]})
                print(f"  T={temp:g} {v} | {dname}: AL {fmt_al(stats[v])}", flush=True)
            worst, best = (
                min(VARIANTS, key=lambda v: stats[v]["al_mean"]),
                max(VARIANTS, key=lambda v: stats[v]["al_mean"]),
            )
            ratio = stats[worst]["al_mean"] / stats[best]["al_mean"]
            out["summary"].append(
                {
                    "drafter": dname,
                    "label": drafter_label(drafter),
                    "temperature": temp,
                    "worst": worst,
                    "best": best,
                    "worst_over_best": ratio,
                }
            )
            rows.append([dname, f"{temp:g}", *(fmt_al(stats[v]) for v in VARIANTS), f"{ratio:.2f} ({worst} / {best})"])
    return out, rows, ["drafter", "T", *VARIANTS, "worst / best"]


def plot_long(runs: list[dict], path: Path, k: int) -> None:
    """AL (95% CI) vs mean prompt tokens, one line per drafter; the short baseline is its first point."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dname in dict.fromkeys(r["drafter"] for r in runs):
        rs = sorted((r for r in runs if r["drafter"] == dname), key=lambda r: r["mean_prompt_tokens"])
        ax.errorbar(
            [r["mean_prompt_tokens"] for r in rs],
            [r["al_mean"] for r in rs],
            yerr=[0 if np.isnan(r["al_ci95"]) else r["al_ci95"] for r in rs],
            marker="o",
            capsize=3,
            label=dname,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens (chat-rendered; leftmost: the article alone)")
    ax.set_ylabel("acceptance length (tokens / target forward)")
    ax.set_title(f"Summarisation prompts with background documents (greedy, chain K={k})")
    save_plot(fig, ax, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--target", default=DEFAULT_TARGET, help="a checkpoint directory, a .gguf file or a named chat model"
    )
    ap.add_argument("--drafters", nargs="+", default=list(DEFAULT_DRAFTERS))
    ap.add_argument("--studies", nargs="+", choices=("long", "robustness"), default=["long", "robustness"])
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8000], help="long study: prompt lengths in tokens"
    )
    ap.add_argument("--n-prompts", type=int, default=8, help="long study: end articles from sum.jsonl")
    ap.add_argument(
        "--n-questions", type=int, default=16, help="robustness study: questions, in turn from mt_bench, alpaca, qa"
    )
    ap.add_argument(
        "--long-system-tokens", type=int, default=400, help="robustness study: minimum length of the long system prompt"
    )
    ap.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="robustness study (the long study is greedy)"
    )
    ap.add_argument("--k", type=int, default=5, help="chain depth")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=4, help="rows per generate call (long prompts need memory)")
    ap.add_argument(
        "--batch-tokens",
        type=int,
        default=8192,
        help=(
            "long study: prompt tokens per generate call at most (a lone longer prompt runs alone); 8k-token rows x4 "
            "exceed 24 GB"
        ),
    )
    ap.add_argument("--seed", type=int, default=0, help="end articles, background order and sampling keys")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="bench/results/chat_drift.json")
    ap.add_argument("--plot", default="bench/results/chat_long.png", help="long study: AL vs length plot ('' for none)")
    args = ap.parse_args(argv)

    target, drafters, tokenizer, source, is_random = load_models(args.target, args.drafters, args.dtype)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SystemExit("bench.chat_drift needs a chat model: a target whose tokenizer has a chat template")
    eos = stop_ids(tokenizer)
    kw = dict(
        spec=SpecConfig(num_speculative_tokens=args.k),
        max_new=args.max_new,
        temperature=0.0,
        eos=eos,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    results = {"models": source, "settings": {k: v for k, v in vars(args).items() if k != "out"}, "eos_ids": list(eos)}
    tables = []
    if "long" in args.studies:
        results["long"], rows, header = long_study(target, drafters, tokenizer, args, kw)
        tables.append(
            (
                f"AL vs prompt length: summarise the last of several news articles (greedy, chain K={args.k}, "
                f"{args.max_new} new tokens, mean ± 95% CI over prompts)",
                header,
                rows,
            )
        )
    if "robustness" in args.studies:
        results["robustness"], rows, header = robustness_study(target, drafters, tokenizer, args, kw)
        r = results["robustness"]
        tables.append(
            (
                f"AL per prompt rendering: {len(r['questions'])} questions from {', '.join(ROBUSTNESS_SETS)} (chain "
                f"K={args.k}, {args.max_new} new tokens; long system prompt {r['long_system_tokens']} tokens; mean "
                "prompt tokens " + ", ".join(f"{v} {t:.0f}" for v, t in r["prompt_tokens"].items()) + ")",
                header,
                rows,
            )
        )
    for title, header, rows in tables:
        print()
        print(title + ("  [RANDOM MODELS: meaningless]" if is_random else ""))
        print_table(header, rows)
    if "robustness" in args.studies:
        for s in results["robustness"]["summary"]:
            if s["label"] == "EAGLE-3.1":
                verdict = "met" if s["worst_over_best"] >= GOAL else "NOT met"
                print(
                    f"goal {s['drafter']} T={s['temperature']:g}: worst/best {s['worst_over_best']:.2f} >= {GOAL}: "
                    f"{verdict}"
                )
    write_json(args.out, results)
    if args.plot and results.get("long", {}).get("runs"):
        plot_long(results["long"]["runs"], Path(args.plot), args.k)
    return results


if __name__ == "__main__":
    main()
