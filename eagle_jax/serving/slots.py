"""The slot engine: a fixed number of batch rows ("slots") whose caches are allocated once.

A request's prompt is prefilled into a free slot by jitted prefill ``chunk`` programs of a few fixed sizes
(target prefill with aux capture and drafter prefill, each chunk after what the slot's caches hold: the
prompt's earlier chunks, or a prefix copied there), then advanced with every other occupied slot by a
jitted ``step``: up to ``rounds_per_step`` speculative rounds of the same ``one_round`` that ``generate``
runs, with per-slot sampling parameters, logits processors, keys, token limits and EOS handling
(``ignore_eos``) as arrays and free slots masked. The host (``scheduler.Scheduler``) admits, streams
and frees between steps.

The programs (``slot_programs``; compiled and kept by ``program_cache``) form a small fixed set
(``program_set``, ``eagle-jax-serve --list-programs``): a prefill chunk per chunk size, the slot row read a
chunk starts from, one cache row copy (prefix reuse, and the ``n`` choices of one prompt), a scoring
program per scoring bucket, and a step per (speculation config, rows): rows is the number of leading slots
a step computes (a power of four over the highest occupied slot). Attention in every program reads only
the cache blocks its rows reach (``layers.softmax_over_blocks``), so a short request alone costs a short
batch-1 forward, not the whole allocation, without a program per cache length. ``precompile`` compiles
the set (its steps are sampling programs, which run greedy rows exactly) before serving (the server's
default); then no request waits for a compile. Without it a program compiles when first needed, and
meanwhile a compiled step over more rows (which computes the same tokens) runs while its own compiles
in the background.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.config import ConfigError, SpecConfig, check_pair
from eagle_jax.decoding.calls import merged
from eagle_jax.decoding.engine import Plan, scratch_slots
from eagle_jax.decoding.penalties import RowPenalties
from eagle_jax.decoding.sampling import RowSampling, SamplingParams
from eagle_jax.decoding.scoring import TokenLogprobs, token_logprobs
from eagle_jax.decoding.state import LoopState
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.layers import read_spans
from eagle_jax.modeling.target import Target
from eagle_jax.serving.program_cache import ProgramCache, check_map_limit
from eagle_jax.serving.slot_programs import chunk_program, copy_program, row_program, step_program

Array = jax.Array
CHUNK_SIZES = (8, 32, 128)  # prefill chunk programs below the engine's ``chunk`` (its per-step prefill budget)
# What one more chunk costs, in computed prompt positions (the row read, the write-back, the call): a
# prompt is cut into the chunks of least positions + CHUNK_OVERHEAD each (BENCHMARKS.md, "A server's start").
CHUNK_OVERHEAD = 48
# Prompt tokens one step's prefill computes at most while streams decode: smaller keeps running streams
# smoother, larger keeps more rows busy (BENCHMARKS.md, "Prefix caching and chunked prefill (bench.prefill)").
DEFAULT_CHUNK = 512
DEFAULT_MAX_LEN = 4096  # a slot's tokens when no max_len is given (the target's context if shorter)
ROW_GROWTH = 4  # steps are compiled for 1, 4, 16, ... leading slots (``SlotEngine.rows_for``)
SCORE_MIN = 128  # the shortest scoring program; then four times longer each, up to the context
# Scoring programs longer than this are not run at warm-up: their first run's one-time cost is a small share
# of their own run (BENCHMARKS.md, "A server's start").
SCORE_WARMED = 512
CHUNK_DONATED = (2, 3, 4)  # a prefill chunk's state and its row (``row_program``'s copy, its own): written in place


def default_compile_workers() -> int:
    """Programs ``precompile`` compiles at once by default: one per core, at most 8 (each compile holds its own
    memory); one on a GPU, where XLA times candidate kernels on the device while compiling, and concurrent
    compiles would time each other's."""
    return 1 if jax.default_backend() == "gpu" else max(1, min(8, os.cpu_count() or 1))


def slot_len(target_config, max_len: int | None = None) -> int:
    """A slot's tokens at most: ``max_len``, else the target's context up to ``DEFAULT_MAX_LEN``."""
    return min(target_config.max_position_embeddings, DEFAULT_MAX_LEN) if max_len is None else int(max_len)


