"""The default speculation (``spec="auto"``) against every fixed choice, over sequences of calls as a
process meets them: held-out prompts from several sets, in several orders.

    python -m bench.autospec                                  # bundled pair, the grid below
    python -m bench.autospec --batch 1 4 12 --temps 0 1 --dtypes float32 bfloat16 --orders 5
    python -m bench.autospec --target smollm2-135m-instruct --drafter assets/smollm2/drafter-eagle3.1

The prompts: held-out code prompts and the first turns of ``../shared/data/eval`` mt_bench, gsm8k and
sum (rendered with the tokenizer's chat template), ``--per-set`` of each. A sequence is ``--calls``
calls of ``batch`` prompts each, taken in order from one ordering of the prompts; ``--orders``
orderings are random, except the first, which puts the prompts with the lowest acceptance first (the
case where one measurement on the first prompt used to decide the whole process).

For each (dtype, temperature, batch): every order starts from a fresh chooser (``chooser.reset``: no costs, no
acceptance known: the first call pays the warm-up profile), the programs already compiled (compile time is
apart, and so is each program's first run: ``warm``; a call's time is its wall time less its compiles, the host
work of setting it up and of auto's choices included). Python's cyclic garbage is collected before each call,
untimed, with the heap of the models and programs frozen first (``gc.freeze``): a full collection of that heap
takes 0.25-0.45 s here, and struck about one call in ten, whichever configuration it was running (one such
pause is 10% of a configuration's time over an order at batch 1), so it would decide which configuration
looks best in hindsight. Each call runs auto, plain decoding and each fixed chain on the same prompts, side by
side (their order rotated call by call), so the machine's drift touches all alike. Fixed configurations do not
depend on the order; auto does. Per order: tokens/s of auto, plain and each fixed chain over the whole sequence; auto
against the best fixed configuration in hindsight (goal >= 0.95) and against plain (goal >= 1.0); the first
call's time per token against plain decoding's on the same call (goal <= 1.3). Greedy outputs are checked
equal to plain decoding's. Sampled, auto against the best is also read over the calls every configuration ran to
one length (``vs_best_same_length``): a batch runs until its last row is done, so a call whose samples ended a row
early makes fewer tokens in about the same time. The plot shows the depth auto ran (mean over its rounds) call by
call, a panel per dtype, temperature and batch size.
``--repeats N`` runs each order N times with other generation seeds and pools the rates: at T=1 every
configuration draws other tokens, so one run's best fixed configuration is partly the luckiest. The best fixed
configuration is also read with its choice kept apart from its measurement (``held_out_best``: chosen on the
other repeats, rated on each): the best of several near-equal configurations, each measured with a few percent
of noise, is read high on the run that chose it, against auto measured once.
``--control K=1`` runs that fixed configuration a second time in each call, as one more system (``control``):
its rate against its twin's is what the measurement alone does to one configuration over an order, and,
where the twin is the best fixed configuration, its rate against the best (the best of the others and the
twin, as auto meets it) is the floor under what auto can show against the best in hindsight.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np

import eagle_jax
from bench.common import (
    BUNDLED_DRAFTER,
    EVAL,
    TARGET_HELP,
    heldout_code_prompts,
    load_models,
    print_table,
    pyplot,
    question_prompts,
    stop_ids,
    write_json,
)
from eagle_jax.config import SpecConfig
from eagle_jax.decoding import chooser

QUESTION_SETS = ("mt_bench", "gsm8k", "sum")
CONTROL = "control"  # a fixed configuration measured twice (``--control``)


def collect_prompts(tokenizer, per_set: int, max_prompt: int) -> list[dict]:
    """``per_set`` held-out code prompts and first turns of each QUESTION_SETS file, at most
    ``max_prompt`` tokens each, as {"ids", "set"}."""
    out = [
        {"ids": p["ids"][:max_prompt], "set": "code"} for p in heldout_code_prompts(tokenizer, per_set, max_chars=1200)
    ]
    for name in QUESTION_SETS:
        qs = [q for q in question_prompts(EVAL / f"{name}.jsonl", tokenizer) if len(q["ids"]) <= max_prompt]
        out += [{"ids": q["ids"], "set": name} for q in qs[:per_set]]
    return out


def orders(prompts: list[dict], acceptance: list[float], n: int, seed: int) -> list[tuple[str, list[int]]]:
    """The lowest-acceptance-first order, then n - 1 random ones (indices into prompts)."""
    rng = np.random.default_rng(seed)
    out = [("hardest first", [int(i) for i in np.argsort(acceptance, kind="stable")])]
    out += [(name, [int(i) for i in rng.permutation(len(prompts))]) for name in order_names(n)[1:]]
    return out


def order_names(n: int) -> list[str]:
    """The names ``orders`` gives its n orders."""
    return ["hardest first", *(f"random {i}" for i in range(1, n))]


def resumed(previous: dict, config: dict) -> dict:
    """``previous`` results to continue, if they were measured with ``config`` (all but the run's own
    flags and the grid's extent); else exit, naming the first option that differs."""
    loose = {"resume", "report_only", "out", "plot", "dtypes", "temps", "batch", "orders"}
    for key, value in config.items():
        if key not in loose and previous["config"].get(key) != value:
            raise SystemExit(
                f"--resume: {config['out']} was measured with {key}={previous['config'].get(key)!r}, "
                f"not {value!r}; use another --out"
            )
    return {**previous, "config": config}


def calls_of(order: list[int], prompts: list[dict], batch: int, calls: int) -> list[list[list[int]]]:
    """``calls`` calls of ``batch`` prompts, taken in order (cycling)."""
    seq = [prompts[order[j % len(order)]]["ids"] for j in range(calls * batch)]
    return [seq[c * batch : (c + 1) * batch] for c in range(calls)]


def mean_depth(chunks: list[tuple[int | None, int]]) -> float:
    """Drafts per round over a call's rounds (probe rounds count as 0)."""
    rounds = sum(n for _, n in chunks)
    return sum((d or 0) * n for d, n in chunks) / max(rounds, 1)


def warm(target, drafter, calls, fixed: dict, *, max_new: int, temperature: float, eos) -> None:
    """Compiles and runs once every program the calls' shapes need (each fixed configuration, and each of
    auto's: its prefill, a chunk at every depth, plain decoding), on one call per prompt bucket: a
    program's first run pays one-time costs (~0.3 s here) that are compile time, not decoding."""
    from eagle_jax.decoding.calls import bucket

    kw = dict(max_new_tokens=max_new, temperature=temperature, eos_token_id=list(eos), seed=0)
    by_shape = {bucket(max(map(len, c))): c for c in calls}
    for prompts in by_shape.values():
        for d, spec in fixed.values():
            eagle_jax.generate(target, d, prompts, spec=spec, **kw)
        eagle_jax.generate(
            target, drafter, prompts, spec="auto", **kw
        )  # its first call compiles and runs all of auto's


def run_sequence(
    target, drafter, calls, fixed: dict, *, max_new: int, temperature: float, eos, seed: int = 0
) -> list[dict]:
    """One sequence from a fresh chooser: per call, auto and every fixed configuration on the same
    prompts, their order rotated by one each call (the first run after another program is often the
    slowest here: no configuration always takes that place)."""
    chooser.reset()
    kw = dict(max_new_tokens=max_new, temperature=temperature, eos_token_id=list(eos), seed=seed)
    systems = [("auto", (drafter, "auto")), *fixed.items()]
    rows = []
    for c, prompts in enumerate(calls):
        row, tokens = {}, {}
        for name, (d, spec) in systems[c % len(systems) :] + systems[: c % len(systems)]:
            gc.collect()  # the garbage of the calls before, not this call's (the module docstring)
            t0 = time.perf_counter()
            r = eagle_jax.generate(target, d, prompts, spec=spec, **kw)
            # The call's wall time less its compiles: auto's choices between chunks are host work its run_s leaves out
            # (~4 ms a call at batch 1 over a fixed chain's), as is every call's setup (~7 ms at batch 1).
            row[name], tokens[name] = (time.perf_counter() - t0 - r.compile_s, r.num_generated), r.tokens
            row.setdefault("run_s", {})[name] = r.run_s  # the program's time alone, for comparison
            if name == "auto":
                row["auto_depth"] = mean_depth(r.stats["chunks"])
                row["auto_chunks"] = r.stats["chunks"]
        if temperature == 0:
            row["equal_to_plain"] = tokens["plain"] == tokens["auto"]
        rows.append(row)
    return rows


def _rate(rows: list[dict], name: str) -> float:
    """Tokens per second of ``name`` over ``rows`` (calls)."""
    return sum(r[name][1] for r in rows) / sum(r[name][0] for r in rows)


def held_out_best(rows: list[dict], names: list[str]) -> float:
    """The best fixed configuration's rate with the choice and its measurement kept apart: on each repeat, the
    configuration the other repeats rate best, as measured on this one (pooled over the repeats). The best of
    several configurations measured once is read on the run that made it look best, so it is biased up by its
    luck there: at T=1 fixed chains of 1, 3 and 5 are within a few percent of one another, and one
    configuration measured twice in the same calls differs by up to 7% over an order."""
    repeats = sorted({r.get("repeat", 0) for r in rows})
    tokens = seconds = 0.0
    for i in repeats:
        mine = [r for r in rows if r.get("repeat", 0) == i]
        others = [r for r in rows if r.get("repeat", 0) != i]
        pick = max(names, key=lambda n: _rate(others, n))
        tokens += sum(r[pick][1] for r in mine)
        seconds += sum(r[pick][0] for r in mine)
    return tokens / seconds


def summarise(rows: list[dict], names: list[str], twin: str | None = None) -> dict:
    """Rates over every call of every repeat of one order (a row's ``repeat``: which sequence it belongs
    to; one sequence when absent). Repeats of a sampled sequence draw other tokens, so each
    configuration's rate is a mean over draws, and the best in hindsight is not merely the luckiest.
    ``names``: the fixed configurations; a ``control`` in the rows (a second run of ``twin``) is rated apart, never
    the best."""
    names = [n for n in names if n != CONTROL]
    rate = {n: _rate(rows, n) for n in ["auto", *names, *([CONTROL] if CONTROL in rows[0] else [])]}
    best = max(names, key=rate.get)
    control = {}
    if CONTROL in rate:
        control = {
            "control_vs_best": rate[CONTROL] / rate[best],
            "control_vs_twin": rate[CONTROL] / rate[twin],
            "control_of": twin,
        }
    firsts = [r for i, r in enumerate(rows) if i == 0 or r.get("repeat", 0) != rows[i - 1].get("repeat", 0)]
    repeats = sorted({r.get("repeat", 0) for r in rows})
    depths = np.mean([[r["auto_depth"] for r in rows if r.get("repeat", 0) == i] for i in repeats], axis=0)
    # Sampled rows end at their own end-of-sequence tokens, and a batch runs until its last row is done: a call in which
    # one configuration's samples ended a row early makes fewer tokens in about the same time (303 of 384 at batch 4),
    # luck that is not the configuration's. Rated again over the calls every configuration ran to the same length.
    same_length = {}
    even = [r for r in rows if len({r[n][1] for n in ["auto", *names]}) == 1]
    if len(even) < len(rows) and even:
        fair = {n: _rate(even, n) for n in ["auto", *names]}
        same_length = {
            "vs_best_same_length": fair["auto"] / max(fair[n] for n in names),
            "same_length_calls": len(even),
        }
    held_out = {}
    if len(repeats) > 1:
        reference = held_out_best(rows, names)
        held_out["vs_best_held_out"] = rate["auto"] / reference
        if control:
            held_out["control_vs_best_held_out"] = rate[CONTROL] / reference
    return {
        "tok_s": rate,
        "best_fixed": best,
        "vs_best": rate["auto"] / rate[best],
        **held_out,
        "vs_plain": rate["auto"] / rate["plain"],
        # per token: sampled calls may stop at EOS after different numbers of tokens
        "first_call_vs_plain": max((r["auto"][0] / r["auto"][1]) / (r["plain"][0] / r["plain"][1]) for r in firsts),
        "equal_to_plain": all(r.get("equal_to_plain", True) for r in rows),
        "depths": [float(d) for d in depths],
        "repeats": len(repeats),
        **control,
        **same_length,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help=TARGET_HELP)
    ap.add_argument("--drafter", default=str(BUNDLED_DRAFTER))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 12])
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--orders", type=int, default=5)
    ap.add_argument("--calls", type=int, default=8, help="calls per sequence")
    ap.add_argument("--per-set", type=int, default=4, help="prompts from each set")
    ap.add_argument("--max-prompt", type=int, default=384, help="longest prompt, in tokens")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--ks", type=int, nargs="+", default=list(chooser.DEPTHS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="sequences per order (generation seeds seed, seed+1, ...; a fresh chooser each): rates pool them",
    )
    ap.add_argument(
        "--control", help="a fixed configuration (plain, K=1, ...) measured a second time in each call, as the control"
    )
    ap.add_argument("--out", default="bench/results/autospec.json")
    ap.add_argument("--plot", default="bench/figures/autospec.png")
    ap.add_argument(
        "--report-only", action="store_true", help="re-summarise --out's runs (table and plot), measure nothing"
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the orders --out already holds (same configuration) and measure the rest",
    )
    args = ap.parse_args(argv)
    if args.report_only:
        results = json.loads(Path(args.out).read_text())
        names = ["plain", *(f"K={k}" for k in results["config"]["ks"])]
        for run in results["runs"]:
            run.update(summarise(run["calls"], names, results["config"].get("control")))
        report(results, Path(args.plot))
        write_json(args.out, results)
        return results

    results = {"config": vars(args), "runs": []}
    if args.resume and Path(args.out).exists():
        results = resumed(json.loads(Path(args.out).read_text()), vars(args))
    done = {(r["dtype"], r["temperature"], r["batch"], r["order"]) for r in results["runs"]}
    for dtype in args.dtypes:
        if all(
            (dtype, t, b, name) in done for t in args.temps for b in args.batch for name in order_names(args.orders)
        ):
            continue
        target, drafters, tokenizer, source, _ = load_models(args.target, [args.drafter], dtype)
        drafter = next(iter(drafters.values()))
        eos = stop_ids(tokenizer)
        prompts = collect_prompts(tokenizer, args.per_set, args.max_prompt)
        # Per-prompt acceptance at K=5, greedy, batch 1: what the hardest-first order sorts by.
        k5 = SpecConfig(num_speculative_tokens=max(args.ks))
        al = [
            eagle_jax.generate(
                target, drafter, [p["ids"]], max_new_tokens=args.max_new, spec=k5, eos_token_id=list(eos)
            ).acceptance_length
            for p in prompts
        ]
        print(
            f"{dtype}: {len(prompts)} prompts ({', '.join(sorted({p['set'] for p in prompts}))}); AL at "
            f"K={max(args.ks)}: min {min(al):.2f}, median {np.median(al):.2f}, max {max(al):.2f}",
            flush=True,
        )
        fixed = {"plain": (None, None), **{f"K={k}": (drafter, SpecConfig(num_speculative_tokens=k)) for k in args.ks}}
        if args.control:
            if args.control not in fixed:
                raise SystemExit(f"--control {args.control!r}: not one of the fixed configurations {', '.join(fixed)}")
            fixed[CONTROL] = fixed[args.control]
        for temp in args.temps:
            for batch in args.batch:
                seqs = [
                    (name, order)
                    for name, order in orders(prompts, al, args.orders, args.seed)
                    if (dtype, temp, batch, name) not in done
                ]
                if not seqs:
                    continue
                warm(
                    target,
                    drafter,
                    [c for _, order in seqs for c in calls_of(order, prompts, batch, args.calls)],
                    fixed,
                    max_new=args.max_new,
                    temperature=temp,
                    eos=eos,
                )
                gc.collect()
                gc.freeze()  # the models and programs: collections while measuring walk only what the calls made
                for name, order in seqs:
                    t0 = time.perf_counter()
                    rows = [
                        row | {"repeat": i}
                        for i in range(args.repeats)
                        for row in run_sequence(
                            target,
                            drafter,
                            calls_of(order, prompts, batch, args.calls),
                            fixed,
                            max_new=args.max_new,
                            temperature=temp,
                            eos=eos,
                            seed=args.seed + i,
                        )
                    ]
                    s = summarise(rows, list(fixed), args.control)
                    run = {
                        "dtype": dtype,
                        "temperature": temp,
                        "batch": batch,
                        "order": name,
                        **s,
                        "calls": rows,
                        "seconds": time.perf_counter() - t0,
                    }
                    results["runs"].append(run)
                    print(summary_line(dtype, temp, batch, name, s), flush=True)
                    write_json(args.out, results | {"models": source})
        gc.unfreeze()  # this dtype's models may go
    report(results, Path(args.plot))
    write_json(args.out, results | {"models": source})
    return results


