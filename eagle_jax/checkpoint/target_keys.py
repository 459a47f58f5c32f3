"""What every target loader shares (HF directories and GGUF files alike): the dtype a load asks for,
and the HF key of each ``Target`` variable."""

from __future__ import annotations

import jax.numpy as jnp

from eagle_jax.checkpoint.tensor_files import TensorSource
from eagle_jax.config import ConfigError

DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "half": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}


def resolve_dtype(requested, config_dtype: str | None, source: TensorSource | None, probe_key: str):
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


__all__ = ["DTYPES", "resolve_dtype", "target_key"]
