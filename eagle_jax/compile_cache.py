"""JAX's persistent compilation cache, as the server and the CLI turn it on: compiled programs are
written under the user's cache directory and a later process with the same programs (models, shapes,
JAX version, device) loads them instead of compiling, so a restart does not pay the compiles again."""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from eagle_jax.checkpoint.models import cache_dir

log = logging.getLogger("eagle_jax")


def default_dir() -> Path:
    """``<the project's cache directory>/xla`` (``$EAGLE_JAX_CACHE``, ``$XDG_CACHE_HOME/eagle_jax`` or ``~/.cache/eagle_jax``)."""
    return cache_dir() / "xla"


def enable(directory: str | Path | None) -> Path | None:
    """Writes and reads compiled programs under ``directory`` ("off" or None: no persistent cache).
    Every program is cached, however fast it compiled: a server's programs are many small ones."""
    if directory is None or str(directory) == "off":
        return None
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("compiled programs are cached in %s", path)
    return path
