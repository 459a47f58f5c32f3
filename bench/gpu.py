"""The checks an accelerator is needed for, sized to run in a few minutes: the CUDA parity cases, then plain
decoding against chain speculation through ``eagle_jax.generate`` on the bundled pair.

    python -m bench.gpu                # parity cases + speed, float32, results in bench/results/gpu.json
    python -m bench.gpu --no-parity --dtypes float32 bfloat16 --ks 3 5 7
    python -m bench.gpu --no-parity --no-speed --precompile-workers 1 16   # a server's compiles, one vs 16 at a time
    # a program in 6-12 s on an H200, not 35+ (BENCHMARKS.md):
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m bench.gpu

Speed: greedy, held-out code prompts (their last ``--prompt-len`` tokens), ``--max-new`` new tokens, no stop
token. Batch 1 decodes ``--batch1-prompts`` prompts one after another (one favourable prompt proves
nothing); a larger batch decodes its first prompts together. Each configuration runs once to compile, then
``--repeats`` passes with the configurations interleaved (a drift of the machine's speed touches all alike);
a row reports the median pass, every pass, the acceptance length and how many rows equal plain decoding's
output token for token. Times include prefill, as a caller meets them. Rows print as they are measured, so
a run cut short keeps what it measured.

Parity: ``pytest parity_tests -k cuda`` with the suite's CPU compile shortcuts off (``EAGLE_JAX_TEST_XLA_OPT``) and
JAX's preallocation of GPU memory off (the workers share one GPU); its errors
(``parity_tests/.last_parity_errors.json``) are kept in the results. The cases skip, with the reason, where torch or
JAX sees no GPU. A machine whose Python is not the one the held-out manifest was built with reads a copy of those
files named by ``EAGLE_JAX_CORPUS_ROOT``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import load_pair_or_random, run_batched, write_json
from eagle_jax.config import SpecConfig

PARITY_ERRORS = Path(__file__).resolve().parent.parent / "parity_tests" / ".last_parity_errors.json"


def pytest_summary(lines: list[str]) -> str:
    """pytest's counts line ("3 failed, 47 passed in 75.09s"), which warnings printed at exit can follow."""
    counts = re.compile(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s")
    return next((ln.strip("= ") for ln in reversed(lines) if counts.search(ln)), lines[-1] if lines else "")


def run_parity(timeout_s: int, workers: int) -> dict:
    """The parity suite's cuda cases in a subprocess: pytest's counts, its failures and the errors measured."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "parity_tests",
        "-k",
        "cuda",
        "-o",
        "addopts=",
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
    ]
    if workers > 1:
        cmd += ["-n", str(workers), "--dist", "loadfile"]
    t0, started = time.perf_counter(), time.time()
    try:
        env = {**os.environ, "EAGLE_JAX_TEST_XLA_OPT": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    print("\n".join(ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))) or "", flush=True)
    summary = pytest_summary(lines)
    print(f"parity: {summary} (rc {rc}, {time.perf_counter() - t0:.0f} s)", flush=True)
    errors = PARITY_ERRORS.read_text() if PARITY_ERRORS.exists() and PARITY_ERRORS.stat().st_mtime >= started else "{}"
    return {
        "rc": rc,
        "summary": summary,
        "seconds": time.perf_counter() - t0,
        "failed": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))],
        "errors": {name: e for name, e in json.loads(errors).items() if "[cuda" in name},
    }  # the file keeps other runs' too


def precompile_once(workers: int) -> dict:
    """Precompiles a small serving engine of the bundled pair (8 slots of 512 tokens, plain and a chain of 3: 43
    programs) with ``workers`` compiles at once, in this process; its seconds and programs."""
    from eagle_jax.serving.slots import SlotEngine

    target, drafter, _, _, _ = load_pair_or_random(None, None, None, 16)
    engine = SlotEngine(
        target, drafter, slots=8, max_len=512, specs=(None, SpecConfig(num_speculative_tokens=3)), rounds_per_step=4
    )
    t0 = time.perf_counter()
    engine.precompile(warm_up=False, workers=workers)
    return {"workers": workers, "programs": len(engine.compile_events), "seconds": round(time.perf_counter() - t0, 1)}


def precompile_seconds(workers: int) -> dict:
    """``precompile_once`` in a fresh process (nothing compiled before it, nothing shared with other counts)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--precompile-child", str(workers)],
        capture_output=True,
        text=True,
        check=True,
    )
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def measure_speed(
    dtype: str, batches: list[int], ks: list[int], max_new: int, prompt_len: int, batch1_prompts: int, repeats: int
) -> list[dict]:
    """Rows of plain and chain-K decoding at each batch size (module docstring)."""
    target, drafter, _, prompts, _ = load_pair_or_random(None, None, None, prompt_len, dtype)
    configs = {"plain": None, **{f"K={k}": SpecConfig(num_speculative_tokens=k) for k in ks}}
    rows = []
    for batch in batches:
        rows_in = prompts[:batch1_prompts] if batch == 1 else [prompts[i % len(prompts)] for i in range(batch)]

        def one_pass(spec):
            t0 = time.perf_counter()
            r = run_batched(
                target, None if spec is None else drafter, rows_in, spec=spec, max_new=max_new, batch_size=batch
            )
            secs = time.perf_counter() - t0
            calls = [
                r["accepted"][i : i + batch] for i in range(0, len(rows_in), batch)
            ]  # a call's AL: over its row-rounds
            al = None if spec is None else float(np.mean([np.mean([a + 1 for row in c for a in row]) for c in calls]))
            return sum(map(len, r["tokens"])) / secs, r["tokens"], al

        first_pass_s = {}
        for name, spec in configs.items():
            t0 = time.perf_counter()
            one_pass(spec)
            first_pass_s[name] = time.perf_counter() - t0
        rates = {name: [] for name in configs}
        outputs, als = {}, {}
        for _ in range(repeats):
            for name, spec in configs.items():
                rate, outputs[name], als[name] = one_pass(spec)
                rates[name].append(rate)
        plain = float(np.median(rates["plain"]))
        for name in configs:
            rate = float(np.median(rates[name]))
            row = {
                "dtype": dtype,
                "batch": batch,
                "config": name,
                "tok_s": round(rate, 1),
                "speedup": round(rate / plain, 3),
                "acceptance_length": None if name == "plain" else round(als[name], 2),
                "rows_equal_to_plain": (
                    f"{sum(a == b for a, b in zip(outputs[name], outputs['plain']))}/{len(outputs['plain'])}"
                ),
                "passes_tok_s": [round(x, 1) for x in rates[name]],
                "first_pass_s": round(first_pass_s[name], 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-parity", action="store_true", help="skip the CUDA parity cases")
    ap.add_argument("--parity-timeout", type=int, default=240)
    ap.add_argument("--parity-workers", type=int, default=8)
    ap.add_argument("--no-speed", action="store_true", help="skip the decoding speed rows")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--batch1-prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--precompile-workers",
        type=int,
        nargs="*",
        default=[],
        help="also time a small serving engine's precompile at each of these worker counts (fresh processes)",
    )
    ap.add_argument("--out", default="bench/results/gpu.json")
    ap.add_argument("--precompile-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.precompile_child:
        print(json.dumps(precompile_once(args.precompile_child)))
        return {}
    results = {
        "device": str(jax.devices()[0]),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "max_new": args.max_new,
        "prompt_len": args.prompt_len,
    }
    print(
        f"device: {results['device_kind']} ({results['device']}), jax {jax.__version__}, "
        f"XLA_FLAGS={results['xla_flags']!r}",
        flush=True,
    )
    if not args.no_parity:
        results["parity"] = run_parity(args.parity_timeout, args.parity_workers)
        write_json(args.out, results)
    if args.precompile_workers:
        results["precompile"] = [precompile_seconds(w) for w in args.precompile_workers]
        write_json(args.out, results)
    if not args.no_speed:
        results["speed"] = []
        for dtype in args.dtypes:
            results["speed"] += measure_speed(
                dtype, args.batch, args.ks, args.max_new, args.prompt_len, args.batch1_prompts, args.repeats
            )
            write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
