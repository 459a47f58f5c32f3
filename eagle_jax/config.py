"""Model configurations read from HF ``config.json`` files: frozen dataclasses, validated on load.

Both config dialects are read: transformers >= 5 (``rope_parameters``, ``dtype``) and transformers 4 /
most published checkpoints (top-level ``rope_theta``, ``rope_scaling`` with ``rope_type`` or ``type``,
``torch_dtype``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

AuxConvention = Literal["input", "output"]


class ConfigError(ValueError):
    """A config.json field is missing, inconsistent or unsupported."""


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Llama-layout drafters only ever use these (SPEC 3); targets and MLA drafters use all of ROPE_TYPES.
DRAFTER_ROPE_TYPES = ("default", "linear", "dynamic")

LLAMA_DRAFTER_ARCHITECTURE = "LlamaForCausalLMEagle3"
# EAGLE-3 drafters whose decoder layer is DeepSeek multi-head latent attention. vLLM registers the first
# two (deepseek_eagle3), SGLang the first two as well; SpecForge's MLA branch writes the third; the
# fourth is an older SGLang-style name. vLLM wraps a bare DeepseekV{2,3}ForCausalLM draft config as
# Eagle3DeepseekV{2,3}ForCausalLM, so those name it too. The first is what save_drafter writes: the
# published Kimi-K2.x MLA drafters (TorchSpec exports) carry it.
MLA_DRAFTER_ARCHITECTURES = (
    "Eagle3DeepseekV2ForCausalLM",
    "Eagle3DeepseekV3ForCausalLM",
    "DeepseekV3ForCausalLMEagle3",
    "DeepseekV2ForCausalLMEagle3",
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
)
_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")

TARGET_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma3ForCausalLM": "gemma3",
}
# Kimi-K2 is the DeepSeek-V3 architecture under its own model_type.
TARGET_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "gemma3_text": "gemma3",
}
# MLP gate activations, by their HF names.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
# Gemma 3 layer kinds (HF ``layer_types``): sliding layers see the last ``sliding_window`` positions.
SLIDING_LAYER, FULL_LAYER = "sliding_attention", "full_attention"
# The multimodal Gemma 3 (vision tower + text model); only the text model Gemma3ForCausalLM is a target.
_GEMMA3_MULTIMODAL = ("Gemma3ForConditionalGeneration", "gemma3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: theta plus an optional scaling rule (HF ``rope_type`` names)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3 / yarn / dynamic: the context the model was pretrained on
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def to_hf(self) -> dict[str, Any] | None:
        """The ``rope_scaling`` dict of the transformers-4 dialect (None for plain RoPE)."""
        if self.type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.type, "factor": self.factor}
        if self.type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        if self.type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow)
            for k in ("attention_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings"):
                if getattr(self, k) is not None:
                    out[k] = getattr(self, k)
        if self.type == "dynamic" and self.original_max_position_embeddings is not None:
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out


def read_config_json(path: str | Path) -> tuple[dict[str, Any], str]:
    """Reads ``config.json`` from a directory (or the file itself); returns (dict, file name)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: no config.json found")
    try:
        return json.loads(file.read_text()), str(file)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from e


