"""What every config shares: the error type, RoPE (both config dialects), reading config.json and the
aux-layer conventions.

Both config dialects are read: transformers >= 5 (``rope_parameters``, ``dtype``) and transformers 4 /
most published checkpoints (top-level ``rope_theta``, ``rope_scaling`` with ``rope_type`` or ``type``,
``torch_dtype``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

AuxConvention = Literal["input", "output"]


class ConfigError(ValueError):
    """A config.json field is missing, inconsistent or unsupported."""


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Llama-layout drafters only ever use these; targets and MLA drafters use all of ROPE_TYPES.
DRAFTER_ROPE_TYPES = ("default", "linear", "dynamic")


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


def _positive(obj: Any, names: tuple[str, ...], what: str, minimum: int = 1) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{what}: field '{name}'={value!r} must be an integer >= {minimum}")
