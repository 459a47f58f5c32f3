"""Speculation chosen for the user (``spec="auto"``) against every fixed choice, measured side by side.

    python -m bench.choice                          # bundled pair, held-out code prompts
    python -m bench.choice --batch 1 4 16 --ks 1 3 5 --trees 8,5,48 --per-prompt 16

Two tables. (1) Tokens/s by batch size for plain decoding, each fixed chain K and tree, and auto
(what it chose in the last column): auto should be within 5% of the best fixed row and never below
plain. (2) At batch 1, per held-out prompt: the speedup over plain decoding of the best fixed chain
and of auto, with the spread (min, median, max); auto's choice is the one made for batch 1 (it is
cached per pair, batch size and sampling mode). The runs of one row are interleaved (this machine's
timings drift; ratios within a run are what counts); each figure is the fastest of its warm runs.
"""

from __future__ import annotations

import argparse

import numpy as np

import eagle_jax
from eagle_jax.config import SpecConfig
from eagle_jax.decoding.autospec import candidate_name
from bench.common import TARGET_HELP, load_pair_or_random, print_table, spec_name, write_json


def timed_interleaved(target, drafter, prompts, specs: dict, max_new: int, repeats: int = 3) -> dict:
    """{name: the fastest of ``repeats`` warm runs} for ``specs`` {name: (drafter or None, spec)}, the
    runs interleaved (one of each in turn) so that a machine whose speed drifts favours none; the
    first call of each compiles (and, for "auto", measures its candidates)."""
    kw = dict(max_new_tokens=max_new, eos_token_id=[])
    for d, spec in specs.values():
        eagle_jax.generate(target, d, prompts, spec=spec, **kw)
    best = {}
    for _ in range(repeats):
        for name, (d, spec) in specs.items():
            r = eagle_jax.generate(target, d, prompts, spec=spec, **kw)
            if name not in best or r.run_s < best[name].run_s:
                best[name] = r
    return best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help=TARGET_HELP)
    ap.add_argument("--drafter")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--trees", nargs="*", default=["8,5,48"], help="top_k,depth,total_tokens")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--per-prompt", type=int, default=16, help="held-out prompts in the batch-1 table (0: skip it)")
    ap.add_argument("--out", default="bench/results/choice.json")
    args = ap.parse_args(argv)

    target, drafter, _, prompts, source = load_pair_or_random(args.target, args.drafter, None, args.prompt_len)
    fixed = [SpecConfig(num_speculative_tokens=k) for k in args.ks]
    for t in args.trees:
        k, d, n = (int(x) for x in t.split(","))
        fixed.append(SpecConfig(method="tree", tree_top_k=k, tree_depth=d, tree_total_tokens=n))
    results = {"models": source, "by_batch": [], "per_prompt": []}

    rows = []
    for b in args.batch:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        runs = timed_interleaved(target, drafter, batch, {"plain": (None, None), **{spec_name(s): (drafter, s) for s in fixed},
                                                          "auto": (drafter, "auto")}, args.max_new)
        plain, auto = runs.pop("plain"), runs.pop("auto")
        best_name = max(runs, key=lambda n: runs[n].tokens_per_s)
        best = max(runs[best_name].tokens_per_s, plain.tokens_per_s)
        chose = candidate_name(auto.stats["spec"])
        rows.append([b, f"{plain.tokens_per_s:.1f}", *(f"{r.tokens_per_s:.1f}" for r in runs.values()), f"{auto.tokens_per_s:.1f}",
                     f"{auto.tokens_per_s / plain.tokens_per_s:.2f}x", f"{auto.tokens_per_s / best:.2f}",
                     f"{auto.acceptance_length:.2f}", chose])
        results["by_batch"].append({"batch": b, "plain": plain.tokens_per_s, "fixed": {n: r.tokens_per_s for n, r in runs.items()},
                                    "auto": auto.tokens_per_s, "auto_al": auto.acceptance_length, "auto_chose": chose,
                                    "auto_rates": auto.stats["auto_rates"], "best_fixed": best_name})
    print_table(["batch", "plain", *runs.keys(), "auto", "auto/plain", "auto/best", "auto AL", "auto chose"], rows)

    if args.per_prompt:
        best_k = max(fixed[: len(args.ks)], key=lambda s: results["by_batch"][0]["fixed"][spec_name(s)]) if args.batch[0] == 1 else fixed[0]
        speed = {"fixed": [], "auto": []}
        for p in prompts[: args.per_prompt]:
            r = timed_interleaved(target, drafter, [p], {"plain": (None, None), "fixed": (drafter, best_k), "auto": (drafter, "auto")},
                                  args.max_new, repeats=2)
            speed["fixed"].append(r["fixed"].tokens_per_s / r["plain"].tokens_per_s)
            speed["auto"].append(r["auto"].tokens_per_s / r["plain"].tokens_per_s)
            results["per_prompt"].append({"plain": r["plain"].tokens_per_s, "fixed": r["fixed"].tokens_per_s,
                                          "fixed_al": r["fixed"].acceptance_length, "auto": r["auto"].tokens_per_s,
                                          "auto_al": r["auto"].acceptance_length, "auto_chose": candidate_name(r["auto"].stats["spec"])})
        print()
        print_table(["batch 1, per prompt", "mean speedup", "min", "median", "max", "prompts below plain"], [
            [name if name == "auto" else spec_name(best_k), f"{np.mean(v):.2f}x", f"{min(v):.2f}x", f"{np.median(v):.2f}x", f"{max(v):.2f}x",
             sum(x < 1.0 for x in v)] for name, v in speed.items()
        ])
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