@dataclass
class StepOutput:
    """Host copies of what one step produced, per slot."""

    tokens: list[list[int]]  # new tokens of each slot (empty for free slots); may run past an EOS (see ``step``)
    done: np.ndarray  # [slots] bool: the slot stopped (EOS or its token limit) during or before the step
    accepted: list[list[int]]  # per slot, drafts accepted in each round it ran
    lengths: np.ndarray  # [slots] committed cache length after the step
    seconds: float  # wall time of the step (dispatch to results on the host)
    # [slots, 2] with a drafter: (summed chance that the drafter's first draft is accepted, rounds) over
    # the step's rounds without drafts (engine ``probe_acceptance``)
    probe: np.ndarray | None = None
    # whether ``seconds`` is what a step of its kind costs: its own program ran, and not for the first time (a program's
    # first run pays one-time costs, ~0.3 s on a CPU; a covering program computes more rows)
    timed: bool = True


class SlotEngine:
    """Device state and compiled programs for ``slots`` concurrent requests of at most ``max_len`` tokens.

    ``specs``: every speculation config the host may pick per step (None = no drafts); they share one
    state, so switching between them costs nothing but their first compilation. ``exact``: the target
    computes in float32 (``generate``'s exact mode): a request's greedy output then does not depend on
    which requests share its steps. ``pool_rows``: cache rows past the slots that keep prefixes for reuse
    (``prefix_cache``; steps never compute them).
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        *,
        slots: int = 16,
        max_len: int | None = None,
        specs: Sequence[SpecConfig | None] = (None,),
        rounds_per_step: int = 4,
        eos_ids: Sequence[int] = (),
        exact: bool = False,
        on_compile: Callable[[tuple, float], None] | None = None,
        chunk: int = DEFAULT_CHUNK,
        prefix_cache: bool = False,
        pool_rows: int = 0,
    ):
        if slots < 1:
            raise ConfigError(f"slots must be >= 1, got {slots}")
        if rounds_per_step < 1:
            raise ConfigError(f"rounds_per_step must be >= 1, got {rounds_per_step}")
        if chunk < CHUNK_SIZES[0]:
            raise ConfigError(f"the prefill chunk must be >= {CHUNK_SIZES[0]} tokens, got {chunk}")
        if pool_rows < 0 or (pool_rows and not prefix_cache):
            raise ConfigError(
                f"pool_rows (rows that keep prefixes) must be >= 0 and need prefix_cache, got {pool_rows}"
            )
        if drafter is not None:
            check_pair(target.config, drafter.config)
        if drafter is None and any(s is not None for s in specs):
            raise ConfigError("speculation configs were given but there is no drafter")
        limit = target.config.max_position_embeddings
        max_len = slot_len(target.config, max_len)
        if not 2 <= max_len <= limit:
            raise ConfigError(f"max_len must be in 2..{limit} (the target's max_position_embeddings), got {max_len}")
        self.target, self.drafter = target, drafter
        self.slots, self.max_len, self.rounds_per_step = slots, max_len, rounds_per_step
        self.specs = tuple(specs)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.exact = bool(exact)
        self.max_width = max(1 if s is None else s.max_emitted for s in self.specs)
        self.scratch = max(scratch_slots(s) for s in self.specs)
        self.cache_len = max_len + self.scratch + 1
        self.chunk_sizes = tuple(
            sorted({min(c, self.cache_len) for c in CHUNK_SIZES if c < chunk} | {min(chunk, self.cache_len)})
        )
        self.chunk, self.prefix_cache, self.pool_rows = chunk, bool(prefix_cache), pool_rows
        self._size_plans: dict[int, list[int]] = {}  # prompt positions -> chunk sizes (``_sizes_for``)
        self._t_graph, self._t_state = nnx.split(target)
        self._d_graph, self._d_state = (None, None) if drafter is None else nnx.split(drafter)
        self._precompiled = False  # ``precompile`` ran: steps use its programs only
        self._ran: set[tuple] = set()  # step programs that have run (``StepOutput.timed``)
        # What every program closes over besides its key and arguments (``compile_cache.compile_program``).
        fingerprint = repr(
            (
                target.config,
                None if drafter is None else drafter.config,
                self._t_graph,
                self._d_graph,
                self._plan(),
                self.rounds_per_step,
                self.chunk_sizes,
            )
        )
        self.programs = ProgramCache(fingerprint, on_compile)
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Every slot free, caches zeroed (also the way back after a failed program)."""
        self.state = self._empty_state()
        self._prompts: dict[int, tuple[int, ...]] = {}  # slot -> the prompt its caches hold (``prompt_of``)

    def _empty_state(self) -> LoopState:
        b, s = self.slots, self.cache_len
        rows = b + self.pool_rows  # the caches' rows past the slots keep prefixes
        d = self.drafter

        def zero():  # distinct buffers: the state is donated to every program
            return jnp.zeros((b,), jnp.int32)

        return LoopState(
            t_cache=self.target.init_cache(rows, s, jnp.float32 if self.exact else None),
            d_cache=None if d is None else d.init_cache(rows, s),
            length=zero(),
            pending=zero(),
            d_logits=None if d is None else jnp.zeros((b, d.config.draft_vocab_size), d.dtype),
            d_feat=None if d is None else jnp.zeros((b, d.config.hidden_size), d.dtype),
            out=jnp.zeros((b, (self.rounds_per_step + 1) * self.max_width), jnp.int32),
            n_out=zero(),
            limit=zero(),
            done=jnp.ones((b,), bool),
            accepted=jnp.full((b, self.rounds_per_step), -1, jnp.int32),
            rounds=jnp.int32(0),
            sampling=jax.tree.map(
                jnp.array,
                RowSampling.fill(  # device buffers of its own: the state is donated
                    SamplingParams(),
                    b,
                    RowPenalties.build([SamplingParams().penalties] * b, [[]] * b, self.target.config.vocab_size),
                ),
            ),
            key=jax.random.split(jax.random.key(0), b),
            probe=None if d is None else jnp.zeros((b, 2), jnp.float32),
            ignore_eos=jnp.zeros((b,), bool),
        )

    @property
    def row_bytes(self) -> int:
        """Bytes of one cache row (a slot's or a pool row's target and drafter caches)."""
        caches = (self.state.t_cache, self.state.d_cache)
        return sum(a.nbytes for a in jax.tree.leaves(caches)) // (self.slots + self.pool_rows)

    @property
    def compile_events(self) -> list[tuple[str, float]]:
        """(kind, seconds) of every program compiled so far."""
        return self.programs.events

    def wait_for_compiles(self) -> None:
        """Blocks until the programs being compiled in the background are ready (benchmarks)."""
        self.programs.wait()

    @property
    def score_buckets(self) -> tuple[int, ...]:
        """The lengths scoring programs are compiled for: SCORE_MIN, four times that, ..., then ``max_len``
        (which replaces a bucket within twice of it)."""
        out, n = [], SCORE_MIN
        while 2 * n < self.max_len:
            out.append(n)
            n *= 4
        return (*out, self.max_len)

    def row_counts(self) -> tuple[int, ...]:
        """The row counts steps are compiled for (``rows_for``)."""
        return tuple(sorted({self.rows_for([r]) for r in range(self.slots)}))

    def program_set(self, scoring: bool = True) -> list[tuple]:
        """The programs ``precompile`` compiles, which run every request: a prefill chunk per chunk size,
        the row read they start from, the row copy, (``scoring``) a scoring program per bucket, and a step per
        speculation config and row count (``rows_for``). Steps are sampling programs: they run greedy rows
        exactly (their p and q are one-hot, so the acceptance rules reduce to greedy verification), at about
        the cost of a greedy program, and half as many programs compile. (Without ``precompile`` a greedy
        step compiles its greedy program when first needed.)"""
        keys = [("chunk", c) for c in self.chunk_sizes] + [("row",), ("copy",)]
        keys += [("score", p) for p in self.score_buckets] if scoring else []
        return keys + [("step", spec, False, r) for spec in self.specs for r in self.row_counts()]

    def program_shapes(self, key: tuple) -> str:
        """What ``key``'s program computes, in shapes (``eagle-jax-serve --list-programs``)."""
        s = self.cache_len
        if key[0] == "chunk":
            return f"1 slot x {key[1]} prompt positions, over up to {s} cache slots"
        if key[0] == "row":
            return f"1 slot's caches ({self.row_bytes / 2**20:.1f} MiB)"
        if key[0] == "copy":
            return f"1 cache row of {self.slots + self.pool_rows} ({self.slots} slots, {self.pool_rows} pool rows)"
        if key[0] == "score":
            return f"1 sequence x {key[1]} tokens"
        spec, rows = key[1], key[3]
        verify = 1 if spec is None else spec.verify_width
        return (
            f"{rows} slot{'s' if rows > 1 else ''} x {verify} verified positions, up to {self.rounds_per_step} rounds "
            f"of up to {1 if spec is None else spec.max_emitted} tokens, over up to {s} cache slots"
        )

    def precompile(self, scoring: bool = True, warm_up: bool = True, workers: int = 1) -> None:
        """Compiles ``program_set`` (``on_compile`` hears each), so that serving never compiles: every step
        and prompt then finds its own program. With JAX's persistent compilation cache on (the server's
        default) a restart loads them instead. ``workers``: programs compiled at once (XLA compiles outside
        Python's lock; tracing stays one at a time). ``warm_up``: then runs each once (``warm_up``)."""
        if workers < 1:
            raise ConfigError(f"compile workers must be >= 1, got {workers}")
        keys = self.program_set(scoring)
        todo = [k for k in keys if k not in self.programs]
        check_map_limit(len(todo))
        self._precompiled = True
        recipes = [(key, *self._recipe(key)) for key in todo]  # example arguments read the engine's state here, once
        pool = ThreadPoolExecutor(max(1, min(workers, len(recipes))), thread_name_prefix="eagle_jax-precompile")
        try:
            for done in [pool.submit(self.programs.compiled, *recipe) for recipe in recipes]:
                done.result()
        finally:  # a failure is raised once the compiles under way end; the ones not started are dropped
            pool.shutdown(cancel_futures=True)
        if warm_up:
            self.warm_up(keys)

    def warm_up(self, keys: Sequence[tuple]) -> None:
        """Runs each program of ``keys`` once on throwaway rows (scoring programs up to SCORE_WARMED tokens),
        then frees every slot. A program's first run pays one-time costs (the CPU backend links its kernels
        then), which would otherwise land on the first requests; each step runs one round over rows that are not done
        (prefilled over whatever the slots held: one reset at the end, not one per program)."""
        for key in keys:
            if key[0] == "step":  # live rows under the step, each done after one more token (no prefill: throwaway)
                live = np.arange(self.slots) < key[3]
                self.state = dataclasses.replace(
                    self.state,
                    done=jnp.asarray(~live),
                    limit=jnp.full((self.slots,), 2, jnp.int32),
                    n_out=jnp.zeros((self.slots,), jnp.int32),
                )
                self.state = self.programs.programs[key](*self._example_args(key))
                self._ran.add(key)
            elif key[0] == "score":
                if key[1] <= SCORE_WARMED:
                    self._score_program(key[1])(self._t_state, jnp.zeros((1, key[1]), jnp.int32))
            elif key[0] == "copy":
                self.state = self._copy_program()(self.state, jnp.int32(0), jnp.int32(0), jnp.int32(0))
            elif key[0] == "row":
                self._row_program()(self.state, jnp.int32(0))
            else:
                self.state = self.programs.programs[key](*self._example_args(key))[0]
        jax.block_until_ready(self.state)
        self.reset()

    def _recipe(self, key: tuple) -> tuple[Callable, tuple, tuple[int, ...]]:
        """What compiling ``key``'s program takes: (the function, example arguments, donated arguments)."""
        if key[0] == "score":
            compute = jnp.float32 if self.exact else None
            return (
                lambda t_state, x: token_logprobs(nnx.merge(self._t_graph, t_state), x, compute_dtype=compute),
                (self._t_state, jax.ShapeDtypeStruct((1, key[1]), jnp.int32)),
                (),
            )
        if key[0] == "copy":
            return copy_program(), (self.state, jnp.int32(0), jnp.int32(0), jnp.int32(0)), (0,)
        if key[0] == "row":  # it reads the state, donates nothing
            return row_program(), (self.state, jnp.int32(0)), ()
        return self._build(key), self._example_args(key), CHUNK_DONATED if key[0] == "chunk" else (2,)

    def _build(self, key: tuple):
        """The function ``key``'s program compiles (prefill chunks, steps)."""
        if key[0] == "chunk":
            return chunk_program(self._merge, self._plan(), key[1])
        _, spec, greedy, rows = key
        return step_program(
            self._merge,
            self._plan(batch=rows, max_rounds=self.rounds_per_step, spec=spec, greedy=greedy, lazy_feed=True),
        )

    def _example_args(self, key: tuple) -> tuple:
        """Arguments of ``key``'s program for a one-token request in slot 0 (what precompiling traces and
        warming up runs)."""
        if key[0] == "chunk":
            return self._chunk_args(key[1], 0, [0], 0, 1, SamplingParams(), 0, True)
        return (
            self._t_state,
            self._d_state,
            self.state,
            jnp.zeros((self.slots,), bool),
            jnp.int32(self.rounds_per_step),
        )

    def _plan(self, **kw) -> Plan:
        """A program's plan: one row, the whole cache, no rounds, unless ``kw`` says otherwise."""
        return Plan(
            **{
                "batch": 1,
                "cache_len": self.cache_len,
                "max_rounds": 0,
                "spec": None,
                "greedy": False,
                "eos_ids": self.eos_ids,
                "exact": self.exact,
                **kw,
            }
        )

    def _merge(self, t_state, d_state):
        return merged(self._t_graph, t_state, self._d_graph, d_state)

    # ------------------------------------------------------------------ prefill

    def check_prompt(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Raises ConfigError naming what makes this request impossible in this engine."""
        if not prompt:
            raise ConfigError("the prompt is empty")
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt) + max_tokens > self.max_len:
            raise ConfigError(
                f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: {len(prompt) + max_tokens} "
                f"exceeds the context limit of {self.max_len} tokens"
            )

    def insert(
        self,
        slot: int,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams,
        seed: int,
        stop_at_eos: bool = True,
    ) -> tuple[int, bool]:
        """Prefills all of ``prompt`` into ``slot`` (free; ``prefill``); returns (first token, done already).
        With ``stop_at_eos`` False an EOS first token does not end the request (``ignore_eos``). ``sampling``
        holds the request's logits processors, ``stop_ids`` the tokens ``min_tokens`` holds back."""
        return self.prefill(slot, prompt, 0, len(prompt), max_tokens, sampling, seed, stop_at_eos)

    def prompt_of(self, slot: int) -> tuple[int, ...] | None:
        """The prompt whose prefill ``slot`` holds, None if none yet."""
        return self._prompts.get(slot)

    def chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        """(first position, size) of the prefill chunks that compute positions start..end-1: the least
        cost, counting each chunk's positions plus CHUNK_OVERHEAD, where a last chunk past ``end`` computes
        later prompt tokens (recomputed by the next prefill) or padding past the prompt (rewritten before it
        is read). Near the cache's end a chunk starts earlier instead, recomputing positions the cache
        holds (with the same values)."""
        out = []
        for c in self._sizes_for(end - start):
            at = min(start, self.cache_len - c)
            out.append((at, c))
            start = at + c
        return out

    def _sizes_for(self, n: int) -> list[int]:
        """Chunk sizes covering ``n`` positions at the least cost (``chunks``), largest first."""
        best = self._size_plans.get(n)
        if best is None:  # cost[i]: the least cost of covering i positions, a last chunk free to overshoot
            cost, pick = [0] + [0] * n, [0] * (n + 1)
            for i in range(1, n + 1):
                cost[i], pick[i] = min((cost[max(i - c, 0)] + c + CHUNK_OVERHEAD, c) for c in self.chunk_sizes)
            best, i = [], n
            while i > 0:
                best.append(pick[i])
                i = max(i - pick[i], 0)
            best = self._size_plans[n] = sorted(best, reverse=True)
        return list(best)

    def prefill(
        self,
        slot: int,
        prompt: Sequence[int],
        start: int,
        end: int,
        max_tokens: int,
        sampling: SamplingParams,
        seed: int,
        stop_at_eos: bool = True,
    ) -> tuple[int, bool] | None:
        """Computes prompt positions ``start..end-1`` into ``slot``, whose caches hold the prompt's first
        ``start`` positions (earlier chunks, or a prefix put there by ``copy_row``), in chunks (``chunks``). At
        the prompt's end the request starts and (first token, done) is returned; before it, None, and the
        row stays stopped (steps pass over it)."""
        self.check_prompt(prompt, max_tokens)
        if not 0 <= start < end <= len(prompt):
            raise ConfigError(f"a prefill must lie in the prompt: got {start}..{end} of {len(prompt)} tokens")
        for at, c in self.chunks(start, end):
            args = self._chunk_args(c, slot, prompt, at, max_tokens, sampling, seed, stop_at_eos)
            _, program = self.programs.get(("chunk", c), self._build(("chunk", c)), args, donate_argnums=CHUNK_DONATED)
            self.state, first, done = program(*args)
        if end < len(prompt):
            return None
        self._prompts[slot] = tuple(prompt)
        first, done = jax.device_get((first, done))
        return int(first), bool(done)

    def _chunk_args(
        self,
        c: int,
        slot: int,
        prompt: Sequence[int],
        start: int,
        max_tokens: int,
        sampling: SamplingParams,
        seed: int,
        stop_at_eos: bool,
    ) -> tuple:
        ids = np.zeros((1, c + 1), np.int32)
        part = prompt[start : start + c + 1]
        ids[0, : len(part)] = part
        rows = RowPenalties.build([sampling.penalties], [list(prompt)], self.target.config.vocab_size)
        t_row, d_row = self._row_program()(self.state, np.int32(slot))
        return (
            self._t_state,
            self._d_state,
            self.state,
            t_row,
            d_row,
            np.int32(slot),
            ids,
            np.int32(start),
            np.int32(len(prompt)),
            RowSampling.fill(sampling, 1, rows),
            jax.random.key(seed),
            np.int32(max_tokens),
            np.bool_(stop_at_eos),
        )

    def copy_row(self, src: tuple[str, int], dst: tuple[str, int], held: int = 0) -> None:
        """Copies one row of the target's and the drafter's caches, whole: ``("slot", i)`` or ``("pool", j)``
        (the rows that keep prefixes for reuse). A destination slot's row is stopped at length ``held``, the
        positions of the copy its next request keeps: a stopped row's rounds still write the cache slots
        past its length, so that length must not lie inside the kept prefix (a finished request's would)."""
        rows = []
        for kind, i in (src, dst):
            size = self.slots if kind == "slot" else self.pool_rows
            if kind not in ("slot", "pool") or not 0 <= i < size:
                raise ConfigError(f"no cache row {kind!r} {i} (slots: {self.slots}, pool rows: {self.pool_rows})")
            rows.append(i if kind == "slot" else self.slots + i)
        if not 0 <= held < self.cache_len:
            raise ConfigError(f"a copied row holds 0..{self.cache_len - 1} positions, got {held}")
        self.state = self._copy_program()(self.state, np.int32(rows[0]), np.int32(rows[1]), np.int32(held))
        if dst[0] == "slot":
            self._prompts.pop(dst[1], None)

    def _row_program(self):
        return self.programs.compiled(("row",), *self._recipe(("row",)))

    def _copy_program(self):
        return self.programs.compiled(("copy",), *self._recipe(("copy",)))

    # ------------------------------------------------------------------ scoring

    def score(self, ids: Sequence[int]) -> TokenLogprobs:
        """The target's log-probabilities of ``ids`` (``scoring.token_logprobs``), as numpy arrays of
        ``len(ids)`` entries; the sequence is padded to a scoring bucket (``score_buckets``)."""
        if not 1 <= len(ids) <= self.max_len:
            raise ConfigError(f"a scored sequence must have 1..{self.max_len} tokens, got {len(ids)}")
        p = next(b for b in self.score_buckets if b >= len(ids))
        padded = np.zeros((1, p), np.int32)
        padded[0, : len(ids)] = ids
        out = jax.device_get(self._score_program(p)(self._t_state, jnp.asarray(padded)))
        return TokenLogprobs(*(np.asarray(x[0, : len(ids)]) for x in out))

    def _score_program(self, p: int):
        return self.programs.compiled(("score", p), *self._recipe(("score", p)))

    # ------------------------------------------------------------------ step

    def span_for(self, lengths: Sequence[int], spec: SpecConfig | None) -> int:
        """The cache slots a step's attention reads for rows of these committed lengths (the least of
        ``layers.read_spans`` over what they reach): what its cost depends on besides rows and depth."""
        width = 1 if spec is None else spec.max_emitted
        need = max(lengths, default=1) + self.rounds_per_step * width + scratch_slots(spec) + 1
        return next(s for s in read_spans(self.cache_len) if s >= min(need, self.cache_len))

    def rows_for(self, occupied: Sequence[int]) -> int:
        """Leading slots a step runs: a power of ROW_GROWTH covering the highest occupied slot (free slots
        above it cost nothing; the scheduler fills the lowest free slot first), at most all of them."""
        need = max(occupied, default=0) + 1
        rows = 1
        while rows < need:
            rows *= ROW_GROWTH
        return min(rows, self.slots)

    def step(
        self,
        spec: SpecConfig | None,
        greedy: bool,
        rows: int | None = None,
        cancel: np.ndarray | None = None,
        rounds: int | None = None,
    ) -> StepOutput:
        """Up to ``rounds`` rounds (default and at most ``rounds_per_step``; the same program whatever the
        count) over the first ``rows`` slots (default all); slots in ``cancel`` are stopped first. Rows stop at the
        engine's EOS unless inserted with ``stop_at_eos`` False; the caller cuts each row's tokens at its own stop
        tokens (``stop_token_ids``)."""
        if spec not in self.specs:
            raise ConfigError(f"spec {spec} is not one of this engine's configured specs {self.specs}")
        rows = self.slots if rows is None else rows
        cancel = np.zeros((self.slots,), bool) if cancel is None else np.asarray(cancel, bool)
        rounds = self.rounds_per_step if rounds is None else rounds
        if not 1 <= rounds <= self.rounds_per_step:
            raise ConfigError(f"a step runs 1..{self.rounds_per_step} rounds, got {rounds}")
        args = (self._t_state, self._d_state, self.state, cancel, np.int32(rounds))
        if greedy and self._precompiled and ("step", spec, True, rows) not in self.programs:
            greedy = False  # the precompiled sampling program runs greedy rows exactly: nothing compiles while serving
        key = ("step", spec, greedy, rows)
        ran, program = self.programs.get(key, self._build(key), args, covers=self._covering(*key[1:]))
        timed = ran == key and ran in self._ran
        self._ran.add(ran)
        t0 = time.perf_counter()
        self.state = program(*args)
        out, n_out, done, accepted, length, probe = jax.device_get(
            (
                self.state.out,
                self.state.n_out,
                self.state.done,
                self.state.accepted,
                self.state.length,
                self.state.probe,
            )
        )
        seconds = time.perf_counter() - t0
        tokens = [out[b, : n_out[b]].tolist() for b in range(self.slots)]
        acc = [[int(a) for a in row if a >= 0] for row in accepted]
        return StepOutput(tokens, done, acc, length, seconds, probe, timed=timed)

    def _covering(self, spec: SpecConfig | None, greedy: bool, rows: int) -> list[tuple]:
        """Compiled step programs that can run this step, cheapest first: any row count at least as large,
        and sampling programs for greedy rows (whose p and q are then one-hot)."""
        keys = [
            k
            for k in self.programs.keys()
            if k[0] == "step" and k[1] == spec and k[3] >= rows and (k[2] == greedy or not k[2])
        ]
        return sorted(keys, key=lambda k: (k[3], k[2] != greedy))
