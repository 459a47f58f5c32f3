"""TTT training throughput: tokens/s, model FLOP/s against the measured matmul peak, and where a step's
time goes (target forward, the drafter's TTT steps forward + backward, the optimizer update).

    python -m bench.train                                  # bundled target + EAGLE-3.1 drafter (fp32 master weights)
    python -m bench.train --batch 4 --seq-len 1024 --repeats 5
    python -m bench.train --config configs/train/tiny.yaml # that recipe's random target and a fresh drafter

The whole step is the trainer's own (``make_train_step``, jitted with the trainer's donation); each part
is timed as its own jitted function on the same batch and state: the frozen target's forward (logits
and aux states), the TTT loss's value and gradient given those (the same loss as the train step), and
the optimizer update (``tx.update`` + ``apply_updates``) given those gradients. ``rest`` = step - sum of
parts (negative when the fused step is cheaper than its parts apart). Medians of ``--repeats`` calls,
the parts interleaved, after one compiling call each. Model FLOPs per token are the trainer's
(``train_flops_per_token``: matmuls and attention; MoE: activated experts only); the target's share is
its forward (2 x weights + causal attention), the drafter's the rest. The data are random token ids
(throughput does not depend on the text) with every position in the loss. Without the bundled models
it uses configs/train/tiny.yaml's random target.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import eagle_jax
from bench import roofline as rl
from bench.common import BUNDLED_DRAFTER, BUNDLED_TARGET, TARGET_HELP, print_table, write_json
from eagle_jax.checkpoint.hf_target import DTYPES
from eagle_jax.config import aux_layer_ids_for
from eagle_jax.modeling.flops import attention_flops, matmul_params
from eagle_jax.training.trainer import (
    build_target,
    drafter_config_for,
    load_config,
    make_optimizer,
    make_train_step,
    train_flops_per_token,
)
from eagle_jax.training.ttt import ttt_loss

TINY_RECIPE = Path("configs/train/tiny.yaml")


def load_models(target_dir: str | None, drafter_dir: str | None, config: str | None):
    """(target, drafter, cfg, description): the bundled pair (or the given directories) in float32, or
    a recipe's random target with a fresh drafter of its config (identity-spaced vocabulary map)."""
    if bool(target_dir) != bool(drafter_dir):
        raise SystemExit("--target and --drafter go together")
    if config is None and target_dir is None and BUNDLED_TARGET.exists() and BUNDLED_DRAFTER.exists():
        target_dir, drafter_dir = str(BUNDLED_TARGET), str(BUNDLED_DRAFTER)
    if config is None and target_dir and drafter_dir:
        target = eagle_jax.load_target(target_dir, dtype="float32")
        drafter = eagle_jax.load_drafter(drafter_dir, target, dtype="float32")
        return target, drafter, load_config(None), {"target": target_dir, "drafter": drafter_dir}
    recipe = config or str(TINY_RECIPE)
    cfg = load_config(recipe)
    target = build_target(cfg)
    dc = drafter_config_for(cfg, target)
    drafter = eagle_jax.Drafter(dc, target.embed_tokens[...], dtype=jnp.float32, rngs=nnx.Rngs(int(cfg["seed"])))
    v, vd = dc.vocab_size, dc.draft_vocab_size
    drafter.set_vocab_map(np.arange(vd) * (v // vd) - np.arange(vd))
    return target, drafter, cfg, {"target": f"random ({recipe})", "drafter": "fresh (its drafter config)"}


def target_forward_flops_per_token(target, seq_len: int) -> float:
    """The target's share of ``train_flops_per_token``: 2 x the weights a token uses (+ a tied lm_head)
    plus causal attention over T/2 keys per layer, as the trainer counts it."""
    tc = target.config
    params = matmul_params(target) + (tc.vocab_size * tc.hidden_size if tc.tie_word_embeddings else 0)
    return 2 * params + attention_flops(tc, seq_len / 2) * tc.num_layers


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help=TARGET_HELP)
    ap.add_argument("--drafter")
    ap.add_argument(
        "--config",
        help="a training recipe with target.random (default without the bundled pair: configs/train/tiny.yaml)",
    )
    ap.add_argument(
        "--batch", type=int, default=None, help="sequences per step (default 4; a recipe: its train.batch_size)"
    )
    ap.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default 512; a recipe: its data.max_length)"
    )
    ap.add_argument("--ttt-length", type=int, default=7)
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3, help="timed calls of the step and of each part (median)")
    ap.add_argument("--out", default="bench/results/train.json")
    args = ap.parse_args(argv)

    target, drafter, cfg, source = load_models(args.target, args.drafter, args.config)
    recipe = args.config is not None or "random" in source["target"]
    batch = args.batch or (int(cfg["train"]["batch_size"]) if recipe else 4)
    seq_len = args.seq_len or (int(cfg["data"]["max_length"]) if recipe else 512)
    compute_dtype = DTYPES[args.compute_dtype]
    cfg["train"].update(steps=1000, ttt_length=args.ttt_length, compute_dtype=args.compute_dtype)
    t_cfg = cfg["train"]

    peaks = rl.measure_peaks(args.compute_dtype)
    print(rl.format_peaks(peaks))

    tx, _ = make_optimizer(cfg)
    graphdef_d, params, frozen = nnx.split(drafter, nnx.Param, ...)
    graphdef_t, target_state = nnx.split(target)
    opt_state = jax.jit(tx.init)(params)
    aux_ids = aux_layer_ids_for(drafter.config, target.config)
    kw = dict(ttt_length=int(t_cfg["ttt_length"]), decay=float(t_cfg["decay"]), normalize=t_cfg["normalize"])
    step_fn = make_train_step(graphdef_d, graphdef_t, tx, aux_layer_ids=aux_ids, compute_dtype=compute_dtype, **kw)
    full = jax.jit(step_fn, donate_argnums=(0, 1))

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, target.config.vocab_size, (batch, seq_len)), jnp.int32)
    mask = jnp.ones((batch, seq_len), jnp.int32)
    step_batch = {"input_ids": ids[None], "loss_mask": mask[None]}

    # The parts, as make_train_step computes them.
    def cast(tree):
        return jax.tree.map(lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    @jax.jit
    def target_part(ts, ids):
        logits, aux = nnx.merge(graphdef_t, ts)(ids, aux_ids)
        return logits, aux.astype(compute_dtype)

    def loss_fn(params, frozen, aux, ids, t_logits, mask):
        out = ttt_loss(nnx.merge(graphdef_d, cast(params), frozen), aux, ids, t_logits, mask, **kw)
        return out.total, out

    drafter_part = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

    @jax.jit
    def optimizer_part(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    t0 = time.perf_counter()
    params, opt_state, _ = jax.block_until_ready(full(params, opt_state, frozen, target_state, step_batch))
    compile_s = time.perf_counter() - t0
    t_logits, aux = jax.block_until_ready(target_part(target_state, ids))
    (_, _), grads = jax.block_until_ready(drafter_part(params, frozen, aux, ids, t_logits, mask))
    jax.block_until_ready(optimizer_part(grads, opt_state, params))

    times: dict[str, list[float]] = {
        "step": [],
        "target forward": [],
        "drafter TTT fwd+bwd": [],
        "optimizer update": [],
    }
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        params, opt_state, metrics = jax.block_until_ready(full(params, opt_state, frozen, target_state, step_batch))
        times["step"].append(time.perf_counter() - t0)
        parts = [
            ("target forward", target_part, (target_state, ids)),
            ("drafter TTT fwd+bwd", drafter_part, (params, frozen, aux, ids, t_logits, mask)),
            ("optimizer update", optimizer_part, (grads, opt_state, params)),
        ]
        for name, fn, fargs in parts:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fargs))
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}

    tokens = batch * seq_len
    flops_tok = train_flops_per_token(target, drafter, seq_len, int(t_cfg["ttt_length"]))
    t_flops_tok = target_forward_flops_per_token(target, seq_len)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    # AdamW (+ global-norm clipping) reads params, grads, mu, nu and writes params, mu, nu: 7 x 4 bytes a parameter.
    opt_bytes = 7 * 4 * n_params
    flops = {
        "target forward": t_flops_tok * tokens,
        "drafter TTT fwd+bwd": (flops_tok - t_flops_tok) * tokens,
        "optimizer update": 0.0,
        "step": flops_tok * tokens,
    }
    step_s = med["step"]
    rows, parts_out = [], {}
    for name in ("target forward", "drafter TTT fwd+bwd", "optimizer update"):
        s = med[name]
        f = flops[name]
        cells = [
            name,
            f"{s * 1e3:.1f}",
            f"{100 * s / step_s:.0f}%",
            f"{f / 1e9:.2f}",
            f"{f / s / 1e9:.1f}",
            f"{100 * f / s / peaks['matmul_flops']:.1f}",
            "-",
            "-",
        ]
        extra = {}
        if name == "optimizer update":
            cells[3:] = [
                "-",
                "-",
                "-",
                f"{opt_bytes / s / 1e9:.2f}",
                f"{100 * opt_bytes / s / peaks['read_bytes_per_s']:.1f}",
            ]
            extra = {
                "bytes": opt_bytes,
                "bytes_per_s": opt_bytes / s,
                "bytes_fraction": opt_bytes / s / peaks["read_bytes_per_s"],
            }
        rows.append(cells)
        parts_out[name] = {
            "seconds": s,
            "share_of_step": s / step_s,
            "flops": f,
            "flops_per_s": f / s,
            "flops_fraction": f / s / peaks["matmul_flops"],
            **extra,
        }
    rest = step_s - sum(med[n] for n in parts_out)
    rows.append(["rest (step - parts)", f"{rest * 1e3:.1f}", f"{100 * rest / step_s:.0f}%", "", "", "", "", ""])
    rows.append(
        [
            "whole step",
            f"{step_s * 1e3:.1f}",
            "100%",
            f"{flops['step'] / 1e9:.2f}",
            f"{flops['step'] / step_s / 1e9:.1f}",
            f"{100 * flops['step'] / step_s / peaks['matmul_flops']:.1f}",
            "",
            "",
        ]
    )
    tok_s = tokens / step_s
    mfu = flops_tok * tok_s / peaks["matmul_flops"]
    print(
        f"\n{source['target']} + {source['drafter']}: batch {batch} x {seq_len} tokens, TTT length "
        f"{t_cfg['ttt_length']}, compute {args.compute_dtype}; drafter {n_params / 1e6:.2f} M trainable; "
        f"{flops_tok / 1e6:.1f} MFLOP/token "
        f"({t_flops_tok / 1e6:.1f} target forward); first step (compile) {compile_s:.1f} s"
    )
    print(
        f"throughput {tok_s:.0f} tokens/s, model {flops_tok * tok_s / 1e9:.1f} GFLOP/s = {100 * mfu:.1f}% of the "
        "measured matmul peak\n"
    )
    print_table(["part", "ms", "of step", "GFLOP", "GFLOP/s", "% peak", "GB/s", "% BW"], rows)
    results = {
        "models": source,
        "peaks": peaks,
        "batch": batch,
        "seq_len": seq_len,
        "ttt_length": int(t_cfg["ttt_length"]),
        "compute_dtype": args.compute_dtype,
        "trainable_params": n_params,
        "flops_per_token": flops_tok,
        "target_flops_per_token": t_flops_tok,
        "compile_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": tok_s,
        "model_flops_per_s": flops_tok * tok_s,
        "mfu": mfu,
        "parts": parts_out,
        "rest_s": rest,
        "times": times,
        "loss": float(metrics["loss"]),
    }
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
