"""GGUF import parity: ``eagle_jax.load_target(file.gguf)`` against transformers' own GGUF load of the same
file (``from_pretrained(dir, gguf_file=...)``, which dequantizes with the same ``gguf.quants``).

Files are tiny seeded HF models written by ``gguf_writer``, one per architecture (llama, qwen2, qwen3),
whose weight matrices cycle through every tensor type the gguf package can write (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1) and the K-quants Q2_K .. Q6_K (random blocks: the package cannot quantize to
them). Each dequantized tensor must equal transformers' exactly (same ``gguf.quants`` code, same
float32 values); the logits, computed in float32 on both sides, within the fp32 tolerance of the other
target parity tests: 1e-5 relative (``rel_err``; measured ~1e-6).
The real SmolLM2-135M-Instruct GGUF is compared too where it is cached (``eagle-jax-fetch``).
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import eagle_jax
from eagle_jax.checkpoint.hf_target import target_key
from eagle_jax.checkpoint.models import model_path
from eagle_jax.checkpoint.module_fill import export_tensors
from parity_tests.conftest import build_hf_model, rel_err
from parity_tests.gguf_writer import K_QUANT_SCALES, WRITABLE, write_gguf

FP32_TOL = 1e-5
# Rows of 256 values, so the K-quants' 256-value blocks fit; Qwen3 at its real head_dim 128 (transformers'
# GGUF config for qwen3 ignores key_length and assumes 128).
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
TYPES = WRITABLE + tuple(K_QUANT_SCALES)  # 13 types
ARCHS = ("llama", "qwen2", "qwen3")


def tiny_gguf(tmp_path, arch: str):
    """One file per architecture holding every tensor type: the 16 weight matrices cycle through TYPES
    (shifted per architecture, so each type meets several kinds of tensor); norms and biases F32."""
    shape = dict(SHAPE, head_dim=128) if arch == "qwen3" else SHAPE
    model = build_hf_model(arch, **shape)
    cfg = model.config.to_dict()
    cfg["rope_theta"] = model.config.rope_parameters["rope_theta"]
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    matrices = [k for k, v in state.items() if v.ndim == 2]
    shift = 5 * ARCHS.index(arch)
    types = {k: TYPES[(i + shift) % len(TYPES)] for i, k in enumerate(matrices)}
    assert set(types.values()) == set(TYPES)
    return write_gguf(tmp_path / f"{arch}.gguf", state, cfg, tensor_qtypes=types), types


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_weights_and_logits_match_transformers(tmp_path, arch, record_error):
    file, types = tiny_gguf(tmp_path, arch)
    ref = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    target = eagle_jax.load_target(file, dtype="float32")
    assert target.config.architecture == arch and target.config.num_layers == 2
    # Every tensor, whatever its type, dequantizes (and, for llama's q/k, un-permutes) to transformers' values.
    ours = dict(export_tensors(target, target_key))
    theirs = {k: v.numpy() for k, v in ref.state_dict().items() if k in ours}
    assert set(theirs) == set(ours)
    for key, value in ours.items():
        np.testing.assert_array_equal(value, theirs[key], err_msg=f"{key} ({types.get(key, 'F32')})")
    ids = np.random.default_rng(0).integers(0, 128, (2, 24))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits
    got, _ = target(jnp.asarray(ids, jnp.int32))
    assert record_error(f"{arch} logits, every tensor type", rel_err(got, want)) <= FP32_TOL


SMOLLM2 = model_path("smollm2-135m-instruct")


@pytest.mark.skipif(
    not SMOLLM2.exists(),
    reason=f"SmolLM2-135M-Instruct is not cached ({SMOLLM2}): eagle-jax-fetch smollm2-135m-instruct",
)
def test_real_smollm2_gguf_matches_transformers(record_error):
    start = time.perf_counter()
    target = eagle_jax.load_target(SMOLLM2, dtype="float32")
    load_s = time.perf_counter() - start
    tok = eagle_jax.load_tokenizer(SMOLLM2)
    ref = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Write a haiku about the sea, then explain its imagery."}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits
        greedy = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    got, _ = target(jnp.asarray([ids], jnp.int32))
    print(f"[gguf] SmolLM2-135M-Instruct Q4_1 load_target: {load_s:.2f} s")
    assert record_error("SmolLM2-135M-Instruct logits", rel_err(got, want)) <= FP32_TOL
    out = eagle_jax.generate(target, None, [list(ids)], max_new_tokens=24, tokenizer=tok)
    assert out.tokens[0] == greedy[: len(out.tokens[0])] and len(out.tokens[0]) > 0
