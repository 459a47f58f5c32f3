"""Target parity: ``eagle_jax.load_target`` against HF transformers on the same tiny random checkpoints.

Error norm everywhere: ``rel_err`` = max|jax - hf| / max|hf| (max-abs relative error, conftest).
Tolerances: fp32 <= 1e-5 (measured ~1e-6: same math, different summation order); bf16 (HF in bf16,
JAX loaded in bf16) <= 2e-2 on logits (a bf16 ulp is 2^-8 ~ 4e-3 relative; the two sides round
attention scores and a few fused ops differently, and those 1-ulp differences compound over the layers).
Every measured error is printed and collected into parity_tests/.last_parity_errors.json.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import eagle_jax
from eagle_jax.config import TargetConfig, default_aux_layer_ids
from eagle_jax.modeling.target import window_mask
from parity_tests.conftest import hf_forward, rel_err, save_hf_model

FP32_TOL = 1e-5
BF16_TOL = 2e-2
BF16_HIDDEN_TOL = 3e-2  # per-layer residual streams in bf16: recorded, loosely bounded
BATCH, SEQ, VOCAB = 2, 24, 128

# family -> (HF architecture, config overrides). Sequences (SEQ=24) are longer than every
# original_max_position_embeddings (16) and than Mistral's sliding window (8), so scaling/window matter.
FAMILIES = {
    "llama": ("llama", {}),  # untied, GQA (4 q heads, 2 kv heads)
    # llama3 scaling with all three frequency bands present at head_dim 16: theta=100 gives wavelengths
    # 6.3 (< 16/high_freq_factor: kept), 11.2 (between: smoothed), >= 19.9 (> 16/low_freq_factor: scaled).
    "llama3_rope": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=100.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=2.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "linear_rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "yarn_rope": (
        "llama",
        dict(
            max_position_embeddings=64,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
        ),
    ),
    "tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", {}),  # q/k/v bias (randomised, nonzero)
    "qwen3": ("qwen3", dict(head_dim=32)),  # q/k RMSNorm; head_dim 32 != hidden/heads = 16
    "mistral": ("mistral", {}),  # sliding window 8
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """``get(family, dtype=fp32, fmt="safetensors", num_layers=None) -> (path, HF model)``, built once per module."""
    root = tmp_path_factory.mktemp("hf_targets")
    cache: dict = {}

    def get(family: str, dtype: torch.dtype = torch.float32, fmt: str = "safetensors", num_layers: int | None = None):
        key = (family, dtype, fmt, num_layers)
        if key not in cache:
            arch, overrides = FAMILIES[family]
            overrides = dict(overrides)
            if num_layers is not None:
                overrides["num_hidden_layers"] = num_layers
            name = f"{family}_{fmt}_{str(dtype).replace('torch.', '')}_{num_layers or 'L'}"
            cache[key] = save_hf_model(root, arch, dtype, fmt=fmt, name=name, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def input_ids() -> np.ndarray:
    return np.random.default_rng(1234).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)


def layer_chunks(aux, hidden: int, n: int):
    return [aux[..., i * hidden : (i + 1) * hidden] for i in range(n)]


def check_per_layer(target, hf_model, ids, device, record, tol_logits, tol_hidden):
    """Compares logits and every residual stream entering a layer (HF hidden_states[i], i < L)."""
    num_layers = target.config.num_layers
    hf_logits, hf_hidden = hf_forward(hf_model, ids, device)
    logits, aux = target(jnp.asarray(ids), tuple(range(num_layers)))
    assert logits.dtype == target.dtype
    assert aux.shape == (BATCH, SEQ, num_layers * target.config.hidden_size)
    errs = {}
    for i, chunk in enumerate(layer_chunks(aux, target.config.hidden_size, num_layers)):
        errs[f"hidden_states[{i}]"] = record(f"hidden_states[{i}]", rel_err(chunk, hf_hidden[i]))
    err_logits = record("logits", rel_err(logits, hf_logits))
    bad = {k: v for k, v in errs.items() if v > tol_hidden}
    assert not bad, f"residual streams differ from HF: {bad}"
    assert err_logits <= tol_logits, f"logits rel err {err_logits:.3e} > {tol_logits}"


# ------------------------------------------------------------------------------------------ families


@pytest.mark.parametrize("family", list(FAMILIES))
def test_target_parity_fp32(family, device, hf_models, input_ids, record_error):
    path, hf_model = hf_models(family)
    target = eagle_jax.load_target(path)
    assert target.dtype == jnp.float32
    c = target.config  # the feature under test was read from config.json
    assert (target.lm_head is None) == c.tie_word_embeddings == (family == "tied")
    assert c.attention_bias == (family == "qwen2") and c.qk_norm == (family == "qwen3")
    assert c.sliding_window == (8 if family == "mistral" else None)
    assert c.head_dim == (32 if family == "qwen3" else 16)
    assert c.rope.type == {"llama3_rope": "llama3", "linear_rope": "linear", "yarn_rope": "yarn"}.get(family, "default")
    check_per_layer(target, hf_model, input_ids, device, record_error, FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("family", ["llama3_rope", "qwen2", "qwen3", "mistral"])
def test_target_parity_bf16(family, device, hf_models, input_ids, record_error):
    path, hf_model = hf_models(family, torch.bfloat16)
    assert hf_model.dtype == torch.bfloat16
    target = eagle_jax.load_target(path)  # dtype from config.json
    assert target.dtype == jnp.bfloat16
    check_per_layer(target, hf_model, input_ids, device, record_error, BF16_TOL, BF16_HIDDEN_TOL)


def test_llama3_rope_transformers4_config(hf_models, input_ids, record_error, tmp_path):
    """The same checkpoint with its config.json rewritten in the transformers-4 dialect (top-level
    rope_theta, rope_scaling with the old 'type' key, torch_dtype) gives the same logits."""
    path, hf_model = hf_models("llama3_rope")
    v4 = tmp_path / "v4"
    v4.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    (v4 / "config.json").write_text(json.dumps(cfg))
    (v4 / "model.safetensors").symlink_to(path / "model.safetensors")
    a, b = TargetConfig.from_pretrained(path), TargetConfig.from_pretrained(v4)
    assert a.rope == b.rope and a.rope.type == "llama3" and a.rope.theta == 100.0
    hf_logits, _ = hf_forward(hf_model, input_ids)
    logits, _ = eagle_jax.load_target(v4)(jnp.asarray(input_ids))
    assert record_error("logits", rel_err(logits, hf_logits)) <= FP32_TOL


def test_default_aux_ids_are_hf_hidden_states(hf_models, input_ids, record_error):
    """With L=8 the default ids are the reference (2, L//2, L-3) = (2, 4, 5); aux = cat(hs[2], hs[4], hs[5])."""
    path, hf_model = hf_models("llama", num_layers=8)
    target = eagle_jax.load_target(path)
    assert default_aux_layer_ids(8) == (2, 4, 5)
    _, hf_hidden = hf_forward(hf_model, input_ids)
    _, aux = target(jnp.asarray(input_ids))
    want = torch.cat([hf_hidden[i] for i in (2, 4, 5)], dim=-1)
    assert record_error("aux", rel_err(aux, want)) <= FP32_TOL


# ------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
def test_checkpoint_formats(fmt, hf_models, input_ids, record_error):
    path, hf_model = hf_models("llama", fmt=fmt)
    files = sorted(p.name for p in path.iterdir())
    if fmt == "sharded":
        assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    elif fmt == "bin":
        assert "pytorch_model.bin" in files and not any(f.endswith(".safetensors") for f in files)
    hf_logits, _ = hf_forward(hf_model, input_ids)
    logits, _ = eagle_jax.load_target(path)(jnp.asarray(input_ids))
    assert record_error("logits", rel_err(logits, hf_logits)) <= FP32_TOL


# ------------------------------------------------------------------------------------ cached decoding


def cached_decode(target, ids: np.ndarray, lengths, block: int = 3, singles: int = 5, cache_len: int = SEQ):
    """Prefill each row's prompt, then a block of ``block`` tokens with a causal mask inside the block,
    then ``singles`` one-token steps.

    The prefill block is padded to the cache length with tokens that differ from the true continuation
    (its attention shapes are then those of the full-sequence pass: fewer eager compilations); the
    padding's keys/values sit in slots past each row's length until decoding overwrites them.

    Each row writes at its own length (write_index = row length); the mask over cache slots is
    window_mask(query positions, slot positions) with slots at or past the row's current length masked
    out. Returns {phase: (logits [n, V], [(row, position), ...])}.
    """
    b, _ = ids.shape
    lengths = np.asarray(lengths, np.int32)
    cache = target.init_cache(b, cache_len)
    slots = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (b, cache_len))
    window = target.config.sliding_window
    out = {}

    def run(tokens: np.ndarray, start: np.ndarray):
        nonlocal cache
        n = tokens.shape[1]
        pos = jnp.asarray(start[:, None] + np.arange(n, dtype=np.int32)[None, :])
        filled = slots < jnp.asarray(start + n)[:, None]  # slots >= the row's current length: empty
        mask = window_mask(pos, slots, window) & filled[:, None, :]
        hidden, _, cache = target.forward(jnp.asarray(tokens), pos, mask, cache, jnp.asarray(start))
        return np.asarray(target.logits(hidden), np.float32)

    # prefill: every row padded to the cache length with tokens that differ from the true continuation
    prompt = ids[:, :cache_len].copy()
    for r in range(b):
        prompt[r, lengths[r] :] = (ids[r, lengths[r] : cache_len] + 1) % VOCAB
    logits = run(prompt, np.zeros(b, np.int32))
    where = [(r, t) for r in range(b) for t in range(lengths[r])]
    out["prefill"] = (np.stack([logits[r, t] for r, t in where]), where)

    cur = lengths.copy()
    tokens = np.stack([ids[r, cur[r] : cur[r] + block] for r in range(b)])
    logits = run(tokens, cur)
    where = [(r, cur[r] + j) for r in range(b) for j in range(block)]
    out[f"block{block}"] = (logits.reshape(b * block, -1), where)
    cur = cur + block

    got, where = [], []
    for _ in range(singles):
        logits = run(np.stack([ids[r, cur[r] : cur[r] + 1] for r in range(b)]), cur)
        got.extend(logits[:, 0])
        where.extend((r, cur[r]) for r in range(b))
        cur = cur + 1
    out["single"] = (np.stack(got), where)
    assert int(cur.max()) <= ids.shape[1]
    return out


