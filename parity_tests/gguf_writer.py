"""Small GGUF files for tests, written with ``gguf.GGUFWriter`` as llama.cpp's converter lays them out.

``write_gguf`` takes an HF state dict (torch layout, numpy arrays) and its config dict, renames the
tensors to llama.cpp's names, permutes q/k rows for the llama architecture, and stores every weight
matrix in the requested type: quantized from the values with ``gguf.quants.quantize`` where the gguf
package can write the type, else (the K-quants) as seeded random blocks whose scale fields are set to
small finite values. Norms and biases stay F32, as llama.cpp stores them. ``tokenizer_metadata`` turns a
transformers fast BPE tokenizer into the ``tokenizer.ggml.*`` fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

# byte offsets of the float16 scale fields inside one 256-value block of each K-quant type
K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_key: str) -> str:
    if not hf_key.startswith(("model.", "lm_head")):
        return hf_key  # already a llama.cpp name
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_key in glob:
        return glob[hf_key]
    _, _, i, rest = hf_key.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}"


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation (HF rotate-half -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rows: int, cols: int, qtype: str, seed: int) -> np.ndarray:
    """[rows, bytes per row] of random ``qtype`` blocks whose scales give weights of O(0.01-0.1), as in a trained
    model (Q6_K's int8 sub-scales reach 127, the others 63 or less, hence its smaller block scale)."""
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for off in K_QUANT_SCALES[qtype]:
        low, high = (1e-5, 4e-5) if qtype == "Q6_K" else (5e-5, 2e-4)
        scale = rng.uniform(low, high, blocks.shape[0]).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def _encode(w: np.ndarray, qtype: str, seed: int) -> tuple[np.ndarray, Q | None]:
    if w.ndim < 2 or qtype == "F32":
        return np.ascontiguousarray(w, np.float32), None
    if qtype == "F16":
        return np.ascontiguousarray(w, np.float16), None
    if qtype in K_QUANT_SCALES:
        return random_k_blocks(w.shape[0], w.shape[1], qtype, seed), Q[qtype]
    if qtype not in WRITABLE:  # any other type: random bytes in its block layout (for error tests)
        block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
        rows = np.random.default_rng(seed).integers(0, 256, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
        return rows, Q[qtype]
    return quantize(np.ascontiguousarray(w, np.float32), Q[qtype]), Q[qtype]


def write_gguf(
    path: str | Path,
    state: dict[str, np.ndarray],
    config: dict[str, Any],
    *,
    qtype: str = "F32",
    embed_qtype: str | None = None,
    tensor_qtypes: dict[str, str] | None = None,
    tokenizer: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    """Writes ``state`` (HF keys, torch layout) as a GGUF of ``config["model_type"]``; returns the path.

    ``qtype``: every weight matrix's type; ``embed_qtype`` / ``tensor_qtypes`` (HF key -> type) override
    it for the embedding / single tensors. ``extra``: more metadata, key -> (value, GGUFValueType).
    A tensor named in ``state`` by its llama.cpp name (no "model." prefix, e.g. ``rope_freqs.weight``) is
    written as it is, in F32."""
    arch = config["model_type"]
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_vocab_size(config["vocab_size"])
    w.add_bos_token_id(config.get("bos_token_id", 1))
    w.add_eos_token_id(config.get("eos_token_id", 2))
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    for key, value in (tokenizer or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, int(value))
    for key, value in (extra or {}).items():
        w.add_key_value(key, value[0], value[1])
    for i, (key, value) in enumerate(state.items()):
        value = np.asarray(value, np.float32)
        if arch == "llama" and key.endswith(("q_proj.weight", "q_proj.bias")):
            value = permute_rows(value, config["num_attention_heads"])
        elif arch == "llama" and key.endswith(("k_proj.weight", "k_proj.bias")):
            value = permute_rows(value, config["num_key_value_heads"])
        kind = (tensor_qtypes or {}).get(key) or (
            embed_qtype if (embed_qtype and key == "model.embed_tokens.weight") else qtype
        )
        if kind == "BF16" and value.ndim >= 2:
            data, raw = quantize(value, Q.BF16), Q.BF16
        else:
            data, raw = _encode(value, kind, seed + i)
        w.add_tensor(gguf_name(key), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokenizer_metadata(tokenizer, chat_template: str | None = None) -> dict[str, Any]:
    """``tokenizer.ggml.*`` fields of a byte-level BPE (gpt2-model) fast tokenizer."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    out: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
    }
    if chat_template:
        out["tokenizer.chat_template"] = chat_template
    return out
