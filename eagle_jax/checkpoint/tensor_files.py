"""Reading and writing tensor files one tensor at a time.

safetensors is parsed directly (8-byte header length, JSON header, raw little-endian data) and memory
mapped, so a large checkpoint is never held twice and bf16 needs no framework. ``pytorch_model.bin``
goes through ``torch.load(weights_only=True, mmap=True)``: a pickle can run code, weights_only cannot.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint is malformed, incomplete or does not fit the model it is loaded into."""


_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # block-quantized weights (DeepSeek-V3, Kimi-K2)
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _read_safetensors_header(file: Path) -> tuple[dict, int]:
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > os.path.getsize(file) - 8:
            raise CheckpointError(f"{file}: safetensors header length {n} exceeds the file size")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: safetensors header is not valid JSON ({e})") from e
    header.pop("__metadata__", None)
    return header, 8 + n


class TensorSource:
    """The tensors of one checkpoint directory: names, shapes and lazily read arrays."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._where: dict[str, Path] = {}  # tensor name -> file
        self._st_meta: dict[str, tuple[dict, int]] = {}  # tensor name -> (header entry, data start)
        self._bin: dict[Path, dict] = {}
        self._discover()

    def _discover(self) -> None:
        d = self.directory
        if not d.is_dir():
            raise CheckpointError(f"{d}: not a directory")
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = d / index_name
            if index.exists():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise CheckpointError(f"{index}: malformed index, no 'weight_map' ({e})") from e
                files = sorted(set(weight_map.values()))
                for name in files:
                    if not (d / name).exists():
                        raise CheckpointError(f"{index}: lists shard '{name}', which is missing from {d}")
                for name in files:
                    self._add_file(d / name)
                for key, name in weight_map.items():
                    if self._where.get(key) != d / name:
                        raise CheckpointError(f"{index}: tensor '{key}' is not in its listed shard '{name}'")
                return
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (d / single).exists():
                self._add_file(d / single)
                return
        raise CheckpointError(
            f"{d}: no weights found (expected model.safetensors, sharded safetensors with "
            f"model.safetensors.index.json, or pytorch_model.bin)"
        )

    def _add_file(self, file: Path) -> None:
        if file.suffix == ".safetensors":
            header, start = _read_safetensors_header(file)
            for key, meta in header.items():
                if meta.get("dtype") not in _ST_DTYPES:
                    raise CheckpointError(f"{file}: tensor '{key}' has unsupported dtype {meta.get('dtype')}")
                self._put(key, file)
                self._st_meta[key] = (meta, start)
        else:
            import torch  # optional dependency: only .bin checkpoints need it

            try:
                sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - re-raised with the file named
                raise CheckpointError(f"{file}: cannot be read with torch.load(weights_only=True): {e}") from e
            if not isinstance(sd, dict):
                raise CheckpointError(f"{file}: expected a state dict, found {type(sd).__name__}")
            self._bin[file] = sd
            for key in sd:
                self._put(key, file)

    def _put(self, key: str, file: Path) -> None:
        if key in self._where:
            raise CheckpointError(f"{file}: tensor '{key}' also appears in {self._where[key]}")
        self._where[key] = file

    def keys(self) -> list[str]:
        return list(self._where)

    def file_of(self, key: str) -> Path:
        return self._where[key]

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._st_meta:
            return tuple(self._st_meta[key][0]["shape"])
        return tuple(self._bin[self._where[key]][key].shape)

    def get(self, key: str) -> np.ndarray:
        """Reads one tensor (memory-mapped for safetensors)."""
        file = self._where[key]
        if key in self._st_meta:
            meta, start = self._st_meta[key]
            dtype = _ST_DTYPES[meta["dtype"]]
            begin, end = meta["data_offsets"]
            count = int(np.prod(meta["shape"], dtype=np.int64))
            if end - begin != count * dtype.itemsize:
                raise CheckpointError(f"{file}: tensor '{key}' has {end - begin} bytes for shape {meta['shape']}")
            if start + end > os.path.getsize(file):
                raise CheckpointError(f"{file}: tensor '{key}' lies past the end of the file (truncated?)")
            return np.memmap(file, dtype=dtype, mode="r", offset=start + begin, shape=tuple(meta["shape"]))
        return torch_to_numpy(self._bin[file][key])

    def release(self) -> None:
        self._bin.clear()


def torch_to_numpy(t) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def write_safetensors(
    file: str | Path,
    tensors: Iterator[tuple[str, np.ndarray]] | dict[str, np.ndarray],
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes a safetensors file atomically (temp file + rename: an existing file is never half-overwritten)."""
    file = Path(file)
    items = list(tensors.items() if isinstance(tensors, dict) else tensors)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for key, arr in items:
        arr = np.asarray(arr)
        if arr.dtype not in _ST_NAMES:
            raise CheckpointError(f"{file}: cannot write tensor '{key}' of dtype {arr.dtype}")
        header[key] = {
            "dtype": _ST_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = file.with_name(file.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, arr in items:
                f.write(np.ascontiguousarray(arr).astype(np.asarray(arr).dtype.newbyteorder("<"), copy=False).tobytes())
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a partial (possibly huge) temp file behind
        raise