@pytest.mark.parametrize(
    "family,lengths",
    [("llama", (11, 11)), ("llama", (7, 11)), ("mistral", (7, 11))],
    ids=["llama-uniform", "llama-ragged", "mistral-ragged-window8"],
)
def test_cached_decoding(family, lengths, device, hf_models, input_ids, record_error):
    path, hf_model = hf_models(family)
    hf_logits, _ = hf_forward(hf_model, input_ids, device)
    hf_logits = hf_logits.numpy()
    target = eagle_jax.load_target(path)
    for phase, (got, where) in cached_decode(target, input_ids, lengths).items():
        want = np.stack([hf_logits[r, t] for r, t in where])
        err = record_error(phase, rel_err(got, want))
        assert err <= FP32_TOL, f"{phase}: cached logits differ from the full-sequence logits ({err:.3e})"


# ---------------------------------------------------------------------------------------- save_target


@pytest.mark.parametrize("family", ["llama3_rope", "yarn_rope", "tied", "qwen2", "qwen3", "mistral"])
def test_save_target_round_trip(family, hf_models, input_ids, record_error, tmp_path):
    """load_target -> save_target -> transformers from_pretrained gives the original HF logits."""
    path, hf_model = hf_models(family)
    target = eagle_jax.load_target(path)
    out = tmp_path / "saved"
    eagle_jax.save_target(target, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    a, b = reloaded.config, hf_model.config
    # save_target may spell out HF's own yarn defaults; everything else must come back as it was.
    extra = {k: v for k, v in a.rope_parameters.items() if k not in b.rope_parameters}
    assert extra in ({}, {"beta_fast": 32.0, "beta_slow": 1.0}), extra
    assert {k: a.rope_parameters[k] for k in b.rope_parameters} == b.rope_parameters
    assert (a.head_dim, a.tie_word_embeddings, getattr(a, "sliding_window", None)) == (
        b.head_dim,
        b.tie_word_embeddings,
        getattr(b, "sliding_window", None),
    )
    want, _ = hf_forward(hf_model, input_ids)
    got, _ = hf_forward(reloaded, input_ids)
    assert record_error("logits", rel_err(got, want)) <= 1e-6
