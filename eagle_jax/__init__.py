"""eagle_jax: EAGLE-3 / EAGLE-3.1 speculative decoding in JAX and Flax NNX."""

from eagle_jax.checkpoint.eagle_drafter import load_drafter, save_drafter
from eagle_jax.checkpoint.hf_target import load_target, save_target
from eagle_jax.checkpoint.models import fetch_model
from eagle_jax.checkpoint.tensor_files import CheckpointError
from eagle_jax.checkpoint.tokenizer import load_tokenizer
from eagle_jax.config import ConfigError, DrafterConfig, MLAConfig, MoEConfig, RopeConfig, SpecConfig, TargetConfig
from eagle_jax.decoding.calls import GenerationResult
from eagle_jax.generate import generate, generate_stream
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import KVCache, Target

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Drafter",
    "DrafterConfig",
    "KVCache",
    "GenerationResult",
    "MLAConfig",
    "MoEConfig",
    "RopeConfig",
    "SpecConfig",
    "Target",
    "TargetConfig",
    "generate",
    "fetch_model",
    "generate_stream",
    "load_drafter",
    "load_target",
    "load_tokenizer",
    "save_drafter",
    "save_target",
]
