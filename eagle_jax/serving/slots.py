"""The slot engine: a fixed number of batch rows ("slots") whose caches are allocated once.

A request is prefilled into a free slot by a jitted ``insert`` (target prefill with aux capture and
drafter prefill; up to ``INSERT_ROWS`` waiting prompts packed into one row, each attending only to
itself, padded to a length bucket), then advanced with every other occupied slot by a
jitted ``step``: up to ``rounds_per_step`` speculative rounds of the same ``one_round`` that ``generate``
runs, with per-slot sampling parameters, logits processors, keys, token limits and EOS handling
(``ignore_eos``) as arrays and free slots masked. The host (``scheduler.Scheduler``) admits, streams
and frees between steps.

The programs (``slot_programs``; compiled and kept by ``program_cache``) form a fixed set (``program_set``): an ``insert`` and a scoring program per prompt bucket, a ``fork``,
and a ``step`` per (speculation config, greedy or not, rows, span): rows is the number of leading slots a
step computes (a power of two over the highest occupied slot) and span the number of leading cache slots
its rounds read (the least of ``spans``, powers of two from MIN_SPAN, that covers the longest occupied
slot), so a short request alone costs a short batch-1 forward, not the whole allocation. ``precompile``
compiles the set (its steps are sampling programs, which run greedy rows exactly) before serving (the
server's default); then no request waits for a compile. Without it
a program compiles when first needed, and meanwhile a compiled one with a larger span and more rows (which
computes the same tokens) runs the step while its own compiles in the background.
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
from eagle_jax.decoding.engine import Plan, scratch_slots
from eagle_jax.decoding.penalties import RowPenalties
from eagle_jax.decoding.sampling import RowSampling, SamplingParams
from eagle_jax.decoding.scoring import TokenLogprobs, token_logprobs
from eagle_jax.decoding.state import LoopState
from eagle_jax.decoding.calls import PROMPT_BUCKETS, bucket, merged
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target
from eagle_jax.serving.program_cache import ProgramCache, check_map_limit
from eagle_jax.serving.slot_programs import (INSERT_ROWS, chunk_program, copy_program, fork_program, insert_program, row_program,
                                             step_program)

Array = jax.Array
MIN_SPAN = 256  # the shortest span a step is compiled for (``SlotEngine.spans``)
CHUNK_SIZES = (32, 128)  # prefill chunk programs below the engine's ``chunk`` (its per-step prefill budget)
# Prompt tokens one step's prefill computes at most while streams decode: smaller keeps running streams
# smoother, larger keeps more rows busy (BENCHMARKS.md, "Prefix caching and chunked prefill").
DEFAULT_CHUNK = 512
DEFAULT_MAX_LEN = 4096  # a slot's tokens when no max_len is given (the target's context if shorter)


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
    # first run pays one-time costs, ~0.3 s on a CPU; a covering program computes more rows or a longer span)
    timed: bool = True


@dataclass(frozen=True)
class Admission:
    """A request starting in a free slot (``SlotEngine.insert_many``): its prompt, token limit, sampling
    rules and logits processors (``sampling.stop_ids``: what ``min_tokens`` holds back), seed, whether EOS ends it."""

    slot: int
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    stop_at_eos: bool = True


class SlotEngine:
    """Device state and compiled programs for ``slots`` concurrent requests of at most ``max_len`` tokens.

    ``specs``: every speculation config the host may pick per step (None = no drafts); they share one
    state, so switching between them costs nothing but their first compilation. ``exact``: the target
    computes in float32 (``generate``'s exact mode): a request's greedy output then does not depend on
    which requests share its steps.
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
            raise ConfigError(f"pool_rows (rows that keep prefixes) must be >= 0 and need prefix_cache, got {pool_rows}")
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
        self.chunk_sizes = tuple(sorted({min(c, self.cache_len) for c in CHUNK_SIZES if c < chunk} | {min(chunk, self.cache_len)}))
        self.chunk, self.prefix_cache, self.pool_rows = chunk, bool(prefix_cache), pool_rows
        self._t_graph, self._t_state = nnx.split(target)
        self._d_graph, self._d_state = (None, None) if drafter is None else nnx.split(drafter)
        self._precompiled = False  # ``precompile`` ran: steps use its programs only
        self._ran: set[tuple] = set()  # step programs that have run (``StepOutput.timed``)
        # What every program closes over besides its key and arguments (``compile_cache.compile_program``).
        fingerprint = repr((target.config, None if drafter is None else drafter.config, self._t_graph, self._d_graph,
                            self._plan(), self.rounds_per_step, self.chunk_sizes))
        self.programs = ProgramCache(fingerprint, on_compile)
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Every slot free, caches zeroed (also the way back after a failed program)."""
        self.state = self._empty_state()
        # Rows beside the slots that keep caches for prefix reuse (``copy_row``); steps never touch them.
        d = self.drafter
        self.pool = (self.target.init_cache(self.pool_rows, self.cache_len, jnp.float32 if self.exact else None),
                     None if d is None else d.init_cache(self.pool_rows, self.cache_len))
        self._prompts: dict[int, tuple] = {}  # slot -> (prompt, last-position logits, aux) of its prefill (``fork``)

    def _empty_state(self) -> LoopState:
        b, s = self.slots, self.cache_len
        d = self.drafter

        def zero():  # distinct buffers: the state is donated to every program
            return jnp.zeros((b,), jnp.int32)

        return LoopState(
            t_cache=self.target.init_cache(b, s, jnp.float32 if self.exact else None),
            d_cache=None if d is None else d.init_cache(b, s),
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
            sampling=RowSampling.fill(SamplingParams(), b, RowPenalties.build([SamplingParams().penalties] * b, [[]] * b, self.target.config.vocab_size)),
            key=jax.random.split(jax.random.key(0), b),
            probe=None if d is None else jnp.zeros((b, 2), jnp.float32),
            ignore_eos=jnp.zeros((b,), bool),
        )

    @property
    def compile_events(self) -> list[tuple[str, float]]:
        """(kind, seconds) of every program compiled so far."""
        return self.programs.events

    def wait_for_compiles(self) -> None:
        """Blocks until the programs being compiled in the background are ready (benchmarks)."""
        self.programs.wait()

    def program_set(self, scoring: bool = True) -> list[tuple]:
        """The programs ``precompile`` compiles, which run every request: an insert and (``scoring``) a
        scoring program per prompt bucket; the fork; a step per speculation config, row count
        (``rows_for``) and span (``spans``). Steps are sampling programs: they run greedy rows exactly
        (their p and q are one-hot, so the acceptance rules reduce to greedy verification), at about the
        cost of a greedy program, and half as many programs compile. (Without ``precompile`` a greedy
        step compiles its greedy program when first needed.)"""
        buckets = sorted({self._insert_bucket(b) for b in PROMPT_BUCKETS if b < bucket(self.max_len)} | {self._insert_bucket(self.max_len)})
        keys = [("insert", p) for p in buckets] + [("fork",)] + ([("score", p) for p in buckets] if scoring else [])
        keys += [("row",)] + [("chunk", c, span) for c in self.chunk_sizes for span in self.spans if span >= c]
        if self.prefix_cache:
            keys += [("copy", "slot", "slot")] + ([("copy", "slot", "pool"), ("copy", "pool", "slot")] if self.pool_rows else [])
        rows = sorted({self.rows_for([r - 1]) for r in range(1, self.slots + 1)})
        return keys + [("step", spec, False, span, r) for spec in self.specs for r in rows for span in self.spans]

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
        """Runs each program of ``keys`` once on throwaway rows, then frees every slot. A program's first run
        pays one-time costs (the CPU backend links its kernels then), which would otherwise land on the
        first requests; each step runs one round over rows that are not done (inserted over whatever the
        slots held: one reset at the end, not one per program)."""
        for key in keys:
            if key[0] == "step":
                rows = key[4]
                for first in range(0, rows, INSERT_ROWS):  # live rows under the step, each done after one more token
                    self.insert_many([Admission(slot, (0,), 2, SamplingParams(), 0) for slot in range(first, min(first + INSERT_ROWS, rows))])
                self.state = self.programs.programs[key](*self._example_args(key))
                self._ran.add(key)
            elif key[0] == "score":
                self._score_program(key[1])(self._t_state, jnp.zeros((1, key[1]), jnp.int32))
            elif key[0] == "copy":
                self.state, self.pool = self._copy_program(key)(self.state, self.pool, jnp.int32(0), jnp.int32(0), jnp.int32(0))
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
            return (lambda t_state, x: token_logprobs(nnx.merge(self._t_graph, t_state), x, compute_dtype=compute),
                    (self._t_state, jax.ShapeDtypeStruct((1, key[1]), jnp.int32)), ())
        if key[0] == "copy":
            return copy_program(key[1], key[2]), (self.state, self.pool, jnp.int32(0), jnp.int32(0), jnp.int32(0)), (0, 1)
        if key[0] == "row":  # it reads the state, donates nothing
            return row_program(), (self.state, jnp.int32(0)), ()
        return self._build(key), self._example_args(key), (2,)

    def _build(self, key: tuple):
        """The function ``key``'s program compiles (inserts, the fork, prefill chunks, steps)."""
        if key[0] == "insert":
            return self._insert_fn(key[1])
        if key[0] == "fork":
            return self._fork_fn()
        if key[0] == "chunk":
            return self._chunk_fn(*key[1:])
        return self._step_fn(*key[1:])

    def _example_args(self, key: tuple) -> tuple:
        """Arguments of ``key``'s program for a one-token request in slot 0 (what precompiling traces and
        warming up runs)."""
        if key[0] == "insert":
            return self._insert_args(key[1], [Admission(0, (0,), 1, SamplingParams(), 0)])
        if key[0] == "fork":
            args = self._fork_args(0, 0, (0,), None, None, 1, SamplingParams(), 0, True)
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, args)
        if key[0] == "chunk":
            return self._chunk_args(key[1], 0, [0], 0, 1, SamplingParams(), 0, True)
        return (self._t_state, self._d_state, self.state, jnp.zeros((self.slots,), bool), jnp.int32(self.rounds_per_step))

    def _plan(self, **kw) -> Plan:
        """A program's plan: one row, the whole cache, no rounds, unless ``kw`` says otherwise."""
        return Plan(**{"batch": 1, "cache_len": self.cache_len, "max_rounds": 0, "spec": None, "greedy": False,
                       "eos_ids": self.eos_ids, "exact": self.exact, **kw})

    def _insert_fn(self, p: int):
        return insert_program(self._merge, self._plan(batch=INSERT_ROWS, cache_len=p))

    def _fork_fn(self):
        return fork_program(self._merge, self._plan())

    def _chunk_fn(self, c: int, span: int):
        return chunk_program(self._merge, self._plan(span=span), c)

    def _step_fn(self, spec: SpecConfig | None, greedy: bool, span: int, rows: int):
        return step_program(self._merge, self._plan(batch=rows, max_rounds=self.rounds_per_step, spec=spec, greedy=greedy, span=span,
                                                    lazy_feed=True))

    def _merge(self, t_state, d_state):
        return merged(self._t_graph, t_state, self._d_graph, d_state)

    # ------------------------------------------------------------------ insert

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

    def insert(self, slot: int, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams, seed: int,
               stop_at_eos: bool = True) -> tuple[int, bool]:
        """Prefills ``prompt`` into ``slot`` (free); returns (first token, done already). With
        ``stop_at_eos`` False an EOS first token does not end the request (``ignore_eos``). ``sampling``
        holds the request's logits processors, ``stop_ids`` the tokens ``min_tokens`` holds back."""
        return self.insert_many([Admission(slot, tuple(prompt), max_tokens, sampling, seed, stop_at_eos)])[0]

    def insert_many(self, rows: Sequence["Admission"]) -> list[tuple[int, bool]]:
        """Prefills up to ``INSERT_ROWS`` prompts into their (free, distinct) slots in one program, packed
        into one row of their summed length (``prefill_packed``): what ``insert`` gives each alone."""
        if not 1 <= len(rows) <= INSERT_ROWS or len({r.slot for r in rows}) != len(rows):
            raise ConfigError(f"one insert takes 1..{INSERT_ROWS} prompts for distinct slots, got slots {[r.slot for r in rows]}")
        for r in rows:
            self.check_prompt(r.prompt, r.max_tokens)
        total = sum(len(r.prompt) for r in rows)
        if total > self.cache_len:
            raise ConfigError(f"prompts of {total} tokens in all do not fit one insert (at most {self.cache_len})")
        p = self._insert_bucket(total)
        largest = self._insert_bucket(self.max_len - 1)
        larger = [("insert", b) for b in sorted({self._insert_bucket(b) for b in PROMPT_BUCKETS}) if p < b <= largest]
        args = self._insert_args(p, rows)
        key, program = self.programs.get(("insert", p), self._insert_fn(p), args, covers=larger)
        if key[1] != p:  # a larger bucket's program: pad further
            args = self._insert_args(key[1], rows)
        self.state, first, done, last_logits, last_aux = program(*args)
        for i, r in enumerate(rows):
            self._prompts[r.slot] = (tuple(r.prompt), last_logits[i: i + 1], None if last_aux is None else last_aux[i: i + 1])
        first, done = jax.device_get((first, done))
        return [(int(first[i]), bool(done[i])) for i in range(len(rows))]

    def prompt_of(self, slot: int) -> tuple[int, ...] | None:
        """The prompt whose prefill ``slot`` holds (inserted or forked there), None if none yet."""
        entry = self._prompts.get(slot)
        return None if entry is None else entry[0]

    def fork(self, src: int, dst: int, max_tokens: int, sampling: SamplingParams, seed: int, stop_at_eos: bool = True) -> tuple[int, bool]:
        """Starts another request for the prompt prefilled in ``src`` in slot ``dst`` (free) without a
        prefill: the prompt's cache rows are copied, the first token is drawn from the stored last-position
        logits with this request's rules and seed, and the drafter's last prompt position is recomputed for
        it. ``src`` may have decoded meanwhile (rounds only write past the prompt). Returns as ``insert``."""
        if src == dst or src not in self._prompts:
            raise ConfigError(f"slot {src} holds no prefill to fork into slot {dst}")
        prompt, last_logits, last_aux = self._prompts[src]
        self.check_prompt(prompt, max_tokens)
        args = self._fork_args(src, dst, prompt, last_logits, last_aux, max_tokens, sampling, seed, stop_at_eos)
        _, program = self.programs.get(("fork",), self._fork_fn(), args)
        self.state, first, done = program(*args)
        self._prompts[dst] = self._prompts[src]
        first, done = jax.device_get((first, done))
        return int(first), bool(done)

    def _insert_bucket(self, n: int) -> int:
        return min(bucket(n), self.cache_len)

    def _insert_args(self, p: int, rows: Sequence["Admission"]) -> tuple:
        """The packed row of ``rows``' prompts and their per-prompt arrays, padded to ``INSERT_ROWS`` by
        repeating the first (a repeated row writes what the first does)."""
        ids, positions, segments = (np.zeros((1, p), np.int32) for _ in range(3))
        starts, at = [], 0
        for i, r in enumerate(rows):
            n = len(r.prompt)
            ids[0, at: at + n], positions[0, at: at + n], segments[0, at: at + n] = r.prompt, np.arange(n), i + 1
            starts.append(at)
            at += n
        pad = [0] * (INSERT_ROWS - len(rows))
        rows, starts = [*rows, *(rows[i] for i in pad)], starts + [starts[i] for i in pad]
        penalties = RowPenalties.build([r.sampling.penalties for r in rows], [list(r.prompt) for r in rows], self.target.config.vocab_size)
        sampling = jax.tree.map(lambda *a: jnp.concatenate(a), *(RowSampling.fill(r.sampling, 1) for r in rows))
        sampling = dataclasses.replace(sampling, penalties=penalties)

        def col(values, dtype):
            return jnp.asarray(values, dtype)

        return (self._t_state, self._d_state, self.state, col([r.slot for r in rows], jnp.int32), jnp.asarray(ids), jnp.asarray(positions),
                jnp.asarray(segments), col(starts, jnp.int32), col([len(r.prompt) for r in rows], jnp.int32), sampling,
                jnp.stack([jax.random.key(r.seed) for r in rows]), col([r.max_tokens for r in rows], jnp.int32),
                col([r.stop_at_eos for r in rows], jnp.bool_))

    def _fork_args(self, src: int, dst: int, prompt: Sequence[int], last_logits, last_aux, max_tokens: int, sampling: SamplingParams,
                   seed: int, stop_at_eos: bool) -> tuple:
        if last_logits is None:  # shapes only (``precompile``): what an insert leaves
            p = self._insert_bucket(1)
            out = jax.eval_shape(self._insert_fn(p), *self._insert_args(p, [Admission(0, (0,), 1, SamplingParams(), 0)]))
            last_logits, last_aux = (None if o is None else jax.ShapeDtypeStruct((1, *o.shape[1:]), o.dtype) for o in out[3:5])
        rows = RowPenalties.build([sampling.penalties], [list(prompt)], self.target.config.vocab_size)
        return (self._t_state, self._d_state, self.state, jnp.int32(src), jnp.int32(dst), jnp.int32(len(prompt)), last_logits, last_aux,
                RowSampling.fill(sampling, 1, rows), jax.random.key(seed), jnp.int32(max_tokens), jnp.bool_(stop_at_eos))

    # ------------------------------------------------------------------ chunked prefill, prefix reuse

    def chunk_program_for(self, start: int, n: int) -> tuple[int, int, int]:
        """(first position, chunk size, span) of the program that computes prompt positions start..start+n-1
        (``n`` at most ``chunk``): the least chunk size that holds them, and the least span over its end.
        Near the cache's end the chunk starts earlier instead, recomputing positions the cache holds
        (with the same values)."""
        if not 1 <= n <= self.chunk:
            raise ConfigError(f"a prefill chunk has 1..{self.chunk} tokens, got {n}")
        c = next(c for c in self.chunk_sizes if c >= n)
        start = min(start, self.cache_len - c)
        return start, c, next(s for s in self.spans if s >= min(start + c, self.cache_len))

    def prefill_chunk(self, slot: int, prompt: Sequence[int], start: int, end: int, max_tokens: int, sampling: SamplingParams,
                      seed: int, stop_at_eos: bool = True) -> tuple[int, bool] | None:
        """Computes prompt positions ``start..end-1`` (at most ``chunk``) into ``slot``, whose caches hold the
        prompt's first ``start`` positions (earlier chunks, or a prefix put there by ``copy_row``). At the
        prompt's end the request starts as ``insert`` starts it and (first token, done) is returned; before
        it, None, and the row stays stopped (steps pass over it)."""
        self.check_prompt(prompt, max_tokens)
        if not 0 <= start < end <= len(prompt):
            raise ConfigError(f"a prefill chunk must lie in the prompt: got {start}..{end} of {len(prompt)} tokens")
        start, c, span = self.chunk_program_for(start, end - start)
        args = self._chunk_args(c, slot, prompt, start, max_tokens, sampling, seed, stop_at_eos)
        _, program = self.programs.get(("chunk", c, span), self._chunk_fn(c, span), args)
        self.state, first, done, last_logits, last_aux = program(*args)
        if end < len(prompt):
            return None
        self._prompts[slot] = (tuple(prompt), last_logits, last_aux)
        first, done = jax.device_get((first, done))
        return int(first), bool(done)

    def _chunk_args(self, c: int, slot: int, prompt: Sequence[int], start: int, max_tokens: int, sampling: SamplingParams,
                    seed: int, stop_at_eos: bool) -> tuple:
        ids = np.zeros((1, c + 1), np.int32)
        part = prompt[start: start + c + 1]
        ids[0, : len(part)] = part
        rows = RowPenalties.build([sampling.penalties], [list(prompt)], self.target.config.vocab_size)
        t_row, d_row = self._row_program()(self.state, jnp.int32(slot))
        return (self._t_state, self._d_state, self.state, t_row, d_row, jnp.int32(slot), jnp.asarray(ids), jnp.int32(start), jnp.int32(len(prompt)),
                RowSampling.fill(sampling, 1, rows), jax.random.key(seed), jnp.int32(max_tokens), jnp.bool_(stop_at_eos))

    def copy_row(self, src: tuple[str, int], dst: tuple[str, int], held: int = 0) -> None:
        """Copies one row of the target's and the drafter's caches, whole: ``("slot", i)`` or ``("pool", j)``
        (the rows that keep prefixes for reuse). A destination slot's row is stopped at length ``held``, the
        positions of the copy its next request keeps: a stopped row's rounds still write the cache slots
        past its length, so that length must not lie inside the kept prefix (a finished request's would)."""
        for kind, i in (src, dst):
            size = self.slots if kind == "slot" else self.pool_rows
            if kind not in ("slot", "pool") or not 0 <= i < size:
                raise ConfigError(f"no cache row {kind!r} {i} (slots: {self.slots}, pool rows: {self.pool_rows})")
        if not 0 <= held < self.cache_len:
            raise ConfigError(f"a copied row holds 0..{self.cache_len - 1} positions, got {held}")
        program = self._copy_program(("copy", src[0], dst[0]))
        self.state, self.pool = program(self.state, self.pool, jnp.int32(src[1]), jnp.int32(dst[1]), jnp.int32(held))

    def _row_program(self):
        return self.programs.compiled(("row",), *self._recipe(("row",)))

    def _copy_program(self, key: tuple):
        return self.programs.compiled(key, *self._recipe(key))

    # ------------------------------------------------------------------ scoring

    def score(self, ids: Sequence[int]) -> TokenLogprobs:
        """The target's log-probabilities of ``ids`` (``scoring.token_logprobs``), as numpy arrays of
        ``len(ids)`` entries; the sequence is padded to a prompt bucket (one program per bucket)."""
        if not 1 <= len(ids) <= self.max_len:
            raise ConfigError(f"a scored sequence must have 1..{self.max_len} tokens, got {len(ids)}")
        p = self._insert_bucket(len(ids))
        padded = np.zeros((1, p), np.int32)
        padded[0, : len(ids)] = ids
        out = jax.device_get(self._score_program(p)(self._t_state, jnp.asarray(padded)))
        return TokenLogprobs(*(np.asarray(x[0, : len(ids)]) for x in out))

    def _score_program(self, p: int):
        return self.programs.compiled(("score", p), *self._recipe(("score", p)))

    # ------------------------------------------------------------------ step

    @property
    def spans(self) -> tuple[int, ...]:
        """The spans steps are compiled for: powers of two from MIN_SPAN, and the whole cache (which
        replaces a power of two within 25% of it)."""
        out, s = [], MIN_SPAN
        while 1.25 * s < self.cache_len:
            out.append(s)
            s *= 2
        return (*out, self.cache_len)

    def span_for(self, lengths: Sequence[int], spec: SpecConfig | None) -> int:
        """Leading cache slots a step must cover for rows of these committed lengths (the least of ``spans``:
        attention then reads fewer than twice the slots in use)."""
        width = 1 if spec is None else spec.max_emitted
        need = max(lengths, default=1) + self.rounds_per_step * width + scratch_slots(spec) + 1
        return next(s for s in self.spans if s >= min(need, self.cache_len))

    def rows_for(self, occupied: Sequence[int]) -> int:
        """Leading slots a step runs: a power of two covering the highest occupied slot (free slots
        above it cost nothing; the scheduler fills the lowest free slot first)."""
        need = max(occupied, default=0) + 1
        rows = 1
        while rows < need:
            rows *= 2
        return min(rows, self.slots)

    def step(self, spec: SpecConfig | None, greedy: bool, span: int, rows: int | None = None,
             cancel: np.ndarray | None = None, rounds: int | None = None) -> StepOutput:
        """Up to ``rounds`` rounds (default and at most ``rounds_per_step``; the same program whatever the
        count) over the first ``rows`` slots (default all); slots in ``cancel`` are stopped first. Rows stop at the engine's EOS unless inserted with ``stop_at_eos``
        False; the caller cuts each row's tokens at its own stop tokens (``stop_token_ids``)."""
        if spec not in self.specs:
            raise ConfigError(f"spec {spec} is not one of this engine's configured specs {self.specs}")
        rows = self.slots if rows is None else rows
        cancel = np.zeros((self.slots,), bool) if cancel is None else np.asarray(cancel, bool)
        rounds = self.rounds_per_step if rounds is None else rounds
        if not 1 <= rounds <= self.rounds_per_step:
            raise ConfigError(f"a step runs 1..{self.rounds_per_step} rounds, got {rounds}")
        args = (self._t_state, self._d_state, self.state, jnp.asarray(cancel), jnp.int32(rounds))
        if greedy and self._precompiled and ("step", spec, True, span, rows) not in self.programs:
            greedy = False  # the precompiled sampling program runs greedy rows exactly: nothing compiles while serving
        key = ("step", spec, greedy, span, rows)
        ran, program = self.programs.get(key, self._step_fn(*key[1:]), args, covers=self._covering(*key[1:]))
        timed = ran == key and ran in self._ran
        self._ran.add(ran)
        t0 = time.perf_counter()
        self.state = program(*args)
        out, n_out, done, accepted, length, probe = jax.device_get(
            (self.state.out, self.state.n_out, self.state.done, self.state.accepted, self.state.length, self.state.probe)
        )
        seconds = time.perf_counter() - t0
        tokens = [out[b, : n_out[b]].tolist() for b in range(self.slots)]
        acc = [[int(a) for a in row if a >= 0] for row in accepted]
        return StepOutput(tokens, done, acc, length, seconds, probe, timed=timed)

    def _covering(self, spec: SpecConfig | None, greedy: bool, span: int, rows: int) -> list[tuple]:
        """Compiled step programs that can run this step, cheapest first: any span and row count at
        least as large, and sampling programs for greedy rows (whose p and q are then one-hot)."""
        keys = [k for k in self.programs.keys() if k[0] == "step" and k[1] == spec and k[3] >= span and k[4] >= rows
                and (k[2] == greedy or not k[2])]
        return sorted(keys, key=lambda k: (k[3] * k[4], k[2] != greedy))
