"""HF target checkpoints (Llama, Mistral, Qwen2, Qwen3) <-> ``Target``."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from eagle_jax.checkpoint.module_fill import export_tensors, fill_module
from eagle_jax.checkpoint.tensor_files import CheckpointError, TensorSource, write_safetensors
from eagle_jax.config import ConfigError, TargetConfig
from eagle_jax.modeling.target import Target

DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "half": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}


def resolve_dtype(requested, config_dtype: str | None, source: TensorSource, probe_key: str):
    """The requested dtype, else the config's, else the dtype of the checkpoint's tensor ``probe_key``."""
    if requested is not None:
        if isinstance(requested, str):
            if requested not in DTYPES:
                raise ConfigError(f"dtype '{requested}' is not one of {sorted(DTYPES)}")
            return DTYPES[requested]
        return jnp.dtype(requested).type
    if config_dtype in DTYPES:
        return DTYPES[config_dtype]
    if source is not None and probe_key in source.keys():
        return jnp.dtype(source.get(probe_key).dtype).type
    return jnp.float32


def target_key(path: tuple) -> str:
    """NNX path of a ``Target`` variable -> HF key."""
    if path[0] == "lm_head":
        return "lm_head.weight"
    name = ".".join(str(p) for p in path)
    if path[-1] == "kernel":
        name = name[: -len("kernel")] + "weight"
    if path == ("embed_tokens",):
        name = "embed_tokens.weight"
    return "model." + name


def _ignored_target_key(key: str, config: TargetConfig) -> bool:
    # Old Llama checkpoints store rotary buffers; tied checkpoints may still store lm_head.
    return key.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and key == "lm_head.weight")


def load_target(path: str | Path, dtype=None, *, aux_layer_ids: tuple[int, ...] | None = None) -> Target:
    """Loads an HF checkpoint directory into a ``Target``, streaming tensors one at a time.

    dtype: None keeps the checkpoint's (config ``torch_dtype``/``dtype``, else the tensors'); or
    "float32"/"bfloat16"/"float16" or a jnp dtype. ``aux_layer_ids`` (reference convention: residual
    stream entering layer i) overrides the default (2, L//2, L-3).
    """
    config = TargetConfig.from_pretrained(path)
    if aux_layer_ids is not None:
        config = config.replace(aux_layer_ids=tuple(aux_layer_ids))
    source = TensorSource(path)
    dt = resolve_dtype(dtype, config.dtype, source, "model.embed_tokens.weight")
    abstract = nnx.eval_shape(lambda: Target(config, dtype=dt))
    # Some exports drop the "model." prefix of the decoder's keys.
    renamed = {k: "model." + k for k in source.keys() if not k.startswith("model.") and k != "lm_head.weight"}
    try:
        return fill_module(abstract, source, target_key, dt, renamed=renamed, ignored=lambda k: _ignored_target_key(k, config))
    finally:
        source.release()


def save_target(target: Target, path: str | Path, dtype=None) -> None:
    """Writes an HF directory (config.json + model.safetensors) that transformers loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = target.config
    out_dtype = target.dtype if dtype is None else resolve_dtype(dtype, None, None, "")
    hf = config.replace(dtype=jnp.dtype(out_dtype).name).to_hf()
    write_safetensors(path / "model.safetensors", export_tensors(target, target_key, out_dtype))
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


__all__ = ["load_target", "save_target", "CheckpointError", "resolve_dtype", "target_key"]
