"""One ``spec="auto"`` call (``AutoRun``): chunks of rounds, each at the depth ``decoding/autospec.py`` chooses
from the measured round costs and the observed acceptance, on one loop state."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.config import SpecConfig
from eagle_jax.decoding import autospec, calls, cost_cache
from eagle_jax.decoding.acceptance_estimate import prompts_alike
from eagle_jax.decoding.calls import GenerationResult
from eagle_jax.decoding.engine import Plan, one_shot_cache_len, run_rounds
from eagle_jax.decoding.prefill import start
from eagle_jax.modeling import flops
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target


class AutoRun:
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
        self.plan, prompt, lens, rs = calls.prepare(target, drafter, prompts, max_new_tokens, kw["sampling"], kw["penalties"],
                                               top, kw["eos_token_id"], kw["tokenizer"], kw["mesh"], kw["exact"])
        self.t_graph, self.t_state, self.d_graph, self.d_state = calls.split_pair(target, drafter, kw["mesh"])
        greedy = self.plan.greedy
        # One lookup of the pair's graphs per call (hashing a graph walks all its nodes): its programs with
        # and without the drafter, and its costs and acceptance, keyed by the programs' dict.
        fed, plain = calls.PROGRAMS.pair_and_plain(self.t_graph, self.d_graph)
        self._pairs = {True: fed, False: plain}
        pair = (id(fed), id(target), id(drafter))
        self.costs = autospec.cost_model((*pair, greedy, self.plan.exact, kw["mesh"], jax.default_backend()))
        self.estimate = autospec.acceptance_estimate((*pair, greedy))
        self.compile_s = 0.0
        self.run_s = 0.0
        self.chunks: list[tuple[int | None, int]] = []  # (depth, rounds): None = probe rounds
        self._explored: int | None = None  # the close, unsettled depth this call ran to measure (``close_unsettled``)
        self._seed = kw["seed"]
        self._args = (prompt, lens, rs, jax.random.key(self._seed))
        # A program lookup would otherwise walk the models' states again (0.6-1.8 ms per program a call runs).
        # The one without the drafter is computed where a call decodes plainly (~0.4 ms a call otherwise).
        self._states = {True: calls.signature((self.t_state, self.d_state))}
        if self.costs.cache_name is None:  # the first call to meet these costs: those an earlier process measured here
            shapes = [(tuple(shape), str(dtype)) for shape, dtype, _ in self._states[True][1]]
            self.costs.keep(lambda: cost_cache.key(target.config, drafter.config, shapes, greedy, self.plan.exact, kw["mesh"]), self.estimate)
        if self.costs.drafter_prefill_share is None:  # counted once per pair (~4 ms)
            self.costs.drafter_prefill_share = flops.prefill_drafter_share(target, drafter)
        self._programs: dict[tuple[int | None, bool], Any] = {}
        self.most_rounds = most_rounds  # the longest chunk: a stream's reader waits for each (None: any)
        self.carry = 0.0  # rounds of the pair's evidence each new prompt carries (``carry_rounds``), read at the start
        self.start_costs: dict[int, float] = {}  # seconds per round by depth at this call's span and batch, as read at its start
        self._unwatched = False  # the next chunk is a look (``_look``): it runs its rounds
        self._read_rows: list | None = None  # the rows the next chunk's choice read (``_times``), its watch reads them too

    def _compiled(self, kind: str, plan: Plan, fed: bool, args: tuple, build, donate_argnums: tuple[int, ...] = ()):
        compiled, seconds = calls.PROGRAMS.get(kind, self.t_graph, None, plan, args, build, self._pairs[fed], donate_argnums, self._state_signature(fed))
        self.compile_s += seconds
        return compiled

    def _state_signature(self, fed: bool) -> tuple:
        """``calls.signature`` of the models' states a program reads: with the drafter's where ``fed``."""
        if fed not in self._states:
            self._states[fed] = calls.signature((self.t_state, self.d_state if fed else None))
        return self._states[fed]

    def _begin(self, fed: bool):
        plan, t_graph, d_graph = self.plan, self.t_graph, (self.d_graph if fed else None)

        def begin(t_state, d_state, prompt, lens, rs, key):
            drf = None if d_graph is None else nnx.merge(d_graph, d_state)
            return start(nnx.merge(t_graph, t_state), drf, plan, prompt, lens, rs, key, plan.max_rounds)

        args = (self.t_state, self.d_state if fed else None, *self._args)
        return self._compiled("auto_start", plan, fed, args, begin)(*args)

    def _plain_from_start(self) -> bool:
        """Whether this call decodes plainly without ever feeding the drafter (``SpanCosts.plain_settled``),
        while the pair's acceptance was observed within ``SpanCosts.reprobe_rounds`` rounds (past them, a call probes)."""
        batch = self.plan.batch
        return self.costs.plain_settled(batch, prompts_alike(self.carry)) and self.estimate.unobserved < self.costs.reprobe_rounds(batch)

    def _chunk(self, depth: int | None, st, limit: int, fed: bool, watch: np.ndarray | None = None):
        """Rounds at ``depth`` (None: without drafts, drafter fed; PLAIN with ``fed`` False: plain
        decoding proper) until ``limit`` rounds in all, or until they depart from ``watch``
        (``autospec.watch``); returns (state, whether the program was compiled for this chunk)."""
        spec = None if depth in (None, autospec.PLAIN) else SpecConfig(num_speculative_tokens=depth)
        plan = dataclasses.replace(self.plan, spec=spec)
        t_graph, d_graph = self.t_graph, (self.d_graph if fed else None)

        def chunk(t_state, d_state, st, limit, watch):
            drf = None if d_graph is None else nnx.merge(d_graph, d_state)
            return run_rounds(nnx.merge(t_graph, t_state), drf, plan, st, limit, watch)

        watch = autospec.never(self.plan.batch) if watch is None else watch
        args = (self.t_state, self.d_state if fed else None, st, jnp.int32(limit), jnp.asarray(watch))
        fresh = False
        if (depth, fed) not in self._programs:
            compile0 = self.compile_s
            # The loop state is consumed: its caches are updated in place, not copied once per chunk.
            self._programs[depth, fed] = self._compiled("auto_chunk", plan, fed, args, chunk, donate_argnums=(2,))
            fresh = self.compile_s > compile0
        return self._programs[depth, fed](*args), fresh

    def _start_and_chunk(self, depth: int, rounds: int, watch: np.ndarray):
        """The prefill, drafter fed, and a first chunk of ``rounds`` rounds at ``depth`` (``_chunk``) as one program:
        apart, the second execution, the host round trip between them and the first chunk's dispatch cost ~3 ms
        at batch 1 on a CPU (~3% of a call that speculates well). Returns as ``_chunk`` does."""
        plan, chunk_plan = self.plan, dataclasses.replace(self.plan, spec=SpecConfig(num_speculative_tokens=depth))
        t_graph, d_graph = self.t_graph, self.d_graph

        def start_and_chunk(t_state, d_state, prompt, lens, rs, key, limit, watch):
            tgt, drf = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
            return run_rounds(tgt, drf, chunk_plan, start(tgt, drf, plan, prompt, lens, rs, key, plan.max_rounds), limit, watch)

        args = (self.t_state, self.d_state, *self._args, jnp.int32(rounds), jnp.asarray(watch))
        compile0 = self.compile_s
        program = self._compiled("auto_start_chunk", chunk_plan, True, args, start_and_chunk)
        return program(*args), self.compile_s > compile0

    def _time_empty_chunk(self, depth: int | None, st, fed: bool, rounds: int):
        """Measures a chunk's dispatch and host sync (~1 ms on a CPU), the least of its fixed cost, by running
        this chunk's program for no rounds, twice (the least counts); returns the (unchanged) state. Once per
        pair: the prior of the fixed part that the chunks then fit (``chunk_overhead``)."""
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            st, _ = self._chunk(depth, st, rounds, fed)
            jax.device_get((st.done, st.n_out, st.rounds, st.accepted, st.probe))
            times.append(time.perf_counter() - t0)
        self.costs.overhead.set_dispatch(min(times))
        return st

    def warm(self) -> None:
        """Compiles and runs once every program this call's shapes may use (the prefill with and without
        the drafter, a chunk at every depth, each chain's also with the prefill, plain decoding): a program's
        first run pays one-time costs (~0.3 s on a CPU) that benchmarks count as compile time, not decoding."""
        st = self._begin(True)
        for i, depth in enumerate((None, *autospec.DEPTHS)):
            st, _ = self._chunk(depth, st, i + 1, True)
        for depth in autospec.DEPTHS:
            jax.block_until_ready(self._start_and_chunk(depth, 1, autospec.never(self.plan.batch))[0].out)
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
            return todo[0], self._explore_rounds(costs, todo[0])
        times, rows = self._times(costs, rows, observed)
        depth = autospec.keep_close(times, self.chunks[-1][0] if self.chunks else None)
        if depth == autospec.PLAIN and observed < self._evidence_for_plain(costs):
            # Plain decoding chosen ends the call's speculation: only on this call's own evidence.
            return self._look(costs, rows)
        if depth == autospec.PLAIN and not plain_known:
            return autospec.PLAIN, autospec.EXPLORE_ROUNDS  # measured (the rest of this call decodes plainly)
        # Plain decoding not measured yet, or long ago (``SpanCosts.stale``), but it may win: it is measured on the
        # call's last rounds (``tail``), where dropping the drafter costs nothing. Measured where the call had its say,
        # it took the rest of the call, 1.25x what a chain of 1 would have (float32, batch 1, T=1).
        reach = autospec.PLAIN_STALE_CLOSE if plain_known else autospec.PLAIN_WORTH_TRYING
        may_win = (not plain_known or self.costs.stale(autospec.PLAIN, batch)) and times[autospec.PLAIN] <= reach * times[depth]
        depth, n = self._spend(costs, rows, times, depth, observed)
        if may_win and depth != autospec.PLAIN:
            tail = min(autospec.PLAIN_TAIL_ROUNDS, self.most_rounds or autospec.PLAIN_TAIL_ROUNDS)
            per_round = (lambda est: 1.0) if depth is None else (lambda est: est.expected_tokens(depth))
            # rounds until the slowest row is down to its last ``tail`` tokens (the batch runs until every row is done)
            before = math.ceil(max((left - tail) / per_round(est) for left, est in rows))
            if before < min(n, autospec.EXPLORE_ROUNDS):
                return autospec.PLAIN, tail  # a chunk that short would cost its overhead for little: the tail starts here
            n = min(n, before)
        return depth, n

    def _look(self, costs: autospec.AtSpan, rows: list[tuple[int, autospec.AcceptanceEstimate]]) -> tuple[int | None, int]:
        """``PROBE_ROUNDS`` rounds that observe these rows' first drafts: probe rounds (no drafts, the drafter fed), or a
        chain of 1 where it is expected to leave the call sooner done. Both see the first draft; a chain of 1's round also
        verifies it, and emits it where accepted: it pays where its extra cost over a probe round is less than what the
        drafts it is expected to emit save at the best choice's cost per token (bfloat16 batch 1 on a CPU: a probe
        round cost 0.93x a chain of 1's and emitted 1 token where the chain emitted ~1.5). Not watched: a look runs
        its rounds."""
        batch = self.plan.batch
        probe, one = self.costs.probe_cost(batch, self.plan.cache_len), costs.cost(1, batch)
        drafts = sum(est.expected_tokens(1) - 1.0 for _, est in rows)
        per_token = autospec.token_seconds(costs, batch, lambda d: sum(est.expected_tokens(d) for _, est in rows))
        if probe is None or one is None or not per_token or one - probe > drafts * min(per_token.values()):
            return None, autospec.PROBE_ROUNDS
        self._unwatched = True
        return 1, autospec.PROBE_ROUNDS

    def _evidence_for_plain(self, costs: autospec.AtSpan) -> int:
        """Rounds of this call's own acceptance that plain decoding is chosen on: ``PROBE_ROUNDS`` where prompts are
        alike or no chain could beat plain decoding with every draft accepted, else ``PLAIN_OWN_ROUNDS``."""
        batch = self.plan.batch
        plain = costs.cost(autospec.PLAIN, batch)
        could = plain is not None and any((c := costs.cost(d, batch)) is not None and c < (1 + d) * plain for d in autospec.DEPTHS)
        return autospec.PLAIN_OWN_ROUNDS if could and not prompts_alike(self.carry) else autospec.PROBE_ROUNDS

    def _spend(self, costs: autospec.AtSpan, rows: list[tuple[int, autospec.AcceptanceEstimate]], times: dict[int, float],
               depth: int, observed: int) -> tuple[int | None, int]:
        """(depth, rounds) of the next chunk once ``depth`` is the choice on ``times`` (depth -> expected seconds to
        finish the call): a close chain tried, a look at the rows' first drafts, a depth being measured, or the choice's rounds."""
        batch = self.plan.batch
        if depth == autospec.PLAIN and not any(d is not None and d > 1 for d, _ in self.chunks):
            # this call's rows run a chain past the first draft (a look sees only that) before it stops speculating,
            # where deeper drafts could make one pay
            if (hoped := autospec.deeper_unseen(costs, batch, rows, depth)) is not None:
                return hoped, self._explore_rounds(costs, hoped)
        if not observed and times[depth] > autospec.PROBE_FIRST_BELOW * times[autospec.PLAIN]:
            return self._look(costs, rows)  # a close call: this call's rows decide
        # A close depth whose cost is not known well yet, or measured long ago (``SpanCosts.stale``), runs to be
        # measured: one such depth per call (it may run again until settled), the next on a later call. At bfloat16
        # batch 12 a call explored K=3 and then K=5, each worse than plain decoding, and took 1.31x plain's time.
        skip = lambda d: (self.costs.settled(d, batch) and not self.costs.stale(d, batch)) or self._explored not in (None, d)  # noqa: E731
        if (rival := autospec.close_unsettled(times, skip)) is not None:
            self._explored = rival
            return rival, self._explore_rounds(costs, rival, again=self.costs.settled(rival, batch))
        if depth == autospec.PLAIN:  # plain decoding proper cannot be left within the call: no look, no boundary
            return depth, self.most_rounds or self.plan.max_rounds
        # A choice whose cost is modelled, or measured over few rounds, is measured before it takes a long chunk: a
        # chain of 7 forgotten as above the line through chains of 3 and 5 (two noisy costs, read as equal) was
        # modelled on that line at a chain of 3's cost and ran a whole call at 1.2-1.4x a chain of 3's time (float32,
        # batch 4, greedy).
        if not self.costs.settled(depth, batch):
            return depth, self._explore_rounds(costs, depth)
        # A deeper chain that would win were its deeper drafts accepted as the chosen ones are runs a look, once a
        # call, while none of this call's chunks ran deeper than the choice: where prompts differ, the deeper drafts'
        # estimate is some earlier prompt's. Where they were seen alike, it holds for this one too.
        seen = max((d for d, _ in self.chunks if d is not None), default=autospec.PLAIN)
        if seen <= depth and not prompts_alike(self.carry) and (deeper := autospec.deeper_unseen(costs, batch, rows, depth)):
            return deeper, self._explore_rounds(costs, deeper)
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
        most = min(longest, self.most_rounds or longest)
        if not again and left > 2 * autospec.CHUNK_ROUNDS:
            return depth, min(autospec.CHUNK_ROUNDS, most)
        return depth, min(max(autospec.CHUNK_ROUNDS, math.ceil(1.5 * left)), most)

    def _explore_rounds(self, costs: autospec.AtSpan, depth: int, again: bool = False) -> int:
        """Rounds that measure ``depth``: ``EXPLORE_ROUNDS``, in one chunk up to ``SETTLED_ROUNDS`` where a chunk's
        overhead is a round's cost or more (bfloat16 batch 12 on a CPU paid ~20 ms a chunk, ~18 ms a round,
        before its cache writes were scattered as bits), since a settled depth takes two such chunks otherwise;
        ``SETTLED_ROUNDS`` where ``again`` (a settled cost measured again: ``SpanCosts.stale``), whose one chunk
        then weighs as much as a settled depth's; never past a stream's chunk (``most_rounds``) beyond
        ``EXPLORE_ROUNDS``, since its reader waits for each chunk."""
        if self.most_rounds is not None:
            return autospec.EXPLORE_ROUNDS
        if again:
            return autospec.SETTLED_ROUNDS
        per_round = costs.cost(depth, self.plan.batch) or math.inf
        share = self.costs.overhead.seconds(self.plan.batch) / per_round
        return min(autospec.SETTLED_ROUNDS, autospec.EXPLORE_ROUNDS * (1 + round(share)))

    def _times(self, costs: autospec.AtSpan, rows: list[tuple[int, autospec.AcceptanceEstimate]],
               observed: int) -> tuple[dict[int, float], list[tuple[int, autospec.AcceptanceEstimate]]]:
        """(expected seconds to finish the call at each depth, the rows the rest of the choice and the watch read).
        Before a call of one prompt has evidence of its own, where prompts differ, its acceptance is any recent
        prompt's: the time is the mean over the recent finished prompts' (``SpanCosts.recent_rows``), not the last
        one's alone, and the rest reads the prompt's own start (the pair's estimate carried as far as prompts were
        seen alike). After a hard prompt, the last one's row alone made the next call look at a chain of 1 and climb
        through a chain of 3 to a chain of 7, 1.17-1.21x a fixed chain of 7 on that call (bfloat16, greedy)."""
        recent = self.costs.recent_rows
        if observed or self.plan.batch > 1 or prompts_alike(self.carry) or len(recent) < autospec.FIRST_CHOICE_ROWS:
            rows = autospec.toward_the_batch(self._as_chosen(rows, observed), self._row_pool())
            times = autospec.finish_times(costs, self.plan.batch, rows)
        else:
            each = [autospec.finish_times(costs, 1, [(rows[0][0], est)]) for est in recent]
            times = {d: float(np.mean([t[d] for t in each])) for d in each[0]}
        self._read_rows = rows
        return times, rows

    def _watched(self, remaining: list[tuple[int, autospec.AcceptanceEstimate]], observed: int
                 ) -> tuple[list[tuple[int, autospec.AcceptanceEstimate]], float]:
        """(the rows a chunk's watch reads, the rounds of the batch's pooled evidence it adds to each): the rows the
        chunk's choice read (``_times``), which hold their pooled evidence already, else the rows as chosen. Pooled
        twice, a row's watch read 16 rounds of the batch's evidence where its choice read 8."""
        if self._read_rows is not None:
            return self._read_rows, 0.0
        return self._as_chosen(remaining, observed), self._row_pool()

    def _row_pool(self) -> float:
        """Rounds of the batch's pooled evidence each row's estimate is read with (``autospec.ROW_POOL_ROUNDS``): only
        where prompts were seen alike."""
        return autospec.ROW_POOL_ROUNDS if prompts_alike(self.carry) else 0.0

    def _as_chosen(self, rows: list[tuple[int, autospec.AcceptanceEstimate]], observed: int) -> list[tuple[int, autospec.AcceptanceEstimate]]:
        """The rows a choice reads: before this call's own evidence, the last call's rows (their estimates)."""
        last = self.costs.last_call.get(self.plan.batch)
        if observed or not last:
            return rows
        return [(n, last[i % len(last)]) for i, (n, _) in enumerate(rows)]

    def __iter__(self) -> Iterator[Any]:
        self.carry = self.estimate.carry_rounds()  # read once: the start's choice and every row's estimate
        at = self.costs.at(self.plan.cache_len)
        self.start_costs = {d: c for d in (autospec.PLAIN, *autospec.DEPTHS) if (c := at.cost(d, self.plan.batch)) is not None}
        fed = not self._plain_from_start()
        if not fed and self.most_rounds is None:
            yield from self._plain_program()
            return
        batch = self.plan.batch
        observed, rounds, prefill_s = 0, 0, 0.0
        # Each row's own acceptance, from the pair's: the slowest row decides when the call ends.
        row_est = [self.estimate.for_new_prompt(self.carry, alone=batch == 1) for _ in range(batch)]
        # The first chunk is chosen before the prefill, after which every row holds its first token.
        st, done_rows, n_out = None, np.zeros(batch, bool), np.ones(batch, np.int32)
        while not np.all(done_rows) and rounds < self.plan.max_rounds:
            remaining = [(self.plan.max_rounds - int(n_out[b]), row_est[b]) for b in range(batch) if not done_rows[b]]
            self._unwatched, self._read_rows = False, None  # set by ``_look``, by ``_times``
            depth, n = self._next(fed, remaining, observed)
            if st is None and not self._fuses(depth):
                st, prefill_s = self._prefill(fed)
                yield st
                done_rows, n_out = jax.device_get((st.done, st.n_out))
                if np.any(done_rows):  # a row ended with its first token: chosen again on the rows left
                    continue
            watched, pool = self._watched(remaining, observed)
            watch = autospec.never(batch) if self._unwatched else autospec.watch(
                self.costs.at(self.plan.cache_len), batch, watched, depth, self.costs.overhead.seconds(batch),
                active=np.flatnonzero(~done_rows), pool=pool)
            if depth == autospec.PLAIN and fed:  # from here on the drafter is not fed: its state is dropped
                fed = False
                st = dataclasses.replace(st, d_cache=None, d_logits=None, d_feat=None, probe=None)
            compile0, t0 = self.compile_s, time.perf_counter()
            fused = st is None
            st, fresh = self._start_and_chunk(depth, n, watch) if fused else self._chunk(depth, st, rounds + n, fed, watch)
            # Whole arrays: slicing on the device would compile a program per slice.
            done_rows, n_out, new_rounds, accepted, probe = jax.device_get((st.done, st.n_out, st.rounds, st.accepted, st.probe))
            accepted = accepted[:, rounds : rounds + n]
            seconds = time.perf_counter() - t0 - (self.compile_s - compile0)
            ran = int(new_rounds) - rounds
            self.run_s += seconds
            if fused:  # the prefill's share: what the chunk's rounds and overhead are known to cost, taken off
                per_round = self.costs.at(self.plan.cache_len).cost(depth, batch) or 0.0
                prefill_s = max(seconds - self.costs.overhead.seconds(batch) - ran * per_round, 0.0)
            elif not fresh:  # a program's first run pays one-time costs (~0.3 s on a CPU): not a round's cost
                if self.costs.overhead.dispatch_s is None:
                    st = self._time_empty_chunk(depth, st, fed, int(new_rounds))
                self.costs.observe_chunk(self.plan.cache_len, depth, batch, ran, seconds, first=not self.chunks)
            if not ran:  # every row ended with its first token (a fused chunk is chosen before the prefill)
                yield st
                break
            if depth is None:
                self.estimate.observe_probe(float(probe[:, 0].sum() / max(probe[:, 1].sum(), 1)), ran)
                for b, (hits, count) in enumerate(probe):
                    if count > 0:
                        row_est[b].observe_probe(float(hits / count), float(count))
                # Zeros from the host, not ``jnp.zeros_like``: an eager op compiles on a process's first call (~85 ms
                # at batch 1, outside the compile time a call reports, in its first call's time).
                st = dataclasses.replace(st, probe=jax.device_put(np.zeros(st.probe.shape, st.probe.dtype), st.probe.sharding))
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
            rows = [(int(n), est) for n, est in zip(n_out, row_est)]
            judged = [(n, self.estimate.judged_over_prompts(est, self.carry)) for n, est in rows]
            share = self.costs.drafter_prefill_share(self._args[0].shape[1])
            self.costs.record_hindsight(self.plan.cache_len, rows, prefill_s * share, self.chunks, judged)
        self.costs.kept()

    def _fuses(self, depth: int | None) -> bool:
        """Whether a call's first chunk runs in one program with its prefill (``_start_and_chunk``): a chain whose
        cost is settled at this batch size, outside a stream (whose reader takes the first token from the prefill).
        A depth being measured runs apart from the prefill, which its time would otherwise include."""
        return self.most_rounds is None and depth in autospec.DEPTHS and self.costs.settled(depth, self.plan.batch)

    def _prefill(self, fed: bool):
        """(the state after the prefill, its seconds)."""
        compile0, t0 = self.compile_s, time.perf_counter()
        st = self._begin(fed)
        jax.block_until_ready(st.out)
        seconds = time.perf_counter() - t0 - (self.compile_s - compile0)
        self.run_s += seconds
        return st, seconds

    def _plain_program(self) -> Iterator[Any]:
        """A call that decodes plainly from its start (not streamed) runs plain decoding's own program, the prefill
        and every round in one execution, as ``spec=None`` does: in chunks it paid an execution's overhead more,
        and the first chunk after a prefill more again (1-6% of a call at bfloat16 batch 12 on a CPU)."""
        prompt, lens, rs, _ = self._args
        # This call's split target and its program lookup, not another's (~4 ms at batch 1: 1-2% of a plain call).
        self.plan = dataclasses.replace(self.plan, spec=None, cache_len=one_shot_cache_len(prompt.shape[1], self.plan.max_rounds, None))
        st, compile_s, run_s = calls.run_whole((self.t_graph, self.t_state, None, None), self.plan, prompt, lens, rs, self._seed,
                                               self._pairs[False], self._state_signature(False))
        self.compile_s += compile_s
        self.run_s += run_s
        rounds = int(st.rounds)
        self.estimate.age(rounds)
        self.costs.aged(self.plan.batch, rounds)
        self.chunks.append((autospec.PLAIN, rounds))
        yield st

    def result(self, tokenizer) -> GenerationResult:
        st = None
        for st in self:
            pass
        res = calls.result(st, self.plan, self.compile_s, self.run_s, tokenizer)
        # what the call's first choice read: a report of why a depth ran (ms per round; none before any was measured)
        res.stats.update(spec="auto", chunks=list(self.chunks), round_ms={d: round(1e3 * c, 3) for d, c in self.start_costs.items()})
        return res
