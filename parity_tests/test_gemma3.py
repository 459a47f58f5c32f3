"""Gemma 3 parity: ``eagle_jax.load_target`` against transformers' Gemma3ForCausalLM.

Tiny random checkpoints, built here: an HF-format one (4 layers, sliding window 8 on three of them, a
global layer with its own rope base, query_pre_attn_scalar 24 != head_dim 16, final logit soft-capping)
and a GGUF written as llama.cpp's converter writes gemma3 (norm weights stored as 1 + w, the sandwich
norms under llama.cpp's names), which transformers loads with ``gguf_file=``. Sequences of 24 tokens
are three windows long, so the windows matter. Tolerances as the other target parity tests: fp32
<= 1e-5 relative (``rel_err``), bf16 <= 3e-2.

Where the real Gemma 3 270M GGUF is cached (``eagle-jax-fetch gemma-3-270m``), it is compared with
transformers' own load of the file on prompts of ~30 and ~1500 tokens (past its 512-token window):
every layer's residual stream, the logits and greedy continuations.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import eagle_jax
from eagle_jax import CheckpointError, ConfigError
from eagle_jax.checkpoint.models import model_path
from eagle_jax.config import FULL_LAYER, SLIDING_LAYER, TargetConfig
from parity_tests.conftest import hf_forward, randomize_, rel_err
from parity_tests.gguf_writer import write_gguf

FP32_TOL = 1e-5
BF16_HIDDEN_TOL = 3e-2
BATCH, SEQ, VOCAB, WINDOW = 2, 24, 128, 8
LAYER_TYPES = [SLIDING_LAYER, SLIDING_LAYER, FULL_LAYER, SLIDING_LAYER]
TINY_GEMMA3 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=len(LAYER_TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
    layer_types=LAYER_TYPES,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rope_local_base_freq=100.0,
    final_logit_softcapping=30.0,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def build_gemma3(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random Gemma3ForCausalLM (eager attention, eval mode, tied head)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{**TINY_GEMMA3, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize_(Gemma3ForCausalLM(config), seed).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``get(dtype) -> (directory, HF model as from_pretrained loads it back)``, saved once per dtype."""
    root = tmp_path_factory.mktemp("gemma3")
    cache = {}

    def get(dtype=torch.float32):
        if dtype not in cache:
            path = root / str(dtype).replace("torch.", "")
            build_gemma3().to(dtype).save_pretrained(path)
            cache[dtype] = (
                path,
                AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval(),
            )
        return cache[dtype]

    return get


@pytest.fixture(scope="module")
def input_ids() -> np.ndarray:
    return np.random.default_rng(7).integers(3, VOCAB, (BATCH, SEQ)).astype(np.int32)


def check_every_layer(target, hf_model, ids, device, record, tol_logits, tol_hidden):
    """Logits and every residual stream entering a layer (HF hidden_states[i]) against transformers."""
    n, h = target.config.num_layers, target.config.hidden_size
    want_logits, want_hidden = hf_forward(hf_model, ids, device)
    logits, aux = target(jnp.asarray(ids), tuple(range(n)))
    bad = {}
    for i in range(n):
        err = record(f"hidden_states[{i}]", rel_err(aux[..., i * h : (i + 1) * h], want_hidden[i]))
        if err > tol_hidden:
            bad[i] = err
    assert not bad, f"residual streams differ from transformers: {bad}"
    err = record("logits", rel_err(logits, want_logits))
    assert err <= tol_logits, f"logits rel err {err:.3e} > {tol_logits}"


# ------------------------------------------------------------------------------------ HF format


def test_tiny_gemma3_config_is_read_as_gemma3(tiny):
    path, _ = tiny()
    c = TargetConfig.from_pretrained(path)
    assert c.architecture == "gemma3" and c.layer_types == tuple(LAYER_TYPES)
    assert [c.layer_window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]
    assert [c.layer_rope(i).theta for i in range(4)] == [100.0, 100.0, 10000.0, 100.0]
    assert (c.query_pre_attn_scalar, c.final_logit_softcapping, c.hidden_act) == (24.0, 30.0, "gelu_pytorch_tanh")
    assert c.norm_unit_offset and c.sandwich_norms and c.scale_embeddings and c.qk_norm and c.tie_word_embeddings


def test_tiny_gemma3_fp32_every_layer(tiny, device, input_ids, record_error):
    path, hf_model = tiny()
    check_every_layer(eagle_jax.load_target(path), hf_model, input_ids, device, record_error, FP32_TOL, FP32_TOL)


