"""The slot engine's compiled programs, by key: each compiled once (or loaded from JAX's persistent
compilation cache, ``compile_cache.compile_program``), every compile reported (``on_compile``, the
server's log line and metric), and a program not compiled yet stood in for by a compiled one that
covers it while it compiles in the background (``get``).

Keys (``describe``): ``("chunk", size)``, ``("row",)``, ``("copy",)``, ``("score", bucket)`` and
``("step", spec, greedy, rows)``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from eagle_jax.compile_cache import compile_program
from eagle_jax.config import ConfigError

# Memory maps one compiled program holds on the CPU backend (LLVM maps each kernel's code sections apart;
# measured: ~410 per program of the serving set); Linux allows 65530 maps per process by default.
CPU_MAPS_PER_PROGRAM = 450


def describe(key: tuple) -> str:
    """A program key in words (the server logs one line per compiled program)."""
    if key[0] == "score":
        return f"score of sequences up to {key[1]} tokens"
    if key[0] == "chunk":
        return f"prefill chunk of {key[1]} tokens"
    if key[0] == "copy":
        return "cache row copy"
    if key[0] == "row":
        return "cache row read (a prefill chunk's input)"
    _, spec, greedy, rows = key
    depth = (
        "no drafts"
        if spec is None
        else (
            f"chain K={spec.num_speculative_tokens}"
            if spec.method == "chain"
            else f"tree {spec.tree_top_k}/{spec.tree_depth}/{spec.tree_total_tokens}"
        )
    )
    return f"step, {depth}, {'greedy' if greedy else 'sampling'}, {rows} row{'s' if rows > 1 else ''}"


def check_map_limit(programs: int, limit_file: str = "/proc/sys/vm/max_map_count") -> None:
    """Raises ConfigError where compiling ``programs`` more CPU programs would pass the process's
    memory-map limit: LLVM then aborts the whole process ("Unable to allocate section memory")."""
    if jax.default_backend() != "cpu" or not Path(limit_file).exists():
        return
    limit = int(Path(limit_file).read_text())
    in_use = sum(1 for _ in open("/proc/self/maps"))
    need = in_use + programs * CPU_MAPS_PER_PROGRAM
    if need > limit:
        raise ConfigError(
            f"precompiling {programs} programs on the CPU needs about {need} memory maps, more than this system's "
            f"vm.max_map_count ({limit}): raise it (sysctl -w vm.max_map_count={1 << (need * 2).bit_length()}), "
            "serve fewer speculation depths, slots or context (fewer programs), or do not precompile"
        )


def shapes(args: Any) -> Any:
    """Shapes only, which is what compiling needs (the arrays themselves may be donated meanwhile)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), args)


class ProgramCache:
    """Compiled programs by key. ``fingerprint``: what every program closes over besides its key and
    arguments (the persistent cache's key); ``on_compile(key, seconds)`` hears every compile."""

    def __init__(self, fingerprint: str, on_compile: Callable[[tuple, float], None] | None = None):
        self.fingerprint, self.on_compile = fingerprint, on_compile
        self.programs: dict[tuple, Any] = {}
        self.events: list[tuple[str, float]] = []  # (kind, seconds) per compile
        self._pending: set[tuple] = set()
        self._lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="eagle_jax-compile")

    def __contains__(self, key: tuple) -> bool:
        with self._lock:
            return key in self.programs

    def keys(self) -> list[tuple]:
        with self._lock:
            return list(self.programs)

    def compiled(self, key: tuple, build: Callable, args: Any, donate_argnums: tuple[int, ...] = (2,)):
        """The program for ``key``, compiled here if it is not yet."""
        with self._lock:
            program = self.programs.get(key)
        return program if program is not None else self.compile(key, build, shapes(args), donate_argnums)

    def get(
        self,
        key: tuple,
        build: Callable,
        args: tuple,
        covers: Sequence[tuple] = (),
        donate_argnums: tuple[int, ...] = (2,),
    ):
        """The compiled program for ``key``. If it is not compiled yet but a program in ``covers`` is (a
        larger one that computes the same thing), that one runs now and ``key`` is compiled in the
        background; with none, ``key`` is compiled here.
        Returns (the key of the program that runs, the program).
        """
        with self._lock:
            if key in self.programs:
                return key, self.programs[key]
            used = next((c for c in covers if c in self.programs), None)
            background = used is not None and key not in self._pending
            if background:
                self._pending.add(key)
        if used is not None and not background:  # already being compiled
            return used, self.programs[used]
        if background:
            self._compiler.submit(self.compile, key, build, shapes(args), donate_argnums)
            return used, self.programs[used]
        return key, self.compile(key, build, shapes(args), donate_argnums)

    def compile(self, key: tuple, build: Callable, abstract: Any, donate_argnums: tuple[int, ...] = (2,)):
        t0 = time.perf_counter()
        program = compile_program(
            build, abstract, donate_argnums=donate_argnums, fingerprint=f"{self.fingerprint}|{key!r}"
        )
        seconds = time.perf_counter() - t0
        with self._lock:
            self.programs[key] = program
            self._pending.discard(key)
            self.events.append((key[0], seconds))
        if self.on_compile is not None:
            self.on_compile(key, seconds)
        return program

    def wait(self) -> None:
        """Blocks until the programs being compiled in the background are ready (benchmarks)."""
        self._compiler.submit(lambda: None).result()
