"""GGUF (llama.cpp's file format) -> ``Target``: architectures llama, qwen2, qwen3, gemma3.

llama.cpp writes Llama 2/3.x and Mistral 7B / Mistral-Nemo models alike as architecture ``llama`` (it
keeps no sliding window for them), so those load through ``llama``.

The file is read with the format's own Python reader (``gguf.GGUFReader``: metadata and memory-mapped
tensors) and every tensor is dequantized with ``gguf.quants.dequantize``, as transformers' GGUF load
does. The metadata becomes an HF-style config dict (so ``TargetConfig.from_hf`` validates it like any
config.json) and llama.cpp's tensor names become the HF keys, so the same ``fill_module`` fills the
model: one loader, not two. llama.cpp's converter permutes the rows of q_proj / k_proj for the llama
architecture (rotate-half -> interleaved pairs); ``get`` undoes it.

Every failure names the file and the field or tensor at fault (``CheckpointError``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from eagle_jax.checkpoint.formats import GGUF_MAGIC, check_gguf_header
from eagle_jax.checkpoint.target_keys import resolve_dtype, target_key
from eagle_jax.checkpoint.tensor_files import CheckpointError
from eagle_jax.config import FULL_LAYER, ROPE_TYPES, SLIDING_LAYER, ConfigError, TargetConfig

# general.architecture -> the HF model_type it loads as; llama's q/k rows are permuted in the file.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
PERMUTED_QK = ("llama",)
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (the factor itself); transformers'
# GGUF load subtracts the 1 again, and so does this one (the model adds it back: norm_unit_offset).
NORM_SHIFTED = ("gemma3",)
# The tensor types dequantized here (all tested against transformers' load of the same file).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp tensor name (after "blk.{i}.") -> HF key (after "model.layers.{i}.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's sandwich norms: ffn_norm is the MLP's input norm, the post norms sit on the sublayers' outputs.
_ARCH_LAYER_TENSORS = {
    "gemma3": {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
# Tensor name prefixes of a vision tower (a multimodal file; llama.cpp normally keeps them in an mmproj file).
_VISION_PREFIXES = ("v.", "mm.", "vision")
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Llama 3.1+ files store the llama3 rope scaling as per-frequency divisors; it is read back into the config.
ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(name: str, arch: str = "llama") -> str | None:
    """llama.cpp's name of a tensor of architecture ``arch`` -> the HF key (None for a name this loader
    does not know)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    layer_tensors = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {})}
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}"
    return None


def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map, and with each tensor's type and extent
        checked before the reader slices it.

        The stock reader slices an ``np.memmap`` for every metadata value; each slice of the subclass runs
        ``memmap.__array_finalize__``, which makes a 49k-token vocabulary take seconds. The plain view
        shares the same mapped memory.
        """

        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._mapped = mapped
            self._plain = np.asarray(mapped)

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = self._plain.shape[0]
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise CheckpointError(
                        f"tensor '{name}' has unknown ggml type id {int(raw_type[0])} (field 'type')"
                    ) from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                count = int(np.prod(dims.astype(np.int64)))
                if count % block:
                    raise CheckpointError(
                        f"tensor '{name}' of type {qtype.name} has {count} values, not a multiple of its block of "
                        f"{block}"
                    )
                end = start_offs + int(offset[0]) + count // block * type_size
                if end > size:
                    raise CheckpointError(
                        f"tensor '{name}' ends at byte {end} but the file has {size} bytes: truncated (an interrupted "
                        "download?)"
                    )
            super()._build_tensors(start_offs, fields)

    return Reader


def read_gguf(file: str | os.PathLike):
    """A ``gguf.GGUFReader`` over ``file``, every failure a CheckpointError naming the file."""
    file = Path(file)
    check_gguf_header(file)
    try:
        return _reader_class()(file)
    except CheckpointError as e:
        raise CheckpointError(f"{file}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{file}: the GGUF header (version, metadata or tensor table) is truncated or corrupt: {e}"
        ) from e


class GGUFMetadata:
    """Typed access to a reader's metadata, each missing or mistyped key named in the error."""

    def __init__(self, reader, file: Path):
        self.reader, self.file = reader, file

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.file}: metadata field '{key}' cannot be read ({e})") from e

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.file}: required metadata field '{key}' is missing")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        """An integer field; ``default`` when absent (required when no default is given)."""
        value = self.get(key)
        if value is None:
            if default is None:
                raise CheckpointError(f"{self.file}: required metadata field '{key}' is missing")
            return default
        if isinstance(value, (list, str)):
            raise CheckpointError(f"{self.file}: metadata field '{key}' is {value!r:.60}, expected one integer")
        return int(value)


def _eos_ids(meta: GGUFMetadata) -> int | list[int] | None:
    """EOS plus the end-of-turn / end-of-message ids llama.cpp stores beside it (Llama-3's <|eot_id|>)."""
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def llama3_rope_from_factors(factors: np.ndarray, theta: float, where: str) -> dict[str, Any]:
    """Recovers llama3 rope scaling from llama.cpp's per-frequency divisors (``rope_freqs``).

    Every Llama 3.1 / 3.2 / 3.3 release uses low_freq_factor 1, high_freq_factor 4 and an original
    context of 8192, with ``factor`` the largest divisor; the divisors are recomputed from those and must
    match, else the file is refused rather than run with a rope it does not describe.
    """
    factors = np.asarray(factors, np.float64)
    params = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": theta,
    }
    dim = 2 * factors.shape[0]
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    orig, low, high, factor = 8192, 1.0, 4.0, params["factor"]
    smooth = (orig / wavelen - low) / (high - low)
    want = np.where(
        wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth))
    )
    if not np.allclose(factors, want, rtol=1e-4):
        raise CheckpointError(
            f"{where}: tensor '{ROPE_FREQS}' holds rope frequency factors that are not llama3 scaling with factor "
            f"{factor}, low/high freq factors 1/4 and original context 8192; this rope is not supported"
        )
    return params