def test_tiny_gemma3_bf16_every_layer(tiny, input_ids, record_error):
    """bf16: the (1 + w) norms multiply in float32 and the embedding scale is rounded to bf16, as in HF.
    The logits' bound is the residual streams': soft-capping caps them at 30, so the same absolute
    errors of the raw logits (measured 7e-3 relative without the cap) are relative to a smaller maximum."""
    path, hf_model = tiny(torch.bfloat16)
    target = eagle_jax.load_target(path)
    assert target.dtype == jnp.bfloat16
    check_every_layer(target, hf_model, input_ids, "cpu", record_error, BF16_HIDDEN_TOL, BF16_HIDDEN_TOL)


def test_tiny_gemma3_windows_change_the_output(tiny, input_ids):
    """The window test can fail: with a window wider than the sequence (the sliding layers keep their
    rope) the logits past the window differ."""
    path, hf_model = tiny()
    target = eagle_jax.load_target(path)
    want, _ = hf_forward(hf_model, input_ids)
    wide = eagle_jax.load_target(path)
    wide.config = target.config.replace(sliding_window=1 << 20)
    logits, _ = wide(jnp.asarray(input_ids))
    assert rel_err(logits[:, :WINDOW], want[:, :WINDOW]) <= FP32_TOL  # inside the first window nothing changes
    assert rel_err(logits[:, WINDOW:], want[:, WINDOW:]) > 1e-3


def test_tiny_gemma3_greedy_generate_equals_transformers(tiny):
    """Plain greedy decoding (prefill, then one cached step per token) past the window: transformers'
    own generate, token for token."""
    path, hf_model = tiny()
    target = eagle_jax.load_target(path)
    prompts = [[1, 17, 33, 5, 90], [1] + list(range(40, 52))]
    out = eagle_jax.generate(target, None, prompts, max_new_tokens=20, eos_token_id=[])
    for prompt, got in zip(prompts, out.tokens):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert got == ref[0, len(prompt) :].tolist()
        assert len(prompt) + len(got) > 3 * WINDOW


