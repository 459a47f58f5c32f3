"""Peer comparison at batch 1 on CPU: the same target in HF transformers (PyTorch, its own greedy
``generate``) vs eagle_jax plain decoding vs eagle_jax speculative decoding (chain K and dynamic trees),
tokens/s side by side in one run, on the same prompts (held-out code, or chat questions), plus the
agreement of the greedy tokens with HF's.

    python -m bench.peer                                    # bundled target + EAGLE-3.1 drafter
    python -m bench.peer --target assets/target --drafter assets/drafter-eagle3.1 --n-prompts 8 \\
        --max-new 128 --ks 5 --trees 8,5,48 --threads 2 --out bench/results/peer.json
    python -m bench.peer --n-prompts 2 --max-new 16 --trees 4,3,12          # smoke test
    python -m bench.peer --target smollm2-135m-instruct --drafter assets/smollm2/drafter-eagle3.1 \
        --questions ../shared/data/eval/mt_bench.jsonl ../shared/data/eval/alpaca.jsonl --n-questions 4 \
        --max-new 128 --ks 3 --trees 8,5,48 --dtype bfloat16       # a real chat model on chat prompts, bf16

Prompts: ``--n-prompts`` held-out code prompts (a file's text up to a def/class header), or with
``--questions`` the first ``--n-questions`` turns of each FastChat question file rendered with the
target tokenizer's chat template, the files interleaved round-robin; prompts too long for the context
with max-new tokens are dropped. The JSON's ``prompt_source`` records which.

Timing: every engine is warmed up first (HF: one short generate; eagle_jax: one call per prompt-length
bucket and configuration, so compilation is excluded), then each prompt is generated --repeats times and
the best wall time around the call is summed (eagle_jax: the whole ``generate`` call including host-side
preparation, not only its ``run_s``; HF: ``model.generate``); tok/s = generated tokens / summed time.
Both engines load the same checkpoint in ``--dtype`` (float32 or bfloat16) and stop at the same eos ids
(``--no-eos``: never); a .gguf target (or ``smollm2-135m-instruct``) is dequantized by each from the
same file (transformers through its GGUF support, then cast to the dtype).
torch runs with ``--threads`` intra-op threads; XLA's CPU client uses the machine's cores.

Prefill / decode split (``--no-split`` to skip): the same calls with max-new 1 give the prompt-processing
time per prompt (eagle_jax pads prompts to power-of-two buckets, HF does not); decode tok/s = the
remaining tokens / (full time - that time).

Roofline (bench/roofline.py; needs the split): per engine, model FLOPs and bytes per generated token of the
decoding loop (weights and KV cache read by target forwards at the verification width and by drafter
steps; each prompt's rounds over the tokens they emitted, batch 1) at the decode rate above, and per
prompt token of the prefill (the prompts' real lengths: eagle_jax's bucket padding counts against it)
at the prefill rate; achieved GFLOP/s and GB/s as fractions of a matmul peak (in ``--dtype``) and read
bandwidth measured (with JAX) in the same run, the bound that applies and the fraction of the roofline
reached. Weight bytes are each engine's as held: eagle_jax's CPU backend keeps bf16 matrices widened
to float32 (``layers.weight_matrix``), torch keeps them in bf16.

Agreement: a row agrees when its tokens equal HF's exactly; ``prefix`` is the mean over prompts of the
length of the common prefix / HF's length. float32 near-ties in the argmax can legitimately flip a
token between two implementations and everything after it, so agreement below 1.0 is not by itself a
bug; speculative vs eagle_jax plain (``same_as_plain`` in the JSON) should agree too, up to the same
near-tie caveat (a verify block sums in a different order than one-token steps). In bfloat16 far more
logits are near-ties (8 mantissa bits; each engine rounds activations at its own points, and eagle_jax
on CPU runs bf16 dots as float32 dots over bf16-rounded inputs), so rows legitimately diverge earlier:
there the agreement columns show where the two engines' bf16 rounding parts, not by themselves a bug.
Without the trained target it saves a random one in HF format to a temporary folder and compares on
that (acceptance is then meaningless).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import eagle_jax
from bench import roofline as rl
from bench.common import (
    BUNDLED_DRAFTERS,
    BUNDLED_TARGET,
    FALLBACK_TOKENIZER,
    RANDOM_WARNING,
    TARGET_HELP,
    acceptance_stats,
    chat_prompts,
    chat_source,
    drafter_label,
    fit_prompts,
    heldout_code_prompts,
    load_tokenizer,
    local_target,
    parse_tree,
    print_table,
    random_drafter,
    random_pair,
    spec_name,
    stop_ids,
    write_json,
)
from bench.speed import dtype_bytes
from eagle_jax.checkpoint.tokenizer import is_gguf_file
from eagle_jax.config import SpecConfig
from eagle_jax.decoding.calls import bucket


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    exact = [a == b for a, b in zip(ours, ref)]
    prefix = []
    for a, b in zip(ours, ref):
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        prefix.append(n / max(len(b), 1))
    return {
        "exact_rows": int(sum(exact)),
        "rows": len(exact),
        "exact_fraction": float(np.mean(exact)),
        "prefix_fraction": float(np.mean(prefix)),
        "per_row_prefix": prefix,
    }


def hf_generate(model, prompts: list[list[int]], max_new: int, repeats: int = 1):
    """HF greedy generate per prompt; seconds = sum over prompts of the best of ``repeats`` calls."""
    import torch

    outs, total = [], 0.0
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], dtype=torch.long)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                y = model.generate(
                    input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new
                )
                best = min(best, time.perf_counter() - t0)
            total += best
            outs.append(y[0, len(ids) :].tolist())
    return outs, total


def jax_generate(target, drafter, prompts: list[list[int]], spec, max_new: int, eos, repeats: int = 1):
    """Warm-up (compile) once per prompt bucket, then one timed call per prompt at batch 1.

    Returns (tokens per prompt, wall seconds of the calls, compile seconds, accepted per round, the
    calls' own ``run_s`` summed: the compiled program alone, without host-side preparation); per
    prompt the best of ``repeats`` calls."""
    kw = dict(max_new_tokens=max_new, spec=spec, eos_token_id=list(eos))
    compile_s = 0.0
    seen = set()
    for ids in prompts:
        if bucket(len(ids)) not in seen:
            seen.add(bucket(len(ids)))
            compile_s += eagle_jax.generate(target, drafter, [ids], **kw).compile_s
    outs, accepted, total, run_s = [], [], 0.0, 0.0
    for ids in prompts:
        best = (float("inf"), None)
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = eagle_jax.generate(target, drafter, [ids], **kw)
            best = min(best, (time.perf_counter() - t0, r), key=lambda x: x[0])
        total += best[0]
        r = best[1]
        run_s += r.run_s
        outs.append(r.tokens[0])
        accepted += r.accepted
    return outs, total, compile_s, accepted, run_s


def split(prefill_s: float | None, total_s: float, tokens: int, rows: int) -> dict:
    """Prefill (time of the same calls with max-new 1: prompt processing + first token) and the decode
    rate of the remaining tokens from the full runs."""
    if prefill_s is None:
        return {}
    decode_s = total_s - prefill_s
    return {
        "prefill_s_per_prompt": prefill_s / rows,
        "decode_tokens_per_s": (tokens - rows) / decode_s if decode_s > 0 else float("nan"),
    }  # nan: timing noise


def split_cells(run: dict) -> list[str]:
    if "prefill_s_per_prompt" not in run:
        return ["-", "-"]
    return [f"{run['prefill_s_per_prompt'] * 1e3:.0f}", f"{run['decode_tokens_per_s']:.1f}"]


def roofline_runs(
    target_config,
    drafter_config,
    spec,
    prompt_lens: list[int],
    new_tokens: list[int],
    rounds: list[int],
    decode_tps: float,
    prefill_s: float | None,
    peaks: dict,
    weight_bytes: float = 4,
    cache_bytes: float = 4,
) -> dict:
    """Roofline columns of one engine's decode (each prompt's loop at batch 1: its own context, rounds
    and emitted tokens, pooled over prompts) and prefill (the prompts' real lengths, their summed time);
    ``weight_bytes`` / ``cache_bytes``: bytes per number as that engine holds them."""
    kw = dict(weight_bytes=weight_bytes, cache_bytes=cache_bytes)
    total = rl.Cost()
    for plen, n, r in zip(prompt_lens, new_tokens, rounds):
        if n > 0:
            total = total + rl.per_generated_token(target_config, drafter_config, spec, 1, plen, n, r, **kw).scale(n)
    out = {"decode": rl.roofline(total.scale(1 / max(sum(new_tokens), 1)), decode_tps, peaks)}
    if prefill_s is not None:
        cost = rl.Cost()
        for plen in prompt_lens:
            cost = cost + rl.prefill(target_config, drafter_config, 1, plen, **kw)
        tps = sum(prompt_lens) / prefill_s
        out["prefill"] = {"prefill_tokens_per_s": tps, **rl.roofline(cost.scale(1 / sum(prompt_lens)), tps, peaks)}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help=TARGET_HELP)
    ap.add_argument("--drafter", default=BUNDLED_DRAFTERS[-1])
    ap.add_argument("--ks", type=int, nargs="*", default=[5], help="chain depths")
    ap.add_argument("--trees", nargs="*", default=["8,5,48"], help="top_k,depth,total_tokens")
    ap.add_argument("--n-prompts", type=int, default=8, help="held-out code prompts (without --questions)")
    ap.add_argument(
        "--questions",
        nargs="+",
        help="FastChat question files: their first turns in the target "
        "tokenizer's chat template replace the code prompts",
    )
    ap.add_argument("--n-questions", type=int, default=0, help="first N questions of each --questions file (0: all)")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' weights and arithmetic"
    )
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--no-eos", action="store_true", help="ignore eos: every row runs max-new tokens")
    ap.add_argument("--seed", type=int, default=0, help="prompt sampling")
    ap.add_argument("--repeats", type=int, default=1, help="timed calls per prompt and engine; the best counts")
    ap.add_argument(
        "--no-split",
        dest="split",
        action="store_false",
        help="skip the prefill / decode split (extra max-new=1 runs of every engine)",
    )
    ap.add_argument("--out", default="bench/results/peer.json")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if load_before[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"WARNING: load average {load_before[0]:.1f} on {os.cpu_count()} cores: other processes compete for the "
            "CPU, timings (torch's OpenMP threads especially) will be noisy"
        )
    transformers.logging.set_verbosity_error()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    peaks = rl.measure_peaks(args.dtype)
    print(rl.format_peaks(peaks))
    tmp = None
    target_dir = local_target(args.target)
    if Path(target_dir).exists() and Path(args.drafter).exists():
        target = eagle_jax.load_target(target_dir, dtype=args.dtype)
        drafter = eagle_jax.load_drafter(args.drafter, target, dtype=args.dtype)
        tokenizer = load_tokenizer(target_dir, target.config.vocab_size)
        source = {"target": target_dir, "drafter": args.drafter, "dtype": args.dtype, "random": False}
        is_random = False
    else:
        print(RANDOM_WARNING.format(missing=", ".join(p for p in (target_dir, args.drafter) if not Path(p).exists())))
        tmp = tempfile.TemporaryDirectory()
        target_dir, drafter_dir = str(Path(tmp.name) / "target"), Path(tmp.name) / "drafter"
        rand, _ = random_pair()
        eagle_jax.save_target(rand, target_dir, dtype="float32")
        eagle_jax.save_drafter(random_drafter(rand, eagle31=True), drafter_dir, dtype="float32")
        if (FALLBACK_TOKENIZER / "tokenizer.json").exists():
            for f in FALLBACK_TOKENIZER.iterdir():
                shutil.copy(f, Path(target_dir) / f.name)
        # Both through the real import path, rounded to --dtype there as a checkpoint would be.
        target = eagle_jax.load_target(target_dir, dtype=args.dtype)
        drafter = eagle_jax.load_drafter(drafter_dir, target, dtype=args.dtype)
        tokenizer = load_tokenizer(target_dir, target.config.vocab_size)
        source = {
            "target": "random 12x384 (saved as HF, float32)",
            "drafter": "random (acceptance meaningless)",
            "dtype": args.dtype,
            "random": True,
        }
        is_random = True

    eos = stop_ids(tokenizer, not args.no_eos)
    limit = target.config.max_position_embeddings
    if args.questions:
        prompts = fit_prompts(chat_prompts(args.questions, tokenizer, args.n_questions), args.max_new, limit)
        prompt_source = chat_source(args.questions, args.n_questions, prompts)
    else:
        prompts = fit_prompts(
            heldout_code_prompts(tokenizer, args.n_prompts, seed=args.seed, vocab_size=target.config.vocab_size),
            args.max_new,
            limit,
        )
        prompt_source = {
            "kind": "heldout code" if tokenizer is not None else "random tokens",
            "n_prompts": args.n_prompts,
            "seed": args.seed,
            "count": len(prompts),
        }
    if not prompts:
        raise SystemExit(f"no prompt fits {limit} positions with {args.max_new} new tokens")
    ids = [p["ids"] for p in prompts]

    if is_gguf_file(target_dir):  # transformers dequantizes the same file
        hf = AutoModelForCausalLM.from_pretrained(
            str(Path(target_dir).parent), gguf_file=Path(target_dir).name, dtype=torch_dtype
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch_dtype)
    if next(hf.parameters()).dtype != torch_dtype:  # in case a loader (GGUF's dequantization) ignores dtype
        hf = hf.to(torch_dtype)
    hf = hf.eval()
    hf_bytes = (next(hf.parameters()).element_size(),) * 2  # torch keeps weights and KV cache in the model's dtype
    jax_bytes = dtype_bytes(target, exact=False)
    gc = hf.generation_config
    gc.eos_token_id = list(eos) or None
    gc.pad_token_id = (
        tokenizer.pad_token_id
        if tokenizer is not None and tokenizer.pad_token_id is not None
        else (eos[0] if eos else 0)
    )
    gc.do_sample, gc.temperature, gc.top_k, gc.top_p = False, None, None, None
    with torch.inference_mode():  # warm-up
        x = torch.tensor([ids[0]], dtype=torch.long)
        hf.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=4)
    hf_tokens, hf_s = hf_generate(hf, ids, args.max_new, args.repeats)
    hf_n = sum(len(t) for t in hf_tokens)
    hf_prefill = hf_generate(hf, ids, 1, args.repeats + 1)[1] if args.split else None
    results = {
        "models": source,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "eos_ids": list(eos),
        "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "hf_dtype": str(next(hf.parameters()).dtype),
        "prompt_source": prompt_source,
        "prompts": [p["name"] for p in prompts],
        "prompt_tokens": [len(i) for i in ids],
        "runs": [],
    }
    results["runs"].append(
        {
            "engine": "transformers",
            "spec": None,
            "tokens": hf_n,
            "seconds": hf_s,
            "tokens_per_s": hf_n / hf_s,
            **split(hf_prefill, hf_s, hf_n, len(ids)),
        }
    )
    results["peaks"] = peaks
    plens = [len(i) for i in ids]
    roof_rows = []

    def add_roofline(
        run: dict,
        label: list[str],
        spec,
        drafter_config,
        toks: list[list[int]],
        rounds: list[int],
        nbytes: tuple[float, float],
    ) -> None:
        if "decode_tokens_per_s" not in run:
            return
        prefill_total = run["prefill_s_per_prompt"] * len(ids)
        run["roofline"] = roofline_runs(
            target.config,
            drafter_config,
            spec,
            plens,
            [len(t) - 1 for t in toks],
            rounds,
            run["decode_tokens_per_s"],
            prefill_total,
            peaks,
            *nbytes,
        )
        d, p = run["roofline"]["decode"], run["roofline"]["prefill"]
        roof_rows.append(
            [
                *label,
                f"{run['decode_tokens_per_s']:.1f}",
                *rl.roofline_cells(d),
                f"{p['prefill_tokens_per_s']:.0f}",
                f"{100 * p['flops_fraction']:.1f}",
                f"{100 * p['bytes_fraction']:.1f}",
                p["bound"],
                f"{100 * p['roofline_fraction']:.0f}",
            ]
        )

    add_roofline(
        results["runs"][-1], ["transformers", "none"], None, None, hf_tokens, [len(t) - 1 for t in hf_tokens], hf_bytes
    )
    rows = [
        [
            f"transformers {transformers.__version__} (torch {torch.__version__})",
            "none",
            f"{hf_n / hf_s:.1f}",
            "1.00x",
            "-",
            "-",
            "-",
            "-",
            *split_cells(results["runs"][-1]),
        ]
    ]

    specs = [None] + [SpecConfig(num_speculative_tokens=k) for k in args.ks] + [parse_tree(t) for t in args.trees]
    plain_tokens = plain_tps = None
    for spec in specs:
        toks, secs, compile_s, accepted, program_s = jax_generate(
            target, None if spec is None else drafter, ids, spec, args.max_new, eos, args.repeats
        )
        n = sum(len(t) for t in toks)
        tps = n / secs
        prefill = (
            jax_generate(target, None if spec is None else drafter, ids, spec, 1, eos, args.repeats + 1)[1]
            if args.split
            else None
        )
        agree = agreement(toks, hf_tokens)
        run = {
            "engine": "eagle_jax",
            "spec": spec_name(spec),
            "tokens": n,
            "seconds": secs,
            "tokens_per_s": tps,
            "speedup_vs_hf": tps / (hf_n / hf_s),
            "compile_s": compile_s,
            "program_seconds": program_s,
            "host_overhead_s": secs - program_s,
            **split(prefill, secs, n, len(ids)),
            "agreement_with_hf": agree,
        }
        if spec is None:
            plain_tokens, plain_tps = toks, tps
            al = "-"
        else:
            st = acceptance_stats(accepted, spec.max_emitted - 1)
            run.update(
                acceptance_length=st["al_pooled"],
                position_acceptance=st["position_acceptance"],
                speedup_vs_plain=tps / plain_tps,
                same_as_plain=agreement(toks, plain_tokens),
            )
            al = f"{st['al_pooled']:.2f}"
        results["runs"].append(run)
        add_roofline(
            run,
            ["eagle_jax", spec_name(spec)],
            spec,
            None if spec is None else drafter.config,
            toks,
            [len(t) - 1 for t in toks] if spec is None else [len(a) for a in accepted],
            jax_bytes,
        )
        rows.append(
            [
                "eagle_jax" + ("" if spec is None else f" + {drafter_label(drafter)}"),
                spec_name(spec),
                f"{tps:.1f}",
                f"{run['speedup_vs_hf']:.2f}x",
                "1.00x" if spec is None else f"{run['speedup_vs_plain']:.2f}x",
                al,
                f"{agree['exact_rows']}/{agree['rows']}",
                f"{agree['prefix_fraction']:.3f}",
                *split_cells(run),
            ]
        )
        print(f"  eagle_jax {spec_name(spec)}: {tps:.1f} tok/s", flush=True)
    print()
    if is_random:
        print("(random models: acceptance meaningless)")
    print(
        f"batch 1, {len(ids)} prompts, up to {args.max_new} new tokens, {args.dtype} on CPU, torch threads "
        f"{torch.get_num_threads()}"
    )
    print_table(
        [
            "engine",
            "speculation",
            "tok/s",
            "vs HF",
            "vs plain",
            "AL",
            "rows = HF",
            "HF prefix agreement",
            "prefill ms",
            "decode tok/s",
        ],
        rows,
    )
    if roof_rows:
        print(
            f"\nAgainst the roofline ({rl.format_peaks(peaks)}): decode per generated token, prefill per prompt token"
        )
        print_table(
            [
                "engine",
                "speculation",
                "decode tok/s",
                *rl.ROOFLINE_HEADER,
                "prefill tok/s",
                "% peak",
                "% BW",
                "bound",
                "% roofline",
            ],
            roof_rows,
        )
    results["load_average_before_after"] = [load_before, os.getloadavg()]
    results["cpu_count"] = os.cpu_count()
    write_json(args.out, results)
    if tmp is not None:
        tmp.cleanup()
    return results


if __name__ == "__main__":
    main()
