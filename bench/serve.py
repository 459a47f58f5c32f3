"""Per-user output throughput against concurrency through the OpenAI-compatible server (the EAGLE 3.1
release's serving measurement), speculative vs no speculation, on the bundled pair.

    python -m bench.serve [--concurrency 1 4 16 64] [--ks 3 5 7] [--requests 8] [--max-new 256] [--temperatures 0 1]

For each served system (the target alone; EAGLE-3.1 at each fixed chain depth K; EAGLE-3.1 and EAGLE-3
with the depth schedule of ``configs/serve/bundled.yaml``; EAGLE-3.1 with ``--spec auto``, the server's
default: depth per step from measured costs and live acceptance) a server is started on a loopback port and C
users run a closed loop (each sends its next request when the last returns, streaming) over held-out
code prompts. Per-user tokens/s = a user's generated tokens / its own wall time, mean over users;
total = all tokens / the run's wall time; TTFT and inter-token latency percentiles from the stream
(guidellm's metrics, measured the same way). The servers precompile their programs before they report
ready, as ``eagle-jax-serve`` does; the first pass at each concurrency on a fresh server is reported as
"cold", then passes run until one compiles nothing new, and the next is measured ("warm").

The same request sequence is then run through ``eagle_jax.generate`` in batches of C (no server, one
program per batch) for the fixed-depth systems: the server's per-user tokens/s over generate's is what
serving costs. Greedy, so every system returns the same tokens (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from bench.common import heldout_code_prompts, print_table, pyplot, write_json
from eagle_jax.config import SpecConfig
from eagle_jax.serving import SpecSchedule
from eagle_jax.serving.depth import AutoDepth



async def _user(client, url: str, model: str, prompts: list[list[int]], max_new: int, log: list, user: int,
                temperature: float = 0.0) -> dict:
    t_user = time.perf_counter()
    tokens = 0
    for i, ids in enumerate(prompts):
        body = {"model": model, "prompt": ids, "max_tokens": max_new, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}, "seed": 1000 * user + i}
        t0 = time.perf_counter()
        first, last, text, usage, spec = None, None, [], None, {}
        gaps = []
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage, spec = chunk["usage"], chunk.get("speculation", {})
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    text.append(chunk["choices"][0]["text"])
        n = usage["completion_tokens"]
        tokens += n
        log.append({"request": (user, i), "ttft": (first or time.perf_counter()) - t0, "gaps": gaps, "tokens": n, "text": "".join(text),
                    "seconds": time.perf_counter() - t0, "al": spec.get("acceptance_length")})
    return {"tokens": tokens, "seconds": time.perf_counter() - t_user}


async def closed_loop(url: str, model: str, per_user: list[list[list[int]]], max_new: int, temperature: float = 0.0) -> dict:
    import httpx

    log: list = []
    limits = httpx.Limits(max_connections=len(per_user) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        users = await asyncio.gather(*[_user(client, url, model, p, max_new, log, u, temperature) for u, p in enumerate(per_user)])
        wall = time.perf_counter() - t0
    gaps = [g for r in log for g in r["gaps"]]
    ttft = [r["ttft"] for r in log]
    return {
        "per_user_tok_s": float(np.mean([u["tokens"] / u["seconds"] for u in users])),
        "per_user_tok_s_min": float(np.min([u["tokens"] / u["seconds"] for u in users])),
        "total_tok_s": sum(u["tokens"] for u in users) / wall,
        "tokens": sum(u["tokens"] for u in users), "wall_s": wall,
        "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p90": float(np.percentile(ttft, 90)), "ttft_p99": float(np.percentile(ttft, 99)),
        "itl_p50": float(np.percentile(gaps, 50)) if gaps else None, "itl_p90": float(np.percentile(gaps, 90)) if gaps else None,
        "itl_p99": float(np.percentile(gaps, 99)) if gaps else None,
        "texts": [r["text"] for r in sorted(log, key=lambda r: r["request"])],
    }


def assign(prompts: list[list[int]], users: int, requests: int) -> list[list[list[int]]]:
    """User u's requests: prompts u, u + C, u + 2C, ... (``requests`` in all, spread over the users)."""
    per = max(1, requests // users)
    return [[prompts[(u + i * users) % len(prompts)] for i in range(per)] for u in range(users)]


def generate_per_user(target, drafter, spec, per_user, max_new: int, eos) -> float:
    """The same requests through ``eagle_jax.generate``: request i of every user in one batch of C."""
    import eagle_jax

    users = len(per_user)
    tokens = np.zeros(users)
    seconds = 0.0
    for i in range(len(per_user[0])):
        batch = [per_user[u][i] for u in range(users)]
        kw = dict(max_new_tokens=max_new, eos_token_id=list(eos), spec=spec)
        eagle_jax.generate(target, drafter, batch, **kw)  # compile (and warm) outside the timing
        r = eagle_jax.generate(target, drafter, batch, **kw)
        tokens += [len(t) for t in r.tokens]
        seconds += r.run_s
    return float(np.mean(tokens / seconds))


def _row_key(c: int, temperature: float, temperatures: list[float]) -> str:
    """Rows by concurrency; by (concurrency, temperature) when several temperatures are measured."""
    return str(c) if len(temperatures) == 1 else f"{c}@T={temperature:g}"


def _measure(srv, svc, name: str, schedule, drafter, c: int, temperature: float, prompts, args, target, eos, baseline_texts: dict) -> dict:
    """One system at one concurrency and temperature: the cold first pass, warm-up passes until nothing
    new compiles, then the measured pass."""
    per_user = assign(prompts, c, max(args.requests, c))
    engine = svc.scheduler.engine
    t0 = time.perf_counter()
    cold = asyncio.run(closed_loop(srv.url, "target", per_user, args.max_new, temperature))
    for _ in range(3):
        before = len(engine.compile_events)
        engine.wait_for_compiles()
        if len(engine.compile_events) == before:
            break
        asyncio.run(closed_loop(srv.url, "target", per_user, args.max_new, temperature))
    warm_s = time.perf_counter() - t0
    compiles_before = len(engine.compile_events)
    r = asyncio.run(closed_loop(srv.url, "target", per_user, args.max_new, temperature))
    r["warmup_s"] = warm_s
    r["compiles_while_measured"] = len(engine.compile_events) - compiles_before
    r["cold"] = {k: cold[k] for k in ("per_user_tok_s", "total_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}
    r["texts_sha"] = hashlib.sha256(json.dumps(r.pop("texts")).encode()).hexdigest()
    key = _row_key(c, temperature, args.temperatures)
    if name == "none":
        baseline_texts[key] = r["texts_sha"]
    r["same_text_as_none"] = r["texts_sha"] == baseline_texts.get(key) if temperature == 0 and key in baseline_texts else None
    if not args.no_generate and temperature == 0 and len(getattr(schedule, "rules", ())) == 1:
        r["generate_per_user_tok_s"] = generate_per_user(target, drafter, schedule.rules[0][1], per_user, args.max_new, eos)
        r["server_vs_generate"] = r["per_user_tok_s"] / r["generate_per_user_tok_s"]
    print(f"{name:20s} C={c:2d} T={temperature:g}: per-user {r['per_user_tok_s']:7.1f} tok/s (cold {cold['per_user_tok_s']:7.1f}), "
          f"total {r['total_tok_s']:7.1f}, TTFT p50/p99 {r['ttft_p50'] * 1e3:6.0f}/{r['ttft_p99'] * 1e3:6.0f} ms, "
          f"ITL p50/p99 {(r['itl_p50'] or 0) * 1e3:5.1f}/{(r['itl_p99'] or 0) * 1e3:5.1f} ms"
          + (f", vs generate {r['server_vs_generate']:.2f}" if "server_vs_generate" in r else ""), flush=True)
    return r


def main(argv=None) -> None:
    import eagle_jax
    from eagle_jax import bundled, compile_cache
    from eagle_jax.generate import eos_ids
    from eagle_jax.serving.server import Server, make_service, read_profile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ks", type=int, nargs="*", default=[3, 5, 7], help="fixed chain depths to measure (none: only the schedule rows)")
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level (at least one per user)")
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--max-chars", type=int, default=1200)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--rounds-per-step", type=int, default=None)
    ap.add_argument("--schedule", default=None, help="depth schedule of the schedule rows (default: the bundled profile's)")
    ap.add_argument("--systems", nargs="*", default=None, help="the systems to run, by name (default: all)")
    ap.add_argument("--no-generate", action="store_true", help="skip the generate-at-batch-C comparison")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                    help="each concurrency is measured at each (requests seeded; outputs compared with none's only at 0)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the servers' per-step prefill budget (default: the server's)")
    ap.add_argument("--no-prefix-cache", action="store_true", help="serve without prefix caching")
    ap.add_argument("--out", default="bench/results/serve.json")
    ap.add_argument("--resume", action="store_true", help="keep the systems --out already holds (same configuration) and measure the rest")
    args = ap.parse_args(argv)

    compile_cache.enable(compile_cache.default_dir())  # as the server does: a rerun loads the programs
    profile = read_profile(bundled.config_path("serve/bundled.yaml"))
    schedule_text = args.schedule or profile["spec"]
    rounds = args.rounds_per_step or profile["rounds_per_step"]
    target = eagle_jax.load_target(profile["target"], dtype="float32")
    tokenizer = eagle_jax.load_tokenizer(profile.get("tokenizer") or profile["target"])
    eos = eos_ids(target, tokenizer)
    d31 = eagle_jax.load_drafter(bundled.drafter_dir("eagle3.1"), target, dtype="float32")
    d3 = eagle_jax.load_drafter(bundled.drafter_dir("eagle3"), target, dtype="float32")
    prompts = [p["ids"] for p in heldout_code_prompts(tokenizer, args.n_prompts, max_chars=args.max_chars)]
    print(f"{len(prompts)} held-out prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
          f"{args.max_new} new tokens; {args.slots} slots; {rounds} rounds per step; EOS {eos}")

    systems = [("none", None, SpecSchedule.fixed(None))]
    systems += [(f"EAGLE-3.1 K={k}", d31, SpecSchedule.fixed(SpecConfig(num_speculative_tokens=k))) for k in args.ks]
    systems += [("EAGLE-3.1 schedule", d31, SpecSchedule.parse(schedule_text)), ("EAGLE-3 schedule", d3, SpecSchedule.parse(schedule_text))]
    systems += [("EAGLE-3.1 auto", d31, AutoDepth())]  # the server's default
    if args.systems is not None:
        unknown = set(args.systems) - {name for name, _, _ in systems}
        if unknown:
            raise SystemExit(f"--systems: unknown {sorted(unknown)}; known: {[name for name, _, _ in systems]}")
        systems = [s for s in systems if s[0] in args.systems]

    config = vars(args) | {"schedule": schedule_text, "rounds_per_step": rounds, "eos": list(eos)}
    results = {"config": config, "systems": {}}
    if args.resume and Path(args.out).exists():
        results = json.loads(Path(args.out).read_text())
        if {k: v for k, v in results["config"].items() if k not in ("systems", "resume")} != {k: v for k, v in config.items() if k not in ("systems", "resume")}:
            raise SystemExit(f"--resume: {args.out} was measured with another configuration")
    baseline_texts = {}
    if "none" in results["systems"]:
        baseline_texts = {key: row["texts_sha"] for key, row in results["systems"]["none"]["by_concurrency"].items() if "texts_sha" in row}
    for name, drafter, schedule in systems:
        if name in results["systems"]:
            print(f"{name}: measured before (--resume)")
            continue
        chunk = ({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}) | {"prefix_cache": not args.no_prefix_cache}
        svc = make_service(target, drafter, tokenizer, schedule, eos, slots=args.slots, max_len=profile["max_len"], precompile=True, **chunk,
                           rounds_per_step=rounds, model_name="target")
        srv = Server(svc).start()
        rows = {}
        try:
            for c in args.concurrency:
                for temperature in args.temperatures:
                    rows[_row_key(c, temperature, args.temperatures)] = _measure(srv, svc, name, schedule, drafter, c, temperature, prompts, args,
                                                                                 target, eos, baseline_texts)
        finally:
            srv.stop()
        results["systems"][name] = {"schedule": schedule.describe(), "by_concurrency": rows,
                                    "compile_s": sum(s for _, s in svc.scheduler.engine.compile_events)}
        write_json(args.out, results)
        # A precompiled engine's programs hold ~400 memory maps each: free them before the next server's
        # (one process runs every system; Linux allows 65530 maps by default).
        del svc, srv
        gc.collect()

    report(results, args.concurrency, args.temperatures, Path(args.out).with_suffix(".png"))
    write_json(args.out, results)


def report(results: dict, concurrency: list[int], temperatures: list[float], plot: Path) -> None:
    systems = results["systems"]
    levels = [_row_key(c, t, temperatures) for t in temperatures for c in concurrency]
    base = systems["none"]["by_concurrency"] if "none" in systems else None
    header = ["system"] + [f"C={c} per-user tok/s (x none)" for c in levels] + [f"C={c} total tok/s" for c in levels]
    rows = []
    for name, s in systems.items():
        by = s["by_concurrency"]
        rows.append([name] + [f"{by[c]['per_user_tok_s']:.1f}" + (f" ({by[c]['per_user_tok_s'] / base[c]['per_user_tok_s']:.2f}x)" if base else "")
                              for c in levels]
                    + [f"{by[c]['total_tok_s']:.0f}" for c in levels])
    fixed = {n: s for n, s in systems.items() if n.startswith("EAGLE-3.1 K=")}
    if fixed and base:
        best = ["best fixed K"]
        for c in levels:
            n, s = max(fixed.items(), key=lambda kv: kv[1]["by_concurrency"][c]["per_user_tok_s"])
            best.append(f"{n.split()[-1]}: {s['by_concurrency'][c]['per_user_tok_s'] / base[c]['per_user_tok_s']:.2f}x")
        rows.append(best + [""] * len(levels))
    print_table(header, rows)
    lat = []
    for name, s in systems.items():
        for c in levels:
            r = s["by_concurrency"][c]
            cold = r.get("cold", {})
            lat.append([name, c, f"{r['ttft_p50'] * 1e3:.0f}", f"{r['ttft_p90'] * 1e3:.0f}", f"{r.get('ttft_p99', float('nan')) * 1e3:.0f}",
                        f"{(r['itl_p50'] or 0) * 1e3:.1f}",
                        f"{(r['itl_p90'] or 0) * 1e3:.1f}", f"{(r['itl_p99'] or 0) * 1e3:.1f}",
                        f"{cold['per_user_tok_s'] / r['per_user_tok_s']:.2f}" if cold else "-",
                        f"{r['server_vs_generate']:.2f}" if "server_vs_generate" in r else "-",
                        {True: "yes", False: "NO", None: "-"}[r["same_text_as_none"]]])
    print_table(["system", "C", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "p90", "p99", "cold / warm per-user",
                 "server / generate per-user", "text = none"], lat)
    plt = pyplot()
    fig, axes = plt.subplots(len(temperatures), 2, figsize=(11, 4 * len(temperatures)), squeeze=False)
    for row, t in zip(axes, temperatures):
        keys = [_row_key(c, t, temperatures) for c in concurrency]
        for key, ax, label in (("per_user_tok_s", row[0], "per-user output tokens/s"), ("total_tok_s", row[1], "total output tokens/s")):
            for name, s in systems.items():
                ax.plot(concurrency, [s["by_concurrency"][k][key] for k in keys], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrency, [str(c) for c in concurrency])
            ax.set_xlabel("concurrent users")
            ax.set_ylabel(label)
            ax.set_title(f"temperature {t:g}", fontsize=9)
        row[0].legend(fontsize=7)
    fig.suptitle("Bundled pair through the server (2-core CPU)")
    fig.tight_layout()
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=120)


if __name__ == "__main__":
    main()
