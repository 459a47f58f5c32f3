"""``load_tokenizer``: the transformers tokenizer of a checkpoint directory, a Hub id, a .gguf file or a
named model (``eagle_jax.checkpoint.models``).

A GGUF carries its tokenizer in its metadata (``tokenizer.ggml.*``: vocabulary, merges, token types,
special ids, and ``tokenizer.chat_template``); transformers converts it (``gguf_file=``). Converting a
49k-token vocabulary takes seconds, so the converted tokenizer is saved once under the cache
(``models.cache_dir() / "tokenizers"``), keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from eagle_jax.checkpoint.formats import check_gguf_header, is_gguf_file
from eagle_jax.checkpoint.models import cache_dir, resolve_model
from eagle_jax.checkpoint.tensor_files import CheckpointError


def load_tokenizer(path: str | os.PathLike, *, revision: str | None = None) -> Any:
    """A transformers tokenizer for a checkpoint directory, a Hub repo id, a .gguf file or a model name."""
    from transformers import AutoTokenizer

    source = resolve_model(path)
    if is_gguf_file(source):
        return _gguf_tokenizer(Path(source))
    if Path(source).is_file():
        raise CheckpointError(
            f"{source}: is a file but not a GGUF; give a checkpoint directory, a Hub repo id or a .gguf file"
        )
    from eagle_jax.checkpoint.hub import resolve_checkpoint

    directory = resolve_checkpoint(source, revision=revision)
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory}: has no tokenizer transformers can load ({e})") from e


def _gguf_tokenizer(file: Path) -> Any:
    from transformers import AutoTokenizer

    file = file.resolve()
    stat = file.stat()
    key = hashlib.sha256(f"{file}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    check_gguf_header(file)  # a clear error for a bad file before transformers' own
    try:
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; re-raised naming the file
        raise CheckpointError(f"{file}: the tokenizer in its metadata (tokenizer.ggml.*) cannot be loaded: {e}") from e
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache only costs the conversion next time
    return tok


__all__ = ["is_gguf_file", "load_tokenizer"]
