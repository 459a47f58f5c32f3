"""bench.scale's abstract build and compile of generate's program, and the guard against hoisted weight copies.

XLA's CPU backend widens bf16 matmul operands to float32; inside the decoding while_loop the widening
of a weight is loop-invariant and XLA hoists it out, holding a float32 copy of every weight as
temporaries (Llama-3.1-8B: 33.8 GiB of temporaries for 16.7 GiB of weights). eagle_jax stores
half-precision weight matrices widened on CPU (``layers.weight_matrix``), so a bf16 program needs
about the temporaries of the float32 one. This test compiles a small pair's program abstractly in
both dtypes (and, on CPU, with the widening switched off, to show the guard fails without it).
About 12 s on a 2-core CPU: three small compiles.
"""

from __future__ import annotations

import jax
import pytest

from bench import scale
from eagle_jax.config import DrafterConfig, SpecConfig, TargetConfig
from eagle_jax.modeling import layers

# Small enough to compile in seconds, with weights (1.9 M numbers) far above the program's activations
# and caches, so that a hoisted float32 copy of them would dominate the temporaries.
TARGET = {
    **scale.TINY,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
}
DRAFTER = {
    **scale.TINY_DRAFTER,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "draft_vocab_size": 512,
    "target_hidden_size": 256,
    "num_aux_hidden_states": 2,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]},
}
SPEC = SpecConfig(num_speculative_tokens=2)
BATCH, PROMPT, NEW = 1, 16, 8


@pytest.fixture(scope="module")
def pair():
    return TargetConfig.from_hf(TARGET, "test target"), DrafterConfig.from_hf(DRAFTER, "test drafter")


def test_abstract_pair_has_no_weights(pair):
    tc, dc = pair
    t_graph, t_state, d_graph, d_state = scale.abstract_pair(tc, dc, jax.numpy.bfloat16)
    leaves = jax.tree.leaves((t_state, d_state))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    plan = scale.plan_for(tc, SPEC, BATCH, PROMPT, NEW)
    assert plan.cache_len == scale.bucket(PROMPT) + NEW + SPEC.verify_width + 1  # generate's one-shot plan


def half_f32_bytes(tc, dc) -> int:
    """Float32 bytes of the weight matrices the bf16 pair still stores in bf16 (not built with
    ``layers.weight_matrix``: today the drafter's frozen embedding, built in drafter.py), whose widening
    XLA may hoist; 0 where weights stay bf16 (native bf16 matmuls). Norm vectors are left out on both
    sides (``scale.hoisted_widening_bytes`` counts matrices)."""
    if not layers.widen_half_weights():
        return 0
    _, t_state, _, d_state = scale.abstract_pair(tc, dc, jax.numpy.bfloat16)
    return sum(4 * x.size for x in jax.tree.leaves((t_state, d_state)) if x.dtype == jax.numpy.bfloat16 and x.ndim >= 2)


def test_bf16_program_temporaries_close_to_fp32(pair, record_property):
    tc, dc = pair
    f32 = scale.measure(tc, dc, "float32", SPEC, BATCH, PROMPT, NEW)
    bf16 = scale.measure(tc, dc, "bfloat16", SPEC, BATCH, PROMPT, NEW)
    allowance = half_f32_bytes(tc, dc)
    record_property(
        "temp_bytes", {"float32": f32["temp_bytes"], "bfloat16": bf16["temp_bytes"], "allowance": allowance}
    )
    # The float32 program's temporaries are activations, scratch and cache updates; the bf16 program
    # needs about as many (some values held in both dtypes). A float32 copy of the widened weights
    # (4 bytes x 1.9 M numbers = 7 MiB) would be ~35x the float32 program's temporaries.
    assert bf16["temp_bytes"] <= 2 * f32["temp_bytes"] + allowance, (bf16["temp_bytes"], f32["temp_bytes"], allowance)
    assert bf16["hoisted_widening_bytes"] <= allowance, bf16["hoisted_widening_bytes"]
    if jax.default_backend() != "cpu":
        return
    # Without the widening the same program holds float32 copies of (nearly) all weights: the guard fails.
    native = scale.measure(tc, dc, "bfloat16", SPEC, BATCH, PROMPT, NEW, weights="native")
    assert native["hoisted_widening_bytes"] > 0.8 * 2 * native["weight_bytes"], native["hoisted_widening_bytes"]
    assert native["temp_bytes"] > 2 * f32["temp_bytes"] + allowance, (
        native["temp_bytes"],
        f32["temp_bytes"],
        allowance,
    )
