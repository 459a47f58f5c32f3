"""Decoding speed: tokens/s and acceptance with and without speculation in one run, plus a round's time split.

    python -m bench.speed                                   # bundled pair if present, else random models
    python -m bench.speed --target DIR --drafter DIR --batch 1 4 16 --ks 1 3 5 --trees 8,5,48
    python -m bench.speed --dtype bfloat16 --exact          # bf16 weights, every row also in exact mode
    python -m bench.speed --recipe configs/train/tiny_mla_moe.yaml --prompt-len 8   # the DeepSeek-V3-shaped tiny pair
    python -m bench.speed --target smollm2-135m-instruct --drafter assets/smollm2/drafter-eagle3.1 \
        --questions ../shared/data/eval/mt_bench.jsonl ../shared/data/eval/alpaca.jsonl --n-questions 8 \
        --batch 1 4 --ks 3 5 --trees 8,5,48            # a real chat model on chat prompts

Prompts: held-out code (the last --prompt-len tokens up to a def/class header), a ``--prompts`` JSONL,
or with ``--questions`` the first turns of FastChat question files rendered with the tokenizer's chat
template, whole, the files interleaved round-robin (a batch of b rows takes the first b prompts,
cycling); the JSON's ``models.prompts`` records which.

Writes JSON (``--out``) and prints tables. Roofline columns (bench/roofline.py): per row, model FLOPs and
bytes per generated token (weights and KV cache read by the target forwards at the verification width
and by the drafter steps, per round divided by the tokens the rounds emitted), the decode rate they
ran at (the row's time minus its prefill, timed in the same run with max-new 1), achieved GFLOP/s and
GB/s, their fractions of the matmul peak and read bandwidth measured at start, which bound applies
and the fraction of the roofline reached; the same for each batch's prefill. The round split times,
inside jitted loops (no host dispatch, like the real loop): one drafter step (1 token), one target
verification of the round's width, and one whole round; overhead = round / (K x drafter step + verify) (goal <=
1.15). Random weights make acceptance meaningless: use a trained pair for acceptance numbers.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import eagle_jax
from bench import roofline as rl
from bench.common import (
    TARGET_HELP,
    load_pair_or_random,
    load_recipe_pair,
    print_table,
    spec_name,
    stop_ids,
    write_json,
)
from eagle_jax.config import SpecConfig
from eagle_jax.decoding.calls import bucket
from eagle_jax.decoding.engine import Plan, causal_cache_mask, run_rounds
from eagle_jax.decoding.prefill import start
from eagle_jax.decoding.sampling import RowSampling, SamplingParams


def _timed_interleaved(calls: dict, repeats: int = 9) -> dict:
    """Median wall time of each ``fn(*args)``, the calls interleaved so drifts of the machine's speed hit
    all of them alike (one warm-up call each compiles)."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: dict = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def round_split(target, drafter, spec: SpecConfig, batch: int, prompt_len: int, rounds: int = 48) -> dict:
    """Seconds per drafter step, per verification and per whole round, each inside a jitted loop."""
    plen = bucket(prompt_len)
    plan = Plan.one_shot(batch, plen, rounds * spec.max_emitted + 8, spec, True, ())
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(drafter)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, target.config.vocab_size, (batch, plen)), jnp.int32)
    lens = jnp.full((batch,), prompt_len, jnp.int32)

    @jax.jit
    def begin(ts, ds):
        return start(
            nnx.merge(t_graph, ts),
            nnx.merge(d_graph, ds),
            plan,
            prompt,
            lens,
            RowSampling.fill(SamplingParams(), batch),
            jax.random.key(0),
            plan.max_rounds,
        )

    st = begin(t_state, d_state)

    @jax.jit
    def loop(ts, ds, st):
        return run_rounds(nnx.merge(t_graph, ts), nnx.merge(d_graph, ds), plan, st, jnp.int32(rounds)).rounds

    # A chain step drafts 1 token per row; a tree expansion runs top_k frontier nodes at once.
    nodes = 1 if spec.method == "chain" else spec.tree_top_k

    @jax.jit
    def draft_steps(ds, st):
        drf = nnx.merge(d_graph, ds)

        def body(i, carry):
            feat, tok, cache = carry
            pos = jnp.broadcast_to((st.length + i)[:, None], (batch, nodes))
            normed, f, cache = drf.layer(
                feat, tok, pos, causal_cache_mask(pos, plan.cache_len, None), cache, st.length + i
            )
            _, ids = jax.lax.top_k(drf.lm_head(normed), nodes)
            return f, drf.draft_to_target(ids[..., 0]), cache

        init = (
            jnp.broadcast_to(st.d_feat[:, None], (batch, nodes, st.d_feat.shape[-1])),
            jnp.broadcast_to(st.pending[:, None], (batch, nodes)),
            st.d_cache,
        )
        return jax.lax.fori_loop(0, rounds, body, init)[1]

    width = spec.verify_width

    @jax.jit
    def verifies(ts, st):
        tgt = nnx.merge(t_graph, ts)

        def body(i, carry):
            tok, cache = carry
            pos = st.length[:, None] + jnp.arange(width)[None, :]
            block = jnp.broadcast_to(tok[:, None], (batch, width))
            h, _, cache = tgt.forward(block, pos, causal_cache_mask(pos, plan.cache_len, None), cache, st.length)
            # Verification needs the target's prediction at every verified position.
            return jnp.argmax(tgt.logits(h), -1).astype(jnp.int32)[:, -1], cache

        return jax.lax.fori_loop(0, rounds, body, (st.pending, st.t_cache))[0]

    t = _timed_interleaved(
        {
            "round": (loop, (t_state, d_state, st)),
            "draft": (draft_steps, (d_state, st)),
            "verify": (verifies, (t_state, st)),
        }
    )
    t_round, t_draft, t_verify = t["round"] / rounds, t["draft"] / rounds, t["verify"] / rounds
    # A chain round runs K drafter forwards (K-1 single steps + the extend block); a tree round
    # runs depth-1 expansions of top_k nodes plus the extend block.
    steps = spec.num_speculative_tokens if spec.method == "chain" else spec.tree_depth
    ideal = steps * t_draft + t_verify
    return {
        "round_s": t_round,
        "draft_step_s": t_draft,
        "verify_s": t_verify,
        "draft_steps": steps,
        "overhead": t_round / ideal,
        "rest_s": t_round - ideal,
    }


