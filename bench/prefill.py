"""Prefix caching and chunked prefill in the server's engine, on the bundled pair.

    python -m bench.prefill [--prefixes 5] [--slots 4] [--out bench/results/prefill.json]

1. **Prefix caching**: for each of ``--prefixes`` long prompts (held-out code files joined to ~1500
   tokens), a cold request (the prefix + 20 new tokens) and then a warm one (the same prefix + 20 other
   new tokens): time to first token of each (submission to the first token, in the engine's scheduler)
   and the prompt tokens the warm one reused. Goal: warm TTFT <= 0.2x cold.
2. **Chunked prefill**: a running greedy stream (short prompt, 1200 tokens) while an 1800-token prompt
   arrives: the stream's longest gap between deliveries during the long prompt's prefill over its
   median gap, with per-step prefill budgets of 128 (the default) and 256 tokens and with the whole
   prompt at once (as before chunking). Goal: <= 3x.

Both run in one process, one service after the other, every program compiled first (``precompile``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from bench.common import BUNDLED_DRAFTER, heldout_code_prompts, load_models, print_table, stop_ids, write_json
from eagle_jax.serving.slots import DEFAULT_CHUNK


def long_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, each held-out code files joined until long enough."""
    files = heldout_code_prompts(tokenizer, 8 * n + 16, seed=seed, min_chars=400, max_chars=4000)
    out, ids = [], []
    for f in files:
        ids += f["ids"]
        if len(ids) >= length:
            out.append(ids[:length])
            ids = []
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} prompts of {length} tokens could be made from the held-out files")


def _service(target, drafter, tokenizer, eos, args, chunk: int, prefix_cache: bool):
    from eagle_jax.serving import SpecSchedule
    from eagle_jax.serving.server import make_service

    return make_service(
        target,
        drafter,
        tokenizer,
        SpecSchedule.parse(args.schedule),
        eos,
        slots=args.slots,
        max_len=args.max_len,
        rounds_per_step=args.rounds_per_step,
        precompile=True,
        prefill_chunk=chunk,
        prefix_cache=prefix_cache,
        model_name="target",
    )


def prefix_ttft(svc, prompts: list[list[int]], new: list[list[int]]) -> list[dict]:
    from eagle_jax.serving import Request

    sched = svc.scheduler.start()
    rows = []
    try:
        for prefix, (a, b) in zip(prompts, new):
            cold = sched.submit(Request(tuple(prefix + a), 1)).wait(600)
            warm = sched.submit(Request(tuple(prefix + b), 1)).wait(600)
            rows.append(
                {
                    "cold_s": cold.t_first - cold.t_submit,
                    "warm_s": warm.t_first - warm.t_submit,
                    "prompt": len(prefix) + len(b),
                    "reused": warm.cached_tokens,
                }
            )
    finally:
        sched.stop()
    return rows


def stream_gaps(svc, short: list[int], long: list[int]) -> dict:
    """The running stream's delivery gaps before, during and after the long prompt's prefill."""
    from eagle_jax.serving import Request

    sched = svc.scheduler.start()
    try:
        running = sched.submit(Request(tuple(short), 1200, ignore_eos=True))
        while len(running.chunk_times) < 6 and not running.finished:
            time.sleep(0.005)
        t_arrive = time.perf_counter()
        arriving = sched.submit(Request(tuple(long), 8))
        arriving.wait(600)
        running.wait(600)
    finally:
        sched.stop()
    if not t_arrive < arriving.t_first < running.t_done:
        raise SystemExit("the running stream ended before the long prompt's first token: make it longer")
    times = [t for t, _ in running.chunk_times]
    gaps = [(b, b - a) for a, b in zip(times, times[1:])]
    # the gaps that end while it is prefilled; then the one through the first step that decodes it too
    # (its long context makes that step slower, whatever the prefill did)
    during = [g for t, g in gaps if t_arrive <= t <= arriving.t_first] or [0.0]
    joint = next(g for t, g in gaps if t > arriving.t_first)
    median = statistics.median(g for _, g in gaps)
    return {
        "median_gap_s": median,
        "max_gap_during_s": max(during),
        "ratio": max(during) / median,
        "joint_gap_s": joint,
        "long_ttft_s": arriving.t_first - arriving.t_submit,
        "long_first_at_s": arriving.t_first - t_arrive,
        "gaps_from_arrival": [(round(t - t_arrive, 4), round(g, 4)) for t, g in gaps if t >= t_arrive - 1.0][:80],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", type=int, default=5)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--rounds-per-step", type=int, default=8)
    ap.add_argument("--schedule", default="1:7,9:3", help="the bundled profile's")
    ap.add_argument("--out", default="bench/results/prefill.json")
    ap.add_argument("--skip-prefix", action="store_true", help="only the chunked-prefill part")
    ap.add_argument(
        "--chunks",
        type=int,
        nargs="*",
        default=[128, 256, 2048],
        help="per-step prefill budgets to compare (2048: the whole prompt)",
    )
    args = ap.parse_args(argv)

    from eagle_jax import compile_cache

    compile_cache.enable(compile_cache.default_dir())
    target, drafters, tokenizer, source, _ = load_models(None, [str(BUNDLED_DRAFTER)])
    drafter, eos = next(iter(drafters.values())), stop_ids(tokenizer)
    prefixes = long_prompts(tokenizer, args.prefixes, 1500, seed=1)
    tails = long_prompts(tokenizer, 2 * args.prefixes, 20, seed=2)
    results: dict = {"config": vars(args), "models": source}

    rows = (
        []
        if args.skip_prefix
        else prefix_ttft(
            _service(target, drafter, tokenizer, eos, args, DEFAULT_CHUNK, True),
            prefixes,
            list(zip(tails[::2], tails[1::2])),
        )
    )
    results["prefix"] = rows
    print_table(
        ["prompt", "reused", "cold TTFT ms", "warm TTFT ms", "warm / cold"],
        [
            [
                r["prompt"],
                r["reused"],
                f"{r['cold_s'] * 1e3:.0f}",
                f"{r['warm_s'] * 1e3:.0f}",
                f"{r['warm_s'] / r['cold_s']:.3f}",
            ]
            for r in rows
        ],
    )

    short, long = long_prompts(tokenizer, 1, 40, seed=3)[0], long_prompts(tokenizer, 1, 1800, seed=4)[0]
    results["chunked"] = {}
    for chunk in args.chunks:
        name = (
            "whole prompt at once"
            if chunk >= len(long)
            else f"chunks of {chunk}" + (" (default)" if chunk == DEFAULT_CHUNK else "")
        )
        svc = _service(target, drafter, tokenizer, eos, args, chunk, False)
        g = stream_gaps(svc, short, long)
        del svc
        gc.collect()  # the last service's programs go (each program maps memory; the process has a bound)
        results["chunked"][name] = g
        print(
            f"{name:30s}: median gap {g['median_gap_s'] * 1e3:.0f} ms, longest during the 1800-token prefill "
            f"{g['max_gap_during_s'] * 1e3:.0f} ms ({g['ratio']:.1f}x), then through its first step "
            f"{g['joint_gap_s'] * 1e3:.0f} ms; its TTFT {g['long_ttft_s'] * 1e3:.0f} ms",
            flush=True,
        )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
