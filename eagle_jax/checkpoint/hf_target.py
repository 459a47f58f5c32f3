"""HF target checkpoints (Llama, Mistral, Qwen2, Qwen3) <-> ``Target``."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from eagle_jax.checkpoint.hub import resolve_checkpoint
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


def load_target(path: str | Path, dtype=None, *, revision: str | None = None) -> Target:
    """Loads an HF checkpoint into a ``Target``, streaming tensors one at a time.

    path: a checkpoint directory, or a Hugging Face Hub repo id (``org/name``) fetched into the HF
    cache at ``revision`` (branch, tag or commit; see ``eagle_jax.checkpoint.hub.resolve_checkpoint``).
    dtype: None keeps the checkpoint's (config ``torch_dtype``/``dtype``, else the tensors'); or
    "float32"/"bfloat16"/"float16" or a jnp dtype. The EOS ids are generation_config.json's when it
    names them (as HF ``generate`` reads them), else config.json's.
    """
    path = resolve_checkpoint(path, revision=revision)
    config = TargetConfig.from_pretrained(path)
    eos = generation_eos_ids(path)
    if eos is not None:
        config = config.replace(eos_token_id=eos)
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
