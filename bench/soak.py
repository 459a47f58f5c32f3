"""Load and faults against a real server process: many streaming clients for minutes, with clients that
hang up mid-stream, bad requests and long prompts; then SIGTERM while requests are in flight.

    python -m bench.soak [--clients 64] [--minutes 10] [--out bench/results/soak.json]

The server is ``python -m serve`` (the bundled profile) in its own process. Each client loops: a greedy
streamed completion of a held-out code prompt (most requests), one whose client disconnects after a
few chunks, a malformed or invalid request (expects a 400), or a long prompt (~1500 tokens). The
server's resident memory is sampled every 10 s. At the end a sample of the finished greedy requests is
checked against the target's own greedy decoding of the same prompt alone (``eagle_jax.generate``,
no drafter), and SIGTERM is sent while 8 requests stream: they must all finish whole, and the process
exit 0.

Goals: 0 responses 5xx, memory flat (last sample within 10% of the first after warm-up), every checked
request equal to its solo greedy output, the drain complete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.common import heldout_code_prompts, write_json

BAD_BODIES = [
    b'{"model": "target", "prompt": ',
    b'{"model": "target", "prompt": "x", "max_tokens": -3}',
    b'{"model": "target", "prompt": "x", "temperature": "hot"}',
    b'{"prompt": "no model"}',
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _stream(client, url: str, body: dict, hang_up_after: int | None = None) -> dict:
    """One streamed completion: its status, text and finish reason (or that the client hung up)."""
    text, reason, chunks = [], None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 500, "error": chunk["error"]}
            for c in chunk.get("choices", []):
                text.append(c["text"])
                reason = c["finish_reason"] or reason
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return {"status": 200, "hung_up": True}
    return {"status": 200, "text": "".join(text), "finish_reason": reason}


async def _client(i: int, url: str, prompts, long_prompts, deadline: float, log: list) -> None:
    import httpx

    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=900) as client:
        while time.perf_counter() < deadline:
            roll = rng.random()
            ids = rng.choice(long_prompts if roll > 0.9 else prompts)
            body = {
                "model": "target",
                "prompt": ids,
                "max_tokens": rng.randint(16, 128),
                "temperature": 0,
                "stream": True,
            }
            try:
                if 0.80 < roll <= 0.85:
                    r = await _stream(client, url, body, hang_up_after=rng.randint(1, 4))
                    kind = "hang-up"
                elif 0.85 < roll <= 0.90:
                    resp = await client.post(
                        url + "/v1/completions",
                        content=rng.choice(BAD_BODIES),
                        headers={"Content-Type": "application/json"},
                    )
                    r, kind = {"status": resp.status_code}, "bad"
                else:
                    r = await _stream(client, url, body)
                    kind = "long" if roll > 0.9 else "normal"
            except Exception as exc:  # noqa: BLE001 - a transport failure is a finding, not a crash
                r, kind = {"status": -1, "error": f"{type(exc).__name__}: {exc}"}, "transport"
            log.append({"kind": kind, "prompt": ids, "max_tokens": body["max_tokens"], **r})


async def _drain(url: str, proc: subprocess.Popen, prompts) -> dict:
    """SIGTERM while 8 requests stream: each must end whole (its max_tokens or a stop)."""
    import httpx

    async with httpx.AsyncClient(timeout=900) as client:
        bodies = [
            {"model": "target", "prompt": p, "max_tokens": 96, "temperature": 0, "stream": True, "ignore_eos": True}
            for p in prompts[:8]
        ]
        tasks = [asyncio.create_task(_stream(client, url, b)) for b in bodies]
        await asyncio.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    code = await asyncio.to_thread(proc.wait, 300)
    whole = [isinstance(r, dict) and r.get("finish_reason") == "length" for r in results]
    return {
        "requests": len(results),
        "finished_whole": sum(whole),
        "exit_code": code,
        "failures": [repr(r)[:200] for r, ok in zip(results, whole) if not ok],
    }


def _check(log: list, sample: int) -> dict:
    """Finished greedy requests against the target's greedy decoding of each prompt alone: every one
    with a long prompt (chunked prefill, prefix reuse) and a sample of the others, ``sample`` in all."""
    import eagle_jax
    from eagle_jax import bundled
    from eagle_jax.decoding.calls import eos_ids
    from eagle_jax.serving.server import read_profile

    profile = read_profile(bundled.config_path("serve/bundled.yaml"))
    target = eagle_jax.load_target(profile["target"], dtype="float32")
    tok = eagle_jax.load_tokenizer(profile["target"])
    eos = list(eos_ids(target, tok))
    long = [r for r in log if r["kind"] == "long" and "text" in r][:sample]
    normal = [r for r in log if r["kind"] == "normal" and "text" in r]
    picked = long + random.Random(0).sample(normal, min(sample - len(long), len(normal)))
    bad = []
    for r in picked:
        out = eagle_jax.generate(target, None, [r["prompt"]], max_new_tokens=r["max_tokens"], eos_token_id=eos)
        solo = tok.decode(out.tokens[0], skip_special_tokens=True)
        if solo != r["text"]:
            at = next((i for i, (a, b) in enumerate(zip(solo, r["text"])) if a != b), min(len(solo), len(r["text"])))
            bad.append(
                {
                    "kind": r["kind"],
                    "prompt_tokens": len(r["prompt"]),
                    "max_tokens": r["max_tokens"],
                    "first_difference": at,
                    "solo": solo[max(0, at - 40) : at + 40],
                    "served": r["text"][max(0, at - 40) : at + 40],
                }
            )
    return {"checked": len(picked), "long_prompts": len(long), "mismatched": len(bad), "examples": bad[:5]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--check", type=int, default=100, help="finished requests checked against solo greedy decoding")
    ap.add_argument("--out", default="bench/results/soak.json")
    args = ap.parse_args(argv)

    import eagle_jax
    from eagle_jax import bundled
    from eagle_jax.serving.server import read_profile

    profile = read_profile(bundled.config_path("serve/bundled.yaml"))
    tok = eagle_jax.load_tokenizer(profile["target"])
    prompts = [p["ids"] for p in heldout_code_prompts(tok, 48, max_chars=1200)]
    joined = [t for p in heldout_code_prompts(tok, 64, seed=5, min_chars=400, max_chars=4000) for t in p["ids"]]
    long_prompts = [joined[i * 1500 : (i + 1) * 1500] for i in range(len(joined) // 1500)][:8]

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    t_start = time.perf_counter()
    import httpx

    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    print(
        f"server ready in {time.perf_counter() - t_start:.0f} s (pid {proc.pid}, {_rss_mb(proc.pid):.0f} MiB)",
        flush=True,
    )

    log: list = []
    memory: list[tuple[float, float]] = []

    async def soak():
        deadline = time.perf_counter() + 60 * args.minutes
        clients = asyncio.gather(*[_client(i, url, prompts, long_prompts, deadline, log) for i in range(args.clients)])
        t0 = time.perf_counter()
        while not clients.done():
            memory.append((time.perf_counter() - t0, _rss_mb(proc.pid)))
            await asyncio.sleep(10)
        await clients
        return await _drain(url, proc, prompts)

    drain = asyncio.run(soak())
    proc.stderr.close()
    by_kind: dict[str, dict[str, int]] = {}
    for r in log:
        by_kind.setdefault(r["kind"], {}).setdefault(str(r["status"]), 0)
        by_kind[r["kind"]][str(r["status"])] += 1
    errors_5xx = sum(1 for r in log if r["status"] >= 500 or r["status"] < 0)
    warm = [m for t, m in memory if t >= 60] or [m for _, m in memory]
    check = _check(log, args.check)
    result = {
        "config": vars(args),
        "requests": len(log),
        "by_kind": by_kind,
        "errors_5xx": errors_5xx,
        "memory_mib": memory,
        "memory_growth_after_warmup": warm[-1] / warm[0] - 1 if warm else None,
        "check": check,
        "drain": drain,
    }
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "memory_mib"}, indent=1))
    sys.exit(0 if errors_5xx == 0 and check["mismatched"] == 0 and drain["finished_whole"] == drain["requests"] else 1)


if __name__ == "__main__":
    main()
