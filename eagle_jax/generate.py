"""``eagle_jax.generate``: the Python entry point of speculative decoding."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.config import ConfigError, SpecConfig, check_pair
from eagle_jax.decoding import adaptive_costs, autospec
from eagle_jax.decoding.engine import Plan, run_rounds
from eagle_jax.decoding.prefill import start
from eagle_jax.decoding.penalties import Penalties, RowPenalties
from eagle_jax.decoding.sampling import RowSampling, SamplingParams
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target

# Powers of two and the midpoints between them: at most 1/3 of a prefill is padding.
PROMPT_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)


@dataclass
class GenerationResult:
    """Tokens per row (prompt excluded), text when a tokenizer was given, and the run's statistics.

    ``accepted[b][r]``: drafts accepted by row b in round r (a round emits accepted + 1 tokens).
    ``acceptance_length``: tokens produced per target forward = mean over row-rounds of accepted + 1
    (the bonus token counted once; the prefill's first token is not a round and is not counted).
    ``position_acceptance[i]``: fraction of rounds whose draft i (0-based) was accepted.
    """

    tokens: list[list[int]]
    text: list[str] | None
    accepted: list[list[int]]
    acceptance_length: float
    position_acceptance: list[float]
    compile_s: float
    run_s: float
    rounds: int
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.run_s if self.run_s > 0 else float("inf")


def bucket(n: int) -> int:
    for b in PROMPT_BUCKETS:
        if n <= b:
            return b
    raise ConfigError(f"prompt of {n} tokens is longer than the largest bucket {PROMPT_BUCKETS[-1]}")


class _Programs:
    """Compiled programs, one per (models' graph, plan); reused across calls with the same shapes.

    Kept per pair of graphs: hashing a model's graph walks all of its nodes (~10 ms for a small
    model), so a call that runs several programs (``spec="auto"``) looks its pair up once (``pair``)."""

    def __init__(self) -> None:
        self._by_pair: dict[Any, dict[Any, Any]] = {}
        self._plain_of: dict[int, dict[Any, Any]] = {}

    def pair(self, t_graph, d_graph) -> dict[Any, Any]:
        return self._by_pair.setdefault((t_graph, d_graph), {})

    def pair_and_plain(self, t_graph, d_graph) -> tuple[dict[Any, Any], dict[Any, Any]]:
        """``pair(t_graph, d_graph)`` and ``pair(t_graph, None)`` for one graph hash (the dicts live as
        long as the process, so their ids name the pair)."""
        programs = self.pair(t_graph, d_graph)
        if id(programs) not in self._plain_of:
            self._plain_of[id(programs)] = self.pair(t_graph, None)
        return programs, self._plain_of[id(programs)]

    def get(self, kind: str, t_graph, d_graph, plan: Plan, args: tuple, build, programs: dict | None = None,
            donate_argnums: tuple[int, ...] = (), states: tuple | None = None) -> tuple[Any, float]:
        """(the compiled program, seconds spent compiling it now); ``programs``: ``pair(t_graph, d_graph)``;
        ``donate_argnums``: arguments the program consumes (each ``kind`` always donates the same);
        ``states``: ``signature(args[:2])`` (the models' states), when the caller keeps it across lookups."""
        cache = self.pair(t_graph, d_graph) if programs is None else programs
        key = (kind, plan, signature(args[:2]) if states is None else states, signature(args[2:]))
        if key in cache:
            return cache[key], 0.0
        t0 = time.perf_counter()
        compiled = jax.jit(build, donate_argnums=donate_argnums).lower(*args).compile()
        cache[key] = compiled
        return compiled, time.perf_counter() - t0


_PROGRAMS = _Programs()


def signature(args: Any) -> tuple:
    """What a compiled program's key needs of its arguments: their tree and each leaf's shape, dtype and
    placement (~0.4 ms for a model's state: a ``spec="auto"`` call computes its models' once)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((getattr(a, "shape", None), getattr(a, "dtype", None), getattr(a, "sharding", None)) for a in leaves)


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (int, np.integer)):
        return {int(value)}
    return {int(v) for v in value}


def eos_ids(target: Target, tokenizer=None, eos_token_id: int | Sequence[int] | None = None) -> tuple[int, ...]:
    """The ids that end a row: ``eos_token_id`` when given (``[]``: never stop early), else the model's
    own (generation_config.json, else config.json) together with the tokenizer's EOS."""
    if eos_token_id is not None:
        return tuple(sorted(_ids(eos_token_id)))
    ids = _ids(target.config.eos_token_id)
    if tokenizer is not None:
        ids |= _ids(getattr(tokenizer, "eos_token_id", None))
    return tuple(sorted(ids))


def _rules(temperature: float, top_k: int, top_p: float, min_p: float, presence_penalty: float, frequency_penalty: float,
           repetition_penalty: float, logit_bias: dict[int, float] | None, min_tokens: int) -> tuple[SamplingParams, Penalties]:
    """A call's sampling rule and logits processors (validated)."""
    bias = tuple((int(t), float(v)) for t, v in (logit_bias or {}).items())
    return (SamplingParams(float(temperature), int(top_k), float(top_p), float(min_p)),
            Penalties(float(presence_penalty), float(frequency_penalty), float(repetition_penalty), bias, int(min_tokens)))


def _prepare(target, drafter, prompts, max_new_tokens, sampling: SamplingParams, pen: Penalties, spec, eos_token_id, tokenizer,
             mesh=None, exact=False):
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if drafter is not None:
        check_pair(target.config, drafter.config)
    if isinstance(prompts, (str, np.ndarray)) or (prompts and isinstance(prompts[0], int)):
        raise ConfigError("prompts must be a list of prompts (token-id lists or strings), not a single prompt")
    if len(prompts) == 0:
        raise ConfigError("prompts is empty")
    ids: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ConfigError(f"prompt {i} is a string but no tokenizer was given")
            p = tokenizer.encode(p, add_special_tokens=False) if hasattr(tokenizer, "encode") else tokenizer(p)
        p = [int(t) for t in p]
        if not p:
            raise ConfigError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < target.config.vocab_size]
        if bad:
            raise ConfigError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {target.config.vocab_size})")
        ids.append(p)
    longest = max(len(p) for p in ids)
    limit = target.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ConfigError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the target's "
            f"max_position_embeddings={limit}"
        )
    if isinstance(spec, str) and spec != "auto":
        raise ConfigError(f"spec must be a SpecConfig, a dict, 'auto' or None, got {spec!r}")
    spec_cfg = None if drafter is None else SpecConfig.parse(spec)  # "auto" is resolved before this
    plan = Plan.one_shot(
        batch=len(ids),
        prompt_len=bucket(max(len(p) for p in ids)),
        max_new=int(max_new_tokens),
        spec=spec_cfg,
        greedy=sampling.greedy,
        eos_ids=eos_ids(target, tokenizer, eos_token_id),
        mesh=mesh,
        exact=bool(exact),
    )
    if spec_cfg is not None and spec_cfg.adaptive:
        plan = dataclasses.replace(plan, widths=adaptive_costs.widths_for(spec_cfg.num_speculative_tokens))
    prompt = np.zeros((plan.batch, bucket(longest)), np.int32)
    for i, p in enumerate(ids):
        prompt[i, : len(p)] = p
    lens = np.array([len(p) for p in ids], np.int32)
    rows = None
    if pen.active:  # min_tokens holds back the call's stop tokens
        rows = RowPenalties.build([dataclasses.replace(pen, stop_ids=plan.eos_ids)] * plan.batch, ids, target.config.vocab_size)
    return plan, jnp.asarray(prompt), jnp.asarray(lens), RowSampling.fill(sampling, plan.batch, rows)


