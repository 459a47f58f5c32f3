"""Routed-expert weights: HF's tensors <-> one stacked tensor per layer and projection.

A ``MoE`` layer keeps each projection of its E experts as one kernel [E, in, out], whose checkpoint
key (``target_key``) is the per-expert key without the expert index,
``model.layers.N.mlp.experts.gate_proj.weight``, holding [E, out, in] (torch layout). On disk HF
stores one tensor per expert, ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` (what
``save_pretrained`` writes and loads); a state dict saved straight from a transformers model holds
them fused, ``...mlp.experts.gate_up_proj`` [E, 2I, H] and ``...mlp.experts.down_proj`` [E, H, I].
``StackedExperts`` reads either as the stacked keys; ``per_expert_tensors`` writes the per-expert
layout back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np

from eagle_jax.checkpoint.tensor_files import CheckpointError, TensorSource

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_STACKED = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class StackedExperts:
    """A view of a ``TensorSource`` in which every layer's expert tensors appear as the stacked keys.

    Keys of experts numbered ``num_experts`` or above stay as they are (and are then reported as
    unexpected by the loader); a layer whose experts are incomplete raises, naming the missing key.
    """

    def __init__(self, source: TensorSource, num_experts: int):
        self.source = source
        self.directory = source.directory
        self.num_experts = num_experts
        self._stacked: dict[
            str, list[str] | tuple[str, slice]
        ] = {}  # stacked key -> per-expert keys | (fused key, rows)
        self._keys: list[str] = []
        per_expert: dict[tuple[str, str], dict[int, str]] = {}
        for key in source.keys():
            m, f = _PER_EXPERT.match(key), _FUSED.match(key)
            if m and int(m["expert"]) < num_experts:
                per_expert.setdefault((m["prefix"], m["proj"]), {})[int(m["expert"])] = key
            elif f:
                self._add_fused(key, f["prefix"], f["proj"])
            else:
                self._keys.append(key)
        for (prefix, proj), found in sorted(per_expert.items()):
            missing = [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts) if e not in found]
            if missing:
                raise CheckpointError(
                    f"{self.directory}: missing tensor '{missing[0]}' ({len(missing)} of the {num_experts} experts' "
                    f"{proj} missing in {prefix})"
                )
            self._put(f"{prefix}.{proj}.weight", [found[e] for e in range(num_experts)])

    def _add_fused(self, key: str, prefix: str, proj: str) -> None:
        shape = self.source.shape(key)
        if len(shape) != 3 or shape[0] != self.num_experts:
            raise CheckpointError(
                f"{self.source.file_of(key)}: tensor '{key}' has shape {list(shape)}, expected [{self.num_experts}, "
                "out, in]"
            )
        if proj == "down_proj":
            self._put(f"{prefix}.down_proj.weight", (key, slice(None)))
            return
        if shape[1] % 2:
            raise CheckpointError(f"{self.source.file_of(key)}: tensor '{key}' has an odd gate_up width {shape[1]}")
        half = shape[1] // 2
        self._put(f"{prefix}.gate_proj.weight", (key, slice(0, half)))
        self._put(f"{prefix}.up_proj.weight", (key, slice(half, None)))

    def _put(self, stacked: str, where: list[str] | tuple[str, slice]) -> None:
        if stacked in self._stacked:
            raise CheckpointError(f"{self.directory}: the experts of '{stacked}' are stored both per expert and fused")
        self._stacked[stacked] = where
        self._keys.append(stacked)

    def keys(self) -> list[str]:
        return list(self._keys)

    def file_of(self, key: str) -> Path:
        where = self._stacked.get(key)
        if where is None:
            return self.source.file_of(key)
        return self.source.file_of(where[0])

    def get(self, key: str) -> np.ndarray:
        where = self._stacked.get(key)
        if where is None:
            return self.source.get(key)
        if isinstance(where, tuple):
            fused, rows = where
            return np.asarray(self.source.get(fused)[:, rows])
        parts = [self.source.get(k) for k in where]
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise CheckpointError(f"{self.file_of(key)}: the experts of '{key}' differ in shape: {sorted(shapes)}")
        return np.stack(parts)

    def release(self) -> None:
        self.source.release()


def per_expert_tensors(items: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Splits every stacked expert tensor [E, out, in] into HF's per-expert keys; others pass through."""
    for key, arr in items:
        m = _STACKED.match(key)
        if m is None or arr.ndim != 3:
            yield key, arr
            continue
        for e in range(arr.shape[0]):
            yield f"{m['prefix']}.{e}.{m['proj']}.weight", np.ascontiguousarray(arr[e])
