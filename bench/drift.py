"""Attention drift at small scale: EAGLE-3 vs EAGLE-3.1 drafters on the same target (greedy, chain K).

Three measurements, each with the mean acceptance length (AL) over prompts and a 95% Student-t interval:

1. AL vs context length: prompts of exactly L tokens (default 256, 512, 1024, 1536 and the target's
   context minus --max-new) cut from the held-out source files joined as in pretraining (files
   separated by ``<|end_of_text|>``). Every L uses the SAME end points (a line start whose next
   --max-new reference tokens stay in one file), so the text to continue is identical and only the
   amount of history differs.
2. AL vs draft position: per-position acceptance at K (default 7): the fraction of rounds whose i-th
   draft was accepted, and the conditional rate given draft i-1 was accepted.
3. Out-of-distribution prefix: held-out code prompts (``code_prompts``) with and without ~--ood-tokens
   tokens of licence text written as ``#`` comments put before them.

    python -m bench.drift                                   # bundled target + both drafters
    python -m bench.drift --drafters assets/drafter-eagle3 assets/drafter-eagle3.1 --k 7 --n-prompts 32 \\
        --contexts 256 512 1024 1536 1920 --max-new 128 --ood-tokens 600 --out bench/results/drift.json
    python -m bench.drift --n-prompts 2 --max-new 16 --contexts 64 128 --k 3 --ood-tokens 60   # smoke test

Mechanism diagnostics (on the same end points; ``--no-norms`` skips 4 and 5):

4. Hidden-state norms: the RMS (||h|| / sqrt(H)) of the target's residual stream entering each layer
   (``*``: the aux layers the drafters read) and of each drafter's fused feature fc(aux), median over
   tokens, by position band, on the --norm-prompts prompts of the longest context.
5. The drafter's fed-back feature per draft step 1..K: step 1 is the drafter's output on the target's
   features at the prompt's last token, step i > 1 its output on the feature of step i-1 (greedy
   drafts, as ``engine._draft_chain``). "raw" is the pre-norm h2, "fed" the feature passed on
   (post-norm with EAGLE-3.1's norm_output, else h2); median RMS over prompts, per context length.
6. Acceptance per draft position with percentile-bootstrap 95% intervals (prompts resampled, --n-boot
   resamples) and pooled AL, for every temperature in --temperatures (default 0: the greedy runs
   above, no extra cost; ``--temperatures 0 1`` adds a sampled sweep). A deep chain (--k 10) keeps
   AL off its ceiling.

    python -m bench.drift --n-prompts 8 --contexts 128 512 1024 1920 --k 10 --max-new 128 --ood-tokens 0 \
        --temperatures 0 1 --out bench/results/drift_diag.json          # diagnostics run of BENCHMARKS.md
    python -m bench.drift --n-prompts 2 --max-new 16 --contexts 64 128 --k 3 --ood-tokens 0 \
        --temperatures 0 1 --norm-prompts 2 --out /tmp/drift_smoke.json  # diagnostics smoke test

Writes JSON (``--out``) and, next to it, ``drift_context.png`` (AL vs context, one line per drafter)
and ``drift_position.png`` (acceptance vs draft position). Without the trained models it falls back to
random ones: the numbers are then meaningless.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import (
    BUNDLED_DRAFTERS,
    BUNDLED_TARGET,
    HELDOUT_MANIFEST,
    TARGET_HELP,
    acceptance_stats,
    fit_prompts,
    fmt_al,
    heldout_code_prompts,
    load_models,
    mean_ci95,
    print_table,
    pyplot,
    run_batched,
    stop_ids,
    write_json,
)
from eagle_jax.config import SpecConfig, aux_layer_ids_for
from eagle_jax.decoding.engine import causal_cache_mask
from eagle_jax.modeling.layers import window_mask

# Position bands of the norm diagnostics (and of bench.target_quality's loss).
BANDS = ((0, 128), (128, 256), (256, 512), (512, 1024), (1024, 1536), (1536, 2048))

# Public licence texts (MIT, BSD 3-Clause, Apache-2.0 header): prose the code model rarely sees at length.
LICENSE_TEXT = """\
Copyright (c) <year> <copyright holders>

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES
OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN
CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.