def _placeholder_costs(plan: Plan):
    """The costs argument of a program: shaped like ``RoundCosts.as_array()`` for adaptive plans."""
    return None if plan.widths is None else jnp.zeros((len(plan.widths) + 3,), jnp.float32)


def _calibrated(t_graph, d_graph, plan: Plan, run: adaptive_costs.Runner):
    """The costs array of an adaptive plan (measured once per pair and plan), None for other plans."""
    if plan.widths is None:
        return None
    return adaptive_costs.calibrate((t_graph, d_graph, plan), run, plan.widths, plan.spec.num_speculative_tokens).as_array()


def _split(module):
    if module is None:
        return None, None
    return nnx.split(module)


def acceptance_summary(accepted: Sequence[int], k: int) -> tuple[float, list[float]]:
    """(acceptance length = mean of accepted + 1 over rounds, fraction of rounds accepting draft i for
    i < k) from drafts accepted per round; (0, zeros) for no rounds."""
    if not accepted:
        return 0.0, [0.0] * k
    acc = np.asarray(accepted)
    return float(acc.mean() + 1), [float(np.mean(acc > i)) for i in range(k)]


def _result(state, plan: Plan, compile_s: float, run_s: float, tokenizer) -> GenerationResult:
    out, n_out, accepted, rounds = jax.device_get((state.out, state.n_out, state.accepted, state.rounds))
    tokens = [out[b, : n_out[b]].tolist() for b in range(plan.batch)]
    acc = [[int(a) for a in row[:rounds] if a >= 0] for row in accepted]
    k = 0 if plan.spec is None else plan.spec.max_emitted - 1
    al, pos = acceptance_summary([a for row in acc for a in row], k)
    text = None
    if tokenizer is not None:
        text = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return GenerationResult(tokens, text, acc, al, pos, compile_s, run_s, int(rounds), {"spec": plan.spec})


