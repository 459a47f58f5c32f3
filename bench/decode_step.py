"""What one plain decoding step costs at a batch size, by how many cache slots it holds and how many its rows fill.

    python -m bench.decode_step                                     # SmolLM2-135M-Instruct, batch 48
    python -m bench.decode_step --target smollm2-135m-instruct --batch 48 --cases 128:100 640:100 640:300 640:600

A case is SLOTS:FILL: a cache of SLOTS slots per row whose rows all decode at position FILL (attention reads the
cache blocks up to it). A step is what ``generate`` runs per token when it decodes plainly: the target's forward
over one position with the cache donated, its logits and the argmax. Medians of ``--repeats`` steps after a
compiling one; tok/s = batch / step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import print_table, write_json


def step_program(target, slots: int):
    graph, _ = nnx.split(target)

    def step(state, ids, positions, cache):
        model = nnx.merge(graph, state)
        mask = jnp.arange(slots)[None, None, :] <= positions[:, :, None]
        hidden, _, cache = model.forward(ids, positions, mask, cache, write_index=positions[:, 0])
        return jnp.argmax(model.logits(hidden), -1), cache

    return jax.jit(step, donate_argnums=3)


def step_ms(target, batch: int, slots: int, fill: int, repeats: int) -> float:
    if not 0 <= fill < slots:
        raise SystemExit(f"error: a case's fill must be below its slots, got {slots}:{fill}")
    step = step_program(target, slots)
    state = nnx.state(target)
    cache = target.init_cache(batch, slots)
    ids = jnp.zeros((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), fill, jnp.int32)
    tokens, cache = step(state, ids, positions, cache)
    tokens.block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens, cache = step(state, ids, positions, cache)
        tokens.block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def parse_case(text: str) -> tuple[int, int]:
    try:
        slots, fill = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is SLOTS:FILL, got {text!r}") from None
    return slots, fill


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--cases", type=parse_case, nargs="+", default=[(128, 100), (640, 100), (640, 300), (640, 600)])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out", default="bench/results/decode_step.json")
    args = p.parse_args(argv)

    from eagle_jax import load_target

    target = load_target(args.target, args.dtype)
    rows = []
    for slots, fill in args.cases:
        ms = step_ms(target, args.batch, slots, fill, args.repeats)
        rows.append([slots, fill, f"{ms:.0f}", f"{args.batch / ms * 1e3:.0f}"])
    print_table(["slots", "fill", "step ms", "tok/s"], rows)
    write_json(args.out, {"target": args.target, "batch": args.batch, "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