def dtype_bytes(target, exact: bool) -> tuple[float, int]:
    """(weight bytes, cache bytes) per number: the weight matrices as stored (on CPU bf16 matrices may be
    held widened to float32: ``layers.weight_matrix``), the caches in the target's dtype, or float32 in
    exact mode."""
    mats = [x for x in jax.tree.leaves(nnx.state(target, nnx.Param)) if getattr(x, "ndim", 0) >= 2]
    wb = sum(x.nbytes for x in mats) / max(sum(x.size for x in mats), 1)
    return wb, (4 if exact else jnp.dtype(target.dtype).itemsize)


def time_prefill(target, drafter, prompts: list[list[int]], spec, exact: bool, repeats: int = 3) -> float:
    """Seconds of ``generate`` with max-new 1 (prefill, the first token, no rounds): best of ``repeats``
    after a compiling call. ``drafter`` None: the target's prefill alone; else ``spec`` must be set (None
    with a drafter would measure and pick one, 'auto')."""
    kw = dict(max_new_tokens=1, eos_token_id=[], exact=exact, spec=spec)
    eagle_jax.generate(target, drafter, prompts, **kw)
    return min(eagle_jax.generate(target, drafter, prompts, **kw).run_s for _ in range(repeats))


def roofline_row(
    target, drafter, spec, result, prompts: list[list[int]], prefill_s: float, peaks: dict, exact: bool = False
) -> dict:
    """The roofline columns of one ``generate`` result (``bench.roofline.decode_columns``): the loop's
    time is the call's ``run_s`` minus ``prefill_s`` (the same prompts' prefill), its tokens all but the
    first of each row, its rounds the result's."""
    wb, cb = dtype_bytes(target, exact)
    batch = len(prompts)
    return rl.decode_columns(
        target.config,
        None if (drafter is None or spec is None) else drafter.config,
        spec,
        batch=batch,
        prompt_len=float(np.mean([len(p) for p in prompts])),
        new_tokens=result.num_generated - batch,
        rounds=result.rounds,
        decode_s=result.run_s - prefill_s,
        acceptance_length=result.acceptance_length,
        peaks=peaks,
        weight_bytes=wb,
        cache_bytes=cb,
    )