def _program(target: Target, drafter: Drafter | None, plan: Plan, prompt, lens, rs, seed: int, mesh):
    """(generate's compiled program for ``plan``, its arguments, compile seconds). The program takes
    ``(t_state, d_state, prompt, lens, rs, key, costs, limit)`` and returns the loop state after
    the prefill and at most ``limit`` rounds."""
    t_graph, t_state = _split(target)
    d_graph, d_state = _split(drafter)
    if mesh is not None:
        # Tensor parallel: heads / MLP / vocabulary over the mesh's "model" axis by the one rule table;
        # the compiled program follows the placement of its inputs. The caller's modules are untouched.
        from eagle_jax.sharding import shard_tree

        t_state = shard_tree(t_state, mesh)
        d_state = None if d_state is None else shard_tree(d_state, mesh)

    def program(t_state, d_state, prompt, lens, rs, key, costs, limit):
        tgt = nnx.merge(t_graph, t_state)
        drf = None if d_graph is None else nnx.merge(d_graph, d_state)
        st = start(tgt, drf, plan, prompt, lens, rs, key, plan.max_rounds, costs)
        return run_rounds(tgt, drf, plan, st, limit)

    args = (t_state, d_state, prompt, lens, rs, jax.random.key(seed), _placeholder_costs(plan), jnp.int32(plan.max_rounds))
    compiled, compile_s = _PROGRAMS.get("generate", t_graph, d_graph, plan, args, program)
    if plan.widths is not None:  # adaptive: the measured round costs replace the placeholder
        costs = _calibrated(t_graph, d_graph, plan, lambda c, n: compiled(*args[:6], c, jnp.int32(n)))
        args = (*args[:6], costs, args[7])
    return compiled, args, compile_s


def _wants_auto(drafter: Drafter | None, spec) -> bool:
    """A drafter and no spec (or "auto"): the depth is chosen chunk by chunk (``_AutoRun``)."""
    return drafter is not None and (spec is None or (isinstance(spec, str) and spec == "auto"))


