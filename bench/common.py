"""Shared pieces of the benchmarks: the model pair to measure, prompts, tables and JSON output."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

import eagle_jax
from eagle_jax.config import DrafterConfig, TargetConfig

BUNDLED_TARGET = Path("assets/target")
BUNDLED_DRAFTER = Path("assets/drafter-eagle3.1")


def random_pair(vocab: int = 6144, hidden: int = 384, layers: int = 12, draft_vocab: int = 2048):
    """Untrained models of the bundled pair's shape: right for timing, meaningless for acceptance."""
    tc = TargetConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden // 3 * 2,
                      num_layers=layers, num_heads=6, num_kv_heads=2, head_dim=hidden // 6, max_position_embeddings=4096)
    target = eagle_jax.Target(tc, rngs=nnx.Rngs(0))
    dc = DrafterConfig(hidden_size=hidden, num_heads=6, num_kv_heads=2, head_dim=hidden // 6, intermediate_size=tc.intermediate_size,
                       vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=hidden, fc_norm=True, norm_output=True)
    drafter = eagle_jax.Drafter(dc, target.embed_tokens[...], rngs=nnx.Rngs(1))
    drafter.set_vocab_map(np.arange(draft_vocab) * (vocab // draft_vocab) - np.arange(draft_vocab))
    return target, drafter


def load_pair_or_random(target_dir: str | None, drafter_dir: str | None, prompts_file: str | None, prompt_len: int):
    """(target, drafter, tokenizer or None, prompts as id lists, description of the models)."""
    target_dir = target_dir or (str(BUNDLED_TARGET) if BUNDLED_TARGET.exists() else None)
    drafter_dir = drafter_dir or (str(BUNDLED_DRAFTER) if BUNDLED_DRAFTER.exists() else None)
    tokenizer = None
    if target_dir and drafter_dir:
        target = eagle_jax.load_target(target_dir, dtype="float32")
        drafter = eagle_jax.load_drafter(drafter_dir, target, dtype="float32")
        source = {"target": target_dir, "drafter": drafter_dir}
        if (Path(target_dir) / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(target_dir)
    else:
        target, drafter = random_pair()
        source = {"target": "random 12x384", "drafter": "random (acceptance meaningless)"}
    if prompts_file and tokenizer is not None:
        rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines() if line.strip()]
        prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False)[-prompt_len:] for r in rows]
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, target.config.vocab_size, prompt_len).tolist() for _ in range(16)]
    return target, drafter, tokenizer, prompts, source


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if j == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    print(f"wrote {path}")
