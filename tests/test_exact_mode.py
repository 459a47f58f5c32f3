"""Exact mode (``generate(..., exact=True)``) on the bundled pair in bfloat16: the target computes in
float32 from its bf16 weights, plain and speculative alike, so the output of every row is the same
whatever the batch, the drafter and the speculation: zero divergences from plain batch-1 decoding on
held-out prompts, at batch 1 and in a ragged batch, chain (through ``generate_stream``) and tree.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest

import eagle_jax
from eagle_jax.config import SpecConfig

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFTER = ROOT / "assets/target", ROOT / "assets/drafter-eagle3.1"
MANIFEST = ROOT / "assets/data/manifest.json"
N_PROMPTS, MAX_NEW = 4, 32
CHAIN, TREE = (
    SpecConfig(num_speculative_tokens=5),
    SpecConfig(method="tree", tree_top_k=4, tree_depth=5, tree_total_tokens=24),
)

pytestmark = pytest.mark.skipif(
    not all((d / "model.safetensors").exists() for d in (TARGET, DRAFTER)), reason="bundled pair not built"
)


@pytest.fixture(scope="module")
def bf16_pair():
    from transformers import AutoTokenizer

    from workshop.corpus import code_prompts, load_corpus

    target = eagle_jax.load_target(TARGET, dtype="bfloat16")
    drafter = eagle_jax.load_drafter(DRAFTER, target)
    assert target.dtype == drafter.dtype == jnp.bfloat16
    tok = AutoTokenizer.from_pretrained(TARGET)
    picked = code_prompts(load_corpus(MANIFEST, "heldout"), N_PROMPTS, seed=1, min_chars=300, max_chars=1500)
    # Ragged lengths inside one prompt bucket (64): every batch-1 run reuses one compiled program.
    prompts = [tok.encode(p["prompt"], add_special_tokens=False)[-(40 + 7 * i) :] for i, p in enumerate(picked)]
    return target, drafter, prompts


def _gen(target, drafter, prompts, spec=CHAIN):
    return eagle_jax.generate(
        target, drafter, prompts, max_new_tokens=MAX_NEW, spec=spec, eos_token_id=[], exact=True
    ).tokens


def test_exact_mode_has_zero_divergences_in_bf16(bf16_pair):
    target, drafter, prompts = bf16_pair
    reference = [_gen(target, None, [p])[0] for p in prompts]  # plain decoding, one prompt at a time
    assert [_gen(target, drafter, [p])[0] for p in prompts] == reference, "exact chain at batch 1 != plain"
    assert _gen(target, drafter, prompts, TREE) == reference, "exact tree in a ragged batch != plain at batch 1"
    streamed = [[] for _ in prompts]
    for chunk in eagle_jax.generate_stream(
        target, drafter, prompts, max_new_tokens=MAX_NEW, spec=CHAIN, eos_token_id=[], exact=True
    ):
        for row, new in zip(streamed, chunk):
            row.extend(new)
    assert streamed == reference, "exact chain in a ragged batch (generate_stream) != plain at batch 1"