Redistribution and use in source and binary forms, with or without modification, are permitted
provided that the following conditions are met:

1. Redistributions of source code must retain the above copyright notice, this list of conditions
   and the following disclaimer.

2. Redistributions in binary form must reproduce the above copyright notice, this list of
   conditions and the following disclaimer in the documentation and/or other materials provided
   with the distribution.

3. Neither the name of the copyright holder nor the names of its contributors may be used to
   endorse or promote products derived from this software without specific prior written
   permission.

THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY EXPRESS OR
IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF MERCHANTABILITY AND
FITNESS FOR A PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT HOLDER OR
CONTRIBUTORS BE LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR CONSEQUENTIAL
DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF SUBSTITUTE GOODS OR SERVICES; LOSS OF USE,
DATA, OR PROFITS; OR BUSINESS INTERRUPTION) HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER
IN CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF
THE USE OF THIS SOFTWARE, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGE.

Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file except in
compliance with the License. You may obtain a copy of the License at

    http://www.apache.org/licenses/LICENSE-2.0

Unless required by applicable law or agreed to in writing, software distributed under the License
is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or
implied. See the License for the specific language governing permissions and limitations under the
License.
"""


def license_prefix(tokenizer, n_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """About ``n_tokens`` tokens of licence text as ``#`` comment lines, cut at a line end (the text is
    repeated if too short). Without a tokenizer: random ids from the top of the vocabulary."""
    if tokenizer is None:
        return np.random.default_rng(seed + 1).integers(vocab_size // 2, vocab_size, n_tokens).tolist()
    lines = [("# " + ln).rstrip() + "\n" for ln in LICENSE_TEXT.splitlines()]
    ids: list[int] = []
    while len(ids) < n_tokens:
        for ln in lines:
            piece = tokenizer.encode(ln, add_special_tokens=False)
            if ids and len(ids) + len(piece) > n_tokens:
                return ids + tokenizer.encode("\n", add_special_tokens=False)
            ids += piece
    return ids


def heldout_stream(tokenizer, vocab_size: int, seed: int) -> tuple[np.ndarray, int | None, np.ndarray]:
    """(tokens of the held-out files joined by <|end_of_text|>, the separator id, bool: token ends a line)."""
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        toks = rng.integers(10, vocab_size, 200_000)
        return toks, None, rng.random(len(toks)) < 0.1
    from workshop.corpus import load_corpus

    sep = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    sep = sep if isinstance(sep, int) and sep >= 0 and sep != tokenizer.unk_token_id else None
    ids: list[int] = []
    for text in load_corpus(HELDOUT_MANIFEST, "heldout"):
        ids += tokenizer.encode(text, add_special_tokens=False)
        if sep is not None:
            ids.append(sep)
    toks = np.asarray(ids, np.int64)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    newline = np.array(
        [tokenizer.convert_tokens_to_string([t]).endswith("\n") if t is not None else False for t in vocab]
    )
    return toks, sep, newline[toks]


def context_prompts(
    stream, sep, ends_line, contexts: list[int], n: int, max_new: int, seed: int
) -> tuple[dict[int, list[list[int]]], list[int]]:
    """For each L in ``contexts``: the L tokens before each of ``n`` shared end points."""
    longest = max(contexts)
    idx = np.arange(longest, len(stream) - max_new)
    ok = ends_line[idx - 1]
    if sep is not None:
        seps = np.concatenate([[0], np.cumsum(stream == sep)])
        ok &= (seps[idx + max_new] - seps[idx]) == 0  # the reference continuation stays inside one file
    cand = idx[ok]
    if len(cand) < n:
        raise SystemExit(f"only {len(cand)} end points for contexts up to {longest} tokens (asked for {n})")
    ends = sorted(np.random.default_rng(seed).choice(cand, n, replace=False).tolist())
    return {L: [stream[e - L : e].tolist() for e in ends] for L in contexts}, ends


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help=TARGET_HELP)
    ap.add_argument("--drafters", nargs="+", default=list(BUNDLED_DRAFTERS))
    ap.add_argument(
        "--contexts",
        type=int,
        nargs="*",
        help="prompt lengths in tokens (default 256 512 1024 1536 and context - max-new)",
    )
    ap.add_argument("--k", type=int, default=7, help="chain depth for every run")
    ap.add_argument("--n-prompts", type=int, default=32, help="prompts per context length / per OOD condition")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--ood-tokens", type=int, default=600, help="licence-comment prefix length (0: skip the OOD study)")
    ap.add_argument("--batch-size", type=int, default=8, help="rows per generate call (long contexts need memory)")
    ap.add_argument("--no-eos", action="store_true", help="ignore eos: every row runs max-new tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0],
        help="per-position acceptance with bootstrap CIs at each; 0 reuses the greedy runs, every T > 0 reruns the "
        "context sweep sampled (doubles its cost, so not in the default)",
    )
    ap.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples of the prompts")
    ap.add_argument(
        "--norm-prompts", type=int, default=8, help="prompts (of the --n-prompts end points) for the norm diagnostics"
    )
    ap.add_argument("--no-norms", action="store_true", help="skip the hidden-state and fed-back feature norms")
    ap.add_argument("--out", default="bench/results/drift.json")
    args = ap.parse_args(argv)

    target, drafters, tokenizer, source, is_random = load_models(args.target, args.drafters, args.dtype)
    vocab = target.config.vocab_size
    limit = target.config.max_position_embeddings
    contexts = args.contexts or [c for c in (256, 512, 1024, 1536) if c < limit - args.max_new] + [limit - args.max_new]
    if max(contexts) + args.max_new > limit:
        raise SystemExit(f"context {max(contexts)} + max-new {args.max_new} exceeds the target's {limit} positions")
    spec = SpecConfig(num_speculative_tokens=args.k)
    eos = stop_ids(tokenizer, not args.no_eos)
    kw = dict(spec=spec, max_new=args.max_new, temperature=0.0, eos=eos, seed=args.seed, batch_size=args.batch_size)
    results = {
        "models": source,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "contexts": contexts,
        "eos_ids": list(eos),
        "context": [],
        "ood": [],
    }

    stream, sep, ends_line = heldout_stream(tokenizer, vocab, args.seed)
    by_len, ends = context_prompts(stream, sep, ends_line, contexts, args.n_prompts, args.max_new, args.seed)
    results["context_end_points"] = ends
    ctx_rows = []
    accepted_by = {}  # (temperature, drafter, context) -> per-row accepted counts, for the bootstrap table
    for dname, drafter in drafters.items():
        for L in contexts:
            accepted_by[0.0, dname, L] = run_batched(target, drafter, by_len[L], **kw)["accepted"]
            st = acceptance_stats(accepted_by[0.0, dname, L], args.k)
            results["context"].append({"drafter": dname, "context": L, **st})
            ctx_rows.append(
                [
                    dname,
                    L,
                    st["prompts"],
                    fmt_al(st),
                    f"{st['al_pooled']:.2f}",
                    " ".join(f"{p:.2f}" for p in st["position_acceptance"]),
                ]
            )
            print(f"  context {L} | {dname}: AL {fmt_al(st)}", flush=True)

    diff_rows = paired_differences(results, contexts)
    for temp in (t for t in args.temperatures if t > 0):
        for dname, drafter in drafters.items():
            for L in contexts:
                accepted_by[temp, dname, L] = run_batched(target, drafter, by_len[L], **{**kw, "temperature": temp})[
                    "accepted"
                ]
                print(
                    f"  T={temp:g} context {L} | {dname}: AL "
                    f"{acceptance_stats(accepted_by[temp, dname, L], args.k)['al_pooled']:.2f}",
                    flush=True,
                )
    pos_rows = position_study(
        results,
        {key: acc for key, acc in accepted_by.items() if key[0] in args.temperatures},
        args.k,
        args.n_boot,
        args.seed,
    )
    if not args.no_norms:
        norm_rows, feat_rows = norm_study(
            results, target, drafters, by_len, args.norm_prompts, args.k, min(args.batch_size, 4)
        )

    ood_rows = []
    if args.ood_tokens:
        prefix = license_prefix(tokenizer, args.ood_tokens, vocab, args.seed)
        base = heldout_code_prompts(tokenizer, args.n_prompts, seed=args.seed, vocab_size=vocab)
        base = fit_prompts(base, args.max_new + len(prefix), limit)
        results["ood_prefix_tokens"] = len(prefix)
        for dname, drafter in drafters.items():
            pair = {}
            for cond, prompts in (
                ("plain", [p["ids"] for p in base]),
                ("licence prefix", [prefix + p["ids"] for p in base]),
            ):
                st = acceptance_stats(run_batched(target, drafter, prompts, **kw)["accepted"], args.k)
                pair[cond] = st
                results["ood"].append({"drafter": dname, "condition": cond, **st})
                print(f"  OOD {cond} | {dname}: AL {fmt_al(st)}", flush=True)
            ratio = pair["licence prefix"]["al_mean"] / pair["plain"]["al_mean"]
            for cond, st in pair.items():
                ood_rows.append(
                    [
                        dname,
                        cond,
                        st["prompts"],
                        fmt_al(st),
                        f"{st['al_pooled']:.2f}",
                        f"{ratio:.3f}" if cond != "plain" else "",
                        " ".join(f"{p:.2f}" for p in st["position_acceptance"]),
                    ]
                )

    print()
    if is_random:
        print("(random models: acceptance meaningless)")
    print(f"AL vs context length (greedy, chain K={args.k}, {args.max_new} new tokens)")
    print_table(["drafter", "context", "prompts", "AL (95% CI)", "AL pooled", f"pos acceptance 1..{args.k}"], ctx_rows)
    if diff_rows:
        print()
        print("Paired difference per context (same prompts): AL(second drafter) - AL(first), 95% t-interval")
        print_table(
            ["drafters", "context", "prompts", "mean diff (95% CI)", "prompts where second > / = / < first"], diff_rows
        )
    if ood_rows:
        print()
        print(f"Out-of-distribution prefix: {results['ood_prefix_tokens']} tokens of licence text as # comments")
        print_table(
            ["drafter", "condition", "prompts", "AL (95% CI)", "AL pooled", "AL ratio", f"pos acceptance 1..{args.k}"],
            ood_rows,
        )
    print()
    print(
        f"Acceptance per draft position, chain K={args.k}: pooled over rounds, percentile-bootstrap 95% CI over "
        f"prompts ({args.n_boot} resamples)"
    )
    print_table(
        ["drafter", "T", "context", "prompts", "AL pooled (95% CI)"] + [f"pos {i + 1}" for i in range(args.k)], pos_rows
    )
    if not args.no_norms:
        nb = results["norms"]
        print()
        print(
            "Target residual-stream RMS entering each layer (* = aux layer read by the drafters) and the drafters' "
            f"fc(aux), median over tokens of {nb['prompts']} prompts of {nb['context']} tokens, by position band"
        )
        print_table(["layer"] + nb["bands"], norm_rows)
        print()
        print(
            f"Drafter feature RMS per draft step (median over {nb['prompts']} prompts; g = fc(target aux) at the last "
            "prompt token; raw = pre-norm h2, fed = what step i+1 receives)"
        )
        print_table(["drafter", "context", "kind", "g"] + [f"step {i + 1}" for i in range(args.k)], feat_rows)
    write_json(args.out, results)
    plot_dir = Path(args.out).parent
    plot_context(results, plot_dir / "drift_context.png", args.k)
    plot_position(results, plot_dir / "drift_position.png", args.k)
    return results


def paired_differences(results: dict, contexts: list[int]) -> list[list]:
    """With two drafters: per context, the per-prompt AL difference (second - first) on the same prompts,
    its mean and 95% t-interval (paired, so prompt difficulty cancels), stored under results["paired"]."""
    names = list(dict.fromkeys(r["drafter"] for r in results["context"]))
    if len(names) != 2:
        return []
    rows, results["paired"] = [], []
    for L in contexts:
        a, b = (
            next(r for r in results["context"] if r["drafter"] == n and r["context"] == L)["per_prompt_al"]
            for n in names
        )
        d = [y - x for x, y in zip(a, b) if x is not None and y is not None]
        mean, half = mean_ci95(d)
        wins = (sum(v > 0 for v in d), sum(v == 0 for v in d), sum(v < 0 for v in d))
        results["paired"].append(
            {
                "first": names[0],
                "second": names[1],
                "context": L,
                "diff_mean": mean,
                "diff_ci95": half,
                "second_better_equal_worse": wins,
            }
        )
        rows.append(
            [
                f"{names[1]} - {names[0]}",
                L,
                len(d),
                f"{mean:+.2f}" + ("" if np.isnan(half) else f" ± {half:.2f}"),
                " / ".join(map(str, wins)),
            ]
        )
    return rows


def bootstrap_ci(num, den, n_boot: int = 2000, seed: int = 0, level: float = 0.95):
    """Percentile-bootstrap interval of the pooled ratio sum(num) / sum(den) when the rows (prompts) are
    resampled with replacement: rows, not rounds, are the independent units (a prompt's rounds share its
    difficulty). num: [n] or [n, K] per-row numerators, den: [n] per-row denominators. Returns (lo, hi),
    floats for 1-D num, else [K] arrays; nan when there are no rows."""
    num = np.asarray(num, float)
    den = np.asarray(den, float)
    flat = num[:, None] if num.ndim == 1 else num
    if len(num) == 0:
        lo = hi = np.full(flat.shape[1], np.nan)
    else:
        idx = np.random.default_rng(seed).integers(0, len(num), (n_boot, len(num)))
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = flat[idx].sum(axis=1) / den[idx].sum(axis=1)[:, None]  # [n_boot, K]
        tail = 100 * (1 - level) / 2
        lo, hi = np.nanpercentile(ratios, tail, axis=0), np.nanpercentile(ratios, 100 - tail, axis=0)
    return (float(lo[0]), float(hi[0])) if num.ndim == 1 else (lo, hi)


def position_counts(accepted: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt: (rounds [n], rounds accepting draft i [n, k], drafts accepted [n])."""
    rounds = np.array([len(row) for row in accepted], float)
    per_pos = np.array([[sum(a > i for a in row) for i in range(k)] for row in accepted], float).reshape(
        len(accepted), k
    )
    return rounds, per_pos, np.array([sum(row) for row in accepted], float)


