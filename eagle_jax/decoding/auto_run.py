"""One ``spec="auto"`` call (``AutoRun``): the prefill, then chunks of rounds on one loop state, each at the depth
the pair's ``chooser.Chooser`` picks from the costs and acceptance measured so far."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import SpecConfig
from eagle_jax.decoding import calls, chooser
from eagle_jax.decoding.calls import GenerationResult
from eagle_jax.decoding.engine import run_rounds
from eagle_jax.decoding.prefill import start
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.layers import read_spans
from eagle_jax.modeling.target import Target

CHOOSE_EVERY = 8  # rounds between two choices (each a host round trip)
PROFILE_ROUNDS = 4  # rounds of a warm-up profile's depth
PLAIN_LOOKS = 2  # chunks without drafts in a row after which the call drops the drafter (plain decoding proper)

_RAN: set[int] = (
    set()
)  # compiled programs that have run once (a first run pays one-time costs, counted as compile time)


class AutoRun:
    """One ``spec="auto"`` call. The cache is sized for the deepest chain and rounds without drafts keep the drafter
    fed, so the depth can change between any two chunks; every program a call's shapes may run is compiled on its
    first call, so a later call at the same batch size and prompt bucket compiles nothing. Iterating yields the
    state after the prefill and after each chunk; ``most_rounds`` caps a chunk (a stream's reader waits for each)."""

    def __init__(
        self, target: Target, drafter: Drafter, prompts, max_new_tokens: int, kw: dict, most_rounds: int | None = None
    ):
        top = SpecConfig(num_speculative_tokens=chooser.DEEPEST)
        self.plan, prompt, lens, rs = calls.prepare(
            target,
            drafter,
            prompts,
            max_new_tokens,
            kw["sampling"],
            top,
            kw["eos_token_id"],
            kw["tokenizer"],
            kw["mesh"],
            kw["exact"],
        )
        self.t_graph, self.t_state, self.d_graph, self.d_state = calls.split_pair(target, drafter, kw["mesh"])
        self._pair = calls.PROGRAMS.pair(self.t_graph, self.d_graph)
        self.chooser = chooser.for_pair(
            (id(self._pair), id(target), id(drafter), self.plan.exact, kw["mesh"], jax.default_backend())
        )
        self._args = (prompt, lens, rs, jax.random.key(kw["seed"]))
        self.most_rounds = most_rounds
        self.compile_s = 0.0
        self.run_s = 0.0
        self.chunks: list[tuple[int, int]] = []  # (depth, rounds); depth 0: rounds without drafts

    def _compiled(self, kind: str, plan, args: tuple, build, donate: tuple[int, ...] = ()):
        compiled, seconds = calls.PROGRAMS.get(kind, self.t_graph, None, plan, args, build, self._pair, donate)
        self.compile_s += seconds
        return compiled

    def _begin(self):
        plan, t_graph, d_graph = self.plan, self.t_graph, self.d_graph

        def begin(t_state, d_state, prompt, lens, rs, key):
            return start(
                *calls.merged(t_graph, t_state, d_graph, d_state), plan, prompt, lens, rs, key, plan.max_rounds
            )

        args = (self.t_state, self.d_state, *self._args)
        program = self._compiled("auto_start", plan, args, begin)
        if id(program) not in _RAN:  # its first run's one-time costs, paid with the compiles by a throwaway prefill
            t0 = time.perf_counter()
            jax.block_until_ready(program(*args).out)
            self.compile_s += time.perf_counter() - t0
            _RAN.add(id(program))
        return program(*args)

    def _program(self, depth: int, fed: bool, st):
        """The chunk program at ``depth`` (0: rounds without drafts; not ``fed``: plain decoding proper) and its
        arguments but the limit, compiled on first use (its shapes are ``st``'s)."""
        plan = dataclasses.replace(self.plan, spec=chooser.spec_of(depth))
        t_graph, d_graph = self.t_graph, (self.d_graph if fed else None)

        def chunk(t_state, d_state, st, limit):
            return run_rounds(*calls.merged(t_graph, t_state, d_graph, d_state), plan, st, limit)

        args = (self.t_state, self.d_state if fed else None, st, jnp.int32(0))
        # The loop state is consumed: its caches are updated in place, not copied once per chunk.
        return self._compiled("auto_chunk", plan, args, chunk, donate=(2,))

    def _run(self, program, st, limit: int):
        """``program`` to ``limit`` rounds in all: (state, seconds)."""
        _RAN.add(id(program))
        t0 = time.perf_counter()
        st = program(self.t_state, self.d_state if st.d_cache is not None else None, st, jnp.int32(limit))
        jax.block_until_ready(st.rounds)
        return st, time.perf_counter() - t0

    def __iter__(self) -> Iterator[Any]:
        plan, batch, greedy = self.plan, self.plan.batch, self.plan.greedy
        t0, compile0 = time.perf_counter(), self.compile_s
        st = self._begin()
        jax.block_until_ready(st.out)
        self.run_s += time.perf_counter() - t0 - (self.compile_s - compile0)
        bare = dataclasses.replace(st, d_cache=None, d_logits=None, d_feat=None, probe=None)
        programs = {(d, True): self._program(d, True, st) for d in (chooser.PLAIN, *chooser.DEPTHS)}
        programs[chooser.PLAIN, False] = self._program(chooser.PLAIN, False, bare)
        for (depth, fed), program in programs.items():
            if id(program) not in _RAN:
                # A program's first rounds pay one-time costs (~0.2 s each on a CPU: its kernels readied as they first
                # run), for each span attention may read: paid here, with the compiles, by one round per span on a
                # throwaway copy of the state, its rows placed past the span before.
                t0 = time.perf_counter()
                for at in (None, *read_spans(plan.cache_len)[:-1]):
                    scratch = jax.tree.map(jnp.copy, st if fed else bare)
                    if at is not None:
                        scratch = dataclasses.replace(scratch, length=jnp.full_like(scratch.length, at))
                    self._run(program, scratch, 1)
                self.compile_s += time.perf_counter() - t0
        yield st
        rows = [self.chooser.new_row(greedy) for _ in range(batch)]
        fed, looks, rounds = True, 0, 0
        done, n_out = jax.device_get((st.done, st.n_out))
        while not done.all() and rounds < plan.max_rounds:
            active = np.flatnonzero(~done)
            depth = (
                self.chooser.choose(batch, greedy, [rows[b] for b in active], lambda d: plan.cache_len)
                if fed
                else chooser.PLAIN
            )
            looks = looks + 1 if depth == chooser.PLAIN else 0
            if (
                fed and looks > PLAIN_LOOKS
            ):  # speculation has not paid for a while: the rest of the call decodes plainly
                fed, st = False, dataclasses.replace(st, d_cache=None, d_logits=None, d_feat=None, probe=None)
            measured = self.chooser.costs[greedy].measured(batch, depth, plan.cache_len) is not None
            n = plan.max_rounds if not fed else (CHOOSE_EVERY if measured else PROFILE_ROUNDS)
            n = min(n, self.most_rounds or n)
            program = programs[depth, fed]
            st, seconds = self._run(program, st, rounds + n)
            self.run_s += seconds
            done, n_out, now, accepted, probe = jax.device_get((st.done, st.n_out, st.rounds, st.accepted, st.probe))
            ran = int(now) - rounds
            if fed:
                acc = [accepted[b, rounds:now].tolist() for b in active]
                hits = None if probe is None else [(float(probe[b, 0]), float(probe[b, 1])) for b in active]
                self.chooser.observe(
                    depth, batch, plan.cache_len, greedy, seconds, ran, [rows[b] for b in active], acc, hits
                )
                if probe is not None and depth == chooser.PLAIN:  # zeros from the host: an eager op would compile
                    st = dataclasses.replace(
                        st, probe=jax.device_put(np.zeros(st.probe.shape, st.probe.dtype), st.probe.sharding)
                    )
            self.chunks.append((depth, ran))
            rounds = int(now)
            yield st

    def result(self, tokenizer) -> GenerationResult:
        st = None
        for st in self:
            pass
        res = calls.result(st, self.plan, self.compile_s, self.run_s, tokenizer)
        res.stats.update(spec="auto", chunks=list(self.chunks))
        return res
