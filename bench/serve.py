"""Per-user output throughput against concurrency through the OpenAI-compatible server (the EAGLE 3.1
release's serving measurement), speculative vs no speculation: the bundled pair on held-out code, or a
real chat pair as its users run it.

    python -m bench.serve [--concurrency 1 4 16 64] [--ks 3 5 7] [--requests 8] [--max-new 256] [--temperatures 0 1]
    python -m bench.serve --target smollm2-135m-instruct \\
        --drafters assets/smollm2/drafter-eagle3.1 assets/smollm2/drafter-eagle3 \\
        --questions ../shared/data/eval/mt_bench.jsonl ../shared/data/eval/alpaca.jsonl \\
            ../shared/data/eval/gsm8k.jsonl \\
        --concurrency 1 4 16 --ks --requests 16 --max-new 128 --temperatures 0 1 --out bench/results/serve_smollm2.json

Every server is built as ``eagle-jax-serve`` builds it (``eagle_jax.cli.serve.service_settings``: slots,
context, rounds per step, dtype), the bundled profile's without ``--target``, ``eagle-jax-serve --target
T --drafter D`` with it; ``--slots`` / ``--rounds-per-step`` / ``--step-ms`` / ``--prefill-chunk`` /
``--no-prefix-cache`` are passed on as its flags. Systems are named by drafter kind (``--drafters``: the EAGLE-3.1 one
first, optionally an EAGLE-3 one): the target alone (``none``); the first drafter at each fixed chain depth K
(``--ks``); without ``--target`` each drafter with the depth schedule of ``configs/serve/bundled.yaml``
("schedule") and the first with ``--spec auto``, with ``--target`` each drafter with the server's default
spec ("auto": depth per step from measured costs and live acceptance).

A server is started on a loopback port and C users run a closed loop (each sends its next request when
the last returns, streaming) over the prompts: held-out code as token ids through ``/v1/completions``,
or with ``--questions`` the first turns of FastChat question files (the first ``--n-questions`` of each,
files in turn) as a user message through ``/v1/chat/completions``, so the server applies the model's
chat template. Per-user tokens/s = a user's generated tokens / its own wall time, mean over users;
total = all tokens / the run's wall time; TTFT and inter-token latency percentiles from the stream
(guidellm's metrics, measured the same way), and TTFT's median past each user's first request (arrivals
at a busy server one at a time, not the opening burst of C prompts at once). The servers precompile their programs
before they report ready, as ``eagle-jax-serve`` does; the first pass at each concurrency on a fresh server is reported
as "cold", then passes run until one compiles nothing new, and the next is measured ("warm"). Every server measures
auto's step costs anew, as on a fresh machine. One server
runs at a time, each system's levels back to back; with ``--repeats N`` every system's server runs at once
and each level is measured N times per system, the systems taking turns pass by pass (each repeat starting
one system later), so that the machine's drift over minutes touches every system alike: measured one after
another, one system's per-user tok/s moved 10-20% between runs here, more than the differences compared.
A row is then the mean over its passes (``passes`` holds each), and the report adds auto over the best of
the drafter's fixed systems at each level.

The same request sequence is then run through ``eagle_jax.generate`` in batches of C (no server, one
program per batch; chat prompts rendered with the tokenizer's chat template, as the server renders
them) for the fixed-depth systems: the server's per-user tokens/s over generate's is what serving
costs. At temperature 0 every system must return the same text as ``none`` (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from bench.common import (
    TARGET_HELP,
    chat_prompts,
    chat_source,
    drafter_label,
    fit_prompts,
    heldout_code_prompts,
    print_table,
    pyplot,
    write_json,
)
from eagle_jax.config import SpecConfig
from eagle_jax.serving import SpecSchedule


@dataclass(frozen=True)
class Endpoint:
    """What a request depends on its endpoint for: the path, the prompt's fields of the body (from a
    prompt dict: "ids", and "turn" for chat), and a streamed choice's new text."""

    path: str
    prompt: Callable[[dict], dict]
    delta: Callable[[dict], str | None]