def test_tiny_gemma3_save_round_trip(tiny, input_ids, tmp_path, record_error):
    """save_target writes a Gemma3ForCausalLM directory transformers loads with the same logits."""
    path, hf_model = tiny()
    eagle_jax.save_target(eagle_jax.load_target(path), tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    assert (
        reloaded.config.layer_types == LAYER_TYPES
        and reloaded.config.rope_parameters == hf_model.config.rope_parameters
    )
    want, _ = hf_forward(hf_model, input_ids)
    got, _ = hf_forward(reloaded, input_ids)
    assert record_error("logits", rel_err(got, want)) <= 1e-6


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(hidden_activation="gelu"), "hidden_activation"),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "longrope", "rope_theta": 1e6, "factor": 2.0}}),
            "rope_type",
        ),
        (dict(architectures=["Gemma3ForConditionalGeneration"], vision_config={}), "vision"),
        (dict(layer_types=[SLIDING_LAYER, "chunked_attention", FULL_LAYER, SLIDING_LAYER]), "layer_types"),
    ],
    ids=["attn-softcap", "bidirectional", "gelu", "longrope", "vision", "layer-kind"],
)
def test_unsupported_gemma3_variants_are_refused_naming_the_field(tiny, tmp_path, change, field):
    path, _ = tiny()
    cfg = {**json.loads((path / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------------- GGUF

# llama.cpp's names of the Gemma 3 layer tensors (convert_hf_to_gguf.py, gemma3).
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The HF state dict under llama.cpp's gemma3 names, every norm weight stored as 1 + w (as the converter does)."""
    out = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied
        value = value.numpy()
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, i, rest = key.split(".", 3)
            name = f"blk.{i}.{_GGUF_LAYER[rest.removesuffix('.weight')]}.weight"
        out[name] = value + 1.0 if name.endswith("norm.weight") else value
    return out


def tiny_gemma3_gguf(tmp_path, extra_tensors: dict | None = None, extra_meta: dict | None = None):
    """A 6-layer GGUF (llama.cpp's fixed pattern: layer 5 global) at head_dim 256, where llama.cpp's query
    scale (1/sqrt(head_dim)) and transformers' default (query_pre_attn_scalar 256) agree; window 4."""
    model = build_gemma3(
        num_hidden_layers=6,
        layer_types=None,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_local_base_freq=10000.0,
        rope_theta=1e6,
        final_logit_softcapping=None,
    )
    cfg = dict(model.config.to_dict(), model_type="gemma3", rope_theta=1e6)
    state = {**gguf_state(model), **(extra_tensors or {})}
    return write_gguf(tmp_path / "gemma3.gguf", state, cfg, extra=extra_meta), model


def test_tiny_gemma3_gguf_matches_transformers(tmp_path, record_error):
    file, _ = tiny_gemma3_gguf(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert ref.config.layer_types[5] == FULL_LAYER and ref.config.sliding_window == 4
    target = eagle_jax.load_target(file, dtype="float32")
    assert target.config.architecture == "gemma3" and target.config.layer_types == tuple(ref.config.layer_types)
    # The (1 + w) offset is taken off again, as transformers does: the stored norms are HF's w.
    ours = target.layers[0].post_feedforward_layernorm.weight[...]
    np.testing.assert_array_equal(
        np.asarray(ours), ref.model.layers[0].post_feedforward_layernorm.weight.detach().numpy()
    )
    ids = np.random.default_rng(3).integers(3, VOCAB, (2, 20)).astype(np.int32)
    check_every_layer(target, ref, ids, "cpu", record_error, FP32_TOL, FP32_TOL)


def test_gemma3_gguf_with_a_vision_tower_is_refused(tmp_path):
    file, _ = tiny_gemma3_gguf(tmp_path, extra_tensors={"v.patch_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(CheckpointError, match="'v.patch_embd.weight' belongs to a vision tower"):
        eagle_jax.load_target(file)


def test_gemma3_gguf_with_an_unknown_rope_scaling_is_refused(tmp_path):
    import gguf

    file, _ = tiny_gemma3_gguf(
        tmp_path, extra_meta={"gemma3.rope.scaling.type": ("longrope", gguf.GGUFValueType.STRING)}
    )
    with pytest.raises(CheckpointError, match="gemma3.rope.scaling.type"):
        eagle_jax.load_target(file)


# ------------------------------------------------------------------------------ the real 270M

GEMMA3_270M = model_path("gemma-3-270m")
needs_270m = pytest.mark.skipif(
    not GEMMA3_270M.exists(), reason=f"Gemma 3 270M is not cached ({GEMMA3_270M}): eagle-jax-fetch gemma-3-270m"
)


def long_text() -> str:
    """A long natural text that is the same wherever the tests run: the source of a standard-library
    module. (Not a paragraph repeated: on repeated text the residual streams reach 1e5 and transformers'
    own eager and sdpa attention differ by 2e-5 in the logits, 4e-4 in the streams.)"""
    import argparse
    import inspect

    return inspect.getsource(argparse)


@pytest.fixture(scope="module")
def real():
    """(our float32 target, transformers' float32 load of the same file, tokenizer), loaded once."""
    target = eagle_jax.load_target(GEMMA3_270M, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(
        GEMMA3_270M.parent, gguf_file=GEMMA3_270M.name, dtype=torch.float32
    ).eval()
    return target, ref, eagle_jax.load_tokenizer(GEMMA3_270M)


@needs_270m
@pytest.mark.parametrize("length", [30, 1500])
def test_real_gemma3_270m_every_layer_and_logits(real, length, record_error):
    """Every residual stream at every position, and the logits at positions spread over the prompt (all
    of them for 30 tokens; 48 for 1500, most past the 512 window: the full [1500, 262144] logits would
    take 1.5 GB per side)."""
    target, ref, tok = real
    ids = tok(long_text())["input_ids"][:length]
    assert len(ids) == length and target.config.sliding_window == 512
    keep = (
        np.arange(length)
        if length <= 64
        else np.unique(np.r_[np.linspace(0, length - 1, 40).astype(int), length - 8 + np.arange(8)])
    )
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True, logits_to_keep=torch.tensor(keep))
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    n, h = target.config.num_layers, target.config.hidden_size
    hidden, aux, _ = target.forward(
        jnp.asarray([ids], jnp.int32),
        positions,
        jnp.tril(jnp.ones((1, length, length), bool)),
        aux_layer_ids=tuple(range(n)),
    )
    worst = max(
        record_error(f"hidden_states[{i}]", rel_err(aux[..., i * h : (i + 1) * h], out.hidden_states[i]))
        for i in range(n)
    )
    assert worst <= FP32_TOL
    err = record_error(
        f"logits at {len(keep)} of {length} positions", rel_err(target.logits(hidden[:, keep]), out.logits)
    )
    assert err <= FP32_TOL


@needs_270m
def test_real_gemma3_270m_greedy_equals_transformers_generate(real):
    target, ref, tok = real
    ids = tok("The three most important inventions of the nineteenth century were")["input_ids"]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    got = eagle_jax.generate(target, None, [ids], max_new_tokens=16, tokenizer=tok).tokens[0]
    assert got == want[: len(got)] and len(got) == len(want)
