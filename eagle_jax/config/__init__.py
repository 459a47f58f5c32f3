"""Model configurations read from HF ``config.json`` files: frozen dataclasses, validated on load.

``common``: the error type, RoPE and config.json reading; ``target``: targets (the Llama family, Gemma 3,
DeepSeek-V3 / Kimi-K2); ``drafter``: EAGLE-3 / 3.1 drafters and target/drafter pairing; ``spec``:
speculation settings. Everything is importable from ``eagle_jax.config``.
"""

from eagle_jax.config.common import (
    DRAFTER_ROPE_TYPES,
    ROPE_TYPES,
    AuxConvention,
    ConfigError,
    RopeConfig,
    default_aux_layer_ids,
    parse_rope,
    read_config_json,
    validate_aux_layer_ids,
)
from eagle_jax.config.drafter import (
    DRAFTER_OVERRIDES,
    LLAMA_DRAFTER_ARCHITECTURE,
    MLA_DRAFTER_ARCHITECTURES,
    DrafterConfig,
    aux_layer_ids_for,
    check_pair,
    override_drafter_config,
)
from eagle_jax.config.spec import SpecConfig
from eagle_jax.config.target import (
    FULL_LAYER,
    HIDDEN_ACTS,
    SLIDING_LAYER,
    TARGET_ARCHITECTURES,
    TARGET_MODEL_TYPES,
    MLAConfig,
    MoEConfig,
    TargetConfig,
    gemma3_fields,
    gemma3_rope,
)

__all__ = [
    "DRAFTER_OVERRIDES",
    "DRAFTER_ROPE_TYPES",
    "FULL_LAYER",
    "HIDDEN_ACTS",
    "LLAMA_DRAFTER_ARCHITECTURE",
    "MLA_DRAFTER_ARCHITECTURES",
    "ROPE_TYPES",
    "SLIDING_LAYER",
    "TARGET_ARCHITECTURES",
    "TARGET_MODEL_TYPES",
    "AuxConvention",
    "ConfigError",
    "DrafterConfig",
    "MLAConfig",
    "MoEConfig",
    "RopeConfig",
    "SpecConfig",
    "TargetConfig",
    "aux_layer_ids_for",
    "check_pair",
    "default_aux_layer_ids",
    "gemma3_fields",
    "gemma3_rope",
    "override_drafter_config",
    "parse_rope",
    "read_config_json",
    "validate_aux_layer_ids",
]