COMPLETIONS = Endpoint("/v1/completions", lambda p: {"prompt": p["ids"]}, lambda choice: choice.get("text"))
CHAT = Endpoint(
    "/v1/chat/completions",
    lambda p: {"messages": [{"role": "user", "content": p["turn"]}]},
    lambda choice: choice.get("delta", {}).get("content"),
)


async def _user(
    client,
    url: str,
    model: str,
    prompts: list[dict],
    max_new: int,
    log: list,
    user: int,
    temperature: float,
    endpoint: Endpoint,
) -> dict:
    t_user = time.perf_counter()
    tokens = 0
    for i, prompt in enumerate(prompts):
        body = {
            "model": model,
            **endpoint.prompt(prompt),
            "max_tokens": max_new,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 1000 * user + i,
        }
        t0 = time.perf_counter()
        first, last, text, usage, spec = None, None, [], None, {}
        gaps = []
        async with client.stream("POST", url + endpoint.path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage, spec = chunk["usage"], chunk.get("speculation", {})
                piece = endpoint.delta(chunk["choices"][0]) if chunk.get("choices") else None
                if piece:  # chat's first chunk (the role) and the finish chunks carry no text
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    text.append(piece)
        n = usage["completion_tokens"]
        tokens += n
        log.append(
            {
                "request": (user, i),
                "ttft": (first or time.perf_counter()) - t0,
                "gaps": gaps,
                "tokens": n,
                "text": "".join(text),
                "seconds": time.perf_counter() - t0,
                "al": spec.get("acceptance_length"),
            }
        )
    return {"tokens": tokens, "seconds": time.perf_counter() - t_user}


async def closed_loop(
    url: str,
    model: str,
    per_user: list[list[dict]],
    max_new: int,
    temperature: float = 0.0,
    endpoint: Endpoint = COMPLETIONS,
) -> dict:
    """``per_user[u]``: user u's prompts (dicts with "ids", and "turn" for ``CHAT``), sent one after another."""
    import httpx

    log: list = []
    limits = httpx.Limits(max_connections=len(per_user) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        users = await asyncio.gather(
            *[_user(client, url, model, p, max_new, log, u, temperature, endpoint) for u, p in enumerate(per_user)]
        )
        wall = time.perf_counter() - t0
    gaps = [g for r in log for g in r["gaps"]]
    ttft = [r["ttft"] for r in log]
    # Past each user's first request: arrivals at a busy server, one at a time, not the opening burst of C prompts.
    steady = [r["ttft"] for r in log if r["request"][1] > 0]
    return {
        "per_user_tok_s": float(np.mean([u["tokens"] / u["seconds"] for u in users])),
        "per_user_tok_s_min": float(np.min([u["tokens"] / u["seconds"] for u in users])),
        "total_tok_s": sum(u["tokens"] for u in users) / wall,
        "tokens": sum(u["tokens"] for u in users),
        "wall_s": wall,
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p90": float(np.percentile(ttft, 90)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "ttft_steady_p50": float(np.percentile(steady, 50)) if steady else None,
        "itl_p50": float(np.percentile(gaps, 50)) if gaps else None,
        "itl_p90": float(np.percentile(gaps, 90)) if gaps else None,
        "itl_p99": float(np.percentile(gaps, 99)) if gaps else None,
        "texts": [r["text"] for r in sorted(log, key=lambda r: r["request"])],
    }


def assign(prompts: list[dict], users: int, requests: int) -> list[list[dict]]:
    """User u's requests: prompts u, u + C, u + 2C, ... (``requests`` in all, spread over the users)."""
    per = max(1, requests // users)
    return [[prompts[(u + i * users) % len(prompts)] for i in range(per)] for u in range(users)]


def generate_per_user(target, drafter, spec: SpecConfig | None, per_user: list[list[dict]], max_new: int, eos) -> float:
    """The same requests through ``eagle_jax.generate`` (their "ids": a chat prompt rendered as the server
    renders it): request i of every user in one batch of C."""
    import eagle_jax

    users = len(per_user)
    tokens = np.zeros(users)
    seconds = 0.0
    for i in range(len(per_user[0])):
        batch = [per_user[u][i]["ids"] for u in range(users)]
        kw = dict(max_new_tokens=max_new, eos_token_id=list(eos), spec=spec)
        eagle_jax.generate(target, drafter, batch, **kw)  # compile (and warm) outside the timing
        r = eagle_jax.generate(target, drafter, batch, **kw)
        tokens += [len(t) for t in r.tokens]
        seconds += r.run_s
    return float(np.mean(tokens / seconds))


def _row_key(c: int, temperature: float, temperatures: list[float]) -> str:
    """Rows by concurrency; by (concurrency, temperature) when several temperatures are measured."""
    return str(c) if len(temperatures) == 1 else f"{c}@T={temperature:g}"


def _warm(srv, svc, per_user: list[list[dict]], temperature: float, endpoint: Endpoint, args) -> tuple[dict, float]:
    """A fresh level's cold first pass, then warm-up passes until nothing new compiles: (the cold pass, seconds)."""
    engine = svc.scheduler.engine
    t0 = time.perf_counter()
    cold = asyncio.run(closed_loop(srv.url, "target", per_user, args.max_new, temperature, endpoint))
    for _ in range(3):
        before = len(engine.compile_events)
        engine.wait_for_compiles()
        if len(engine.compile_events) == before:
            break
        asyncio.run(closed_loop(srv.url, "target", per_user, args.max_new, temperature, endpoint))
    return cold, time.perf_counter() - t0


def _pass(srv, svc, schedule, per_user: list[list[dict]], temperature: float, endpoint: Endpoint, args) -> dict:
    """One measured pass: ``closed_loop``'s figures, the compiles during it and the steps it ran per depth."""
    engine = svc.scheduler.engine
    compiles_before = len(engine.compile_events)
    steps_before = svc.metrics.steps_per_depth()
    r = asyncio.run(closed_loop(srv.url, "target", per_user, args.max_new, temperature, endpoint))
    r["compiles_while_measured"] = len(engine.compile_events) - compiles_before
    # Which depths the measured pass ran (auto's choices): engine steps per drafts per round.
    r["steps_by_depth"] = {
        d: n - steps_before.get(d, 0)
        for d, n in sorted(svc.metrics.steps_per_depth().items())
        if n > steps_before.get(d, 0)
    }
    if hasattr(schedule, "snapshot"):  # auto: the costs and acceptance its choices came from
        r["auto_state"] = schedule.snapshot()
    r["texts_sha"] = hashlib.sha256(json.dumps(r.pop("texts")).encode()).hexdigest()
    return r


def pooled(passes: list[dict]) -> dict:
    """Measured passes of one system at one level as one row: tokens/s the mean over the passes (each pass's in
    ``passes``), latencies the median, steps by depth and compiles summed, the texts the first pass's and whether
    every pass returned them (``texts_equal``)."""
    if len(passes) == 1:
        return passes[0] | {"texts_equal": True}
    row = dict(passes[-1])  # the fields not pooled below (auto's costs and acceptance) as the last pass left them
    for key in ("per_user_tok_s", "per_user_tok_s_min", "total_tok_s"):
        row[key] = float(np.mean([p[key] for p in passes]))
    for key in ("ttft_p50", "ttft_p90", "ttft_p99", "ttft_steady_p50", "itl_p50", "itl_p90", "itl_p99"):
        values = [p[key] for p in passes if p[key] is not None]
        row[key] = float(np.median(values)) if values else None
    row["tokens"], row["wall_s"] = sum(p["tokens"] for p in passes), sum(p["wall_s"] for p in passes)
    row["compiles_while_measured"] = sum(p["compiles_while_measured"] for p in passes)
    depths = {d for p in passes for d in p["steps_by_depth"]}
    row["steps_by_depth"] = {d: sum(p["steps_by_depth"].get(d, 0) for p in passes) for d in sorted(depths)}
    row["texts_sha"], row["texts_equal"] = passes[0]["texts_sha"], len({p["texts_sha"] for p in passes}) == 1
    row["passes"] = [{k: p[k] for k in ("per_user_tok_s", "total_tok_s", "steps_by_depth")} for p in passes]
    return row


def _report_row(
    name: str, schedule, drafter, c: int, temperature: float, r: dict, per_user, args, target, eos, baseline_texts: dict
) -> dict:
    """Checks a level's pooled row against ``none``'s texts, adds generate's figure and prints it."""
    key = _row_key(c, temperature, args.temperatures)
    if name == "none":
        baseline_texts[key] = r["texts_sha"]
    r["same_text_as_none"] = (
        (r["texts_equal"] and r["texts_sha"] == baseline_texts.get(key))
        if temperature == 0 and key in baseline_texts
        else None
    )
    if not args.no_generate and temperature == 0 and len(getattr(schedule, "rules", ())) == 1:
        r["generate_per_user_tok_s"] = generate_per_user(
            target, drafter, schedule.rules[0][1], per_user, args.max_new, eos
        )
        r["server_vs_generate"] = r["per_user_tok_s"] / r["generate_per_user_tok_s"]
    cold = r["cold"]
    spread = (
        " (passes "
        f"{min(p['per_user_tok_s'] for p in r['passes']):.1f}-{max(p['per_user_tok_s'] for p in r['passes']):.1f})"
        if "passes" in r
        else ""
    )
    print(
        f"{name:20s} C={c:2d} T={temperature:g}: per-user {r['per_user_tok_s']:7.1f} tok/s{spread} (cold "
        f"{cold['per_user_tok_s']:7.1f}), total {r['total_tok_s']:7.1f}, TTFT p50/p99 "
        f"{r['ttft_p50'] * 1e3:6.0f}/{r['ttft_p99'] * 1e3:6.0f} ms "
        + (
            f"(past the opening burst p50 {r['ttft_steady_p50'] * 1e3:.0f}), "
            if r.get("ttft_steady_p50") is not None
            else ", "
        )
        + f"ITL p50/p99 {(r['itl_p50'] or 0) * 1e3:5.1f}/{(r['itl_p99'] or 0) * 1e3:5.1f} ms"
        + (f", vs generate {r['server_vs_generate']:.2f}" if "server_vs_generate" in r else "")
        + f", steps by depth {r['steps_by_depth']}",
        flush=True,
    )
    return r


def main(argv: list[str] | None = None) -> None:
    import eagle_jax
    from eagle_jax import bundled, compile_cache
    from eagle_jax.cli.serve import service_settings
    from eagle_jax.decoding.calls import eos_ids
    from eagle_jax.serving.server import Server, freeze_startup_heap, make_service, parse_spec, served_name
    from eagle_jax.serving.slots import slot_len

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help=TARGET_HELP + " (default: the bundled profile's)")
    ap.add_argument(
        "--drafters",
        nargs="+",
        default=None,
        help="the EAGLE-3.1 drafter, then optionally an EAGLE-3 one (default: the bundled ones)",
    )
    ap.add_argument(
        "--questions",
        nargs="+",
        default=None,
        help="FastChat question files: their first turns through /v1/chat/completions (default: held-out code "
        "prompts through /v1/completions)",
    )
    ap.add_argument("--n-questions", type=int, default=0, help="first N questions of each --questions file (0: all)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--ks", type=int, nargs="*", default=[3, 5, 7], help="fixed chain depths to measure (none: no fixed-depth rows)"
    )
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level (at least one per user)")
    ap.add_argument("--n-prompts", type=int, default=32, help="held-out code prompts (without --questions)")
    ap.add_argument("--max-chars", type=int, default=1200, help="held-out code prompts' length at most")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--slots", type=int, default=None, help="(default: eagle-jax-serve's)")
    ap.add_argument("--rounds-per-step", type=int, default=None, help="(default: eagle-jax-serve's)")
    ap.add_argument("--step-ms", type=float, default=None, help="(default: eagle-jax-serve's)")
    ap.add_argument(
        "--schedule",
        default=None,
        help="depth schedule of the schedule rows (default: the bundled profile's without --target, no rows with it)",
    )
    ap.add_argument(
        "--systems", nargs="*", default=None, help="the systems to run, by name, in this order (default: all)"
    )
    ap.add_argument("--no-generate", action="store_true", help="skip the generate-at-batch-C comparison")
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0],
        help="each concurrency is measured at each (requests seeded; outputs compared with none's only at 0)",
    )
    ap.add_argument(
        "--prefill-chunk", type=int, default=None, help="the servers' per-step prefill budget (default: the server's)"
    )
    ap.add_argument("--no-prefix-cache", action="store_true", help="serve without prefix caching")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measured passes per system and level; above 1 every system's server runs at once and their passes "
        "alternate, so the machine's drift touches all alike (rows: the mean over the passes)",
    )
    ap.add_argument("--out", default="bench/results/serve.json")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the systems --out already holds (same configuration) and measure the rest",
    )
    args = ap.parse_args(argv)

    compile_cache.enable(compile_cache.default_dir())  # as the server does: a rerun loads the programs
    drafter_dirs = args.drafters or [str(bundled.drafter_dir("eagle3.1")), str(bundled.drafter_dir("eagle3"))]
    # The server's settings as eagle-jax-serve resolves them from its command line.
    flags = ["--target", args.target, "--drafter", drafter_dirs[0]] if args.target else []
    for flag, value in (
        ("--slots", args.slots),
        ("--rounds-per-step", args.rounds_per_step),
        ("--step-ms", args.step_ms),
        ("--prefill-chunk", args.prefill_chunk),
    ):
        flags += [] if value is None else [flag, str(value)]
    flags += ["--no-prefix-cache"] if args.no_prefix_cache else []
    settings = service_settings(flags)
    target_dir, dtype, default_spec = settings.pop("target_dir"), settings.pop("dtype"), settings.pop("spec")
    tokenizer_dir = settings.pop("tokenizer_dir") or target_dir
    del settings["drafter_dir"], settings["model_name"], settings["precompile"]  # per system below; always precompiled
    schedule_text = args.schedule or (None if args.target else default_spec)

    target = eagle_jax.load_target(target_dir, dtype=dtype)
    tokenizer = eagle_jax.load_tokenizer(tokenizer_dir)
    eos = eos_ids(target, tokenizer)
    drafters = {}
    for d in drafter_dirs:
        drafter = eagle_jax.load_drafter(d, target, dtype=dtype)
        if drafter_label(drafter) in drafters:
            raise SystemExit(f"--drafters: two {drafter_label(drafter)} drafters; give one of each kind")
        drafters[drafter_label(drafter)] = drafter
    first, d0 = next(iter(drafters.items()))
    if args.questions:
        limit = slot_len(target.config, settings["max_len"])  # the served context
        prompts = fit_prompts(chat_prompts(args.questions, tokenizer, args.n_questions), args.max_new, limit)
        prompt_source, endpoint = chat_source(args.questions, args.n_questions, prompts), CHAT
    else:
        prompts = heldout_code_prompts(tokenizer, args.n_prompts, max_chars=args.max_chars)
        prompt_source, endpoint = {"kind": "heldout code", "count": len(prompts)}, COMPLETIONS
    if not prompts:
        raise SystemExit("no prompts")
    print(
        f"{len(prompts)} prompts ({prompt_source['kind']}), "
        f"{min(len(p['ids']) for p in prompts)}-{max(len(p['ids']) for p in prompts)} "
        f"tokens through {endpoint.path}; {args.max_new} new tokens; {settings['slots']} slots; "
        f"{settings['rounds_per_step']} rounds per step, cut to {settings['step_ms']:g} ms; EOS {eos}"
    )

    def fixed(k: int | None) -> SpecSchedule:
        return SpecSchedule.fixed(None if k is None else SpecConfig(num_speculative_tokens=k))

    systems = [("none", None, fixed(None))]
    if args.target:  # as eagle-jax-serve --target T --drafter D serves each drafter (no --spec)
        systems += [(f"{label} auto", d, parse_spec(default_spec, True)) for label, d in drafters.items()]
    systems += [(f"{first} K={k}", d0, fixed(k)) for k in args.ks]
    if schedule_text:
        systems += [(f"{label} schedule", d, parse_spec(schedule_text, True)) for label, d in drafters.items()]
    if not args.target:
        systems += [(f"{first} auto", d0, parse_spec("auto", True))]
    if args.systems is not None:
        unknown = set(args.systems) - {name for name, _, _ in systems}
        if unknown:
            raise SystemExit(f"--systems: unknown {sorted(unknown)}; known: {[name for name, _, _ in systems]}")
        by_name = {s[0]: s for s in systems}
        systems = [by_name[name] for name in dict.fromkeys(args.systems)]

    config = vars(args) | {
        "slots": settings["slots"],
        "rounds_per_step": settings["rounds_per_step"],
        "step_ms": settings["step_ms"],
        "schedule": schedule_text,
        "eos": list(eos),
        "server": settings | {"dtype": dtype},
        "prompts": prompt_source,
    }
    results = {"config": config, "systems": {}}
    if args.resume and Path(args.out).exists():
        results = json.loads(Path(args.out).read_text())
        if {k: v for k, v in results["config"].items() if k not in ("systems", "resume")} != {
            k: v for k, v in config.items() if k not in ("systems", "resume")
        }:
            raise SystemExit(f"--resume: {args.out} was measured with another configuration")
    baseline_texts = {}
    if "none" in results["systems"]:
        baseline_texts = {
            key: row["texts_sha"]
            for key, row in results["systems"]["none"]["by_concurrency"].items()
            if "texts_sha" in row
        }
    todo = []
    for name, drafter, schedule in systems:
        if name in results["systems"]:
            print(f"{name}: measured before (--resume)")
        else:
            todo.append((name, drafter, schedule))
    # One server at a time, or (--repeats) every system's at once, their measured passes taken in turn.
    for group in [todo] if args.repeats > 1 else [[s] for s in todo]:
        services = []
        for name, drafter, schedule in group:
            svc = make_service(
                target, drafter, tokenizer, schedule, eos, **settings, model_name="target", precompile=True
            )
            services.append((svc, Server(svc).start()))
        freeze_startup_heap()  # as eagle-jax-serve does before it listens
        rows = {name: {} for name, _, _ in group}
        try:
            for c in args.concurrency:
                per_user = assign(prompts, c, max(args.requests, c))
                for temperature in args.temperatures:
                    warmed = [_warm(srv, svc, per_user, temperature, endpoint, args) for svc, srv in services]
                    passes = [[] for _ in group]
                    for rep in range(args.repeats):
                        for i in [
                            (rep + j) % len(group) for j in range(len(group))
                        ]:  # each repeat starts one system later
                            (svc, srv), (_, _, schedule) = services[i], group[i]
                            passes[i].append(_pass(srv, svc, schedule, per_user, temperature, endpoint, args))
                    for (name, drafter, schedule), (cold, warm_s), ps in zip(group, warmed, passes):
                        row = pooled(ps) | {
                            "warmup_s": warm_s,
                            "cold": {
                                k: cold[k]
                                for k in ("per_user_tok_s", "total_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
                            },
                        }
                        rows[name][_row_key(c, temperature, args.temperatures)] = _report_row(
                            name, schedule, drafter, c, temperature, row, per_user, args, target, eos, baseline_texts
                        )
        finally:
            for _, srv in services:
                srv.stop()
        for (name, _, schedule), (svc, _) in zip(group, services):
            results["systems"][name] = {
                "schedule": schedule.describe(),
                "by_concurrency": rows[name],
                "compile_s": sum(s for _, s in svc.scheduler.engine.compile_events),
            }
        write_json(args.out, results)
        # A precompiled engine's programs hold ~400 memory maps each: free them before the next server's
        # (one process runs every system; Linux allows 65530 maps by default).
        del services, svc, srv
        gc.unfreeze()  # frozen, these services' cycles would never be collected
        gc.collect()

    pair = served_name(target_dir) if args.target else "Bundled pair"
    report(
        results,
        args.concurrency,
        args.temperatures,
        Path(args.out).with_suffix(".png"),
        f"{pair} through the server ({jax.devices()[0].device_kind})",
    )
    write_json(args.out, results)


def report(results: dict, concurrency: list[int], temperatures: list[float], plot: Path, title: str) -> None:
    systems = results["systems"]
    levels = [_row_key(c, t, temperatures) for t in temperatures for c in concurrency]
    base = systems["none"]["by_concurrency"] if "none" in systems else None
    header = ["system"] + [f"C={c} per-user tok/s (x none)" for c in levels] + [f"C={c} total tok/s" for c in levels]
    rows = []
    for name, s in systems.items():
        by = s["by_concurrency"]
        rows.append(
            [name]
            + [
                f"{by[c]['per_user_tok_s']:.1f}"
                + (f" ({by[c]['per_user_tok_s'] / base[c]['per_user_tok_s']:.2f}x)" if base else "")
                for c in levels
            ]
            + [f"{by[c]['total_tok_s']:.0f}" for c in levels]
        )
    fixed = {n: s for n, s in systems.items() if " K=" in n}
    if fixed and base:
        best = ["best fixed K"]
        for c in levels:
            n, s = max(fixed.items(), key=lambda kv: kv[1]["by_concurrency"][c]["per_user_tok_s"])
            best.append(f"{n.split()[-1]}: {s['by_concurrency'][c]['per_user_tok_s'] / base[c]['per_user_tok_s']:.2f}x")
        rows.append(best + [""] * len(levels))
    print_table(header, rows)
    # auto against the best of the drafter's fixed systems (fixed depths and schedules), level by level
    autos = [n for n in systems if n.endswith(" auto")]
    others = [n for n in systems if n != "none" and not n.endswith(" auto")]
    if autos and others:
        vs = []
        for name in autos:
            line = [name]
            for c in levels:
                best = max(others, key=lambda n: systems[n]["by_concurrency"][c]["per_user_tok_s"])
                ratio = (
                    systems[name]["by_concurrency"][c]["per_user_tok_s"]
                    / systems[best]["by_concurrency"][c]["per_user_tok_s"]
                )
                line.append(f"{ratio:.3f} ({best.split(' ', 1)[-1]})")
            vs.append(line)
        print_table(["per-user tok/s over the best fixed system's"] + [f"C={c}" for c in levels], vs)
    lat = []
    for name, s in systems.items():
        for c in levels:
            r = s["by_concurrency"][c]
            cold = r.get("cold", {})
            lat.append(
                [
                    name,
                    c,
                    f"{r['ttft_p50'] * 1e3:.0f}",
                    f"{r['ttft_p90'] * 1e3:.0f}",
                    f"{r.get('ttft_p99', float('nan')) * 1e3:.0f}",
                    f"{r['ttft_steady_p50'] * 1e3:.0f}" if r.get("ttft_steady_p50") is not None else "-",
                    f"{(r['itl_p50'] or 0) * 1e3:.1f}",
                    f"{(r['itl_p90'] or 0) * 1e3:.1f}",
                    f"{(r['itl_p99'] or 0) * 1e3:.1f}",
                    f"{cold['per_user_tok_s'] / r['per_user_tok_s']:.2f}" if cold else "-",
                    f"{r['server_vs_generate']:.2f}" if "server_vs_generate" in r else "-",
                    {True: "yes", False: "NO", None: "-"}[r["same_text_as_none"]],
                ]
            )
    print_table(
        [
            "system",
            "C",
            "TTFT p50 ms",
            "p90",
            "p99",
            "p50 past the burst",
            "ITL p50 ms",
            "p90",
            "p99",
            "cold / warm per-user",
            "server / generate per-user",
            "text = none",
        ],
        lat,
    )
    plt = pyplot()
    fig, axes = plt.subplots(len(temperatures), 2, figsize=(11, 4 * len(temperatures)), squeeze=False)
    for row, t in zip(axes, temperatures):
        keys = [_row_key(c, t, temperatures) for c in concurrency]
        for key, ax, label in (
            ("per_user_tok_s", row[0], "per-user output tokens/s"),
            ("total_tok_s", row[1], "total output tokens/s"),
        ):
            for name, s in systems.items():
                ax.plot(concurrency, [s["by_concurrency"][k][key] for k in keys], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrency, [str(c) for c in concurrency])
            ax.set_xlabel("concurrent users")
            ax.set_ylabel(label)
            ax.set_title(f"temperature {t:g}", fontsize=9)
        row[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=120)


if __name__ == "__main__":
    main()