class _AutoRun:
    """One ``spec="auto"`` call: the prefill, then chunks of rounds, each at the depth that
    ``autospec`` expects to emit the most tokens per second from the costs measured so far for this
    pair, batch, sampling mode and device, and the acceptance observed so far on this pair's traffic
    (both updated from every chunk). Every depth's program runs on one loop state: the cache is sized
    for the deepest chain, and rounds without drafts keep the drafter fed, so the depth can change
    between any two chunks; plain decoding proper (drafter not fed) runs to the end of the call once
    chosen. Iterating yields the state after each chunk."""

    def __init__(self, target: Target, drafter: Drafter, prompts, max_new_tokens: int, kw: dict,
                 most_rounds: int | None = None):
        top = SpecConfig(num_speculative_tokens=max(autospec.DEPTHS))
        self.plan, prompt, lens, rs = _prepare(target, drafter, prompts, max_new_tokens, kw["sampling"], kw["penalties"],
                                               top, kw["eos_token_id"], kw["tokenizer"], kw["mesh"], kw["exact"])
        self.t_graph, self.t_state = _split(target)
        self.d_graph, self.d_state = _split(drafter)
        if kw["mesh"] is not None:
            from eagle_jax.sharding import shard_tree

            self.t_state, self.d_state = shard_tree(self.t_state, kw["mesh"]), shard_tree(self.d_state, kw["mesh"])
        greedy = self.plan.greedy
        # One lookup of the pair's graphs per call (hashing a graph walks all its nodes): its programs with
        # and without the drafter, and its costs and acceptance, keyed by the programs' dict.
        fed, plain = _PROGRAMS.pair_and_plain(self.t_graph, self.d_graph)
        self._pairs = {True: fed, False: plain}
        pair = (id(fed), id(target), id(drafter))
        self.costs = autospec.cost_model((*pair, greedy, self.plan.exact, kw["mesh"], jax.default_backend()))
        self.estimate = autospec.acceptance_estimate((*pair, greedy))
        self.compile_s = 0.0
        self.run_s = 0.0
        self.chunks: list[tuple[int | None, int]] = []  # (depth, rounds): None = probe rounds
        self._args = (prompt, lens, rs, jax.random.key(kw["seed"]))
        # A program lookup would otherwise walk the models' states again (0.6-1.8 ms per program a call runs).
        self._states = {True: signature((self.t_state, self.d_state)), False: signature((self.t_state, None))}
        self._programs: dict[tuple[int | None, bool], Any] = {}
        self.most_rounds = most_rounds  # the longest chunk: a stream's reader waits for each (None: any)
        self.carry = 0.0  # rounds of the pair's evidence each new prompt carries (``carry_rounds``), read at the start

    def _compiled(self, kind: str, plan: Plan, fed: bool, args: tuple, build, donate_argnums: tuple[int, ...] = ()):
        compiled, seconds = _PROGRAMS.get(kind, self.t_graph, None, plan, args, build, self._pairs[fed], donate_argnums, self._states[fed])
        self.compile_s += seconds
        return compiled

    def _begin(self, fed: bool):
        plan, t_graph, d_graph = self.plan, self.t_graph, (self.d_graph if fed else None)

        def begin(t_state, d_state, prompt, lens, rs, key):
            drf = None if d_graph is None else nnx.merge(d_graph, d_state)
            return start(nnx.merge(t_graph, t_state), drf, plan, prompt, lens, rs, key, plan.max_rounds)

        args = (self.t_state, self.d_state if fed else None, *self._args)
        return self._compiled("auto_start", plan, fed, args, begin)(*args)

    def _plain_from_start(self) -> bool:
        """Whether this call decodes plainly without ever feeding the drafter (``SpanCosts.plain_settled``),
        while the pair's acceptance was observed within ``REPROBE_ROUNDS`` rounds (past them, a call probes)."""
        alike = self.estimate.carry_rounds() > autospec.CARRY_ROUNDS
        return self.costs.plain_settled(self.plan.batch, alike) and self.estimate.unobserved < autospec.REPROBE_ROUNDS

    def _chunk(self, depth: int | None, st, limit: int, fed: bool, watch: np.ndarray = autospec.NEVER):
        """Rounds at ``depth`` (None: without drafts, drafter fed; PLAIN with ``fed`` False: plain
        decoding proper) until ``limit`` rounds in all, or until they depart from ``watch``
        (``autospec.watch``); returns (state, whether the program was compiled for this chunk)."""
        spec = None if depth in (None, autospec.PLAIN) else SpecConfig(num_speculative_tokens=depth)
        plan = dataclasses.replace(self.plan, spec=spec)
        t_graph, d_graph = self.t_graph, (self.d_graph if fed else None)

        def chunk(t_state, d_state, st, limit, watch):
            drf = None if d_graph is None else nnx.merge(d_graph, d_state)
            return run_rounds(nnx.merge(t_graph, t_state), drf, plan, st, limit, watch)

        args = (self.t_state, self.d_state if fed else None, st, jnp.int32(limit), jnp.asarray(watch))
        fresh = False
        if (depth, fed) not in self._programs:
            compile0 = self.compile_s
            # The loop state is consumed: its caches are updated in place, not copied once per chunk.
            self._programs[depth, fed] = self._compiled("auto_chunk", plan, fed, args, chunk, donate_argnums=(2,))
            fresh = self.compile_s > compile0
        return self._programs[depth, fed](*args), fresh

    def _time_empty_chunk(self, depth: int | None, st, fed: bool, rounds: int):
        """Measures a chunk's dispatch and host sync (~1 ms on a CPU), the least of its fixed cost, by running
        this chunk's program for no rounds, twice (the least counts); returns the (unchanged) state. Once per
        pair: a short chunk (a probe's 4 rounds) would otherwise look dearer per round than a long one. Pairs of
        chunks of one depth then measure the rest of the fixed cost (``SpanCosts.observe_chunk_pair``)."""
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            st, _ = self._chunk(depth, st, rounds, fed)
            jax.device_get((st.done, st.n_out, st.rounds, st.accepted, st.probe))
            times.append(time.perf_counter() - t0)
        self.costs.set_dispatch(min(times))
        return st

    def warm(self) -> None:
        """Compiles and runs once every program this call's shapes may use (the prefill with and without
        the drafter, a chunk at every depth, plain decoding): a program's first run pays one-time costs
        (~0.3 s on a CPU) that benchmarks count as compile time, not decoding."""
        st = self._begin(True)
        for i, depth in enumerate((None, *autospec.DEPTHS)):
            st, _ = self._chunk(depth, st, i + 1, True)
        jax.block_until_ready(self._chunk(autospec.PLAIN, self._begin(False), 1, False)[0].out)

    def _next(self, fed: bool, rows: list[tuple[int, autospec.AcceptanceEstimate]], observed: int) -> tuple[int | None, int]:
        """(depth, rounds) of the next chunk; depth None: probe rounds."""
        batch = self.plan.batch
        plain_known = self.costs.measured(autospec.PLAIN, batch)
        if not fed:  # a first run of plain decoding is not timed (a program's first run): a short chunk first
            return autospec.PLAIN, (self.most_rounds or self.plan.max_rounds) if plain_known else autospec.EXPLORE_ROUNDS
        if not self.costs.probed(batch):
            # what a round without drafts costs at this batch size (the base of every modelled depth), and acceptance
            return None, autospec.PROBE_ROUNDS
        costs = self.costs.at(self.plan.cache_len)
        todo = autospec.unexplored(costs, batch)
        if todo:
            return todo[0], autospec.EXPLORE_ROUNDS
        rows = autospec.toward_the_batch(self._as_chosen(rows, observed))
        times = autospec.finish_times(costs, batch, rows)
        depth = autospec.keep_close(times, self.chunks[-1][0] if self.chunks else None)
        may_win = not plain_known and times[autospec.PLAIN] <= autospec.PLAIN_WORTH_TRYING * times[depth]
        if observed < autospec.PROBE_ROUNDS and (depth == autospec.PLAIN or may_win):
            # Plain decoding ends the call's speculation, measured or chosen: only on this call's own evidence.
            return None, autospec.PROBE_ROUNDS
        if may_win:
            return autospec.PLAIN, autospec.EXPLORE_ROUNDS  # measured (the rest of this call decodes plainly)
        if depth == autospec.PLAIN and not any(d not in (None, autospec.PLAIN) for d, _ in self.chunks):
            best = min((d for d in times if d != autospec.PLAIN), key=times.get, default=None)
            if best is not None and times[best] <= autospec.SPEC_WORTH_TRYING * times[autospec.PLAIN]:
                return best, autospec.EXPLORE_ROUNDS  # close: this call's rows run a chain before it stops speculating
        if not observed and times[depth] > autospec.PROBE_FIRST_BELOW * times[autospec.PLAIN]:
            return None, autospec.PROBE_ROUNDS  # a close call: this call's rows decide
        if (rival := autospec.close_unsettled(times, lambda d: self.costs.settled(d, batch))) is not None:
            return rival, autospec.EXPLORE_ROUNDS  # a close depth whose cost is not known well yet
        if depth == autospec.PLAIN:  # plain decoding proper cannot be left within the call: no look, no boundary
            return depth, self.most_rounds or self.plan.max_rounds
        most = self.most_rounds or self.plan.max_rounds
        if not plain_known and times[autospec.PLAIN] <= autospec.PLAIN_TAIL_WORTH * times[depth]:
            # plain decoding's cost unknown, and maybe close: the call's tail measures it
            before = math.floor(max((r - autospec.PLAIN_TAIL_TOKENS) / est.expected_tokens(depth) for r, est in rows))
            if before < autospec.EXPLORE_ROUNDS:
                return autospec.PLAIN, autospec.EXPLORE_ROUNDS
            most = min(most, before)
        # A depth chosen anew runs CHUNK_ROUNDS: a look at these rows' own acceptance there, read by the
        # estimates' point values (a prompt's first rounds say most about it). Chosen again, it takes the rounds
        # the call is expected to need and half as many again (the loop stops once every row is done), up to
        # MAX_CHUNK_ROUNDS (unless the call is expected to end within a look past them: no short chunk is left
        # for the end), and ends sooner where its rows depart from the estimate it was chosen on
        # (``autospec.watch``): a chunk's host round trip and loop entry (~1.6 ms here, 4% of an 8-round chunk
        # at T=1) is paid about twice a call, not every few rounds.
        # Where prompts are alike (a new one carries at least a long chunk's rounds of their evidence), a look
        # could not change the choice: every chunk is a long one, watched.
        left = max(r / est.expected_tokens(depth) for r, est in rows)
        again = (bool(self.chunks) and self.chunks[-1][0] == depth) or self.carry >= autospec.MAX_CHUNK_ROUNDS
        longest = autospec.MAX_CHUNK_ROUNDS if left > autospec.MAX_CHUNK_ROUNDS + autospec.CHUNK_ROUNDS else self.plan.max_rounds
        most = min(longest, most)
        if not again and left > 2 * autospec.CHUNK_ROUNDS:
            return depth, min(autospec.CHUNK_ROUNDS, most)
        return depth, min(max(autospec.CHUNK_ROUNDS, math.ceil(1.5 * left)), most)

    def _as_chosen(self, rows: list[tuple[int, autospec.AcceptanceEstimate]], observed: int) -> list[tuple[int, autospec.AcceptanceEstimate]]:
        """The rows a choice reads: before this call's own evidence, the last call's rows (their estimates)."""
        last = self.costs.last_call.get(self.plan.batch)
        if observed or not last:
            return rows
        return [(n, last[i % len(last)]) for i, (n, _) in enumerate(rows)]

    def __iter__(self) -> Iterator[Any]:
        t0 = time.perf_counter()
        compile0 = self.compile_s
        fed = not self._plain_from_start()
        st = self._begin(fed)
        jax.block_until_ready(st.out)
        prefill_s = time.perf_counter() - t0 - (self.compile_s - compile0)
        self.run_s += prefill_s
        yield st
        observed, rounds = 0, 0
        last = None  # (depth, rounds, seconds) of the last timed chunk
        # Each row's own acceptance, from the pair's: the slowest row decides when the call ends.
        self.carry = self.estimate.carry_rounds()
        row_est = [self.estimate.for_new_prompt() for _ in range(self.plan.batch)]
        done_rows, n_out = jax.device_get((st.done, st.n_out))
        while not np.all(done_rows) and rounds < self.plan.max_rounds:
            remaining = [(self.plan.max_rounds - int(n_out[b]), row_est[b]) for b in range(self.plan.batch) if not done_rows[b]]
            depth, n = self._next(fed, remaining, observed)
            watch = autospec.watch(self.costs.at(self.plan.cache_len), self.plan.batch, self._as_chosen(remaining, observed), depth)
            if depth == autospec.PLAIN and fed:  # from here on the drafter is not fed: its state is dropped
                fed = False
                st = dataclasses.replace(st, d_cache=None, d_logits=None, d_feat=None, probe=None)
            compile0, t0 = self.compile_s, time.perf_counter()
            st, fresh = self._chunk(depth, st, rounds + n, fed, watch)
            # Whole arrays: slicing on the device would compile a program per slice.
            done_rows, n_out, new_rounds, accepted, probe = jax.device_get((st.done, st.n_out, st.rounds, st.accepted, st.probe))
            accepted = accepted[:, rounds : rounds + n]
            seconds = time.perf_counter() - t0 - (self.compile_s - compile0)
            ran = int(new_rounds) - rounds
            self.run_s += seconds
            if not fresh:  # a program's first run pays one-time costs (~0.3 s on a CPU): not a round's cost
                if self.costs.chunk_s is None:
                    st = self._time_empty_chunk(depth, st, fed, int(new_rounds))
                if last is not None and last[0] == depth and ran:  # the same program twice: its fixed cost shows
                    self.costs.observe_chunk_pair(last[1:], (ran, seconds))
                last = (depth, ran, seconds)
                cost = seconds - self.costs.chunk_s  # the chunk's rounds alone, comparable between chunk lengths
                self.costs.model(self.plan.cache_len).update(depth, self.plan.batch, cost, ran)
            else:
                last = None
            if depth is None:
                self.estimate.observe_probe(float(probe[:, 0].sum() / max(probe[:, 1].sum(), 1)), ran)
                for b, (hits, count) in enumerate(probe):
                    if count > 0:
                        row_est[b].observe_probe(float(hits / count), float(count))
                st = dataclasses.replace(st, probe=jnp.zeros_like(st.probe))
                observed += ran
            elif depth == autospec.PLAIN:
                self.estimate.age(ran)
            else:
                self.estimate.observe(accepted[:, :ran].T, depth)
                for b, row in enumerate(accepted[:, :ran]):
                    row_est[b].observe(row[:, None], depth)
                observed += ran
            self.chunks.append((depth, ran))
            rounds = int(new_rounds)
            yield st
        for est in row_est:
            self.estimate.finish_prompt(est)
        if observed:  # which depth would have finished this call soonest, had it been known from the start
            self.costs.record_hindsight(self.plan.cache_len, [(int(n), est) for n, est in zip(n_out, row_est)], prefill_s)

    def result(self, tokenizer) -> GenerationResult:
        st = None
        for st in self:
            pass
        res = _result(st, self.plan, self.compile_s, self.run_s, tokenizer)
        res.stats.update(spec="auto", chunks=list(self.chunks))
        return res


