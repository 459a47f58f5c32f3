"""The bundled target's own quality by context length, on the held-out split.

Context for bench.drift: if the target itself degrades at long context, every drafter's acceptance
falls there whatever its attention does. Two measurements:

1. Next-token loss (nats/token, float32) by position band (0-128, 128-256, 256-512, 512-1024,
   1024-1536, 1536-2048) over --n-windows full windows of --window tokens cut from the held-out
   stream (``bench.drift.heldout_stream``: the held-out files tokenized and joined as in pretraining).
   Windows lie inside one file (no ``<|end_of_text|>`` in them), so a token's position is the amount
   of same-file history it sees. Per band: the mean over windows of the window's band mean, with a
   95% Student-t interval over windows.
2. Repetition loops of plain greedy decoding (``eagle_jax.generate`` with no drafter): --n-prompts
   held-out prompts of exactly L tokens for each L in --contexts (``bench.drift.context_prompts``,
   shared end points), --max-new tokens each; the fraction of rows that fall into a loop
   (``loop_onset``) within the first --loop-horizon new tokens, with a bootstrap 95% interval over
   prompts, and the fraction that stopped at an end-of-text token.

    python -m bench.target_quality                                              # defaults below
    python -m bench.target_quality --n-windows 2 --n-prompts 2 --contexts 64 128 --max-new 64 \\
        --out /tmp/tq.json                                                      # smoke test

Writes JSON (``--out``, default bench/results/target_quality.json).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import (
    BUNDLED_TARGET,
    TARGET_HELP,
    load_models,
    mean_ci95,
    print_table,
    run_batched,
    stop_ids,
    write_json,
)
from bench.drift import BANDS, bootstrap_ci, context_prompts, heldout_stream

# Loop detector: the last LOOP_WINDOW tokens are periodic with a period of at most LOOP_MAX_PERIOD, so the
# window holds at least two full copies of the repeating unit (64 >= 2 x 32). Code legitimately repeats
# lines, but rarely 64 tokens with an exact short period; a greedy model stuck in a cycle always does.
LOOP_WINDOW = 64
LOOP_MAX_PERIOD = 32


def smallest_period(seq, max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """The smallest p <= max_period with seq[i] == seq[i - p] for every i >= p, if ``seq`` holds at least
    two full periods (len >= 2p); else None."""
    s = np.asarray(seq)
    for p in range(1, min(max_period, len(s) // 2) + 1):
        if np.array_equal(s[p:], s[:-p]):
            return p
    return None


def loop_onset(tokens, window: int = LOOP_WINDOW, max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """The first n (tokens generated so far) at which ``tokens[n - window : n]`` is periodic with a period
    <= ``max_period`` (``smallest_period``): the row is then in a repetition loop. None: never."""
    s = np.asarray(tokens)
    for n in range(window, len(s) + 1):
        if smallest_period(s[n - window : n], max_period) is not None:
            return n
    return None


def band_labels(bands=BANDS) -> list[str]:
    return [f"{a}-{b}" for a, b in bands]


def pick_windows(stream: np.ndarray, sep: int | None, n: int, length: int, seed: int) -> np.ndarray:
    """``n`` non-overlapping windows [n, length] of the stream, at aligned offsets, each inside one file."""
    starts = np.arange(0, len(stream) - length + 1, length)
    if sep is not None:
        starts = np.array([s for s in starts if not (stream[s : s + length] == sep).any()], int)
    if len(starts) < n:
        raise SystemExit(f"only {len(starts)} single-file windows of {length} tokens (asked for {n})")
    picked = np.sort(np.random.default_rng(seed).choice(starts, n, replace=False))
    return np.stack([stream[s : s + length] for s in picked])


@nnx.jit
def token_nll(target, ids: jax.Array) -> jax.Array:
    """[B, T] ids -> [B, T-1] nats: -log p(ids[:, j] | ids[:, :j]) for j = 1..T-1, in float32."""
    logits, _ = target(ids, aux_layer_ids=())
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]


def band_losses(target, windows: np.ndarray, batch_size: int, bands=BANDS) -> np.ndarray:
    """[n_windows, n_bands] mean loss of the tokens at positions j (j tokens of history) in each band
    (nan where the window is too short for the band)."""
    nll = np.concatenate(
        [
            np.asarray(token_nll(target, jnp.asarray(windows[i : i + batch_size], jnp.int32)))
            for i in range(0, len(windows), batch_size)
        ]
    )
    pos = np.arange(1, windows.shape[1])
    out = np.full((len(windows), len(bands)), np.nan)
    for j, (a, b) in enumerate(bands):
        sel = (pos >= a) & (pos < b)
        if sel.any():
            out[:, j] = nll[:, sel].mean(axis=1)
    return out


def loss_study(target, stream, sep, args) -> tuple[list[dict], list[list]]:
    windows = pick_windows(stream, sep, args.n_windows, args.window, args.seed)
    per_window = band_losses(target, windows, args.batch_size)
    rows, table = [], []
    for label, col in zip(band_labels(), per_window.T):
        if np.isnan(col).all():
            continue
        mean, half = mean_ci95(col.tolist())
        # Paired against the first band of the same windows: window-to-window difficulty cancels.
        diff, diff_half = mean_ci95((col - per_window[:, 0]).tolist())
        rows.append(
            {
                "band": label,
                "loss_mean": mean,
                "loss_ci95": half,
                "ppl": float(np.exp(mean)),
                "diff_vs_first": diff,
                "diff_ci95": diff_half,
                "per_window": col.tolist(),
            }
        )
        table.append([label, len(col), fmt_ci(mean, half), f"{np.exp(mean):.2f}", fmt_ci(diff, diff_half, signed=True)])
    return rows, table


def fmt_ci(mean: float, half: float, signed: bool = False) -> str:
    return (f"{mean:+.3f}" if signed else f"{mean:.3f}") + ("" if np.isnan(half) else f" ± {half:.3f}")


def loop_study(target, tokenizer, stream, sep, ends_line, args) -> tuple[list[dict], list[list]]:
    eos = stop_ids(tokenizer, not args.no_eos)
    by_len, _ = context_prompts(stream, sep, ends_line, args.contexts, args.n_prompts, args.max_new, args.seed)
    rows, table = [], []
    for L in args.contexts:
        out = run_batched(
            target,
            None,
            by_len[L],
            spec=None,
            max_new=args.max_new,
            eos=eos,
            seed=args.seed,
            batch_size=args.batch_size,
        )
        onsets = [loop_onset(t[: args.loop_horizon]) for t in out["tokens"]]
        looped = np.array([o is not None for o in onsets], float)
        stopped = np.array([bool(t) and t[-1] in eos for t in out["tokens"]], float)
        lo, hi = bootstrap_ci(looped, np.ones(len(looped)), seed=args.seed)
        rows.append(
            {
                "context": L,
                "prompts": len(looped),
                "loop_fraction": float(looped.mean()),
                "loop_ci95": [lo, hi],
                "eos_fraction": float(stopped.mean()),
                "loop_onsets": onsets,
                "new_tokens": [len(t) for t in out["tokens"]],
            }
        )
        onset_txt = f"{np.median([o for o in onsets if o is not None]):.0f}" if looped.any() else "-"
        table.append(
            [
                L,
                len(looped),
                f"{looped.mean():.2f} [{lo:.2f}, {hi:.2f}]",
                onset_txt,
                f"{stopped.mean():.2f}",
                f"{np.mean([len(t) for t in out['tokens']]):.0f}",
            ]
        )
        print(f"  context {L}: {int(looped.sum())}/{len(looped)} rows looped", flush=True)
    return rows, table


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help=TARGET_HELP)
    ap.add_argument("--n-windows", type=int, default=16, help="held-out windows for the loss by position band")
    ap.add_argument("--window", type=int, default=0, help="window length (0: the target's context)")
    ap.add_argument("--n-prompts", type=int, default=16, help="prompts per context length for the loop study")
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=[128, 512, 1024, 1792], help="prompt lengths for the loop study"
    )
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument(
        "--loop-horizon",
        type=int,
        default=256,
        help="a row counts as looping if a loop starts within this many new tokens",
    )
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--no-eos", action="store_true", help="ignore eos: every row runs max-new tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/target_quality.json")
    args = ap.parse_args(argv)

    target, _, tokenizer, source, is_random = load_models(args.target, [], "float32", need_drafters=False)
    limit = target.config.max_position_embeddings
    args.window = args.window or limit
    if max(args.contexts) + args.max_new > limit:
        raise SystemExit(
            f"context {max(args.contexts)} + max-new {args.max_new} exceeds the target's {limit} positions"
        )
    stream, sep, ends_line = heldout_stream(tokenizer, target.config.vocab_size, args.seed)
    results = {
        "models": source,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "loop_detector": f"last {LOOP_WINDOW} new tokens periodic with period <= {LOOP_MAX_PERIOD}",
    }
    results["loss"], loss_table = loss_study(target, stream, sep, args)
    results["loops"], loop_table = loop_study(target, tokenizer, stream, sep, ends_line, args)

    print()
    if is_random:
        print("(random target: figures meaningless)")
    print(
        f"Held-out next-token loss by position (float32, {args.n_windows} single-file windows of {args.window} tokens, "
        "95% t-interval over windows)"
    )
    print_table(
        ["position band", "windows", "loss nats/token", "ppl", f"minus {band_labels()[0]} (paired)"], loss_table
    )
    print()
    print(
        f"Greedy repetition loops ({args.max_new} new tokens, loop = last {LOOP_WINDOW} tokens periodic with period <= "
        f"{LOOP_MAX_PERIOD}, within {args.loop_horizon}; bootstrap 95% CI over prompts)"
    )
    print_table(
        ["context", "prompts", "looped (95% CI)", "median onset", "stopped at eos", "mean new tokens"], loop_table
    )
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
