"""GGUF import without PyTorch: a Target written to a GGUF (``parity_tests.gguf_writer``) loads back to the
same logits; its metadata becomes the config (EOS with end-of-turn, llama3 rope from ``rope_freqs``); its
tokenizer loads from the file; every malformed or unsupported file is a CheckpointError naming the file
and the field or tensor. (Parity against transformers' own GGUF load: parity_tests/test_gguf_parity.py.)"""

from __future__ import annotations

import math

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle_jax
from eagle_jax import CheckpointError, Target, TargetConfig
from eagle_jax.checkpoint.gguf import gguf_target_config
from eagle_jax.checkpoint.hf_target import target_key
from eagle_jax.checkpoint.module_fill import export_tensors
from eagle_jax.config import RopeConfig
from parity_tests.gguf_writer import tokenizer_metadata, write_gguf

CFG = TargetConfig(
    "llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)


def hf_dict(config: TargetConfig) -> dict:
    d = config.to_hf()
    d["rope_theta"] = config.rope.theta
    return d


def write(tmp_path, config: TargetConfig = CFG, name: str = "m.gguf", **kw):
    target = Target(config)
    state = dict(export_tensors(target, target_key))
    state.update(kw.pop("tensors", {}))
    return target, write_gguf(tmp_path / name, state, hf_dict(config), **kw)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    return write(tmp_path_factory.mktemp("gguf"))


def test_round_trip_same_logits_and_config(llama_file):
    target, file = llama_file
    loaded = eagle_jax.load_target(file)
    c = loaded.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        "llama",
        2,
        4,
        2,
        16,
        96,
    )
    assert (c.bos_token_id, c.eos_token_id, c.tie_word_embeddings, c.rope.theta, c.dtype) == (
        1,
        2,
        False,
        CFG.rope.theta,
        "float32",
    )
    assert c.max_position_embeddings == 128 and abs(c.rms_norm_eps - 1e-5) < 1e-9
    np.testing.assert_allclose(np.asarray(loaded(IDS)[0]), np.asarray(target(IDS)[0]), rtol=1e-6, atol=1e-6)
    assert gguf_target_config(file) == c.replace(dtype=None)
    bf16 = eagle_jax.load_target(file, dtype="bfloat16")
    assert bf16.dtype == jnp.bfloat16


def test_tied_embeddings_and_end_of_turn_ids(tmp_path):
    extra = {"tokenizer.ggml.eot_token_id": (7, gguf.GGUFValueType.UINT32)}
    target, file = write(tmp_path, CFG.replace(tie_word_embeddings=True), extra=extra)
    loaded = eagle_jax.load_target(file)
    assert loaded.config.tie_word_embeddings and loaded.config.eos_token_id == (2, 7)
    np.testing.assert_allclose(np.asarray(loaded(IDS)[0]), np.asarray(target(IDS)[0]), rtol=1e-6, atol=1e-6)