def hf_config(reader, file: Path) -> dict[str, Any]:
    """The GGUF metadata as an HF config.json dict."""
    meta = GGUFMetadata(reader, file)
    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{file}: unsupported architecture '{arch}' (metadata field 'general.architecture'); supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{file}: tensor 'token_embd.weight' (the token embedding) is missing")
    hidden = meta.integer(f"{arch}.embedding_length")
    heads = meta.integer(f"{arch}.attention.head_count")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    d: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "intermediate_size": meta.integer(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.integer(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.integer(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.integer(f"{arch}.attention.key_length", hidden // max(heads, 1)),
        "rms_norm_eps": float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": meta.integer(f"{arch}.context_length", 2048),
        "vocab_size": int(embed.shape[1]),  # ggml's ne: (hidden, vocab)
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "rope_theta": theta,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
    }
    value_length = meta.integer(f"{arch}.attention.value_length", d["head_dim"])
    if value_length != d["head_dim"]:
        raise CheckpointError(
            f"{file}: metadata field '{arch}.attention.value_length' = {value_length} differs from key_length "
            f"{d['head_dim']}"
        )
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        d["sliding_window"] = int(window)
        d["use_sliding_window"] = True
    if arch == "gemma3":
        d.update(_gemma3_config(meta, tensors, d, file))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", *ROPE_TYPES):
        raise CheckpointError(
            f"{file}: unsupported rope scaling '{scaling}' (metadata field '{arch}.rope.scaling.type'); supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    if scaling not in (None, "none"):
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise CheckpointError(
                f"{file}: rope scaling '{scaling}' without metadata field '{arch}.rope.scaling.factor'"
            )
        d["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            d["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    if ROPE_FREQS in tensors:
        from gguf.quants import dequantize

        factors = dequantize(tensors[ROPE_FREQS].data, tensors[ROPE_FREQS].tensor_type).reshape(-1)
        d["rope_scaling"] = llama3_rope_from_factors(factors, theta, str(file))
    return d


def _gemma3_config(meta: GGUFMetadata, tensors: dict, d: dict[str, Any], file: Path) -> dict[str, Any]:
    """What a gemma3 file leaves to llama.cpp's (and transformers') fixed Gemma 3 rules: every sixth
    layer global, the sliding layers' rope base 10k, the query scale 1/sqrt(head_dim) (27B, 62 blocks:
    1/sqrt(hidden / heads)). Soft-capping is read where the file has it (the config refuses it for
    attention)."""
    vision = sorted(name for name in tensors if name.startswith(_VISION_PREFIXES))
    if vision:
        raise CheckpointError(
            f"{file}: tensor '{vision[0]}' belongs to a vision tower (a multimodal Gemma 3); only the text model is "
            "supported"
        )
    layers = d["num_hidden_layers"]
    out: dict[str, Any] = {
        "layer_types": [SLIDING_LAYER if (i + 1) % 6 else FULL_LAYER for i in range(layers)],
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": d["hidden_size"] // d["num_attention_heads"] if layers == 62 else d["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = meta.get(f"gemma3.{key}")
        if value is not None:
            out[key] = float(value)
    return out


class GGUFSource:
    """The tensors of a GGUF under their HF keys (the ``TensorSource`` interface ``fill_module`` reads):
    dequantized to float32 (F16 / BF16 kept as they are), q/k rows un-permuted for llama."""

    def __init__(self, reader, file: Path, config: TargetConfig, arch: str):
        self.directory = file  # named in fill_module's errors
        self.file = file
        self._tensors: dict[str, Any] = {}
        self._permute: dict[str, int] = {}
        self._shifted: set[str] = set()
        for t in reader.tensors:
            if t.name == ROPE_FREQS:
                continue  # read into the config's rope scaling
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{file}: tensor '{t.name}' has quantization type {t.tensor_type.name}, which is not supported "
                    f"(field 'type'; supported: {', '.join(SUPPORTED_TYPES)})"
                )
            key = hf_tensor_name(t.name, arch) or t.name  # an unknown name is reported by fill_module as unexpected
            self._tensors[key] = t
            if arch in NORM_SHIFTED and t.name.endswith("norm.weight"):
                self._shifted.add(key)
            kind = t.name.split(".")[-2] if t.name.count(".") >= 1 else ""
            if arch in PERMUTED_QK and kind in ("attn_q", "attn_k"):
                self._permute[key] = config.num_heads if kind == "attn_q" else config.num_kv_heads

    def keys(self) -> list[str]:
        return list(self._tensors)

    def file_of(self, key: str) -> Path:
        return self.file

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[key].shape.tolist()))

    def get(self, key: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._tensors[key]
        name = t.tensor_type.name
        if name == "F32":
            arr = np.asarray(t.data, np.float32)
        elif name == "F16":
            arr = np.asarray(t.data).view(np.float16)
        elif name == "BF16":
            import ml_dtypes

            arr = np.asarray(t.data).view(np.uint8).view(ml_dtypes.bfloat16)
        else:
            arr = dequantize(t.data, t.tensor_type)
        arr = arr.reshape(self.shape(key))
        if key in self._permute:
            arr = unpermute_rows(arr, self._permute[key])
        if key in self._shifted:
            arr = arr.astype(np.float32) - np.float32(1.0)
        return arr

    def release(self) -> None:
        self._tensors.clear()


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation ``w.reshape(n, 2, r//n//2, ...).swapaxes(1, 2)``: back to
    HF's rotate-half layout. Works on a weight [rows, cols] and on a bias [rows]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _default_dtype(reader) -> str:
    """float16 / bfloat16 when every weight matrix is stored so, else float32 (what quantized weights
    dequantize to, and transformers' default for a GGUF)."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(frozenset(kinds), "float32")


def gguf_target_config(path: str | os.PathLike) -> TargetConfig:
    """The ``TargetConfig`` a GGUF describes (its metadata only; no tensor is dequantized)."""
    file = Path(path)
    reader = read_gguf(file)
    return _config(reader, file)


def _config(reader, file: Path) -> TargetConfig:
    d = hf_config(reader, file)
    try:
        return TargetConfig.from_hf(d, f"{file} (GGUF metadata)")
    except ConfigError as e:
        raise CheckpointError(str(e)) from e


def load_gguf_target(path: str | os.PathLike, dtype=None):
    """A ``Target`` from a GGUF file (``eagle_jax.load_target`` dispatches here for .gguf files)."""
    from flax import nnx

    from eagle_jax.checkpoint.module_fill import fill_module
    from eagle_jax.modeling.target import Target

    file = Path(path)
    reader = read_gguf(file)
    config = _config(reader, file)
    arch = GGUFMetadata(reader, file).require("general.architecture")
    dt = resolve_dtype(dtype if dtype is not None else _default_dtype(reader), None, None, "")
    config = config.replace(dtype=np.dtype(dt).name)
    source = GGUFSource(reader, file, config, arch)
    abstract = nnx.eval_shape(lambda: Target(config, dtype=dt))
    ignored = (lambda key: key == "lm_head.weight") if config.tie_word_embeddings else (lambda key: False)
    try:
        return fill_module(abstract, source, target_key, ignored=ignored)
    finally:
        source.release()


__all__ = [
    "ARCHITECTURES",
    "GGUF_MAGIC",
    "SUPPORTED_TYPES",
    "check_gguf_header",
    "gguf_target_config",
    "hf_tensor_name",
    "load_gguf_target",
    "read_gguf",
    "unpermute_rows",
]
