"""JAX's persistent compilation cache, as the server and the CLI turn it on, and the traced programs
stored beside it.

Compiled programs are written under the user's cache directory and a later process with the same
programs (models, shapes, JAX version, device) loads them instead of compiling. JAX's cache key is the
lowered program, so a restart still traces and lowers every program first (about a second for each
of the serving engine's step loops); ``compile_program`` therefore also stores each program as traced
(``jax.export``, under ``exported/<code digest>/``), keyed by what it was traced from, and a later process lowers
that instead of tracing the Python again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from eagle_jax.checkpoint.models import cache_dir

log = logging.getLogger("eagle_jax")
_exported_dir: Path | None = None  # where ``compile_program`` keeps traced programs (None: not kept)


def default_dir() -> Path:
    """``<the project's cache directory>/xla`` (``$EAGLE_JAX_CACHE``, ``$XDG_CACHE_HOME/eagle_jax`` or
    ``~/.cache/eagle_jax``)."""
    return cache_dir() / "xla"


def enable(directory: str | Path | None) -> Path | None:
    """Writes and reads compiled programs under ``directory`` ("off" or None: no persistent cache, and
    ``compile_program`` keeps no traced programs). Every program is cached, however fast it compiled: a
    server's programs are many small ones."""
    global _exported_dir
    if directory is None or str(directory) == "off":
        _exported_dir = None
        return None
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _exported_dir = path / "exported"
    prune_exported(_exported_dir)
    log.info("compiled programs are cached in %s", path)
    return path


STALE_DAYS = 14


def prune_exported(directory: Path, stale_days: float = STALE_DAYS) -> None:
    """Removes the traced programs of other versions of the code (one folder per code digest) that have
    stored nothing for ``stale_days``: only the code that traced a program can reuse it."""
    if not directory.is_dir():
        return
    cutoff = time.time() - stale_days * 86400
    for folder in directory.iterdir():
        if folder.is_dir() and folder.name != _code_digest()[:16] and folder.stat().st_mtime < cutoff:
            shutil.rmtree(folder, ignore_errors=True)
            log.info("removed the stored programs of an older version of the code (%s)", folder.name)


def disable() -> None:
    """Stops keeping traced programs (JAX's own cache settings are the caller's to restore)."""
    global _exported_dir
    _exported_dir = None


@functools.cache
def _code_digest() -> str:
    """The package's source and the versions that trace it: a stored program is only reused by the code
    that traced it."""
    import flax
    import jaxlib

    h = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__} {flax.__version__}".encode())
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class _FlatProgram:
    """A program compiled from flat arguments, called like the original (pytrees in, pytrees out)."""

    def __init__(self, compiled, in_tree, out_tree):
        self._compiled, self._in_tree, self._out_tree = compiled, in_tree, out_tree

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args)
        if tree != self._in_tree:
            raise TypeError(
                f"arguments {tree} do not have the structure the program was compiled for ({self._in_tree})"
            )
        return jax.tree.unflatten(self._out_tree, self._compiled(*leaves))


def compile_program(
    fn: Callable, abstract: Sequence[Any], *, donate_argnums: Sequence[int] = (), fingerprint: str
) -> Callable:
    """``jax.jit(fn, donate_argnums).lower(*abstract).compile()``; with the cache on (``enable``) the traced
    program is also stored, keyed by ``fingerprint`` (everything ``fn`` closes over that shapes the
    program: configs, plan), the arguments' structure, shapes, dtypes and shardings, the devices and the
    package's code, and loaded instead of tracing ``fn`` when a later process asks for the same."""
    if _exported_dir is None:
        return jax.jit(fn, donate_argnums=tuple(donate_argnums)).lower(*abstract).compile()
    flat, in_tree = jax.tree.flatten(tuple(abstract))
    bounds = [0]
    for arg in abstract:
        bounds.append(bounds[-1] + len(jax.tree.leaves(arg)))
    donated = tuple(i for a in donate_argnums for i in range(bounds[a], bounds[a + 1]))
    avals = [(x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in flat]
    devices = [(d.platform, d.device_kind) for d in jax.devices()]
    key = hashlib.sha256(repr((fingerprint, str(in_tree), avals, devices, _code_digest())).encode()).hexdigest()[:32]
    path = _exported_dir / _code_digest()[:16] / f"{key}.jaxexport"
    stored = _load(path)
    if stored is None:
        out_tree = []

        def flat_fn(*leaves):
            out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, leaves)))
            out_tree.append(tree)
            return out

        exported = jax.export.export(jax.jit(flat_fn, donate_argnums=donated))(*flat)
        stored = exported, out_tree[0]
        _save(path, stored)
    exported, out_tree = stored
    compiled = jax.jit(exported.call, donate_argnums=donated).lower(*flat).compile()
    return _FlatProgram(compiled, in_tree, out_tree)


def _load(path: Path):
    """(the exported program, its output structure) stored at ``path``, or None (absent or unreadable:
    traced again and rewritten)."""
    try:
        blob, out_tree = pickle.loads(path.read_bytes())
        return jax.export.deserialize(blob), out_tree
    except FileNotFoundError:
        return None
    except Exception as e:  # a truncated or foreign file costs one trace, never a wrong program
        log.warning("ignoring the stored program %s (%s: %s)", path.name, type(e).__name__, e)
        return None


def _save(path: Path, stored) -> None:
    exported, out_tree = stored
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps((exported.serialize(), out_tree)))
    tmp.replace(path)  # atomic: a concurrent reader sees the whole file or none