def prefill_row(target, drafter, prompts: list[list[int]], prefill_s: float, peaks: dict, exact: bool = False) -> dict:
    """The roofline columns of a prefill of ``prompts`` (padded to their bucket, as generate runs it)."""
    wb, cb = dtype_bytes(target, exact)
    return rl.prefill_columns(
        target.config,
        None if drafter is None else drafter.config,
        batch=len(prompts),
        prompt_len=bucket(max(len(p) for p in prompts)),
        prefill_s=prefill_s,
        peaks=peaks,
        weight_bytes=wb,
        cache_bytes=cb,
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help=TARGET_HELP)
    ap.add_argument("--drafter")
    ap.add_argument(
        "--recipe", help="a tiny training recipe with target.random (its seeded target and exported drafter)"
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--trees", nargs="*", default=["8,5,48"], help="top_k,depth,total_tokens")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument(
        "--prompt-len",
        type=int,
        default=100,
        help=(
            "code / --prompts prompts keep their last N tokens (--questions prompts stay whole); the round split's "
            "context"
        ),
    )
    source_args = ap.add_mutually_exclusive_group()
    source_args.add_argument(
        "--prompts", help="JSONL with 'prompt' fields (default: held-out code prompts with the bundled pair)"
    )
    source_args.add_argument(
        "--questions",
        nargs="+",
        help="FastChat question files: their first turns in the target "
        "tokenizer's chat template replace the code prompts",
    )
    ap.add_argument("--n-questions", type=int, default=0, help="first N questions of each --questions file (0: all)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--split-only", action="store_true", help="only the round time split")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the bundled pair's dtype")
    ap.add_argument(
        "--exact",
        action="store_true",
        help="also run every row with generate(exact=True); speedups stay "
        "relative to the default plain row, so the exact rows show the mode's cost",
    )
    ap.add_argument("--out", default="bench/results/speed.json")
    args = ap.parse_args(argv)
    if args.recipe and (args.questions or args.prompts):
        ap.error("--recipe brings its own random-token prompts (no tokenizer): drop --questions / --prompts")

    if args.recipe:
        target, drafter, tokenizer, prompts, source = load_recipe_pair(args.recipe, args.prompt_len)
    else:
        target, drafter, tokenizer, prompts, source = load_pair_or_random(
            args.target,
            args.drafter,
            args.prompts,
            args.prompt_len,
            args.dtype,
            questions=args.questions,
            n_questions=args.n_questions,
            max_new=args.max_new,
        )
    # Chat replies end at the template's end-of-turn token, as users meet them; code continuations and
    # random prompts run --max-new tokens (nothing to stop at).
    eos = list(stop_ids(tokenizer)) if args.questions else []
    specs = [SpecConfig(num_speculative_tokens=k) for k in args.ks]
    for t in args.trees:
        k, d, n = (int(x) for x in t.split(","))
        specs.append(SpecConfig(method="tree", tree_top_k=k, tree_depth=d, tree_total_tokens=n))
    peaks = rl.measure_peaks("float32")
    print(rl.format_peaks(peaks))
    peaks_by_mode = {"float32": peaks, "exact": peaks}
    if args.dtype == "bfloat16":
        peaks_by_mode["bfloat16"] = {
            **peaks,
            "matmul_flops": rl.measure_matmul_peak("bfloat16"),
            "matmul_dtype": "bfloat16",
        }
        print(
            f"bf16 matmul peak {peaks_by_mode['bfloat16']['matmul_flops'] / 1e9:.1f} GFLOP/s (used for the bfloat16 "
            "rows)"
        )
    rows, roof_rows, pre_rows = [], [], []
    results = {"models": source, "peaks": peaks_by_mode, "runs": [], "prefill": [], "round_split": []}
    modes = (False, True) if args.exact else (False,)
    for b in [] if args.split_only else args.batch:
        batch_prompts = [prompts[i % len(prompts)] for i in range(b)]
        base_tps = None
        for exact in modes:
            mode = "exact" if exact else args.dtype
            pk = peaks_by_mode[mode]
            # The prefill of this batch, timed alone: the target's, and the target's + the drafter's.
            prefill_s = {False: time_prefill(target, None, batch_prompts, None, exact)}
            if specs:
                prefill_s[True] = time_prefill(target, drafter, batch_prompts, specs[0], exact)
            for with_drafter, secs in prefill_s.items():
                pr = prefill_row(target, drafter if with_drafter else None, batch_prompts, secs, pk, exact)
                who = "target + drafter" if with_drafter else "target"
                pre_rows.append(
                    [
                        b,
                        mode,
                        who,
                        bucket(max(len(p) for p in batch_prompts)),
                        f"{secs * 1e3:.1f}",
                        f"{pr['prefill_tokens_per_s']:.0f}",
                        *rl.roofline_cells(pr),
                    ]
                )
                results["prefill"].append({"batch": b, "mode": mode, "models": who, **pr})
            kw = dict(max_new_tokens=args.max_new, temperature=args.temperature, eos_token_id=eos, exact=exact)
            for spec in [None, *specs]:
                d = None if spec is None else drafter
                first = eagle_jax.generate(target, d, batch_prompts, spec=spec, **kw)
                r = eagle_jax.generate(target, d, batch_prompts, spec=spec, **kw)
                base_tps = base_tps or r.tokens_per_s
                name = spec_name(spec)
                speedup = r.tokens_per_s / base_tps
                al = "-" if spec is None else f"{r.acceptance_length:.2f}"
                roof = roofline_row(target, d, spec, r, batch_prompts, prefill_s[d is not None], pk, exact)
                rows.append([b, mode, name, al, f"{r.tokens_per_s:.1f}", f"{speedup:.2f}x", f"{first.compile_s:.1f}"])
                roof_rows.append([b, mode, name, al, f"{roof['decode_tokens_per_s']:.1f}", *rl.roofline_cells(roof)])
                results["runs"].append(
                    {
                        "batch": b,
                        "mode": mode,
                        "spec": None if spec is None else name,
                        "acceptance_length": r.acceptance_length,
                        "position_acceptance": r.position_acceptance,
                        "tokens_per_s": r.tokens_per_s,
                        "speedup": speedup,
                        "compile_s": first.compile_s,
                        "rounds": r.rounds,
                        "run_s": r.run_s,
                        "roofline": roof,
                    }
                )
    if rows:
        print_table(["batch", "mode", "speculation", "AL", "tok/s", "speedup", "compile s"], rows)
        print(
            "\nDecoding loop against the roofline (per generated token, prefill excluded; model counts, "
            "bench/roofline.py):"
        )
        print_table(["batch", "mode", "speculation", "AL", "decode tok/s", *rl.ROOFLINE_HEADER], roof_rows)
        print("\nPrefill (per prompt position, padded bucket):")
        print_table(["batch", "mode", "prefill of", "positions", "ms", "tok/s", *rl.ROOFLINE_HEADER], pre_rows)
    split_rows = []
    for spec in specs:
        s = round_split(target, drafter, spec, 1, args.prompt_len)
        name = spec_name(spec)
        results["round_split"].append({"spec": name, **s})
        split_rows.append(
            [
                name,
                f"{s['draft_step_s'] * 1e3:.2f}",
                f"{s['verify_s'] * 1e3:.2f}",
                f"{s['round_s'] * 1e3:.2f}",
                f"{s['rest_s'] * 1e3:.2f}",
                f"{s['overhead']:.3f}",
            ]
        )
    print()
    print_table(
        ["batch 1", "draft step ms", "verify ms", "round ms", "rest ms", "round/(steps*draft+verify)"], split_rows
    )
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
