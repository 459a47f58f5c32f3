"""Servers compared as guidellm measures them: each ``eagle-jax-serve`` in its own process (optionally from
another checkout of this repository), its cold start timed, then guidellm's concurrent profile (streaming,
its default) at 1 / 4 / 16 users, greedy and at the API's default temperature, the servers taking turns.

    python -m bench.guidellm_servers --server now= --server "previous@../old-checkout=" \\
        [--concurrency 1 4 16] [--temperatures 0 1] [--repeats 2] [--requests 24] [--max-new 128]
    python -m bench.guidellm_servers --target smollm2-135m-instruct \\
        --server "auto=--drafter assets/smollm2/drafter-eagle3.1" --server "none=--drafter none --spec none" \\
        --questions ../shared/data/eval/mt_bench.jsonl ../shared/data/eval/gsm8k.jsonl ../shared/data/eval/alpaca.jsonl

``--server LABEL[@CHECKOUT]=FLAGS``: a server started as ``python -m eagle_jax.cli.serve FLAGS`` (plus
``--target`` when given) in CHECKOUT (default: this one), over an empty compilation cache unless FLAGS name
one, so each start is a cold start; servers start one after another on an otherwise idle machine. Prompts: held-out code
(``/v1/completions``, text) for the bundled pair, or with ``--questions`` the questions' first turns as
chat messages (``/v1/chat/completions``); every request asks for ``--max-new`` tokens (guidellm then sends
``ignore_eos``). Each server is warmed by one pass, then every (repeat, temperature) runs one guidellm
sweep per server, the order rotated each repeat. Per-user tokens/s is the mean over requests of output
tokens / request latency (a user's requests run back to back); TTFT the median over requests. At the end
``/metrics``' ``eagle_compile_events_total`` says how many programs compiled while serving.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    TARGET_HELP,
    chat_prompts,
    heldout_code_prompts,
    load_tokenizer,
    local_target,
    print_table,
    write_json,
)

REPO = Path(__file__).resolve().parents[1]


@dataclass
class ServerSpec:
    label: str
    checkout: Path
    flags: list[str]
    port: int
    process: subprocess.Popen | None = None
    start_s: float | None = None
    passes: dict = field(default_factory=dict)  # "T=<t> C=<c>" -> [per-pass summaries]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def parse_server(text: str, port: int) -> ServerSpec:
    """``LABEL[@CHECKOUT]=FLAGS`` as a ServerSpec; a bad form exits naming the argument."""
    if "=" not in text:
        raise SystemExit(f"--server {text!r}: expected LABEL[@CHECKOUT]=FLAGS")
    name, flags = text.split("=", 1)
    label, _, checkout = name.partition("@")
    path = Path(checkout).resolve() if checkout else REPO
    if not (path / "eagle_jax" / "cli" / "serve.py").exists():
        raise SystemExit(f"--server {text!r}: {path} is not a checkout of this repository")
    return ServerSpec(label or "server", path, flags.split(), port)


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def start(server: ServerSpec, target: str | None, log_dir: Path, timeout_s: float) -> None:
    """Start the server over an empty compilation cache and wait for ``/health``; the time it took is
    its cold start."""
    cache = (
        []
        if "--compile-cache" in server.flags
        else ["--compile-cache", tempfile.mkdtemp(prefix=f"xla-{server.label}-")]
    )
    cmd = [
        sys.executable,
        "-m",
        "eagle_jax.cli.serve",
        *server.flags,
        "--port",
        str(server.port),
        *cache,
        *(["--target", target] if target else []),
    ]
    env = {**os.environ, "PYTHONPATH": str(server.checkout)}
    log = open(log_dir / f"{server.label}.log", "w")
    t0 = time.perf_counter()
    server.process = subprocess.Popen(cmd, cwd=server.checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    while time.perf_counter() - t0 < timeout_s:
        if server.process.poll() is not None:
            raise SystemExit(f"server {server.label} exited ({server.process.returncode}); see {log.name}")
        try:
            _get(server.url + "/health", timeout=2)
            server.start_s = time.perf_counter() - t0
            print(f"{server.label}: ready after {server.start_s:.1f} s", flush=True)
            return
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"server {server.label} not ready after {timeout_s:.0f} s")


def compile_events(server: ServerSpec) -> float:
    """``eagle_compile_events_total`` summed over program kinds."""
    total = 0.0
    for line in _get(server.url + "/metrics").splitlines():
        if line.startswith("eagle_compile_events_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def model_name(server: ServerSpec) -> str:
    return json.loads(_get(server.url + "/v1/models"))["data"][0]["id"]


def guidellm_sweep(
    server: ServerSpec,
    data: Path,
    chat: bool,
    temperature: float,
    concurrency: list[int],
    requests: int,
    max_seconds: float,
    out: Path,
) -> list[dict]:
    """One guidellm run of the concurrent profile at each concurrency; a summary per level."""
    backend = {
        "kind": "openai_http",
        "target": server.url,
        "model": model_name(server),
        "request_format": "/v1/chat/completions" if chat else "/v1/completions",
    }
    if temperature != 1.0:  # guidellm sends none: the API's default, 1.0
        backend["extras"] = {"body": {"temperature": temperature}}
    exe = Path(sys.executable).with_name("guidellm")
    cmd = [
        str(exe),
        "run",
        "--backend",
        json.dumps(backend),
        "--profile",
        "kind=concurrent",
        "--override",
        "profile.streams",
        ",".join(map(str, concurrency)),
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--constraint",
        f"kind=max_duration,seconds={max_seconds}",
        "--data",
        f"kind=json_file,path={data}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode != 0:
        raise SystemExit(f"guidellm failed against {server.label}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    summaries = []
    for c, bench in zip(concurrency, json.loads(out.read_text())["benchmarks"]):
        ok = bench["requests"]["successful"]
        rates = [r["output_tokens_per_second"] for r in ok if r.get("output_tokens_per_second")]
        ttft = [r["time_to_first_token_ms"] for r in ok if r.get("time_to_first_token_ms") is not None]
        summaries.append(
            {
                "concurrency": c,
                "requests": len(ok),
                "errored": len(bench["requests"]["errored"]),
                "per_user_tok_s": statistics.fmean(rates) if rates else 0.0,
                "median_ttft_ms": statistics.median(ttft) if ttft else None,
            }
        )
    return summaries


def write_data(args, path: Path) -> bool:
    """The prompts as guidellm's JSON lines (``prompt``, ``output_tokens_count``); True for chat."""
    if args.questions:
        tokenizer = load_tokenizer(local_target(args.tokenizer or args.target))
        prompts = [p["turn"] for p in chat_prompts(args.questions, tokenizer, args.n_questions)]
    else:
        tokenizer = load_tokenizer(args.tokenizer or REPO / "assets" / "tokenizer")
        prompts = [p["text"] for p in heldout_code_prompts(tokenizer, args.n_prompts, max_chars=args.max_chars)]
    path.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": args.max_new}) + "\n" for p in prompts))
    return bool(args.questions)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, help="LABEL[@CHECKOUT]=FLAGS (repeatable)")
    ap.add_argument("--target", default=None, help=TARGET_HELP + " (passed to every server)")
    ap.add_argument("--tokenizer", default=None, help="for the prompts (default: the target's, or the bundled one)")
    ap.add_argument("--questions", nargs="+", default=None, help="FastChat question files: chat prompts")
    ap.add_argument("--n-questions", type=int, default=0)
    ap.add_argument("--n-prompts", type=int, default=32, help="held-out code prompts (without --questions)")
    ap.add_argument("--max-chars", type=int, default=1200)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=24, help="requests per level at most")
    ap.add_argument("--max-seconds", type=float, default=90.0, help="seconds per level at most")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--port", type=int, default=8310, help="the first server's port; the others follow")
    ap.add_argument("--out", default="bench/results/guidellm_servers.json")
    args = ap.parse_args(argv)

    servers = [parse_server(s, args.port + i) for i, s in enumerate(args.server)]
    work = Path(tempfile.mkdtemp(prefix="guidellm-servers-"))
    chat = write_data(args, work / "prompts.jsonl")
    try:
        for s in servers:
            start(s, args.target, work, args.start_timeout)
        ready_compiles = {s.label: compile_events(s) for s in servers}
        for s in servers:  # one warm pass each, as a server meets its first traffic
            guidellm_sweep(
                s,
                work / "prompts.jsonl",
                chat,
                args.temperatures[0],
                args.concurrency,
                max(args.concurrency),
                args.max_seconds,
                work / "warm.json",
            )
        for r in range(args.repeats):
            for t in args.temperatures:
                for s in servers[r % len(servers) :] + servers[: r % len(servers)]:
                    for row in guidellm_sweep(
                        s,
                        work / "prompts.jsonl",
                        chat,
                        t,
                        args.concurrency,
                        args.requests,
                        args.max_seconds,
                        work / "run.json",
                    ):
                        s.passes.setdefault(f"T={t:g} C={row['concurrency']}", []).append(row)
                        print(s.label, f"T={t:g}", row, flush=True)
        served_compiles = {s.label: compile_events(s) - ready_compiles[s.label] for s in servers}
    finally:
        for s in servers:
            if s.process and s.process.poll() is None:
                s.process.terminate()
                s.process.wait(timeout=60)

    base = servers[-1]
    rows, report = [], {"servers": [], "config": vars(args)}
    for s in servers:
        entry = {
            "label": s.label,
            "checkout": str(s.checkout),
            "flags": s.flags,
            "start_s": s.start_s,
            "compiles_while_serving": served_compiles[s.label],
            "levels": {},
        }
        for key, passes in s.passes.items():
            tok_s = statistics.fmean(p["per_user_tok_s"] for p in passes)
            ttft = statistics.fmean(p["median_ttft_ms"] for p in passes if p["median_ttft_ms"] is not None)
            base_tok_s = statistics.fmean(p["per_user_tok_s"] for p in base.passes[key])
            entry["levels"][key] = {"per_user_tok_s": tok_s, "median_ttft_ms": ttft, "passes": passes}
            spread = "/".join(f"{p['per_user_tok_s']:.1f}" for p in passes)
            rows.append(
                [
                    s.label,
                    key,
                    f"{tok_s:.1f} ({spread})",
                    f"{tok_s / base_tok_s:.2f}x",
                    f"{ttft:.0f}",
                    sum(p["errored"] for p in passes),
                ]
            )
        report["servers"].append(entry)
    print_table(["server", "level", "per-user tok/s (passes)", f"vs {base.label}", "median TTFT ms", "errors"], rows)
    for s in servers:
        print(f"{s.label}: cold start {s.start_s:.1f} s, {served_compiles[s.label]:.0f} compiles while serving")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
