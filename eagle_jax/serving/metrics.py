"""Prometheus metrics of the server, in a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from eagle_jax.serving import Handle, Scheduler, StepOutput
from eagle_jax.serving.program_cache import describe

disable_created_metrics()  # no *_created series: they double the exposition and nobody graphs them

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)


class Metrics:
    def __init__(self, scheduler: Scheduler):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "eagle_requests",
            "Finished requests by outcome (stop, length, cancelled, error, rejected).",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("eagle_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("eagle_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            "eagle_time_to_first_token_seconds", "Arrival to first token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "eagle_inter_token_latency_seconds",
            "Time per output token after the first, per delivery.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "eagle_request_latency_seconds", "Arrival to last token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue = Gauge("eagle_queue_depth", "Requests waiting for a slot.", registry=r)
        self.queue.set_function(lambda: scheduler.queue_depth)
        self.occupied = Gauge("eagle_slots_occupied", "Slots holding a request.", registry=r)
        self.occupied.set_function(lambda: scheduler.active)
        Gauge("eagle_slots", "Slots of the engine.", registry=r).set(scheduler.engine.slots)
        self.depth = Gauge("eagle_speculation_depth", "Drafts per round chosen at the last step (0: none).", registry=r)
        self.rounds = Counter("eagle_spec_rounds", "Rounds run by occupied slots.", registry=r)
        self.emitted = Counter(
            "eagle_spec_emitted_tokens", "Tokens emitted by those rounds (accepted drafts + 1).", registry=r
        )
        self.al = Gauge("eagle_acceptance_length", "Mean tokens per target forward over all rounds so far.", registry=r)
        self.position = Counter(
            "eagle_spec_accepted_position",
            "Rounds whose draft at this position (0-based) was accepted.",
            ["position"],
            registry=r,
        )
        self.steps = Counter("eagle_steps", "Engine steps.", registry=r)
        self.steps_by_depth = Counter(
            "eagle_steps_by_depth", "Engine steps by drafts per round (0: none).", ["depth"], registry=r
        )
        self.compiles = Counter(
            "eagle_compile_events",
            "Programs compiled, by kind (chunk, row, copy, score, step).",
            ["program"],
            registry=r,
        )
        self.compile_seconds = Counter("eagle_compile_seconds", "Seconds spent compiling.", registry=r)
        Gauge(
            "eagle_programs", "Programs of the engine's precompiled set (eagle-jax-serve --list-programs).", registry=r
        ).set(len(scheduler.engine.program_set()))
        self.program_seconds = Gauge(
            "eagle_program_compile_seconds",
            "Seconds each program took to compile (or load from the compilation cache).",
            ["program"],
            registry=r,
        )
        self.prefix_queries = Counter(
            "eagle_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Counter(
            "eagle_prefix_cache_hits", "Prompt tokens reused from the prefix cache (not computed).", registry=r
        )
        self.prefix_rate = Gauge("eagle_prefix_cache_hit_rate", "Prompt tokens reused / looked up, so far.", registry=r)
        self._prefix_on = scheduler.engine.prefix_cache
        self._rounds = self._emitted = self._queried = self._hit = 0  # written by the engine thread only

    def on_compile(self, key: tuple, seconds: float) -> None:
        self.compiles.labels(key[0]).inc()
        self.compile_seconds.inc(seconds)
        self.program_seconds.labels(describe(key)).set(seconds)

    def on_step(self, active: int, spec, out: StepOutput) -> None:
        self.steps.inc()
        depth = 0 if spec is None else spec.max_emitted - 1
        self.depth.set(depth)
        self.steps_by_depth.labels(str(depth)).inc()
        for row in out.accepted:
            for a in row:
                self._rounds += 1
                self._emitted += a + 1
                self.rounds.inc()
                self.emitted.inc(a + 1)
                for i in range(a):
                    self.position.labels(str(i)).inc()
        if self._rounds:
            self.al.set(self._emitted / self._rounds)

    def steps_per_depth(self) -> dict[int, int]:
        """Engine steps so far by drafts per round (what ``eagle_steps_by_depth`` exposes)."""
        return {
            int(s.labels["depth"]): int(s.value)
            for m in self.steps_by_depth.collect()
            for s in m.samples
            if s.name == "eagle_steps_by_depth_total"
        }

    def on_finish(self, h: Handle) -> None:
        self.requests.labels(h.finish_reason or "error").inc()
        self.prompt_tokens.inc(len(h.request.prompt))
        if self._prefix_on and h.t_first is not None:  # prefilled: its prompt was looked up
            self._queried += len(h.request.prompt)
            self._hit += h.cached_tokens
            self.prefix_queries.inc(len(h.request.prompt))
            self.prefix_hits.inc(h.cached_tokens)
            self.prefix_rate.set(self._hit / self._queried)
        self.generation_tokens.inc(len(h.tokens))
        if h.t_first is not None:
            self.ttft.observe(h.t_first - h.t_submit)
        if h.t_done is not None and h.tokens:
            self.e2e.observe(h.t_done - h.t_submit)
        prev = h.t_first
        for t, n in h.chunk_times[1:]:
            self.itl.observe((t - prev) / n)
            prev = t
