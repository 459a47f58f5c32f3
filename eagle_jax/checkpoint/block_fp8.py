"""Block-quantized FP8 checkpoints (``quantization_config.quant_method: fp8``, as DeepSeek-V3 and
Kimi-K2 are published): weights are dequantized on load, one tensor at a time.

Such a checkpoint stores a linear weight [out, in] as float8 e4m3 next to ``<name>_scale_inv``
[ceil(out/bm), ceil(in/bm)] (float32), one multiplier per ``weight_block_size`` = [bm, bn] block:
``weight = fp8 * scale_inv[row // bm, col // bn]`` (the name is historical: it multiplies), as
transformers' FP8 dequantization and DeepSeek's own conversion script compute it. The model then
computes in its dtype (bf16 by the config), like transformers with ``dequantize=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from eagle_jax.checkpoint.tensor_files import CheckpointError, TensorSource
from eagle_jax.config import ConfigError

SCALE_SUFFIX = "_scale_inv"


def block_size(quantization: dict[str, Any], where: str) -> tuple[int, int]:
    """``weight_block_size`` of a supported quantization_config; ConfigError for any other scheme."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    size = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    if method != "fp8" or not isinstance(size, (list, tuple)) or len(size) != 2:
        raise ConfigError(
            f"{where}: unsupported field 'quantization_config' (quant_method={method!r}, weight_block_size={size!r}); "
            "only block-quantized fp8 (quant_method 'fp8' with a 2-d weight_block_size) is read"
        )
    return int(size[0]), int(size[1])


class DequantizedFP8:
    """A view of a ``TensorSource`` in which every FP8 weight with a ``_scale_inv`` reads as float32 and
    the scale tensors themselves are hidden."""

    def __init__(self, source: TensorSource, block: tuple[int, int]):
        self.source = source
        self.directory = source.directory
        self.block = block
        keys = set(source.keys())
        self._scaled = {
            k[: -len(SCALE_SUFFIX)] for k in keys if k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in keys
        }
        self._keys = [
            k for k in source.keys() if not (k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in self._scaled)
        ]

    def keys(self) -> list[str]:
        return list(self._keys)

    def file_of(self, key: str) -> Path:
        return self.source.file_of(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.source.shape(key)

    def get(self, key: str) -> np.ndarray:
        arr = self.source.get(key)
        if key not in self._scaled:
            return arr
        scale = np.asarray(self.source.get(key + SCALE_SUFFIX), np.float32)
        if arr.dtype != np.dtype(ml_dtypes.float8_e4m3fn) or arr.ndim != 2:
            raise CheckpointError(
                f"{self.file_of(key)}: tensor '{key}' has a block scale but is {arr.dtype} {list(arr.shape)}, "
                "not a 2-d float8_e4m3fn weight"
            )
        (rows, cols), (bm, bn) = arr.shape, self.block
        grid = (-(-rows // bm), -(-cols // bn))
        if scale.shape != grid:
            raise CheckpointError(
                f"{self.file_of(key + SCALE_SUFFIX)}: tensor '{key + SCALE_SUFFIX}' has shape {list(scale.shape)}, "
                f"expected {list(grid)} (one scale per {bm}x{bn} block of '{key}' {[rows, cols]})"
            )
        full = np.repeat(np.repeat(scale, bm, axis=0)[:rows], bn, axis=1)[:, :cols]
        return arr.astype(np.float32) * full

    def release(self) -> None:
        self.source.release()
