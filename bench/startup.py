"""A server's start, cold and from a warm compilation cache, and its first requests (bundled pair).

    python -m bench.startup [--concurrency 4] [--requests 8] [--max-new 128] [--out bench/results/startup.json]
    python -m bench.startup --compile-workers 1      # programs compiled one at a time (default: the server's)

Two fresh processes in turn build the bundled profile's service as ``eagle-jax-serve`` does (every
program compiled before it listens, ``--precompile``), over one compilation-cache directory that starts
empty: the first compiles everything (cold), the second loads it (warm cache). Each then serves C
closed-loop users twice over held-out code prompts (greedy, streaming, as ``bench.serve``): the first
sweep is what the first users of a fresh server get, the second the same server warm (prefix caching off
unless ``--prefix-cache``: the second sweep repeats the first's prompts, and would otherwise hit the cache).

Goals: ready with a warm cache in <= 0.2x the cold start; the warm-cache server's first sweep at C=4
>= 0.9x its second's per-user throughput; no compiles while serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import print_table, write_json


def child(args) -> None:
    from bench.common import heldout_code_prompts
    from bench.serve import assign, closed_loop
    from eagle_jax import bundled, compile_cache
    from eagle_jax.serving.server import Server, build_service

    compile_cache.enable(args.cache)
    profile_path = bundled.config_path("serve/bundled.yaml")
    from eagle_jax.serving.server import read_profile

    profile = read_profile(profile_path)
    t0 = time.perf_counter()
    svc = build_service(
        profile["target"],
        profile["drafter"],
        spec=profile["spec"],
        slots=profile["slots"],
        max_len=profile["max_len"],
        rounds_per_step=profile["rounds_per_step"],
        dtype=profile["dtype"],
        model_name="target",
        precompile=True,
        compile_workers=args.compile_workers,
        prefix_cache=args.prefix_cache,
    )
    ready = time.perf_counter() - t0
    engine = svc.scheduler.engine
    compiled = len(engine.compile_events)
    prompts = heldout_code_prompts(svc.tokenizer, 32, max_chars=1200)
    per_user = assign(prompts, args.concurrency, args.requests)
    srv = Server(svc).start()
    try:
        sweeps = [asyncio.run(closed_loop(srv.url, "target", per_user, args.max_new)) for _ in range(2)]
    finally:
        srv.stop()
    for s in sweeps:
        s.pop("texts")
    out = {
        "ready_s": ready,
        "programs": len(engine.program_set()),
        "compiled_at_start": compiled,
        "compiled_while_serving": len(engine.compile_events) - compiled,
        "sweeps": sweeps,
    }
    Path(args.child_out).write_text(json.dumps(out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", default="bench/results/startup.json")
    ap.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve with prefix caching (off by default: the second sweep repeats the first's prompts, so "
        "with it on the second sweep's prefills are cache hits and the sweeps no longer compare startup alone)",
    )
    ap.add_argument(
        "--compile-workers", type=int, default=None, help="programs compiled at once (default: the server's)"
    )
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_out:
        return child(args)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for phase in ("cold", "warm cache"):
            out = Path(tmp) / "child.json"
            cmd = [
                sys.executable,
                "-m",
                "bench.startup",
                "--cache",
                str(Path(tmp) / "xla"),
                "--child-out",
                str(out),
                "--prefix-cache" if args.prefix_cache else "--no-prefix-cache",
                "--concurrency",
                str(args.concurrency),
                "--requests",
                str(args.requests),
                "--max-new",
                str(args.max_new),
                *([] if args.compile_workers is None else ["--compile-workers", str(args.compile_workers)]),
            ]
            subprocess.run(cmd, check=True)
            runs[phase] = json.loads(out.read_text())
            r = runs[phase]
            print(
                f"{phase}: ready in {r['ready_s']:.1f} s ({r['compiled_at_start']} of {r['programs']} programs "
                f"compiled), first sweep {r['sweeps'][0]['per_user_tok_s']:.1f} tok/s per user, second "
                f"{r['sweeps'][1]['per_user_tok_s']:.1f}, "
                f"{r['compiled_while_serving']} compiles while serving",
                flush=True,
            )
    cold, warm = runs["cold"], runs["warm cache"]
    rows = [
        [
            phase,
            f"{r['ready_s']:.1f}",
            r["compiled_at_start"],
            f"{r['sweeps'][0]['per_user_tok_s']:.1f}",
            f"{r['sweeps'][1]['per_user_tok_s']:.1f}",
            f"{r['sweeps'][0]['per_user_tok_s'] / r['sweeps'][1]['per_user_tok_s']:.2f}",
            r["compiled_while_serving"],
        ]
        for phase, r in runs.items()
    ]
    print_table(
        ["start", "ready s", "compiled", "first sweep tok/s/user", "second", "first / second", "compiles serving"], rows
    )
    print(f"warm-cache start / cold start: {warm['ready_s'] / cold['ready_s']:.3f}")
    write_json(args.out, {"config": vars(args), "runs": runs, "warm_over_cold": warm["ready_s"] / cold["ready_s"]})


if __name__ == "__main__":
    main()