def summary_line(dtype: str, temp: float, batch: int, order: str, s: dict) -> str:
    """One order's summary (``summarise``), as the run prints it."""
    held_out = f"{s['vs_best_held_out']:.2f}x it chosen on the other repeats, " if "vs_best_held_out" in s else ""
    control = (
        f"control {s['control_vs_twin']:.2f}x its twin, {s['control_vs_best']:.2f}x best, "
        if CONTROL in s["tok_s"]
        else ""
    )
    even = (
        f"{s['vs_best_same_length']:.2f}x best on the {s['same_length_calls']} calls of one length, "
        if "vs_best_same_length" in s
        else ""
    )
    return (
        f"{dtype} T={temp:g} B={batch:2d} {order:13s}: auto {s['tok_s']['auto']:7.1f} tok/s, "
        f"{s['vs_best']:.2f}x best fixed ({s['best_fixed']} {s['tok_s'][s['best_fixed']]:.1f}), "
        f"{held_out}{even}{control}{s['vs_plain']:.2f}x plain; "
        f"first call {s['first_call_vs_plain']:.2f}x plain's time; "
        f"depths {' '.join(f'{d:.1f}' for d in s['depths'])}" + ("" if s["equal_to_plain"] else "  OUTPUT DIFFERS")
    )


def _same_length(runs: list[dict]) -> str:
    """``summarise``'s ``vs_best_same_length`` over ``runs`` (min, median), "-" where every call ran to one length."""
    even = [r["vs_best_same_length"] for r in runs if "vs_best_same_length" in r]
    return f"{min(even):.2f}, {np.median(even):.2f}" if even else "-"