def _require(d: dict[str, Any], key: str, source: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{source}: required field '{key}' is missing")
    return d[key]


def parse_rope(d: dict[str, Any], source: str, allowed: tuple[str, ...], default_theta: float) -> RopeConfig:
    """Reads RoPE from either dialect: ``rope_parameters`` (v5) or ``rope_theta`` + ``rope_scaling`` (v4)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{source}: 'rope_parameters' / 'rope_scaling' must be objects")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", default_theta))
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype not in allowed:
        raise ConfigError(
            f"{source}: unsupported rope type '{rtype}' (field rope_scaling/rope_parameters.rope_type); "
            f"supported here: {', '.join(allowed)}"
        )
    if rtype != "default" and "factor" not in merged:
        raise ConfigError(f"{source}: rope type '{rtype}' needs 'factor' in rope_scaling/rope_parameters")
    orig = merged.get("original_max_position_embeddings")
    if rtype == "llama3" and orig is None:
        raise ConfigError(f"{source}: llama3 rope scaling needs 'original_max_position_embeddings'")
    if rtype in ("yarn", "dynamic") and orig is None:
        orig = d.get("max_position_embeddings") or 2048  # HF LlamaConfig's default
    return RopeConfig(
        theta=float(theta),
        type=rtype,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if orig is None else int(orig),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        attention_factor=merged.get("attention_factor"),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        truncate=bool(merged.get("truncate", True)),
    )


def _dtype_name(d: dict[str, Any]) -> str | None:
    dt = d.get("dtype", d.get("torch_dtype"))
    return str(dt).replace("torch.", "") if dt is not None else None


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Reference convention (residual stream ENTERING layer i): low, middle, high."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) < 3 or min(ids) < 0:
        # (2, L//2, L-3) collides for shallow (test-sized) models: spread distinct ids over the depth.
        ids = tuple(sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1}))
    return tuple(sorted(ids))


def validate_aux_layer_ids(ids: tuple[int, ...], num_layers: int, source: str) -> tuple[int, ...]:
    """Aux ids in the reference ('input') convention must be distinct and in [0, num_layers)."""
    ids = tuple(int(i) for i in ids)
    if len(ids) == 0:
        raise ConfigError(f"{source}: aux hidden-state layer ids are empty")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{source}: duplicated aux hidden-state layer ids {list(ids)}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"{source}: aux hidden-state layer ids {bad} out of range for a target with {num_layers} layers "
            f"(valid: 0..{num_layers - 1}, residual stream entering that layer)"
        )
    return tuple(sorted(ids))


# DeepseekV3Config's defaults for the routing fields a config.json may omit (transformers reads them so).
_DEEPSEEK_DEFAULTS = {
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "rope_interleave": True,
}


def _positive(obj: Any, names: tuple[str, ...], what: str, minimum: int = 1) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{what}: field '{name}'={value!r} must be an integer >= {minimum}")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), in HF's field names.

    Keys and values of every head are decoded from one per-token latent of ``kv_lora_rank`` numbers
    plus one rope key of ``qk_rope_head_dim`` shared by all heads; query heads are
    ``qk_nope_head_dim + qk_rope_head_dim`` wide, value heads ``v_head_dim``.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a direct q_proj instead of q_a_proj -> norm -> q_b_proj
    rope_interleave: bool = True  # the rope dims are stored in interleaved pairs (x0, x1), (x2, x3), ...

    def __post_init__(self) -> None:
        what = "MLA config"
        _positive(self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), what)
        if self.q_lora_rank is not None:
            _positive(self, ("q_lora_rank",), what)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{what}: field 'qk_rope_head_dim'={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str) -> "MLAConfig":
        if "q_lora_rank" not in d:
            raise ConfigError(f"{source}: required field 'q_lora_rank' is missing (null for a direct q_proj)")
        q_rank = d["q_lora_rank"]
        return cls(
            kv_lora_rank=int(_require(d, "kv_lora_rank", source)),
            qk_nope_head_dim=int(_require(d, "qk_nope_head_dim", source)),
            qk_rope_head_dim=int(_require(d, "qk_rope_head_dim", source)),
            v_head_dim=int(_require(d, "v_head_dim", source)),
            q_lora_rank=None if q_rank is None else int(q_rank),
            rope_interleave=bool(d.get("rope_interleave", _DEEPSEEK_DEFAULTS["rope_interleave"])),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_interleave": self.rope_interleave,
        }


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with shared experts and group-limited sigmoid routing (DeepSeek-V3, Kimi-K2), in
    HF's field names.

    Routing: sigmoid scores; ``e_score_correction_bias`` is added for the choice only. Experts fall in
    ``n_group`` groups, each scored by the sum of its top-2 biased scores; the best ``topk_group``
    groups are kept and the top ``num_experts_per_tok`` of their experts chosen. The chosen unbiased
    scores are the weights (normalised to sum 1 when ``norm_topk_prob``), times
    ``routed_scaling_factor``. ``n_shared_experts`` add one dense MLP of
    ``moe_intermediate_size * n_shared_experts`` that every token passes. The first
    ``first_k_dense_replace`` layers have a dense MLP of the target's ``intermediate_size`` instead.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0

    def __post_init__(self) -> None:
        what = "MoE config"
        _positive(self, ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"), what)
        _positive(self, ("n_shared_experts", "first_k_dense_replace"), what, minimum=0)
        e, g = self.n_routed_experts, self.n_group
        if e % g:
            raise ConfigError(f"{what}: n_routed_experts={e} is not a multiple of n_group={g}")
        if e // g < 2:
            raise ConfigError(
                f"{what}: n_routed_experts / n_group = {e // g}; groups are scored by their top-2 experts, so each needs >= 2"
            )
        if self.topk_group > g:
            raise ConfigError(f"{what}: topk_group={self.topk_group} is larger than n_group={g}")
        if self.num_experts_per_tok > self.topk_group * (e // g):
            raise ConfigError(
                f"{what}: num_experts_per_tok={self.num_experts_per_tok} exceeds the {self.topk_group * (e // g)} experts "
                f"of the topk_group={self.topk_group} groups a token may use"
            )

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str) -> "MoEConfig":
        scoring = d.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"{source}: unsupported scoring_func '{scoring}' (only sigmoid, as DeepSeek-V3)")
        method = d.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ConfigError(f"{source}: unsupported topk_method '{method}' (only noaux_tc, as DeepSeek-V3)")
        if d.get("moe_layer_freq", 1) != 1:
            raise ConfigError(
                f"{source}: moe_layer_freq={d['moe_layer_freq']} is not supported (only 1: every layer past first_k_dense_replace)"
            )

        def get(key: str) -> Any:
            value = d.get(key)
            return _DEEPSEEK_DEFAULTS[key] if value is None else value

        return cls(
            n_routed_experts=int(_require(d, "n_routed_experts", source)),
            num_experts_per_tok=int(_require(d, "num_experts_per_tok", source)),
            moe_intermediate_size=int(_require(d, "moe_intermediate_size", source)),
            n_shared_experts=int(get("n_shared_experts")),
            n_group=int(get("n_group")),
            topk_group=int(get("topk_group")),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            first_k_dense_replace=int(get("first_k_dense_replace")),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_shared_experts": self.n_shared_experts,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
        }

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


def gemma3_rope(d: dict[str, Any], source: str) -> tuple[RopeConfig, RopeConfig]:
    """(global, sliding) RoPE of a Gemma 3 config, from either dialect: ``rope_parameters`` keyed by
    layer kind (v5), or ``rope_theta`` + ``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` for the sliding ones (v4). Defaults as Gemma3TextConfig: 1e6 and 1e4."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and (FULL_LAYER in params or SLIDING_LAYER in params):
        def kind(name: str, theta: float) -> RopeConfig:
            sub = params.get(name) or {}
            return parse_rope({"rope_parameters": sub, "max_position_embeddings": d.get("max_position_embeddings")},
                              f"{source} (rope_parameters.{name})", ROPE_TYPES, theta)

        return kind(FULL_LAYER, 1e6), kind(SLIDING_LAYER, 1e4)
    local = d.get("rope_local_base_freq")
    return parse_rope(d, source, ROPE_TYPES, 1e6), RopeConfig(theta=float(1e4 if local is None else local))


def gemma3_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The Gemma 3 fields of a ``gemma3_text`` config (TargetConfig names), with Gemma3TextConfig's
    defaults; a variant this engine cannot run is refused naming its field."""
    for key in ("attn_logit_softcapping",):
        if d.get(key) is not None:
            raise ConfigError(f"{source}: field '{key}'={d[key]} (attention logit soft-capping) is not supported")
    if d.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: field 'use_bidirectional_attention'=true is not supported (decoding is causal)")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{source}: unsupported field 'hidden_activation'='{act}' for Gemma 3 (only gelu_pytorch_tanh)")
    layers = int(_require(d, "num_hidden_layers", source))
    types = d.get("layer_types")
    if types is None:  # Gemma3TextConfig: every ``sliding_window_pattern``-th layer is global
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        types = [SLIDING_LAYER if (i + 1) % pattern else FULL_LAYER for i in range(layers)]
    rope, local = gemma3_rope(d, source)
    window = d.get("sliding_window", 4096)
    cap = d.get("final_logit_softcapping")
    return dict(
        rope=rope,
        local_rope=local,
        sliding_window=None if window is None else int(window),
        layer_types=tuple(types),
        norm_unit_offset=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=None if cap is None else float(cap),
        qk_norm=True,
    )


@dataclass(frozen=True)
class TargetConfig:
    """A decoder-only target: the Llama family (Llama 3.x, Mistral, Qwen2, Qwen3), Gemma 3 (text) or
    DeepSeek-V3 / Kimi-K2 (``mla`` and ``moe`` set).

    Gemma 3 is the Llama layout with the fields from ``layer_types`` to ``final_logit_softcapping``
    set: per-layer windows and rope bases, (1 + w) norms around both sublayers, a scaled embedding,
    gelu-tanh gating and its own query scale.

    For DeepSeek-V3, ``num_kv_heads`` equals ``num_heads`` (every head decodes its own key and value from
    the shared latent), ``head_dim`` is the query/key head width ``qk_nope_head_dim + qk_rope_head_dim``
    (RoPE covers only the last ``qk_rope_head_dim`` of it: ``rope_dim``) and ``intermediate_size`` is
    the dense MLP of the first ``moe.first_k_dense_replace`` layers.
    """

    architecture: str  # llama | mistral | qwen2 | qwen3 | deepseek_v3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: every layer; Gemma 3: the layers ``layer_types`` calls sliding
    # Per-layer attention kinds (HF ``layer_types``, SLIDING_LAYER / FULL_LAYER); None: every layer alike.
    layer_types: tuple[str, ...] | None = None
    local_rope: RopeConfig | None = None  # RoPE of the sliding layers, when it differs from ``rope`` (Gemma 3: base 10k)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32 before the cast back (Gemma)
    sandwich_norms: bool = False  # norms on both sublayers' outputs too, before the residual adds (Gemma)
    scale_embeddings: bool = False  # the embedding times sqrt(hidden_size), in the embedding's dtype (Gemma)
    hidden_act: str = "silu"  # the MLP gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    query_pre_attn_scalar: float | None = None  # attention scores over sqrt(this) instead of sqrt(head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # generation_config.json's when it names them
    mla: MLAConfig | None = None  # multi-head latent attention instead of GQA
    moe: MoEConfig | None = None  # routed experts instead of the dense MLP (past moe.first_k_dense_replace)

    def __post_init__(self) -> None:
        source = f"{self.architecture} target config"
        if isinstance(self.eos_token_id, (list, tuple)):  # hashable: the config is part of compiled programs
            object.__setattr__(self, "eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.mla is not None:
            if self.num_kv_heads != self.num_heads:
                raise ConfigError(f"{source}: with MLA num_kv_heads={self.num_kv_heads} must equal num_heads={self.num_heads}")
            if self.head_dim != self.mla.qk_head_dim:
                raise ConfigError(
                    f"{source}: with MLA head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = {self.mla.qk_head_dim}"
                )
            unsupported = [k for k in ("qk_norm", "sliding_window") if getattr(self, k)]
            if unsupported:
                raise ConfigError(f"{source}: {unsupported} are not supported with MLA")
        if (self.mla is None) != (self.moe is None) or (self.architecture == "deepseek_v3") != (self.mla is not None):
            raise ConfigError(f"{source}: architecture deepseek_v3 has both 'mla' and 'moe' set, the other families neither")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"{source}: unsupported hidden activation '{self.hidden_act}' (supported: {', '.join(HIDDEN_ACTS)})")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = sorted(set(self.layer_types) - {SLIDING_LAYER, FULL_LAYER})
            if len(self.layer_types) != self.num_layers or bad:
                raise ConfigError(
                    f"{source}: field 'layer_types' must name {self.num_layers} layers, each '{SLIDING_LAYER}' or "
                    f"'{FULL_LAYER}'; got {len(self.layer_types)}{f' with unknown kinds {bad}' if bad else ''}"
                )
            if SLIDING_LAYER in self.layer_types and self.sliding_window is None:
                raise ConfigError(f"{source}: 'layer_types' has sliding layers but field 'sliding_window' is not set")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"{source}: field 'sliding_window'={self.sliding_window} must be >= 1")

    def layer_window(self, index: int) -> int | None:
        """How many positions back (itself included) layer ``index`` attends; None: all of them."""
        if self.layer_types is not None and self.layer_types[index] == FULL_LAYER:
            return None
        return self.sliding_window

    def layer_rope(self, index: int) -> RopeConfig:
        """The rotary embedding of layer ``index`` (sliding layers may have their own)."""
        if self.local_rope is not None and self.layer_window(index) is not None:
            return self.local_rope
        return self.rope

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of a query/key head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> "TargetConfig":
        archs = d.get("architectures") or []
        if any(a in _GEMMA3_MULTIMODAL for a in [*archs, d.get("model_type")]) or "vision_config" in d:
            raise ConfigError(
                f"{source}: a multimodal Gemma 3 checkpoint (field 'architectures'/'model_type' {archs or d.get('model_type')!r}, "
                f"'vision_config'): its vision tower is not supported; only the text model (Gemma3ForCausalLM, "
                f"model_type gemma3_text) is a target"
            )
        arch = next((TARGET_ARCHITECTURES[a] for a in archs if a in TARGET_ARCHITECTURES), None)
        if arch is None:
            arch = TARGET_MODEL_TYPES.get(d.get("model_type", ""))
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or d.get('model_type')!r} "
                f"(field 'architectures'/'model_type'); supported: {', '.join(TARGET_ARCHITECTURES)}"
            )
        hidden = int(_require(d, "hidden_size", source))
        heads = int(_require(d, "num_attention_heads", source))
        gemma = gemma3_fields(d, source) if arch == "gemma3" else {}
        act = d.get("hidden_act", "silu")
        if arch != "gemma3" and act not in ("silu", "swish"):
            raise ConfigError(f"{source}: unsupported hidden_act '{act}' (only silu)")
        if d.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        sliding = None
        if arch == "mistral" or d.get("use_sliding_window"):
            sliding = d.get("sliding_window")
        default_bias = arch == "qwen2"
        mla = moe = None
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        rope = gemma.pop("rope") if gemma else parse_rope(d, source, ROPE_TYPES, 10000.0)
        qk_norm = bool(gemma.pop("qk_norm", arch == "qwen3"))
        if gemma:
            sliding = gemma.pop("sliding_window")
            head_dim = int(d.get("head_dim") or 256)  # Gemma3TextConfig's default
        if arch == "deepseek_v3":
            try:
                mla, moe = MLAConfig.from_hf(d, source), MoEConfig.from_hf(d, source)
            except ConfigError as e:
                raise ConfigError(str(e).replace("MLA config", source, 1).replace("MoE config", source, 1)) from None
            # Every query head decodes its own key and value from the shared latent. (HF's config calls
            # the rope width head_dim; here head_dim is the query/key head width.)
            kv_heads, head_dim = heads, mla.qk_head_dim
        return cls(
            architecture=arch,
            vocab_size=int(_require(d, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_require(d, "intermediate_size", source)),
            num_layers=int(_require(d, "num_hidden_layers", source)),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(d.get("max_position_embeddings", 131072 if gemma else 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", bool(gemma))),
            attention_bias=bool(d.get("attention_bias", default_bias)),
            qk_norm=qk_norm,
            sliding_window=None if sliding is None else int(sliding),
            dtype=_dtype_name(d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            mla=mla,
            moe=moe,
            **gemma,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "TargetConfig":
        d, source = read_config_json(path)
        return cls.from_hf(d, source)

    def to_hf(self) -> dict[str, Any]:
        """config.json in the transformers-4 dialect, which transformers 4 and 5 both read."""
        arch_name = {v: k for k, v in TARGET_ARCHITECTURES.items()}[self.architecture]
        out: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": self.rope.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        if self.sliding_window is not None and self.architecture != "gemma3":
            out["sliding_window"] = self.sliding_window
            if self.architecture != "mistral":
                out["use_sliding_window"] = True
        if self.architecture == "gemma3":
            out.update(self._gemma3_hf())
        if self.mla is not None:
            del out["head_dim"]  # transformers derives it (the rope width) from qk_rope_head_dim
            out.update(self.mla.to_hf())
            out.update(self.moe.to_hf())
            out["num_nextn_predict_layers"] = 0  # multi-token-prediction layers are not kept
        if self.dtype:
            out["torch_dtype"] = self.dtype
        return out

    def _gemma3_hf(self) -> dict[str, Any]:
        """The Gemma3TextConfig fields (v4 dialect: the sliding layers' rope as ``rope_local_base_freq``)."""
        local = self.local_rope or self.rope
        if local.type != "default":
            raise ConfigError(f"gemma3 target config: a '{local.type}' rope on the sliding layers has no transformers-4 field")
        return {
            "model_type": "gemma3_text",
            "hidden_activation": self.hidden_act,
            "hidden_act": self.hidden_act,
            "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar),  # transformers' field is an int
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types) if self.layer_types else None,
            "rope_local_base_freq": local.theta,
            "final_logit_softcapping": self.final_logit_softcapping,
            "attn_logit_softcapping": None,
        }

    def replace(self, **kw: Any) -> "TargetConfig":
        return dataclasses.replace(self, **kw)


def _aux_ids_field(d: dict[str, Any]) -> list[int] | None:
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(d.get("eagle_config"), dict):
        ids = d["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


@dataclass(frozen=True)
class DrafterConfig:
    """An EAGLE-3 / EAGLE-3.1 drafter: one decoder layer over fused target features (SPEC 3-5)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    num_aux_hidden_states: int = 3
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    fc_norm: bool = False  # 3.1: one RMSNorm per aux chunk before fc
    norm_output: bool = False  # 3.1: feed RMSNorm_final(h2) to the next step
    norm_before_fc: bool = False  # one RMSNorm over the whole concatenation (not 3.1)
    # The target layers this drafter reads, in the reference ('input') convention: the residual stream
    # entering layer i. None: EAGLE's default for the target's depth (``aux_layer_ids_for``).
    aux_layer_ids: tuple[int, ...] | None = None
    architectures: tuple[str, ...] = (LLAMA_DRAFTER_ARCHITECTURE,)
    dtype: str | None = None
    # Multi-head latent attention (DeepSeek-V3 / Kimi-K2 drafters) instead of GQA. As for targets,
    # num_kv_heads then equals num_heads and head_dim is qk_nope_head_dim + qk_rope_head_dim.
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        src = "drafter config"
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(f"{src}: 'fc_norm' and 'norm_before_fc' are mutually exclusive; set one")
        names_mla = any(a in MLA_DRAFTER_ARCHITECTURES for a in self.architectures)
        if self.mla is not None:
            if self.architectures == (LLAMA_DRAFTER_ARCHITECTURE,):  # the default: the MLA family's name instead
                object.__setattr__(self, "architectures", (MLA_DRAFTER_ARCHITECTURES[0],))
            elif not names_mla:
                raise ConfigError(
                    f"{src}: architectures {list(self.architectures)} name a Llama-layout drafter but the MLA fields "
                    f"(kv_lora_rank, ...) are set; MLA drafters are {list(MLA_DRAFTER_ARCHITECTURES[:3])}"
                )
            if (self.num_kv_heads, self.head_dim) != (self.num_heads, self.mla.qk_head_dim):
                raise ConfigError(
                    f"{src}: with MLA num_kv_heads={self.num_kv_heads} must equal num_heads={self.num_heads} and "
                    f"head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = {self.mla.qk_head_dim}"
                )
        elif names_mla:
            raise ConfigError(f"{src}: architectures {list(self.architectures)} name an MLA drafter but no MLA fields are set")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{src}: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"{src}: draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}"
            )
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux_hidden_states:
            raise ConfigError(
                f"{src}: num_aux_hidden_states={self.num_aux_hidden_states} but "
                f"eagle_aux_hidden_state_layer_ids has {len(self.aux_layer_ids)} entries"
            )

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_hidden_states * self.target_hidden_size

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of a query/key head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @classmethod
    def from_hf(
        cls, d: dict[str, Any], source: str = "config.json", aux_convention: AuxConvention = "input"
    ) -> "DrafterConfig":
        """Reads a drafter config.json.

        ``eagle_aux_hidden_state_layer_ids`` is read in the reference convention ("input": the residual
        stream entering layer i, HF ``hidden_states[i]``, as the EAGLE code and vLLM read it) unless
        ``aux_convention="output"`` (SGLang/SpecForge: "output of layer j", i.e. entering j+1).

        MLA drafters (``architectures`` one of ``MLA_DRAFTER_ARCHITECTURES``, or none given and a DeepSeek /
        Kimi ``model_type``) read HF's DeepSeek fields (``q_lora_rank``, ``kv_lora_rank``,
        ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rope_interleave``) and any rope
        scaling, YaRN with mscale included; their ``num_key_value_heads`` and ``head_dim`` are not read.
        """
        if aux_convention not in ("input", "output"):
            raise ConfigError(f"{source}: aux_convention must be 'input' or 'output', got {aux_convention!r}")
        hidden = int(_require(d, "hidden_size", source))
        heads = int(_require(d, "num_attention_heads", source))
        vocab = int(_require(d, "vocab_size", source))
        ids = _aux_ids_field(d)
        if ids is not None and aux_convention == "output":
            ids = [i + 1 for i in ids]
        if ids is not None and len(set(ids)) != len(ids):
            raise ConfigError(f"{source}: duplicated eagle_aux_hidden_state_layer_ids {ids}")
        n_aux = d.get("num_aux_hidden_states")
        if n_aux is None:
            n_aux = len(ids) if ids is not None else 3
        layers = int(d.get("num_hidden_layers", 1))
        if layers != 1:
            raise ConfigError(f"{source}: num_hidden_layers={layers}; EAGLE-3 drafters have exactly 1 layer")
        archs = tuple(d.get("architectures") or ())
        mla = None
        if any(a in MLA_DRAFTER_ARCHITECTURES for a in archs) or (not archs and d.get("model_type") in _MLA_MODEL_TYPES):
            try:
                mla = MLAConfig.from_hf(d, source)
            except ConfigError as e:
                raise ConfigError(str(e).replace("MLA config", source, 1)) from None
            archs = archs or (MLA_DRAFTER_ARCHITECTURES[0],)
        try:
            return cls(
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=heads if mla else int(d.get("num_key_value_heads") or heads),
                head_dim=mla.qk_head_dim if mla else int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(_require(d, "intermediate_size", source)),
                vocab_size=vocab,
                draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
                target_hidden_size=int(d.get("target_hidden_size") or hidden),
                num_aux_hidden_states=int(n_aux),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=parse_rope(d, source, ROPE_TYPES if mla else DRAFTER_ROPE_TYPES, 10000.0),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                fc_norm=bool(d.get("fc_norm", False)),
                norm_output=bool(d.get("norm_output", False)),
                norm_before_fc=bool(d.get("norm_before_fc", False)),
                aux_layer_ids=None if ids is None else tuple(ids),
                architectures=archs or (LLAMA_DRAFTER_ARCHITECTURE,),
                dtype=_dtype_name(d),
                mla=mla,
            )
        except ConfigError as e:
            raise ConfigError(str(e).replace("drafter config", source, 1)) from None

    @classmethod
    def from_pretrained(cls, path: str | Path, aux_convention: AuxConvention = "input") -> "DrafterConfig":
        d, source = read_config_json(path)
        return cls.from_hf(d, source, aux_convention)

    def to_hf(self) -> dict[str, Any]:
        """config.json as PyTorch engines read it (aux ids in the reference 'input' convention). An MLA
        drafter is written as a DeepseekV3Config (model_type deepseek_v3, which transformers knows) with
        its MLA fields; vLLM and SGLang choose the model class by ``architectures``."""
        out: dict[str, Any] = {
            "architectures": list(self.architectures),
            "model_type": "llama" if self.mla is None else "deepseek_v3",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "num_aux_hidden_states": self.num_aux_hidden_states,
            "rope_theta": self.rope.theta,
            "rope_scaling": self.rope.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "norm_before_fc": self.norm_before_fc,
            "tie_word_embeddings": False,
        }
        if self.mla is not None:
            del out["head_dim"]  # DeepseekV3Config's head_dim is the rope width, derived from qk_rope_head_dim
            out.update(self.mla.to_hf())
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        if self.dtype:
            out["torch_dtype"] = self.dtype
        return out

    def replace(self, **kw: Any) -> "DrafterConfig":
        return dataclasses.replace(self, **kw)


def aux_layer_ids_for(drafter: DrafterConfig, target: TargetConfig, where: str = "drafter config") -> tuple[int, ...]:
    """The target layers a drafter reads (ascending, 'input' convention): its own ids, else EAGLE's
    default for the target's depth; validated against that depth."""
    ids = drafter.aux_layer_ids or default_aux_layer_ids(target.num_layers)
    return validate_aux_layer_ids(ids, target.num_layers, f"{where}: eagle_aux_hidden_state_layer_ids")


def check_pair(target: TargetConfig, drafter: DrafterConfig, where: str = "drafter config") -> tuple[int, ...]:
    """A drafter must read the target it was trained for: vocabulary, width, aux count and ids agree.

    Returns the aux layer ids the target computes for this drafter; raises ConfigError naming every
    mismatch."""
    problems = []
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"drafter vocab_size={drafter.vocab_size} but the target's is {target.vocab_size}")
    if drafter.target_hidden_size != target.hidden_size:
        problems.append(
            f"drafter target_hidden_size={drafter.target_hidden_size} but the target's hidden_size is {target.hidden_size}"
        )
    ids = aux_layer_ids_for(drafter, target, where)
    if drafter.num_aux_hidden_states != len(ids):
        problems.append(
            f"drafter num_aux_hidden_states={drafter.num_aux_hidden_states} but it reads {len(ids)} target layers "
            f"({list(ids)}{'' if drafter.aux_layer_ids else ': EAGLE default for the target depth'})"
        )
    if problems:
        raise ConfigError(f"{where}: mismatched target/drafter pair: " + "; ".join(problems))
    return ids


# Fields of DrafterConfig a user may override at load time (a trainer wrote them with another meaning,
# or the checkpoint omits them).
DRAFTER_OVERRIDES = ("fc_norm", "norm_output", "norm_before_fc", "aux_layer_ids", "rope", "rms_norm_eps")


def override_drafter_config(config: DrafterConfig, overrides: dict[str, Any] | None, where: str) -> DrafterConfig:
    """``config`` with ``overrides`` (DrafterConfig field names) applied and validated."""
    if not overrides:
        return config
    unknown = sorted(set(overrides) - set(DRAFTER_OVERRIDES))
    if unknown:
        raise ConfigError(f"{where}: overrides {unknown} are not overridable; allowed: {list(DRAFTER_OVERRIDES)}")
    kw = dict(overrides)
    if kw.get("aux_layer_ids") is not None:
        kw["aux_layer_ids"] = tuple(int(i) for i in kw["aux_layer_ids"])
        kw["num_aux_hidden_states"] = len(kw["aux_layer_ids"])
        if kw["num_aux_hidden_states"] != config.num_aux_hidden_states:
            raise ConfigError(
                f"{where}: override aux_layer_ids={list(kw['aux_layer_ids'])} has {kw['num_aux_hidden_states']} "
                f"ids but the checkpoint's fc reads {config.num_aux_hidden_states} aux states"
            )
    try:
        return config.replace(**kw)
    except ConfigError as e:
        raise ConfigError(f"{where} (with overrides {overrides}): {e}") from None


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings; all static (they fix the shapes of the compiled loop).

    ``method``: "chain" (K drafts in a line, vLLM style) or "tree" (EAGLE-2 dynamic tree). The tree:

    - ``tree_top_k``: the root's children and the children kept per expanded node; also the width
      of the frontier expanded at each level.
    - ``tree_depth``: drafted levels below the root = the most drafts on one root-to-leaf path = the
      most drafts a round can accept; a round emits at most ``tree_depth + 1`` tokens. The drafter
      runs ``tree_depth`` times per round (once over the accepted tokens, which gives the root's
      children, then ``tree_depth - 1`` expansions of ``tree_top_k`` frontier nodes).
    - ``tree_total_tokens``: nodes the target verifies per round, the root (the last token the target
      produced) included, i.e. ``tree_total_tokens - 1`` drafted nodes.

    The EAGLE reference code (``EaModel.from_pretrained(total_token, depth, top_k)``, drafted by
    ``Model.topK_genrate`` in ``eagle/model/cnets.py``) counts depth from the root's children: its
    loop ``for i in range(depth)`` adds ``depth`` levels below that first one. So EAGLE's
    ``depth=D`` is our ``tree_depth=D+1`` (at most D+1 accepted drafts, D+2 tokens a round); its
    ``total_token`` includes the root as ours does (the drafter keeps ``total_token - 1`` nodes) and
    equals ``tree_total_tokens``; its ``top_k`` equals ``tree_top_k``. ``parse`` and ``eagle_tree``
    accept those names as an input dialect; the fields stay ours.
    """

    method: str = "chain"
    num_speculative_tokens: int = 5
    tree_top_k: int = 8
    tree_depth: int = 5
    tree_total_tokens: int = 48

    # EAGLE reference name -> (our field, our value from EAGLE's value). Not a dataclass field.
    _EAGLE_TREE_NAMES = {
        "total_token": ("tree_total_tokens", lambda v: v),
        "depth": ("tree_depth", lambda v: v + 1),
        "top_k": ("tree_top_k", lambda v: v),
    }

    def __post_init__(self) -> None:
        if self.method not in ("chain", "tree"):
            raise ConfigError(f"SpecConfig.method must be 'chain' or 'tree', got {self.method!r}")
        if self.method == "chain" and self.num_speculative_tokens < 1:
            raise ConfigError(f"SpecConfig.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.method == "tree":
            k, d, n = self.tree_top_k, self.tree_depth, self.tree_total_tokens
            if k < 1 or d < 1:
                raise ConfigError(f"SpecConfig: tree_top_k ({k}) and tree_depth ({d}) must be >= 1")
            candidates = k + (d - 1) * k * k
            if not 2 <= n <= candidates + 1:
                raise ConfigError(
                    f"SpecConfig: tree_total_tokens={n} must be in 2..{candidates + 1} "
                    f"(1 root + at most top_k + (depth-1)*top_k^2 = {candidates} drafted candidates)"
                )

    @classmethod
    def parse(cls, spec: "SpecConfig | dict[str, Any] | None") -> "SpecConfig":
        """Accepts a SpecConfig, our own dict, vLLM's ``{"method": "eagle3", "num_speculative_tokens": K}``,
        or the EAGLE reference code's tree names ``{"total_token": N, "depth": D, "top_k": k}``.

        EAGLE names give ``method="tree"`` with ``tree_total_tokens=N``, ``tree_depth=D+1``,
        ``tree_top_k=k`` (see the class docstring); ``method`` may be left out or be "tree". They may
        be given alongside our names for other quantities (a quantity not given keeps this class's
        default), but an EAGLE name and our name for the same quantity together are an error, as is
        EAGLE's ``total_token=-1`` (its GPU-timed auto-tuning).
        """
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise ConfigError(f"spec must be a SpecConfig or a dict, got {type(spec).__name__}")
        d = dict(spec)
        eagle = {name: d.pop(name) for name in cls._EAGLE_TREE_NAMES if name in d}
        if eagle:
            return cls._from_eagle_names(eagle, d)
        if d.get("method") in ("eagle3", "eagle", "eagle-3", "eagle3.1"):
            d["method"] = "chain"
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"spec: unknown fields {unknown}; known: {sorted(known)} and the EAGLE code's {sorted(cls._EAGLE_TREE_NAMES)}")
        return cls(**d)

    @classmethod
    def eagle_tree(cls, *, total_token: int = 60, depth: int = 7, top_k: int = 10) -> "SpecConfig":
        """The EAGLE-2 tree that the EAGLE reference code's ``EaModel.from_pretrained(total_token=...,
        depth=..., top_k=...)`` drafts (its defaults are these: 60, 7, 10; its evaluation scripts use
        depth 5): ``SpecConfig(method="tree", tree_total_tokens=total_token, tree_depth=depth + 1,
        tree_top_k=top_k)``.
        """
        return cls._from_eagle_names({"total_token": total_token, "depth": depth, "top_k": top_k}, {})

    @classmethod
    def _from_eagle_names(cls, eagle: dict[str, Any], ours: dict[str, Any]) -> "SpecConfig":
        """A tree SpecConfig from EAGLE's names in ``eagle`` and our own fields in ``ours``."""
        given = ", ".join(f"{name}={value!r}" for name, value in eagle.items())
        for name, value in eagle.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"spec: {name} (the EAGLE code's name) must be an integer, got {value!r}")
        for name, (field_name, to_ours) in cls._EAGLE_TREE_NAMES.items():
            if name in eagle and field_name in ours:
                raise ConfigError(
                    f"spec: {name!r} (the EAGLE code's name) and {field_name!r} set the same quantity; give only "
                    f"one of them ({name}={eagle[name]} is {field_name}={to_ours(eagle[name])}, got {field_name}={ours[field_name]!r})"
                )
        method = ours.pop("method", "tree")
        if method != "tree":
            raise ConfigError(
                f"spec: unknown fields {sorted(eagle)} for method={method!r}: they are the EAGLE code's tree names "
                f"({given}), which describe an EAGLE-2 dynamic tree; leave method out or set it to 'tree'"
            )
        if eagle.get("total_token") == -1:
            raise ConfigError(
                "spec: total_token=-1 (the EAGLE code's auto-tuning, which times target forwards of 40-60 "
                "tokens on the GPU at load time and keeps the cheapest per expected token) is not supported: "
                "the tree size fixes the compiled program's shapes; give total_token explicitly (EAGLE's default is 60)"
            )
        if eagle.get("depth", 0) < 0:
            raise ConfigError(f"spec: depth={eagle['depth']} must be >= 0 (EAGLE's depth 0: only the root's top_k children)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise ConfigError(
                f"spec: unknown fields {unknown}; known: {sorted(known)} and the EAGLE code's {sorted(cls._EAGLE_TREE_NAMES)}"
            )
        fields = {field_name: to_ours(eagle[name]) for name, (field_name, to_ours) in cls._EAGLE_TREE_NAMES.items() if name in eagle}
        try:
            return cls(method="tree", **ours, **fields)
        except ConfigError as e:
            mapped = ", ".join(f"{k}={v}" for k, v in fields.items())
            raise ConfigError(f"spec with the EAGLE code's names {given} (= {mapped}): {e}") from None

    @property
    def verify_width(self) -> int:
        """Target positions verified per round (root/pending included)."""
        return self.num_speculative_tokens + 1 if self.method == "chain" else self.tree_total_tokens

    @property
    def max_emitted(self) -> int:
        """Most tokens a round can emit (accepted drafts + 1)."""
        return self.num_speculative_tokens + 1 if self.method == "chain" else self.tree_depth + 1
