"""Acceptance: mean acceptance length (AL, tokens per target forward) and per-position acceptance of each
drafter, for chain K = 1..7 and dynamic trees, at temperature 0 and 1, on held-out code prompts (and on
FastChat question files).

    python -m bench.acceptance                                      # bundled pair, both drafters, defaults
    python -m bench.acceptance --drafters assets/drafter-eagle3 assets/drafter-eagle3.1 \\
        --ks 1 2 3 4 5 6 7 --trees 8,5,48 10,7,60 --temperatures 0 1 --n-prompts 64 --max-new 128 \\
        --questions mt_bench/question.jsonl --out bench/results/acceptance.json
    python -m bench.acceptance --n-prompts 2 --max-new 16 --ks 1 3 --trees 4,3,12   # smoke test

Prompts: ``code_prompts(load_corpus("assets/data/manifest.json", "heldout"), n, seed)`` (a held-out
file's text up to a top-level def/class header, the model completes the body); each ``--questions``
file's first turns rendered with the target tokenizer's chat template (add_generation_prompt=True).
All prompts of a data set go through one ``eagle_jax.generate`` call per (drafter, config, temperature)
(rows are independent; ``--batch-size`` splits them for memory). Rows stop at max-new or at the
tokenizer's eos / ``<|end_of_text|>`` (``--no-eos`` to always run max-new).

AL per prompt = mean of (accepted + 1) over that row's rounds (the prefill's first token is not a
round); the table gives the mean over prompts with a 95% Student-t interval, and the pooled AL over all
rounds. ``pos i`` = fraction of rounds whose i-th draft was accepted (trees: depth i of the accepted
path). Without the trained models it falls back to random ones (acceptance then meaningless, ~1.0).
Writes JSON (``--out``, with per-prompt ALs and per-category breakdowns) and ``--plot`` (AL vs K).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.common import (
    BUNDLED_DRAFTERS,
    BUNDLED_TARGET,
    TARGET_HELP,
    acceptance_stats,
    fit_prompts,
    fmt_al,
    heldout_code_prompts,
    load_models,
    mean_ci95,
    parse_tree,
    print_table,
    pyplot,
    question_prompts,
    run_batched,
    save_plot,
    spec_name,
    stop_ids,
    write_json,
)
from eagle_jax.config import SpecConfig


def plot(runs: list[dict], path: Path) -> None:
    """AL (mean over prompts, 95% CI) vs K for chain runs, one line per (data set, drafter, temperature)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["dataset"], r["drafter"], r["temperature"]) for r in runs if r["method"] == "chain"})
    for ds, dr, temp in keys:
        rs = sorted(
            (
                r
                for r in runs
                if (r["dataset"], r["drafter"], r["temperature"]) == (ds, dr, temp) and r["method"] == "chain"
            ),
            key=lambda r: r["k"],
        )
        ks = [r["k"] for r in rs]
        al = [r["al_mean"] for r in rs]
        err = [0 if np.isnan(r["al_ci95"]) else r["al_ci95"] for r in rs]
        ax.errorbar(
            ks,
            al,
            yerr=err,
            marker="o",
            capsize=3,
            label=f"{dr}, T={temp:g}" + ("" if len({k[0] for k in keys}) == 1 else f", {ds}"),
        )
    ax.set_xlabel("chain K (drafts per round)")
    ax.set_ylabel("acceptance length (tokens / target forward)")
    ax.set_title("Acceptance length vs K (mean over prompts, 95% CI)")
    save_plot(fig, ax, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help=TARGET_HELP)
    ap.add_argument("--drafters", nargs="+", default=list(BUNDLED_DRAFTERS))
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7], help="chain depths")
    ap.add_argument("--trees", nargs="*", default=["8,5,48", "10,7,60"], help="top_k,depth,total_tokens")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--n-prompts", type=int, default=64, help="held-out code prompts (0: none)")
    ap.add_argument("--min-chars", type=int, default=200)
    ap.add_argument("--max-chars", type=int, default=2000)
    ap.add_argument("--questions", nargs="*", default=[], help="FastChat question.jsonl files")
    ap.add_argument("--n-questions", type=int, default=0, help="first N questions per file (0: all)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64, help="rows per generate call (0: all prompts in one)")
    ap.add_argument("--no-eos", action="store_true", help="ignore eos: every row runs max-new tokens")
    ap.add_argument("--seed", type=int, default=0, help="prompt sampling and sampling keys")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="bench/results/acceptance.json")
    ap.add_argument("--plot", default="bench/results/acceptance.png", help="AL vs K plot ('' for none)")
    args = ap.parse_args(argv)

    target, drafters, tokenizer, source, is_random = load_models(args.target, args.drafters, args.dtype)
    limit = target.config.max_position_embeddings
    datasets: dict[str, list[dict]] = {}
    if args.n_prompts:
        datasets["heldout-code"] = fit_prompts(
            heldout_code_prompts(
                tokenizer,
                args.n_prompts,
                seed=args.seed,
                min_chars=args.min_chars,
                max_chars=args.max_chars,
                vocab_size=target.config.vocab_size,
            ),
            args.max_new,
            limit,
        )
    for q in args.questions:
        # FastChat keeps every bench in <name>/question.jsonl: name the data set after the folder then.
        datasets[Path(q).parent.name if Path(q).stem == "question" and Path(q).parent.name else Path(q).stem] = (
            fit_prompts(question_prompts(q, tokenizer, args.n_questions or None), args.max_new, limit)
        )
    specs = [SpecConfig(num_speculative_tokens=k) for k in args.ks] + [parse_tree(t) for t in args.trees]
    eos = stop_ids(tokenizer, not args.no_eos)

    results = {
        "models": source,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "eos_ids": list(eos),
        "datasets": {
            name: {
                "n": len(ps),
                "mean_prompt_tokens": float(np.mean([len(p["ids"]) for p in ps])) if ps else 0,
                "names": [p["name"] for p in ps],
            }
            for name, ps in datasets.items()
        },
        "runs": [],
    }
    rows, cat_rows = [], []
    for ds, prompts in datasets.items():
        if not prompts:
            continue
        ids = [p["ids"] for p in prompts]
        for dname, drafter in drafters.items():
            for temp in args.temperatures:
                for spec in specs:
                    r = run_batched(
                        target,
                        drafter,
                        ids,
                        spec=spec,
                        max_new=args.max_new,
                        temperature=temp,
                        eos=eos,
                        seed=args.seed,
                        batch_size=args.batch_size,
                    )
                    st = acceptance_stats(r["accepted"], spec.max_emitted - 1)
                    n_tok = sum(len(t) for t in r["tokens"])
                    run = {
                        "dataset": ds,
                        "drafter": dname,
                        "temperature": temp,
                        "spec": spec_name(spec),
                        "method": spec.method,
                        "k": spec.num_speculative_tokens if spec.method == "chain" else None,
                        "tree": None
                        if spec.method == "chain"
                        else [spec.tree_top_k, spec.tree_depth, spec.tree_total_tokens],
                        **st,
                        "tokens": n_tok,
                        "compile_s": r["compile_s"],
                        "run_s": r["run_s"],
                        "tokens_per_s": n_tok / r["run_s"] if r["run_s"] > 0 else None,
                    }
                    cats = sorted({p.get("category") for p in prompts if p.get("category")})
                    if cats:
                        run["per_category"] = {}
                        for c in cats:
                            m, h = mean_ci95(
                                [a for a, p in zip(st["per_prompt_al"], prompts) if p.get("category") == c]
                            )
                            run["per_category"][c] = {
                                "al_mean": m,
                                "al_ci95": h,
                                "n": sum(p.get("category") == c for p in prompts),
                            }
                            cat_rows.append(
                                [
                                    ds,
                                    dname,
                                    f"{temp:g}",
                                    spec_name(spec),
                                    c,
                                    run["per_category"][c]["n"],
                                    f"{m:.2f}" + ("" if np.isnan(h) else f" ± {h:.2f}"),
                                ]
                            )
                    results["runs"].append(run)
                    pos = " ".join(f"{p:.2f}" for p in st["position_acceptance"])
                    rows.append(
                        [
                            ds,
                            dname,
                            f"{temp:g}",
                            spec_name(spec),
                            st["prompts"],
                            fmt_al(st),
                            f"{st['al_pooled']:.2f}",
                            pos,
                            f"{r['compile_s']:.1f}",
                        ]
                    )
                    print(f"  {ds} | {dname} | T={temp:g} | {spec_name(spec)}: AL {fmt_al(st)}", flush=True)
    print()
    if is_random:
        print("(random models: acceptance meaningless)")
    print_table(
        [
            "data",
            "drafter",
            "T",
            "speculation",
            "prompts",
            "AL (95% CI)",
            "AL pooled",
            "pos acceptance 1..",
            "compile s",
        ],
        rows,
    )
    if cat_rows:
        print()
        print_table(["data", "drafter", "T", "speculation", "category", "n", "AL (95% CI)"], cat_rows)
    write_json(args.out, results)
    if args.plot and any(r["method"] == "chain" for r in results["runs"]):
        plot(results["runs"], Path(args.plot))
    return results


if __name__ == "__main__":
    main()