def position_study(results: dict, accepted_by: dict, k: int, n_boot: int, seed: int) -> list[list]:
    """Per (temperature, drafter, context): pooled per-position acceptance and AL with bootstrap 95% CIs,
    stored under results["position_ci"]; returns the table rows."""
    rows, results["position_ci"] = [], []
    for (temp, dname, L), acc in sorted(accepted_by.items()):
        rounds, per_pos, total = position_counts(acc, k)
        pos = per_pos.sum(axis=0) / max(rounds.sum(), 1)
        lo, hi = bootstrap_ci(per_pos, rounds, n_boot, seed)
        al = 1 + total.sum() / max(rounds.sum(), 1)
        al_lo, al_hi = bootstrap_ci(total, rounds, n_boot, seed)
        results["position_ci"].append(
            {
                "temperature": temp,
                "drafter": dname,
                "context": L,
                "prompts": len(acc),
                "rounds": int(rounds.sum()),
                "al_pooled": al,
                "al_ci95": [1 + al_lo, 1 + al_hi],
                "position_acceptance": pos.tolist(),
                "position_ci95": [lo.tolist(), hi.tolist()],
            }
        )
        rows.append(
            [dname, f"{temp:g}", L, len(acc), f"{al:.2f} [{1 + al_lo:.2f}, {1 + al_hi:.2f}]"]
            + [f"{p:.2f} [{a:.2f},{b:.2f}]" for p, a, b in zip(pos, lo, hi)]
        )
    return rows


