"""Speculation settings (chains and EAGLE-2 trees), static per compiled loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from eagle_jax.config.common import ConfigError


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
            raise ConfigError(
                f"spec: unknown fields {unknown}; known: {sorted(known)} and the EAGLE code's "
                f"{sorted(cls._EAGLE_TREE_NAMES)}"
            )
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
                    f"one of them ({name}={eagle[name]} is {field_name}={to_ours(eagle[name])}, got "
                    f"{field_name}={ours[field_name]!r})"
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
            raise ConfigError(
                f"spec: depth={eagle['depth']} must be >= 0 (EAGLE's depth 0: only the root's top_k children)"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise ConfigError(
                f"spec: unknown fields {unknown}; known: {sorted(known)} and the EAGLE code's "
                f"{sorted(cls._EAGLE_TREE_NAMES)}"
            )
        fields = {
            field_name: to_ours(eagle[name])
            for name, (field_name, to_ours) in cls._EAGLE_TREE_NAMES.items()
            if name in eagle
        }
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
