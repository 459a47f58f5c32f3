"""The default speculation as a user meets it: a fresh process (nothing compiled, nothing measured), calls of the
default one after another on held-out prompts, against plain decoding and every fixed chain run on the same
prompts after a warm-up.

    python -m bench.auto_fresh                                      # bundled pair, 8 held-out code prompts
    python -m bench.auto_fresh --temperature 1
    python -m bench.auto_fresh --target smollm2-135m-instruct --drafter assets/smollm2/drafter-eagle3.1 --questions

Models loaded, the heap is frozen out of Python's collector (``gc.freeze``, as the README advises). Per call: the
default's wall time, its compile time and its run time (wall less compiles: the warm-up profile and
every choice included); the fixed configurations' run times (their programs compiled and run once before). Totals
over the sequence: the default against the best fixed chain and against plain decoding, and the calls that compiled
after the first call at their prompt bucket (goal: none). Greedy outputs are checked equal to plain decoding's.
"""

from __future__ import annotations

import argparse
import gc
import time

import eagle_jax
from bench.common import (
    BUNDLED_DRAFTER,
    EVAL,
    TARGET_HELP,
    chat_prompts,
    heldout_code_prompts,
    load_models,
    print_table,
    stop_ids,
    write_json,
)
from eagle_jax import SpecConfig
from eagle_jax.decoding import auto_run, chooser
from eagle_jax.decoding.calls import bucket


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help=TARGET_HELP)
    ap.add_argument("--drafter", default=str(BUNDLED_DRAFTER))
    ap.add_argument(
        "--questions", action="store_true", help="held-out chat questions (mt_bench, gsm8k, alpaca) instead of code"
    )
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts' pick")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="an ablation: a constant of decoding.chooser or decoding.auto_run, e.g. auto_run.PLAIN_LOOKS=1000",
    )
    ap.add_argument("--out", default="bench/results/auto_fresh.json")
    args = ap.parse_args(argv)
    for item in args.set:
        name, value = item.split("=", 1)
        module, const = name.split(".")
        mod = {"chooser": chooser, "auto_run": auto_run}[module]
        setattr(mod, const, type(getattr(mod, const))(float(value)))

    target, drafters, tokenizer, source, _ = load_models(args.target, [args.drafter], args.dtype)
    drafter = next(iter(drafters.values()))
    eos = list(stop_ids(tokenizer))
    if args.questions:
        files = [EVAL / f"{name}.jsonl" for name in ("mt_bench", "gsm8k", "alpaca")]
        prompts = chat_prompts(files, tokenizer, per_file=args.calls)[: args.calls]
    else:
        prompts = heldout_code_prompts(tokenizer, args.calls, seed=args.seed, vocab_size=target.config.vocab_size)
    kw = dict(max_new_tokens=args.max_new, temperature=args.temperature, eos_token_id=eos)
    gc.collect()
    gc.freeze()  # as the README advises a process that calls generate in a loop: collections walk only what calls made

    calls, buckets = [], set()
    for i, p in enumerate(prompts):  # the default, first: as the process meets it
        t0 = time.perf_counter()
        r = eagle_jax.generate(target, drafter, [p["ids"]], seed=i, **kw)
        wall = time.perf_counter() - t0
        first_at_bucket = bucket(len(p["ids"])) not in buckets
        buckets.add(bucket(len(p["ids"])))
        calls.append(
            {
                "prompt": p["name"],
                "tokens": r.num_generated,
                "wall_s": wall,
                "compile_s": r.compile_s,
                "auto_s": wall - r.compile_s,
                "compiled_again": r.compile_s > 0 and not first_at_bucket,
                "chunks": r.stats["chunks"],
                "auto_tokens": r.tokens,
            }
        )
        print(
            f"call {i}: {p['name']} {r.num_generated} tokens, wall {wall:.2f} s (compile {r.compile_s:.2f}), chunks "
            f"{r.stats['chunks']}",
            flush=True,
        )

    fixed = {
        "plain": (None, None),
        **{f"K={k}": (drafter, SpecConfig(num_speculative_tokens=k)) for k in chooser.DEPTHS},
    }
    one_per_bucket = {bucket(len(p["ids"])): p for p in prompts}.values()
    for d, spec in fixed.values():
        for p in one_per_bucket:  # compiled and run once: their times below are decoding alone
            eagle_jax.generate(target, d, [p["ids"]], spec=spec, **kw)
    names = list(fixed)
    for i, (p, c) in enumerate(zip(prompts, calls)):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # side by side, the order rotated call by call
            d, spec = fixed[name]
            t0 = time.perf_counter()
            r = eagle_jax.generate(target, d, [p["ids"]], spec=spec, seed=i, **kw)
            c[name] = time.perf_counter() - t0 - r.compile_s
            if name == "plain" and args.temperature == 0:
                c["equal_to_plain"] = r.tokens == c["auto_tokens"]

    total = {k: sum(c[k] for c in calls) for k in ("auto_s", "wall_s", *fixed)}
    tokens = sum(c["tokens"] for c in calls)
    best = min(fixed, key=lambda k: total[k])
    summary = {
        "auto_vs_best": total[best] / total["auto_s"],
        "best_fixed": best,
        "auto_vs_plain": total["plain"] / total["auto_s"],
        "best_vs_plain": total["plain"] / total[best],
        "compiled_after_first_call_at_bucket": sum(c["compiled_again"] for c in calls),
        "auto_tok_s": tokens / total["auto_s"],
        "greedy_equal_to_plain": all(c.get("equal_to_plain", True) for c in calls),
    }
    print_table(
        ["call", "tokens", "auto wall s", "auto compile s", "auto s", *(f"{k} s" for k in fixed), "chunks"],
        [
            [
                i,
                c["tokens"],
                f"{c['wall_s']:.2f}",
                f"{c['compile_s']:.2f}",
                f"{c['auto_s']:.3f}",
                *(f"{c[k]:.3f}" for k in fixed),
                " ".join(f"{d}x{n}" for d, n in c["chunks"]),
            ]
            for i, c in enumerate(calls)
        ],
    )
    print(
        f"over the sequence: auto {summary['auto_vs_best']:.2f}x the best fixed ({best}), "
        f"{summary['auto_vs_plain']:.2f}x plain "
        f"(the best fixed {summary['best_vs_plain']:.2f}x plain); calls that compiled after their bucket's first: "
        f"{summary['compiled_after_first_call_at_bucket']}; greedy equal to plain: {summary['greedy_equal_to_plain']}"
    )
    for c in calls:
        del c["auto_tokens"]
    result = {"config": vars(args), "source": source, "calls": calls, "totals_s": total, "summary": summary}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