@nnx.jit
def _target_pass(target, ids: jax.Array):
    """Prompts [B, T] -> (RMS of the residual stream entering every layer [B, L, T], those states
    concatenated [B, T, L*H] for the drafters' fc, the target's greedy next token [B])."""
    n_layers = target.config.num_layers
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, aux, _ = target.forward(
        ids, positions, window_mask(positions, positions, None), aux_layer_ids=tuple(range(n_layers))
    )
    states = aux.astype(jnp.float32).reshape(b, t, n_layers, -1)
    rms = jnp.sqrt(jnp.mean(states**2, axis=-1)).transpose(0, 2, 1)
    first = jnp.argmax(target.logits(hidden[:, -1]), axis=-1).astype(jnp.int32)
    return rms, aux, first


def drafter_aux(aux_all: jax.Array, target, drafter) -> jax.Array:
    """The drafter's aux states [B, T, N*H] out of every layer's [B, T, L*H] (``_target_pass``)."""
    h = target.config.hidden_size
    return jnp.concatenate(
        [aux_all[..., j * h : (j + 1) * h] for j in aux_layer_ids_for(drafter.config, target.config)], axis=-1
    )


def _layer_raw(drafter, g, ids, positions, mask, cache, write_index):
    """``Drafter.layer`` that also returns the pre-norm h2 ("raw"): (normed, fed-back feature, raw, cache)."""
    u, cos, sin = drafter.attention_input(g, ids, positions)
    attn, cache = drafter.self_attn(u, cos, sin, mask, cache, write_index)
    normed, fed = drafter.finish(g, attn)
    h1 = g + attn
    raw = h1 + drafter.mlp(drafter.post_attention_layernorm(h1))  # finish's h2, before the final norm
    return normed, fed, raw, cache


