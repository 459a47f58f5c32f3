"""Target configs: the Llama family, Gemma 3 (text) and DeepSeek-V3 / Kimi-K2 (MLA + MoE), read from HF
``config.json`` dicts and written back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_jax.config.common import (
    ROPE_TYPES,
    ConfigError,
    RopeConfig,
    _dtype_name,
    _positive,
    _require,
    parse_rope,
    read_config_json,
)

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
            raise ConfigError(
                f"{what}: field 'qk_rope_head_dim'={self.qk_rope_head_dim} must be even (RoPE rotates pairs)"
            )

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
        _positive(
            self, ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"), what
        )
        _positive(self, ("n_shared_experts", "first_k_dense_replace"), what, minimum=0)
        e, g = self.n_routed_experts, self.n_group
        if e % g:
            raise ConfigError(f"{what}: n_routed_experts={e} is not a multiple of n_group={g}")
        if e // g < 2:
            raise ConfigError(
                f"{what}: n_routed_experts / n_group = {e // g}; groups are scored by their top-2 experts, so each "
                "needs >= 2"
            )
        if self.topk_group > g:
            raise ConfigError(f"{what}: topk_group={self.topk_group} is larger than n_group={g}")
        if self.num_experts_per_tok > self.topk_group * (e // g):
            raise ConfigError(
                f"{what}: num_experts_per_tok={self.num_experts_per_tok} exceeds the {self.topk_group * (e // g)} "
                f"experts of the topk_group={self.topk_group} groups a token may use"
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
                f"{source}: moe_layer_freq={d['moe_layer_freq']} is not supported (only 1: every layer past "
                "first_k_dense_replace)"
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
            return parse_rope(
                {"rope_parameters": sub, "max_position_embeddings": d.get("max_position_embeddings")},
                f"{source} (rope_parameters.{name})",
                ROPE_TYPES,
                theta,
            )

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
        raise ConfigError(
            f"{source}: unsupported field 'hidden_activation'='{act}' for Gemma 3 (only gelu_pytorch_tanh)"
        )
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
    local_rope: RopeConfig | None = (
        None  # RoPE of the sliding layers, when it differs from ``rope`` (Gemma 3: base 10k)
    )
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
                raise ConfigError(
                    f"{source}: with MLA num_kv_heads={self.num_kv_heads} must equal num_heads={self.num_heads}"
                )
            if self.head_dim != self.mla.qk_head_dim:
                raise ConfigError(
                    f"{source}: with MLA head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                    f"{self.mla.qk_head_dim}"
                )
            unsupported = [k for k in ("qk_norm", "sliding_window") if getattr(self, k)]
            if unsupported:
                raise ConfigError(f"{source}: {unsupported} are not supported with MLA")
        if (self.mla is None) != (self.moe is None) or (self.architecture == "deepseek_v3") != (self.mla is not None):
            raise ConfigError(
                f"{source}: architecture deepseek_v3 has both 'mla' and 'moe' set, the other families neither"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(
                f"{source}: unsupported hidden activation '{self.hidden_act}' (supported: {', '.join(HIDDEN_ACTS)})"
            )
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
                f"{source}: a multimodal Gemma 3 checkpoint (field 'architectures'/'model_type' "
                f"{archs or d.get('model_type')!r}, 'vision_config'): its vision tower is not supported; only the text "
                "model (Gemma3ForCausalLM, "
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
            raise ConfigError(
                f"gemma3 target config: a '{local.type}' rope on the sliding layers has no transformers-4 field"
            )
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