def generate(
    target: Target,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int] | str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    spec: SpecConfig | dict | str | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int = 0,
    tokenizer=None,
    mesh=None,
    exact: bool = False,
) -> GenerationResult:
    """Generates up to ``max_new_tokens`` per prompt with speculative decoding (``drafter=None``: plain).

    One XLA program per call: target prefill with aux capture, drafter prefill, then a while_loop of
    rounds with no host round trip. Sampling keeps the target's distribution (temperature / top_k /
    top_p). Prompts are padded to length buckets so new lengths reuse compiled programs. ``mesh``: run
    tensor-parallel over the mesh's ``model`` axis.

    Greedy output equals the target's own greedy decoding token for token in float32. In bfloat16 it
    does except at near-ties (top-2 logits within bf16 rounding, as in every engine): a position's
    bf16 logits depend slightly on how many positions and rows one matmul covers, so verification of
    K+1 positions (and plain decoding at another batch size) can resolve a tie differently.
    ``exact=True`` computes the target in float32 from its stored weights, plain and speculative
    alike: the output is then the same for every batch size, drafter and speculation setting (cost:
    fp32 activations and caches; see BENCHMARKS.md).

    ``spec``: a SpecConfig or dict, or "auto" (the default, None, with a drafter): the call runs in
    chunks of rounds (each ends early where its rows' acceptance departs from its estimate), each at
    the depth (plain decoding or a chain of ``autospec.DEPTHS`` drafts) with the most expected tokens
    per second from the round costs measured so far for this
    pair, batch size, sampling mode and device and the acceptance observed so far on this pair's
    traffic, this call's included (``decoding/autospec.py``). ``result.stats["chunks"]`` lists the
    (depth, rounds) that ran (depth None: rounds without drafts that observe acceptance).

    ``eos_token_id``: None = the model's own (generation_config.json / config.json) and the
    tokenizer's; an id or a list; ``[]`` = never stop before ``max_new_tokens``.

    ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``
    ({token id: bias}) and ``min_tokens`` as vLLM defines them (``decoding/penalties.py``): they act
    on the target's logits at every verified position, so the output is plain decoding's under the
    same processors (greedy) or the processed distribution (sampling).
    """
    sampling, pen = _rules(temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_tokens)
    kw = dict(sampling=sampling, penalties=pen, eos_token_id=eos_token_id, seed=seed, tokenizer=tokenizer, mesh=mesh, exact=exact)
    if _wants_auto(drafter, spec):
        return _AutoRun(target, drafter, prompts, max_new_tokens, kw).result(tokenizer)
    plan, prompt, lens, rs = _prepare(target, drafter, prompts, max_new_tokens, sampling, pen, spec, eos_token_id, tokenizer, mesh, exact)
    compiled, args, compile_s = _program(target, drafter, plan, prompt, lens, rs, seed, mesh)
    t0 = time.perf_counter()
    state = compiled(*args)
    jax.block_until_ready(state.out)
    run_s = time.perf_counter() - t0
    return _result(state, plan, compile_s, run_s, tokenizer)