def _rms(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(x.astype(jnp.float32) ** 2, axis=-1))


@nnx.jit(static_argnums=(4,))
def _draft_chain_norms(drafter, aux: jax.Array, ids: jax.Array, first: jax.Array, k: int):
    """The drafter's prefill on the target's aux states [B, T, N*H], then K-1 greedy chain steps on its own
    features, as the engine runs them. Returns (RMS of fc(aux) [B, T], raw RMS [B, K], fed RMS [B, K],
    the K greedy drafts as target ids [B, K])."""
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    nxt = jnp.concatenate([ids[:, 1:], first[:, None]], axis=1)  # pairs (feature of t, token t+1)
    g = drafter.fuse(aux.astype(drafter.dtype))
    cache = drafter.init_cache(b, t + k)
    normed, fed, raw, cache = _layer_raw(
        drafter, g, nxt, positions, window_mask(positions, positions, None), cache, jnp.zeros((b,), jnp.int32)
    )
    logits, feat = drafter.lm_head(normed[:, -1]), fed[:, -1]
    raws, feds, drafts = [_rms(raw[:, -1])], [_rms(fed[:, -1])], []
    for i in range(1, k):
        d = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(d)
        pos = jnp.full((b, 1), t + i - 1, jnp.int32)
        normed, fed, raw, cache = _layer_raw(
            drafter,
            feat[:, None],
            drafter.draft_to_target(d)[:, None],
            pos,
            causal_cache_mask(pos, t + k, None),
            cache,
            pos[:, 0],
        )
        logits, feat = drafter.lm_head(normed[:, 0]), fed[:, 0]
        raws.append(_rms(raw[:, 0]))
        feds.append(_rms(fed[:, 0]))
    drafts.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return _rms(g), jnp.stack(raws, axis=1), jnp.stack(feds, axis=1), drafter.draft_to_target(jnp.stack(drafts, axis=1))


