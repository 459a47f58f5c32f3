"""``spec="auto"``'s round costs kept on disk, so they are measured once per machine, not once per process, and
the traffic's acceptance with them.

What a round of each depth costs depends on the models' shapes and dtypes, the sampling mode and the
device, not on the traffic: a process that finds the costs an earlier one measured on this machine skips
the measuring that a fresh process's first calls (or a fresh server's first steps) pay (a round without drafts, the deepest chain, and then
every close depth a few rounds each until its cost is settled: at float32 batch 1 T=1 on a CPU, 1.13x and
1.11x the best chain's time on the first two calls, against 1.07x and 1.03x from kept costs; see BENCHMARKS.md). The costs found are read as measurements like any other, so a
machine that got slower or faster since replaces them within a few chunks. The traffic's acceptance is kept with
them (``SpanCosts.keep``: the estimate per draft position, the finished prompts' first-draft rates, the rounds since
acceptance was last observed, what hindsight found of plain decoding), and a later process goes on from it as if it
were the same one: its own prompts outweigh it as a change of workload within a process would.

Where: ``$EAGLE_JAX_COST_CACHE`` (a directory), else ``costs`` in the project's cache directory
(``$EAGLE_JAX_CACHE``, ``$XDG_CACHE_HOME/eagle_jax`` or ``~/.cache/eagle_jax``); ``EAGLE_JAX_COST_CACHE=off``
(or ``0``, ``false``, ``no``, empty) keeps costs in the process only. One small JSON file per key (``key``: the models' configs, every weight's shape and dtype,
the sampling and exact modes, the mesh, what runs the rounds (``generate`` or a server's slot engine), the devices and
the host's CPU, JAX's and this package's versions). A file that cannot
be read is reported once and measured anew (and then replaced); a cache that cannot be written is reported
once and the process goes on with its costs in memory."""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from eagle_jax.checkpoint.models import cache_dir

FORMAT = 1  # the files' layout: a file of another format is measured anew
ENV = "EAGLE_JAX_COST_CACHE"
OFF = {"", "0", "off", "false", "no"}
# A call's end writes its costs at most this often (a write encodes every span's measurements, and one call's
# change them little); the process's exit writes what is left.
SAVE_EVERY_S = 10.0

_reported: set[str] = set()
_pending: dict[str, Any] = {}  # name -> the SpanCosts whose write was put off (``flush``)
_last_save: dict[str, float] = {}


def directory() -> Path | None:
    """The cache's directory, or None where it is turned off (read from the environment at each call)."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value).expanduser()
    return cache_dir() / "costs"


def key(target_config: Any, drafter_config: Any, shapes: Any, greedy: bool, exact: bool, mesh: Any,
        runner: tuple = ("generate",)) -> str:
    """The file name for costs of this pair as run here: a hash of what sets a round's cost. ``shapes``: the
    models' weights as (shape, dtype) pairs; ``runner``: what runs the rounds (``generate``'s calls, or a server's
    slot engine with its settings: a step's rounds are another program than a call's)."""
    devices = jax.devices()
    parts = {
        "format": FORMAT,
        "target": repr(target_config),
        "drafter": repr(drafter_config),
        "weights": repr(shapes),
        "greedy": bool(greedy),
        "exact": bool(exact),
        "mesh": None if mesh is None else repr(dict(mesh.shape)),
        "runner": list(runner),
        "backend": jax.default_backend(),
        "devices": [len(devices), devices[0].device_kind],
        "host": [platform.machine(), _processor(), os.cpu_count()],
        "versions": [jax.__version__, _version()],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def load(name: str) -> dict | None:
    """The costs kept under ``name`` (``SpanCosts.to_dict``'s), or None: none kept, the cache off, or a file
    that cannot be read (``unreadable``)."""
    where = directory()
    if where is None:
        return None
    path = where / f"{name}.json"
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        return data
    except (FileNotFoundError, NotADirectoryError):  # none kept (a cache that cannot be written says so when written)
        return None
    except (OSError, ValueError) as err:
        unreadable(name, err)
        return None


def unreadable(name: str, err: Exception) -> None:
    """Reports once that the costs kept under ``name`` cannot be read: they are measured anew (and then replaced)."""
    path = (directory() or Path()) / f"{name}.json"
    _report(str(path), f"eagle_jax: the round costs in {path} cannot be read ({err}); measuring them anew")


def save(name: str, costs: Any, *, now: bool = False) -> None:
    """Keeps ``costs`` (a ``SpanCosts``) under ``name``: at once where ``now`` or where none was written in the last
    ``SAVE_EVERY_S``; else at the process's exit. Written whole to a temporary file that then replaces the last."""
    if not now and name in _last_save and time.monotonic() - _last_save[name] < SAVE_EVERY_S:
        _pending[name] = costs
        return
    _pending.pop(name, None)
    where = directory()
    if where is None:
        return
    _last_save[name] = time.monotonic()
    text = json.dumps({"format": FORMAT, **costs.to_dict()})
    tmp = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=where, prefix=f".{name}.", suffix=".tmp", delete=False) as f:
            tmp = f.name
            f.write(text)
        os.replace(tmp, where / f"{name}.json")
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        _report(str(where), f"eagle_jax: cannot keep the round costs in {where} ({err}); they stay in this process")


@atexit.register
def flush() -> None:
    """Writes every costs whose write was put off (``save``); the next ``save`` of each then writes at once, as a
    new process's first does (``autospec.reset``)."""
    for name, costs in list(_pending.items()):
        save(name, costs, now=True)
    _last_save.clear()


def _report(what: str, message: str) -> None:
    if what not in _reported:
        _reported.add(what)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.cache
def _processor() -> str:
    """The CPU's model name (Linux), else what ``platform`` says: a round's cost on a CPU backend is that CPU's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _version() -> str:
    try:
        return metadata.version("eagle_jax")
    except metadata.PackageNotFoundError:
        return "unknown"
