"""EAGLE-3 / EAGLE-3.1 drafter configs, and how a drafter pairs with its target."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_jax.config.common import (
    DRAFTER_ROPE_TYPES,
    ROPE_TYPES,
    AuxConvention,
    ConfigError,
    RopeConfig,
    _dtype_name,
    _require,
    default_aux_layer_ids,
    parse_rope,
    read_config_json,
    validate_aux_layer_ids,
)
from eagle_jax.config.target import MLAConfig, TargetConfig

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


def _aux_ids_field(d: dict[str, Any]) -> list[int] | None:
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(d.get("eagle_config"), dict):
        ids = d["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


@dataclass(frozen=True)
class DrafterConfig:
    """An EAGLE-3 / EAGLE-3.1 drafter: one decoder layer over fused target features."""

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
            raise ConfigError(
                f"{src}: architectures {list(self.architectures)} name an MLA drafter but no MLA fields are set"
            )
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
        if any(a in MLA_DRAFTER_ARCHITECTURES for a in archs) or (
            not archs and d.get("model_type") in _MLA_MODEL_TYPES
        ):
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
            f"drafter target_hidden_size={drafter.target_hidden_size} but the target's hidden_size is "
            f"{target.hidden_size}"
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