def band_medians(values: np.ndarray, bands=BANDS) -> dict[str, float]:
    """values [..., T] by position -> {band: median over the band's positions (and leading axes)}."""
    t = values.shape[-1]
    return {f"{a}-{b}": float(np.median(values[..., a : min(b, t)])) for a, b in bands if a < t}


def norm_study(
    results: dict, target, drafters: dict, by_len: dict, n_prompts: int, k: int, batch_size: int
) -> tuple[list[list], list[list]]:
    """Diagnostics 4 and 5 of the module docstring, stored under results["norms"]; returns both tables' rows."""
    longest = max(by_len)
    out = {
        "prompts": min(n_prompts, len(by_len[longest])),
        "context": longest,
        "hidden": {},
        "fc_aux": {},
        "feature": [],
    }
    feat_rows = []
    for L in sorted(by_len):
        ids = np.asarray(by_len[L][:n_prompts], np.int32)
        parts = {
            "rms": [],
            "g": {d: [] for d in drafters},
            "raw": {d: [] for d in drafters},
            "fed": {d: [] for d in drafters},
        }
        for i in range(0, len(ids), batch_size):
            batch = jnp.asarray(ids[i : i + batch_size])
            rms, aux, first = _target_pass(target, batch)
            parts["rms"].append(np.asarray(rms))
            for dname, drafter in drafters.items():
                sel = drafter_aux(aux, target, drafter)
                g, raw, fed = (np.asarray(x) for x in _draft_chain_norms(drafter, sel, batch, first, k)[:3])
                for key, val in (("g", g), ("raw", raw), ("fed", fed)):
                    parts[key][dname].append(val)
        for dname, drafter in drafters.items():
            g, raw, fed = (np.concatenate(parts[key][dname]) for key in ("g", "raw", "fed"))
            entry = {
                "drafter": dname,
                "context": L,
                "g_last": float(np.median(g[:, -1])),
                "raw": np.median(raw, axis=0).tolist(),
                "fed": np.median(fed, axis=0).tolist(),
                "norm_output": bool(drafter.config.norm_output),
            }
            out["feature"].append(entry)
            for kind in ("raw", "fed"):
                feat_rows.append([dname, L, kind, f"{entry['g_last']:.2f}"] + [f"{v:.2f}" for v in entry[kind]])
            if L == longest:
                out["fc_aux"][dname] = band_medians(g)
        if L == longest:
            rms = np.concatenate(parts["rms"])  # [n, layers, T]
            out["hidden"] = {str(layer): band_medians(rms[:, layer]) for layer in range(rms.shape[1])}
    out["bands"] = list(next(iter(out["hidden"].values())))
    aux_ids = {j for d in drafters.values() for j in aux_layer_ids_for(d.config, target.config)}
    norm_rows = [
        [f"{layer}{' *' if int(layer) in aux_ids else ''}"] + [f"{v:.2f}" for v in by_band.values()]
        for layer, by_band in out["hidden"].items()
    ]
    norm_rows += [
        [f"fc(aux) {dname}"] + [f"{v:.2f}" for v in by_band.values()] for dname, by_band in out["fc_aux"].items()
    ]
    results["norms"] = out
    return norm_rows, feat_rows


