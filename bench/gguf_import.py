"""GGUF import of a real chat model: load time and parity against transformers' own GGUF load.

For the model (default ``smollm2-135m-instruct``, fetched on first use, or any .gguf):

1. Load time of ``eagle_jax.load_target`` (float32, --repeats loads in this process; the first one
   includes reading the file from disk if it is not in the page cache), of ``eagle_jax.load_tokenizer``
   (converted from the file's metadata into an empty cache, then read back from the cache), and of
   transformers' ``from_pretrained(gguf_file=...)`` for comparison.
2. Parity, fp32 both sides: for --per-set first turns of each ``../shared/data/eval`` set, rendered with
   the model's own chat template, the max-abs relative error of the prompt's logits
   (``max|jax - hf| / max|hf|``), and whether greedy decoding of --max-new tokens gives the same tokens
   (eagle_jax.generate vs transformers' generate).

    python -m bench.gguf_import                           # SmolLM2-135M-Instruct, 2 prompts per set
    python -m bench.gguf_import --model path/to/model.gguf --per-set 4 --max-new 64

Writes JSON (``--out``, default bench/results/gguf_import.json).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import jax.numpy as jnp
import numpy as np

import eagle_jax
from bench.common import EVAL, EVAL_SETS, print_table, question_prompts, write_json
from eagle_jax.checkpoint.models import resolve_model


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help=".gguf file or a named model")
    p.add_argument("--eval-dir", default=str(EVAL))
    p.add_argument("--per-set", type=int, default=2)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/gguf_import.json")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    file = Path(resolve_model(args.model))
    loads = []
    for _ in range(args.repeats):
        target, s = timed(lambda: eagle_jax.load_target(file, dtype="float32"))
        loads.append(s)
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {"EAGLE_JAX_CACHE": cache}):
        tok, tok_first = timed(lambda: eagle_jax.load_tokenizer(file))  # converted from the metadata
        _, tok_cached = timed(lambda: eagle_jax.load_tokenizer(file))
    ref, hf_load = timed(
        lambda: AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    )
    print(
        f"{file.name}: load_target {', '.join(f'{s:.2f}' for s in loads)} s; load_tokenizer {tok_first:.2f} s "
        f"(converted), {tok_cached:.2f} s (cached); transformers from_pretrained(gguf_file=) {hf_load:.2f} s"
    )

    rows, results = [], []
    for name in EVAL_SETS:
        for q in question_prompts(Path(args.eval_dir) / f"{name}.jsonl", tok, args.per_set):
            ids = list(q["ids"])
            with torch.no_grad():
                want = ref(torch.tensor([ids])).logits[0].numpy().astype(np.float64)
                hf_tokens = ref.generate(torch.tensor([ids]), max_new_tokens=args.max_new, do_sample=False)[
                    0, len(ids) :
                ].tolist()
            got = np.asarray(target(jnp.asarray([ids], jnp.int32))[0][0], np.float64)
            err = float(np.abs(got - want).max() / np.abs(want).max())
            ours = eagle_jax.generate(target, None, [ids], max_new_tokens=args.max_new, tokenizer=tok).tokens[0]
            n = min(len(ours), len(hf_tokens))
            same = ours[:n] == hf_tokens[:n] and n > 0
            results.append(
                {
                    "set": name,
                    "question_id": q["name"],
                    "prompt_tokens": len(ids),
                    "logits_rel_err": err,
                    "greedy_tokens_compared": n,
                    "greedy_identical": same,
                }
            )
            rows.append([name, q["name"], len(ids), f"{err:.2e}", n, "yes" if same else "NO"])
    print_table(["set", "question", "prompt tokens", "logits rel err", "greedy tokens", "identical"], rows)
    errs = [r["logits_rel_err"] for r in results]
    print(
        f"max rel err {max(errs):.2e}, median {float(np.median(errs)):.2e}; greedy identical "
        f"{sum(r['greedy_identical'] for r in results)}/{len(results)}"
    )
    write_json(
        args.out,
        {
            "model": str(file.name),
            "load_target_s": loads,
            "load_tokenizer_converted_s": tok_first,
            "load_tokenizer_cached_s": tok_cached,
            "transformers_load_s": hf_load,
            "parity": results,
        },
    )


if __name__ == "__main__":
    main()
