"""Which on-disk format a checkpoint path is in: the one place the loaders and the tokenizer ask.

A GGUF (llama.cpp's format) is one file starting with the magic ``GGUF``; anything else a target can
be is a directory (safetensors / .bin shards), a Hub repo id or a named model.
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle_jax.checkpoint.tensor_files import CheckpointError

GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for an existing file that starts with the GGUF magic, or any existing ``*.gguf`` file (whose
    bad magic the GGUF loader then reports)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def check_gguf_header(file: str | os.PathLike) -> None:
    """Raises CheckpointError unless ``file`` is a file that starts with the GGUF magic."""
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"{file}: no such GGUF file")
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{file}: bad magic {magic!r} (field 'magic'), expected {GGUF_MAGIC!r}: not a GGUF file")


__all__ = ["GGUF_MAGIC", "check_gguf_header", "is_gguf_file"]