def llama3_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """llama.cpp's converter's ``rope_freqs`` for llama3 scaling (low 1, high 4, original context 8192)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / 3
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_llama3_rope_read_from_rope_freqs(tmp_path):
    rope = RopeConfig(
        theta=500000.0,
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    config = CFG.replace(rope=rope, max_position_embeddings=131072)
    plain = CFG.replace(rope=RopeConfig(theta=500000.0), max_position_embeddings=131072)  # what the metadata alone says
    target, file = write(tmp_path, plain, tensors={"rope_freqs.weight": llama3_factors(16, 500000.0, 8.0)})
    loaded = eagle_jax.load_target(file)
    assert loaded.config.rope == rope
    graphdef, _ = nnx.split(Target(config))
    want = nnx.merge(graphdef, nnx.state(target))  # the written weights under the llama3 rope
    np.testing.assert_allclose(np.asarray(loaded(IDS)[0]), np.asarray(want(IDS)[0]), rtol=1e-6, atol=1e-6)
    bad = llama3_factors(16, 500000.0, 8.0)
    bad[3] *= 1.5
    _, file = write(tmp_path, plain, name="bad.gguf", tensors={"rope_freqs.weight": bad})
    with pytest.raises(CheckpointError, match=r"bad\.gguf.*rope_freqs\.weight"):
        eagle_jax.load_target(file)


# ------------------------------------------------------------------------------------------- errors


def test_bad_magic_and_not_a_gguf(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"x\.gguf: bad magic .*'magic'"):
        eagle_jax.load_target(f)
    with pytest.raises(CheckpointError, match=r"x\.gguf: bad magic"):
        eagle_jax.load_tokenizer(f)
    with pytest.raises(CheckpointError, match="revision"):
        eagle_jax.load_target(f, revision="main")
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x80\x81 not json, not GGUF")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: is a file but not a GGUF"):
        eagle_jax.load_target(other)


def test_truncated_file_names_the_tensor_or_the_header(llama_file, tmp_path):
    _, file = llama_file
    raw = file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(
        CheckpointError, match=r"cut\.gguf: tensor '[\w.]+' ends at byte \d+ but the file has \d+ bytes: truncated"
    ):
        eagle_jax.load_target(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(raw[:200])
    with pytest.raises(CheckpointError, match=r"head\.gguf: the GGUF header .* truncated or corrupt"):
        eagle_jax.load_target(head)


def test_unknown_architecture(tmp_path):
    target = Target(CFG)
    state = dict(export_tensors(target, target_key))
    file = write_gguf(tmp_path / "falcon.gguf", state, {**hf_dict(CFG), "model_type": "falcon"})
    with pytest.raises(
        CheckpointError,
        match=r"falcon\.gguf: unsupported architecture 'falcon' \(metadata field 'general.architecture'\)",
    ):
        eagle_jax.load_target(file)


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    _, file = write(tmp_path, tensor_qtypes={"model.layers.1.mlp.up_proj.weight": "IQ4_NL"})
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor 'blk\.1\.ffn_up\.weight' has quantization type IQ4_NL"):
        eagle_jax.load_target(file)


def test_unknown_tensor_and_missing_metadata(tmp_path):
    _, file = write(tmp_path, tensors={"blk.0.attn_sinks.weight": np.ones(4, np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['blk\.0\.attn_sinks\.weight'\]"):
        eagle_jax.load_target(file)
    raw = (tmp_path / "m.gguf").read_bytes()
    key = b"llama.attention.layer_norm_rms_epsilon"
    (tmp_path / "noeps.gguf").write_bytes(raw.replace(key, b"llama.attention.layer_norm_rms_epsiloX"))
    with pytest.raises(
        CheckpointError,
        match=r"noeps\.gguf: required metadata field 'llama\.attention\.layer_norm_rms_epsilon' is missing",
    ):
        eagle_jax.load_target(tmp_path / "noeps.gguf")


# ---------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory):
    """A GGUF with a tokenizer and chat template in its metadata: (source tokenizer, file)."""
    from transformers import AutoTokenizer

    from workshop.tokenizer_build import CHAT_TEMPLATE, train_tokenizer

    tmp = tmp_path_factory.mktemp("chat_gguf")
    train_tokenizer(
        ["def add(a, b):\n    return a + b\n" * 20, "Hello there, how are you?\n" * 20],
        vocab_size=300,
        out_dir=tmp / "tok",
    )
    source = AutoTokenizer.from_pretrained(tmp / "tok")
    meta = tokenizer_metadata(source, CHAT_TEMPLATE)
    meta.update(
        {"tokenizer.ggml.bos_token_id": source.bos_token_id, "tokenizer.ggml.padding_token_id": source.pad_token_id}
    )
    config = CFG.replace(vocab_size=len(source), bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id)
    target = Target(config)
    target.lm_head.kernel.set_value(target.lm_head.kernel[...] * 8.0)  # peaked: varied, decisive greedy replies
    file = write_gguf(tmp / "chat.gguf", dict(export_tensors(target, target_key)), hf_dict(config), tokenizer=meta)
    return source, file


def test_tokenizer_and_chat_template_from_the_file(chat_gguf, tmp_path, monkeypatch):
    from workshop.tokenizer_build import CHAT_TEMPLATE

    source, file = chat_gguf
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "cache"))
    for _ in range(2):  # converted, then read back from the cache
        tok = eagle_jax.load_tokenizer(file)
        for text in ("def add(a, b):\n    return a + b", "Hello there! <|end|>", "  spaces\tand\nnewlines"):
            assert tok.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False)
        assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token_id == source.eos_token_id
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        assert tok.apply_chat_template(chat, tokenize=False) == source.apply_chat_template(chat, tokenize=False)
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1


def test_serves_a_gguf_target_with_its_own_tokenizer(chat_gguf, tmp_path, monkeypatch):
    """``build_service`` on a .gguf alone: served under the file's stem, chat rendered with the file's
    template, greedy reply equal to ``generate`` on the same file."""
    import openai

    from eagle_jax.serving.server import Server, build_service

    source, file = chat_gguf
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "cache"))
    service = build_service(file, None, slots=1, max_len=64, rounds_per_step=2, precompile=False)
    server = Server(service).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["chat"]
        chat = [{"role": "user", "content": "def add"}]
        reply = client.chat.completions.create(model="chat", messages=chat, max_tokens=8, temperature=0)
    finally:
        server.stop()
    ids = source.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    want = eagle_jax.generate(eagle_jax.load_target(file), None, [list(ids)], max_new_tokens=8, tokenizer=source)
    assert len(want.tokens[0]) > 0 and want.text[0].strip()
    assert reply.choices[0].message.content == want.text[0] and reply.usage.prompt_tokens == len(ids)