def report(results: dict, plot: Path) -> None:
    runs = results["runs"]
    controlled = all("control_vs_best" in r for r in runs)
    held_out = all("vs_best_held_out" in r for r in runs)
    header = [
        "dtype",
        "T",
        "batch",
        "orders x repeats",
        "auto / best fixed (min, median)",
        *(["auto / best fixed chosen on the other repeats (min, median)"] if held_out else []),
        "auto / best fixed, calls of one length (min, median)",
        "auto / plain (min)",
        "first call / plain (max)",
        "best fixed",
        *(["control / its twin (min, max)", "control / best fixed (min, median)"] if controlled else []),
        *(["control / best fixed chosen on the other repeats (min, median)"] if controlled and held_out else []),
    ]
    rows = []
    for key in sorted({(r["dtype"], r["temperature"], r["batch"]) for r in runs}):
        rs = [r for r in runs if (r["dtype"], r["temperature"], r["batch"]) == key]
        vb, cb, ct = (
            [r["vs_best"] for r in rs],
            [r.get("control_vs_best", 0.0) for r in rs],
            [r.get("control_vs_twin", 0.0) for r in rs],
        )
        ho, ch = [r.get("vs_best_held_out", 0.0) for r in rs], [r.get("control_vs_best_held_out", 0.0) for r in rs]
        rows.append(
            [
                key[0],
                f"{key[1]:g}",
                key[2],
                f"{len(rs)} x {rs[0].get('repeats', 1)}",
                f"{min(vb):.2f}, {np.median(vb):.2f}",
                *([f"{min(ho):.2f}, {np.median(ho):.2f}"] if held_out else []),
                _same_length(rs),
                f"{min(r['vs_plain'] for r in rs):.2f}",
                f"{max(r['first_call_vs_plain'] for r in rs):.2f}",
                ", ".join(sorted({r["best_fixed"] for r in rs})),
                *([f"{min(ct):.2f}, {max(ct):.2f}", f"{min(cb):.2f}, {np.median(cb):.2f}"] if controlled else []),
                *([f"{min(ch):.2f}, {np.median(ch):.2f}"] if controlled and held_out else []),
            ]
        )
    print_table(header, rows)
    plt = pyplot()
    panels = sorted({(r["dtype"], r["temperature"]) for r in runs})  # a row of panels per dtype and temperature
    batches = sorted({r["batch"] for r in runs})  # a column per batch size
    fig, axes = plt.subplots(
        len(panels), len(batches), figsize=(3.6 * len(batches), 2.9 * len(panels)), sharey=True, squeeze=False
    )
    for (dtype, temp), row in zip(panels, axes):
        for ax, batch in zip(row, batches):
            shown = [r for r in runs if (r["dtype"], r["temperature"], r["batch"]) == (dtype, temp, batch)]
            ax.set_title(f"{dtype}, T={temp:g}, batch {batch}", fontsize=9)
            if not shown:  # a grid of the runs' dtypes, temperatures and batch sizes: not every cell ran
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
                ax.set_xticks([])
                continue
            for r in shown:
                ax.plot(range(1, len(r["depths"]) + 1), r["depths"], marker="o", label=r["order"])
            ax.set_xticks(range(1, max(len(r["depths"]) for r in shown) + 1))
        row[0].set_ylabel("drafts per round (mean)")
    for ax in axes[-1]:
        ax.set_xlabel("call in the sequence")
    next(ax for ax in axes.flat if ax.lines).legend(fontsize=7)  # the orders' colours, on the first panel that has them
    fig.suptitle("spec=auto: the depth it ran, call by call", fontsize=10)
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
