"""HF target checkpoints (Llama, Mistral, Qwen2, Qwen3, Gemma 3, DeepSeek-V3 / Kimi-K2) <-> ``Target``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from eagle_jax.checkpoint.block_fp8 import DequantizedFP8, block_size
from eagle_jax.checkpoint.expert_layout import StackedExperts, per_expert_tensors
from eagle_jax.checkpoint.formats import is_gguf_file
from eagle_jax.checkpoint.gguf import load_gguf_target
from eagle_jax.checkpoint.hub import resolve_checkpoint
from eagle_jax.checkpoint.models import resolve_model
from eagle_jax.checkpoint.module_fill import export_tensors, fill_module
from eagle_jax.checkpoint.target_keys import DTYPES, resolve_dtype, target_key
from eagle_jax.checkpoint.tensor_files import CheckpointError, TensorSource, write_safetensors
from eagle_jax.config import ConfigError, TargetConfig, read_config_json
from eagle_jax.modeling.moe import FLOAT32_VARIABLES
from eagle_jax.modeling.target import Target


def generation_eos_ids(path: str | Path) -> int | list[int] | None:
    """``eos_token_id`` of a checkpoint's generation_config.json (None when absent)."""
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return None
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{file}: not a valid generation config ({e})") from e
    return eos


def _ignored_target_key(key: str, config: TargetConfig, extra_layers: int) -> bool:
    # Old Llama checkpoints store rotary buffers; tied checkpoints may still store lm_head; DeepSeek-V3
    # stores its multi-token-prediction modules as ``extra_layers`` layers past the decoder.
    if key.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and key == "lm_head.weight"):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and config.num_layers <= int(m[1]) < config.num_layers + extra_layers


def load_target(path: str | Path, dtype=None, *, revision: str | None = None) -> Target:
    """Loads an HF checkpoint into a ``Target``, streaming tensors one at a time.

    path: a checkpoint directory, a Hugging Face Hub repo id (``org/name``) fetched into the HF cache at
    ``revision`` (branch, tag or commit; see ``eagle_jax.checkpoint.hub.resolve_checkpoint``), a GGUF
    file (``eagle_jax.checkpoint.gguf``: dequantized, default dtype float32 unless every weight matrix
    is F16/BF16), or a named model (``eagle_jax.checkpoint.models``, e.g. ``smollm2-135m-instruct``),
    fetched into the cache on first use.
    dtype: None keeps the checkpoint's (config ``torch_dtype``/``dtype``, else the tensors'); or
    "float32"/"bfloat16"/"float16" or a jnp dtype. The EOS ids are generation_config.json's when it
    names them (as HF ``generate`` reads them), else config.json's. Block-quantized FP8 weights
    (``quantization_config`` quant_method fp8) are dequantized into that dtype. On the CPU backend
    bf16/f16 weight matrices are held as float32 with the bf16/f16 values (``layers.weight_matrix``):
    ``target.dtype``, the activations and the caches are still the requested dtype.
    """
    path = resolve_model(path)
    if is_gguf_file(path):
        if revision is not None:
            raise CheckpointError(
                f"revision '{revision}' was given for the GGUF file {path}; revisions apply to Hub repo ids only"
            )
        return load_gguf_target(path, dtype)
    if Path(path).is_file():
        raise CheckpointError(
            f"{path}: is a file but not a GGUF (no 'GGUF' magic); give a checkpoint directory, a Hub repo id or a "
            ".gguf file"
        )
    path = resolve_checkpoint(path, revision=revision)
    raw, where = read_config_json(path)
    config = TargetConfig.from_hf(raw, where)
    eos = generation_eos_ids(path)
    if eos is not None:
        config = config.replace(eos_token_id=eos)
    quantization = raw.get("quantization_config")
    block = None if not quantization else block_size(quantization, where)
    source = TensorSource(path)
    if block is not None:
        source = DequantizedFP8(source, block)
    if config.moe is not None:
        source = StackedExperts(source, config.moe.n_routed_experts)
    dt = resolve_dtype(dtype, config.dtype, source, "model.embed_tokens.weight")
    abstract = nnx.eval_shape(lambda: Target(config, dtype=dt))
    # Some exports drop the "model." prefix of the decoder's keys.
    renamed = {k: "model." + k for k in source.keys() if not k.startswith("model.") and k != "lm_head.weight"}
    extra_layers = int(raw.get("num_nextn_predict_layers") or 0) if config.mla is not None else 0

    def ignored(key: str) -> bool:
        return _ignored_target_key(key, config, extra_layers)

    try:
        return fill_module(abstract, source, target_key, renamed=renamed, ignored=ignored)
    finally:
        source.release()


def save_target(target: Target, path: str | Path, dtype=None) -> None:
    """Writes an HF directory (config.json + model.safetensors) that transformers loads; routed experts
    one tensor per expert, as transformers saves them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = target.config
    out_dtype = target.dtype if dtype is None else resolve_dtype(dtype, None, None, "")
    hf = config.replace(dtype=jnp.dtype(out_dtype).name).to_hf()
    tensors = export_tensors(target, target_key, out_dtype, keep_dtype=lambda p: p[-1] in FLOAT32_VARIABLES)
    write_safetensors(path / "model.safetensors", per_expert_tensors(tensors))
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


__all__ = ["DTYPES", "load_target", "save_target", "CheckpointError", "resolve_dtype", "target_key"]
