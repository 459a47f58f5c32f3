"""Where a TTT step from precomputed target features spends its time, and its throughput per configuration.

    python -m bench.ttt_profile                       # the SmolLM2-135M drafter's sizes, a few configurations
    python -m bench.ttt_profile --configs 1x2048:5:4096 2x1024:3:4096

A configuration is ROWSxLENGTH:TTT:VD (packed rows of LENGTH tokens, TTT length, draft vocabulary). Each part is its
own jitted function on the same inputs, forward and backward where the step has both, medians of ``--repeats``
calls after a compiling one:

- ``step``: the trainer's whole step (``make_train_step`` from features, donated, AdamW);
- ``head``: the lm_head and the loss of every TTT step (the draft-vocabulary logits, log-softmax and
  cross-entropy against the target's distribution, which is computed once);
- ``attention``: the TTT attention over the packed row (``_extended_attention``: step-0 keys of the query's
  document plus the diagonal keys) of every step;
- ``optimizer``: clip + AdamW update of the drafter's parameters;
- ``layer``: the rest (fc, norms, q/k/v/o projections, MLP): step - head - attention - optimizer;
- ``host``: assembling the step's batch on the host (``FeatureStore.collate`` from a memory-mapped store).

Model FLOPs are the trainer's (``drafter_flops_per_token``); the share is of the measured fp32 matmul
peak. Synthetic features (throughput does not depend on the values), documents of 512 tokens per row.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bench.common import print_table, write_json
from eagle_jax.config import DrafterConfig, RopeConfig
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.layers import document_mask
from eagle_jax.training.features import FeatureStore, draft_vocab_logits
from eagle_jax.training.trainer import drafter_flops_per_token, make_train_step, measure_matmul_peak
from eagle_jax.training.ttt import _extended_attention

# SmolLM2-135M-Instruct's drafter (hidden 576, GQA 9/3 x 64, MLP 1536, three aux states of the 576-wide target)
SMOLLM2 = dict(
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    target_hidden_size=576,
    num_aux_hidden_states=3,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    fc_norm=True,
    norm_output=True,
    aux_layer_ids=(2, 15, 27),
    rope=RopeConfig(theta=1e5),
)
DOC = 512  # tokens per packed document


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def profile(rows: int, length: int, ttt: int, vd: int, repeats: int, peak: float) -> dict:
    c = DrafterConfig(draft_vocab_size=vd, **SMOLLM2)
    rng = np.random.default_rng(0)
    drafter = Drafter(
        c, jnp.asarray(rng.normal(size=(c.vocab_size, c.hidden_size)) * 0.02, jnp.float32), rngs=nnx.Rngs(0)
    )
    drafter.set_vocab_map(np.zeros(vd, np.int64))
    graphdef, params, frozen = nnx.split(drafter, nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3, b1=0.9, b2=0.95))
    n_docs = max(1, length // DOC)
    positions = np.tile(np.arange(length // n_docs), n_docs)[None].repeat(rows, 0).astype(np.int32)
    segments = np.repeat(np.arange(1, n_docs + 1), length // n_docs)[None].repeat(rows, 0).astype(np.int32)
    batch = {
        "input_ids": rng.integers(0, vd, (1, rows, length)).astype(np.int32),
        "loss_mask": np.ones((1, rows, length), np.int32),
        "positions": positions[None],
        "segment_ids": segments[None],
        "aux": rng.normal(size=(1, rows, length, c.fc_in_features)).astype(np.float32),
        "target_hidden": rng.normal(size=(1, rows, length, c.target_hidden_size)).astype(np.float32),
        "target_argmax": rng.integers(0, vd, (1, rows, length)).astype(np.int32),
    }
    batch = jax.tree.map(jnp.asarray, batch)
    head_rows = jnp.asarray(rng.normal(size=(vd, c.target_hidden_size)) * 0.05, jnp.float32)
    step = jax.jit(
        make_train_step(
            graphdef,
            None,
            tx,
            aux_layer_ids=c.aux_layer_ids,
            ttt_length=ttt,
            decay=0.8,
            normalize="valid",
            compute_dtype=jnp.float32,
            from_features=True,
        ),
        donate_argnums=(0, 1),
    )
    state = {"params": params, "opt": tx.init(params)}

    def run_step():
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], frozen, head_rows, batch)
        return metrics

    out = {"step": timed(run_step, repeats=repeats)}
    params = state["params"]  # the step donated the ones above

    # the head and loss of every TTT step on normed features [rows, T, H]
    p = jax.nn.softmax(draft_vocab_logits(batch["target_hidden"][0], head_rows), axis=-1)
    normed = jnp.asarray(rng.normal(size=(rows, length, c.hidden_size)), jnp.float32)

    def head_loss(kernel, normed):
        logq = jax.nn.log_softmax(normed @ kernel, axis=-1)
        return sum(-jnp.sum(p * logq) for _ in range(ttt))  # one per TTT step, as the step computes them

    head = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
    out["head"] = timed(head, params["lm_head"]["kernel"][...], normed, repeats=repeats)

    hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    q = jnp.asarray(rng.normal(size=(rows, length, hq, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(rows, length, hkv, d)), jnp.float32)
    diag = jnp.asarray(rng.normal(size=(max(ttt - 1, 1), rows, length, hkv, d)), jnp.float32)
    mask = document_mask(batch["positions"][0], batch["segment_ids"][0])

    def attention(q, k, v, dk, dv):
        return sum(jnp.sum(_extended_attention(q, k, v, dk, dv, i, 1 / np.sqrt(d), mask)) for i in range(ttt))

    attn = jax.jit(jax.grad(attention, argnums=(0, 1, 2, 3, 4)))
    out["attention"] = timed(attn, q, k, k, diag, diag, repeats=repeats)

    grads = jax.tree.map(jnp.ones_like, params)
    update = jax.jit(lambda g, s, p: optax.apply_updates(p, tx.update(g, s, p)[0]))
    out["optimizer"] = timed(update, grads, tx.init(params), params, repeats=repeats)
    out["layer"] = out["step"] - out["head"] - out["attention"] - out["optimizer"]

    with tempfile.TemporaryDirectory() as tmp:
        n = rows * length
        maps = {}
        for name, width, dtype in (
            ("aux", c.fc_in_features, np.float32),
            ("hidden", c.target_hidden_size, np.float32),
            ("argmax", None, np.int32),
        ):
            shape = (n,) if width is None else (n, width)
            maps[name] = np.lib.format.open_memmap(Path(tmp) / f"{name}.npy", "w+", dtype, shape)
        store = FeatureStore(
            Path(tmp), np.arange(0, n + 1, length // n_docs), maps["aux"], maps["hidden"], maps["argmax"]
        )
        docs = [np.arange(r * n_docs, (r + 1) * n_docs) for r in range(rows)]
        out["host"] = timed(lambda: store.collate(docs, length)["aux"], repeats=repeats)

    tokens = rows * length
    flops = drafter_flops_per_token(drafter, length, ttt)
    return {
        "rows": rows,
        "length": length,
        "ttt_length": ttt,
        "draft_vocab": vd,
        "seconds": out,
        "tokens_per_s": tokens / out["step"],
        "flop_share": tokens / out["step"] * flops / peak,
    }


def parse(spec: str) -> tuple[int, int, int, int]:
    shape, ttt, vd = spec.split(":")
    rows, length = shape.split("x")
    return int(rows), int(length), int(ttt), int(vd)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["1x2048:5:4096", "2x1024:5:4096", "2x1024:3:4096", "2x1024:3:2048", "4x512:3:4096"],
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/ttt_profile.json")
    args = ap.parse_args(argv)
    peak = measure_matmul_peak(jnp.float32)
    print(f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    runs, rows = [], []
    for spec in args.configs:
        r = profile(*parse(spec), repeats=args.repeats, peak=peak)
        runs.append(r)
        s = r["seconds"]
        rows.append(
            [
                spec,
                f"{s['step']:.2f}",
                *(f"{s[k]:.2f} ({100 * s[k] / s['step']:.0f}%)" for k in ("head", "attention", "layer", "optimizer")),
                f"{s['host'] * 1000:.0f} ms",
                f"{r['tokens_per_s']:.0f}",
                f"{100 * r['flop_share']:.1f}%",
            ]
        )
        print(f"  {spec}: {r['tokens_per_s']:.0f} tok/s", flush=True)
    print_table(
        [
            "rows x len : TTT : Vd",
            "step s",
            "head",
            "attention",
            "layer",
            "optimizer",
            "host",
            "tok/s",
            "of matmul peak",
        ],
        rows,
    )
    result = {"peak_flops": peak, "runs": runs}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