def _new_tokens(out: np.ndarray, n_out: np.ndarray, sent: list[int]) -> tuple[list[list[int]], list[int]]:
    """Each row's tokens past the ``sent`` already yielded, and the new counts."""
    return [out[b, sent[b] : n_out[b]].tolist() for b in range(len(sent))], [int(n) for n in n_out]


def generate_stream(
    target: Target,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int] | str],
    *,
    max_new_tokens: int,
    rounds_per_chunk: int = 8,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    spec: SpecConfig | dict | str | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int = 0,
    tokenizer=None,
    exact: bool = False,
) -> Iterator[list[list[int]]]:
    """The same loop run in chunks of ``rounds_per_chunk`` rounds; yields each row's new tokens per chunk.
    ``spec`` as in ``generate`` ("auto" streams each of its chunks of rounds, none longer than ``rounds_per_chunk``
    once a depth is chosen: its choices run in the chunks a stream can wait for)."""
    if rounds_per_chunk < 1:
        raise ConfigError(f"rounds_per_chunk must be >= 1, got {rounds_per_chunk}")
    sampling, pen = _rules(temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_tokens)
    if _wants_auto(drafter, spec):  # streams _AutoRun's chunks
        kw = dict(sampling=sampling, penalties=pen, eos_token_id=eos_token_id, seed=seed, tokenizer=tokenizer, mesh=None, exact=exact)
        sent = [0] * len(prompts)
        for st in _AutoRun(target, drafter, prompts, max_new_tokens, kw, most_rounds=rounds_per_chunk):
            new, sent = _new_tokens(*jax.device_get((st.out, st.n_out)), sent)
            if any(new):
                yield new
        return
    plan, prompt, lens, rs = _prepare(target, drafter, prompts, max_new_tokens, sampling, pen, spec, eos_token_id, tokenizer, None, exact)
    t_graph, t_state = _split(target)
    d_graph, d_state = _split(drafter)

    def begin(t_state, d_state, prompt, lens, rs, key, costs):
        drf = None if d_graph is None else nnx.merge(d_graph, d_state)
        return start(nnx.merge(t_graph, t_state), drf, plan, prompt, lens, rs, key, plan.max_rounds, costs)

    def chunk(t_state, d_state, st, limit):
        drf = None if d_graph is None else nnx.merge(d_graph, d_state)
        return run_rounds(nnx.merge(t_graph, t_state), drf, plan, st, limit)

    args = (t_state, d_state, prompt, lens, rs, jax.random.key(seed), _placeholder_costs(plan))
    start_c, _ = _PROGRAMS.get("stream_start", t_graph, d_graph, plan, args, begin)
    st = start_c(*args)
    chunk_args = (t_state, d_state, st, jnp.int32(0))
    chunk_c, _ = _PROGRAMS.get("stream_chunk", t_graph, d_graph, plan, chunk_args, chunk)
    costs = _calibrated(t_graph, d_graph, plan, lambda c, n: chunk_c(t_state, d_state, start_c(*args[:6], c), jnp.int32(n)))
    if costs is not None:
        st = start_c(*args[:6], costs)
    sent = [0] * plan.batch
    while True:
        out, n_out, done, rounds = jax.device_get((st.out, st.n_out, st.done, st.rounds))
        new, sent = _new_tokens(out, n_out, sent)
        if any(new):
            yield new
        if done.all() or rounds >= plan.max_rounds:
            return
        st = chunk_c(t_state, d_state, st, jnp.int32(rounds + rounds_per_chunk))