def plot_context(results: dict, path: Path, k: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dname in dict.fromkeys(r["drafter"] for r in results["context"]):
        rs = [r for r in results["context"] if r["drafter"] == dname]
        ax.errorbar(
            [r["context"] for r in rs],
            [r["al_mean"] for r in rs],
            yerr=[0 if np.isnan(r["al_ci95"]) else r["al_ci95"] for r in rs],
            marker="o",
            capsize=3,
            label=dname,
        )
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("acceptance length (tokens / target forward)")
    ax.set_title(f"AL vs context length (greedy, chain K={k}, 95% CI over prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def plot_position(results: dict, path: Path, k: int) -> None:
    """Cumulative and conditional acceptance per draft position: code prompts (OOD 'plain' condition,
    or the shortest context without it) solid, the longest context dashed, the licence prefix dotted."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    x = np.arange(1, k + 1)
    longest = max(results["contexts"])
    shortest = min(results["contexts"])
    for i, dname in enumerate(dict.fromkeys(r["drafter"] for r in results["context"])):
        color = f"C{i}"
        curves = []
        plain = [r for r in results["ood"] if r["drafter"] == dname and r["condition"] == "plain"]
        if plain:
            curves.append(("code prompts", "-", plain[0]))
        else:
            curves.append(
                (
                    f"context {shortest}",
                    "-",
                    next(r for r in results["context"] if r["drafter"] == dname and r["context"] == shortest),
                )
            )
        curves.append(
            (
                f"context {longest}",
                "--",
                next(r for r in results["context"] if r["drafter"] == dname and r["context"] == longest),
            )
        )
        curves += [
            ("licence prefix", ":", r) for r in results["ood"] if r["drafter"] == dname and r["condition"] != "plain"
        ]
        for label, style, r in curves:
            axes[0].plot(x, r["position_acceptance"], style, marker="o", color=color, label=f"{dname}, {label}")
            axes[1].plot(x, r["conditional_acceptance"], style, marker="o", color=color, label=f"{dname}, {label}")
    axes[0].set_title("P(draft i accepted)")
    axes[1].set_title("P(draft i accepted | draft i-1 accepted)")
    for ax in axes:
        ax.set_xlabel("draft position i")
        ax.set_ylim(0, 1.02)
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance rate")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Acceptance vs draft position (greedy, chain K={k})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
