"""The host loop of continuous batching: admit waiting requests into free slots, step, stream, free.

One thread owns the ``SlotEngine``; callers ``submit`` requests from any thread and get a ``Handle``
that collects tokens as they come (and calls an optional listener from the engine thread). Between two
steps the loop frees finished and cancelled slots, prefills waiting requests into free slots in arrival
order, and picks the speculation config for the number of occupied slots (``SpecSchedule``).

A prompt is prefilled (``SlotEngine.prefill``) within the engine's per-step prefill budget (``chunk``
tokens) while streams decode, the rest in later iterations, so a long prompt never stalls the running
streams for long. With the engine's ``prefix_cache`` a prompt starts from the longest prefix of it that a
cache row holds (``prefix_cache.PrefixIndex``: a busy or freed slot, or a pool row), copied into its slot;
the ``n`` choices of one prompt start from the first one's cache row likewise.

A step runs at most ``rounds_per_step`` rounds, and no more than fit in ``step_ms`` at the per-round time
its rows and spec took last (``Scheduler._rounds``): a request arriving during a step waits for its end,
so where rounds are dear (many rows, deep chains, a large model) steps are cut short and time to first
token stays near ``step_ms`` plus its prefill; where rounds are cheap a step still runs many rounds per
host round trip.

While prompts are owed prefill (chunks in progress, or requests waiting with a slot free), a step runs
``ROUNDS_WHILE_PREFILLING`` rounds instead of the engine's ``rounds_per_step``, so that the next chunk
comes one round later, not a whole step: a burst of arrivals waits for the prefills ahead of it
and little else, and a running stream's gaps while a long prompt is prefilled stay near one round plus
one chunk (vLLM's chunked prefill interleaves one decode step per scheduler iteration likewise).

Stop tokens (EOS unless a request ignores it, and its own ``stop_token_ids``) are enforced here: each
delivery is cut after a request's first stop token and the slot is freed. The device stops rows at EOS
too where every busy request stops there, which only ends their rounds early.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import numpy as np

from eagle_jax.config import ConfigError, SpecConfig
from eagle_jax.decoding import chooser
from eagle_jax.decoding.calls import acceptance_summary
from eagle_jax.decoding.chooser import Acceptance, Chooser
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.serving.prefix_cache import PrefixIndex
from eagle_jax.serving.slots import SlotEngine, StepOutput

log = logging.getLogger("eagle_jax.serving")
ROUNDS_WHILE_PREFILLING = 1
STEP_MS = 100.0  # a step's rounds cut to about this long (``Scheduler.step_ms``)
T = TypeVar("T")


class QueueFull(RuntimeError):
    """More requests are waiting than the scheduler's bound allows."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    ignore_eos: bool = False  # generate through EOS up to max_tokens
    stop_token_ids: tuple[int, ...] = ()  # stop after any of these as after EOS
    # Requests of one group share a prompt (the ``n`` choices of one prompt): one admitted while another of
    # its group holds a slot starts from a copy of that slot's prefill instead of its own.
    group: int | None = None

    def stop_ids(self, eos_ids: Sequence[int]) -> frozenset[int]:
        """The tokens that end this request (the last token it returns)."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_ids))


@dataclass(frozen=True)
class SpecSchedule:
    """Speculation config by number of occupied slots: ``rules`` = ((min_active, spec or None), ...).

    The rule with the largest ``min_active`` <= the occupancy applies. Verification of K drafts costs
    K+1 target positions per row, which is nearly free while a step is bound by reading weights (few
    rows) and a real cost once it is bound by compute (many rows): deeper drafts pay at low occupancy,
    shallower ones or none at high occupancy (measured per pair by ``bench.serve``).
    """

    rules: tuple[tuple[int, SpecConfig | None], ...]

    def __post_init__(self) -> None:
        if not self.rules or min(m for m, _ in self.rules) != 1:
            raise ConfigError(f"a speculation schedule needs a rule for 1 active slot, got {self.describe()}")

    @classmethod
    def fixed(cls, spec: SpecConfig | None) -> "SpecSchedule":
        return cls(((1, spec),))

    @classmethod
    def parse(cls, text: str) -> "SpecSchedule":
        """``"1:5,4:3,9:0"``: chain K=5 from 1 active slot, K=3 from 4, no drafts from 9."""
        rules = []
        for part in text.split(","):
            try:
                lo, k = (int(x) for x in part.split(":"))
            except ValueError:
                raise ConfigError(f"speculation schedule {text!r}: each rule is MIN_ACTIVE:K, got {part!r}") from None
            if lo < 1 or k < 0:
                raise ConfigError(f"speculation schedule {text!r}: MIN_ACTIVE must be >= 1 and K >= 0 in {part!r}")
            rules.append((lo, SpecConfig(num_speculative_tokens=k) if k else None))
        return cls(tuple(sorted(rules, key=lambda r: r[0])))

    @property
    def specs(self) -> tuple[SpecConfig | None, ...]:
        return tuple(dict.fromkeys(s for _, s in self.rules))

    def choose(self, active: int) -> SpecConfig | None:
        spec = self.rules[0][1]
        for lo, s in self.rules:
            if active >= lo:
                spec = s
        return spec

    def describe(self) -> str:
        def name(s):
            return (
                "none"
                if s is None
                else (
                    f"K={s.num_speculative_tokens}"
                    if s.method == "chain"
                    else f"tree {s.tree_top_k}/{s.tree_depth}/{s.tree_total_tokens}"
                )
            )

        return ", ".join(f">={lo}: {name(s)}" for lo, s in self.rules)


@dataclass
class Handle:
    """A submitted request: its tokens so far, and once finished why (``stop`` = EOS, ``length``,
    ``cancelled``, ``error``), with the acceptance statistics and timings of its rounds."""

    request: Request
    listener: Callable[["Handle", list[int], bool], None] | None = None
    stops: frozenset[int] = frozenset()  # ``request.stop_ids`` of the engine's EOS
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round
    estimate: Acceptance | None = None  # live acceptance (``--spec auto``), from admission on
    cached_tokens: int = 0  # prompt positions reused from the prefix cache (not computed)
    finish_reason: str | None = None
    error: str | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_done: float | None = None
    chunk_times: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per delivery
    _finished: threading.Event = field(default_factory=threading.Event)
    _cancel: str | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        """Stops the request at the next step boundary; its slot is freed then and ``reason`` becomes its
        finish reason (a stop string found by the caller is ``stop``)."""
        self._cancel = reason

    @property
    def cancelled(self) -> bool:
        return self._cancel is not None

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> "Handle":
        if not self._finished.wait(timeout):
            raise TimeoutError("request did not finish in time")
        return self

    def acceptance(self, k: int) -> tuple[float, list[float]]:
        """(tokens per target forward, acceptance of draft positions 0..k-1) over this request's rounds."""
        return acceptance_summary(self.accepted, k)

    def _deliver(self, tokens: list[int], now: float) -> None:
        if tokens:
            if self.t_first is None:
                self.t_first = now
            self.tokens.extend(tokens)
            self.chunk_times.append((now, len(tokens)))
        if self.listener is not None and tokens:
            self.listener(self, tokens, False)

    def _finish(self, reason: str, now: float, error: str | None = None) -> None:
        self.finish_reason, self.error, self.t_done = reason, error, now
        self._finished.set()
        if self.listener is not None:
            self.listener(self, [], True)


class Scheduler:
    """Runs a ``SlotEngine`` in a background thread over a bounded FIFO of requests."""

    def __init__(
        self,
        engine: SlotEngine,
        schedule: SpecSchedule | Chooser,
        *,
        max_queue: int = 256,
        on_step: Callable[[int, SpecConfig | None, StepOutput], None] | None = None,
        step_ms: float = STEP_MS,
    ):
        missing = [s for s in schedule.specs if s not in engine.specs]
        if missing:
            raise ConfigError(f"the schedule uses specs {missing} that the engine was not built with ({engine.specs})")
        if step_ms < 0:
            raise ConfigError(f"step_ms must be >= 0 (0: every step runs rounds_per_step rounds), got {step_ms}")
        self.engine, self.schedule, self.max_queue, self.on_step = engine, schedule, max_queue, on_step
        self.step_ms = step_ms
        self._round_s: dict[
            tuple[int, SpecConfig | None, bool], float
        ] = {}  # seconds per round by (rows, spec, greedy), recent
        self._waiting: collections.deque[Handle] = collections.deque()
        self._slots: list[Handle | None] = [None] * engine.slots
        self._lengths = np.zeros((engine.slots,), np.int64)
        self._stale: set[int] = set()  # freed slots whose device row may still run: stopped at the next step
        self._prefilling: dict[int, int] = {}  # slot -> prompt positions its caches hold so far, in admission order
        self._prefix = PrefixIndex(engine.slots, engine.pool_rows) if engine.prefix_cache else None
        self._jobs: collections.deque[tuple[Callable[[SlotEngine], object], Future]] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ client side

    def submit(self, request: Request, listener: Callable[[Handle, list[int], bool], None] | None = None) -> Handle:
        """Queues a request (raises ConfigError if it can never run here, QueueFull past the bound)."""
        self.engine.check_prompt(request.prompt, request.max_tokens)
        request.sampling.penalties.check_vocab(self.engine.target.config.vocab_size)
        stops = request.stop_ids(self.engine.eos_ids)
        # min_tokens holds back whatever would end the request
        request = dataclasses.replace(
            request, sampling=dataclasses.replace(request.sampling, stop_ids=tuple(sorted(stops)))
        )
        handle = Handle(request, listener, stops)
        with self._cv:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (the bound is {self.max_queue})")
            self._waiting.append(handle)
            self._cv.notify()
        return handle

    def run_on_engine(self, fn: Callable[[SlotEngine], T]) -> Future:
        """Runs ``fn(engine)`` on the engine thread between two steps (work on the engine's device state,
        e.g. ``SlotEngine.score``); the future holds its result or its exception."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the scheduler is stopping")
            self._jobs.append((fn, future))
            self._cv.notify()
        return future

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return sum(h is not None for h in self._slots)

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="eagle_jax-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not any(self._slots) and not self._jobs:
                    self._cv.wait()
                if self._stopping:
                    break
                jobs, self._jobs = list(self._jobs), collections.deque()
            for fn, future in jobs:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as exc:  # noqa: BLE001 - the caller's to report
                        future.set_exception(exc)
            if not self._waiting and not any(self._slots):
                continue
            try:
                self._iterate()
            except Exception as exc:  # noqa: BLE001 - an engine failure must not hang the clients
                log.exception("engine step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
        self._fail_all("the server is shutting down", reason="cancelled")
        with self._cv:
            jobs, self._jobs = list(self._jobs), collections.deque()
        for _, future in jobs:
            future.cancel()

    def _fail_all(self, message: str, reason: str = "error") -> None:
        now = time.perf_counter()
        for slot, h in enumerate(self._slots):
            if h is not None:
                h._finish(reason, now, message)
                self._slots[slot] = None
        self.engine.reset()
        self._stale.clear()
        self._prefilling.clear()
        if self._prefix is not None:
            self._prefix.clear()
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for h in waiting:
            h._finish(reason, now, message)

    def _free(self, slot: int, reason: str) -> None:
        handle = self._slots[slot]
        self._slots[slot] = None
        if self._prefix is not None:  # what the row holds stays reusable until the slot is taken again
            r = handle.request
            held = self._prefilling.get(slot)
            self._prefix.set(
                ("slot", slot),
                r.prompt[:held]
                if held is not None
                else (*r.prompt, *handle.tokens[: max(0, int(self._lengths[slot]) - len(r.prompt))]),
            )
        self._prefilling.pop(slot, None)
        handle._finish(reason, time.perf_counter())

    def _iterate(self) -> None:
        cancel = np.zeros((self.engine.slots,), bool)
        for slot, h in enumerate(self._slots):
            if h is not None and h.cancelled:
                self._free(slot, h._cancel)
                cancel[slot] = True
        self._admit(cancel)
        # A slot still prefilling must not run, nor the request that held it before (a stale row).
        cancel[sorted(self._stale | set(self._prefilling))] = True
        active = [slot for slot, h in enumerate(self._slots) if h is not None and slot not in self._prefilling]
        if not active:
            return
        greedy = all(self._slots[s].request.sampling.greedy for s in active)
        rows = self.engine.rows_for(active)
        auto = isinstance(self.schedule, Chooser)
        lengths = [int(self._lengths[s]) for s in active]
        if auto:
            estimates = [self._slots[s].estimate for s in active]
            spec = chooser.spec_of(
                self.schedule.choose(
                    rows, greedy, estimates, lambda d: self.engine.span_for(lengths, chooser.spec_of(d))
                )
            )
        else:
            spec = self.schedule.choose(len(active))
        span = self.engine.span_for(lengths, spec)
        short = self._owed()
        kind = (rows, spec, greedy)
        out = self.engine.step(
            spec, greedy, rows, cancel, rounds=ROUNDS_WHILE_PREFILLING if short else self._rounds(kind)
        )
        self._stale.clear()
        now = time.perf_counter()
        # A short step's time is mostly what every step costs once (dispatch, the drafter's outputs, the probe): as a
        # per-round cost it would make the depth it ran look dear, so only full steps teach costs, and only those
        # that ran their own program, not for the first time (``StepOutput.timed``): a program's first step pays
        # one-time costs, and a depth that looks dear is not run again, so its cost would never be corrected.
        timed = out.timed and not short
        if timed:
            self._time_rounds(kind, out.seconds, max((len(out.accepted[s]) for s in active), default=0))
        if auto:
            probe = out.probe
            self.schedule.observe(
                chooser.depth_of(spec),
                rows,
                span,
                greedy,
                out.seconds if timed else None,
                max((len(out.accepted[s]) for s in active), default=0),
                estimates,
                [out.accepted[s] for s in active],
                None if probe is None else [(float(probe[s, 0]), float(probe[s, 1])) for s in active],
            )
        for slot in active:
            h = self._slots[slot]
            tokens, accepted = out.tokens[slot], out.accepted[slot]
            end = _stop_end(tokens, h.stops)
            if end is not None:
                tokens, accepted = tokens[:end], _rounds_within(accepted, end)
            h.accepted.extend(accepted)
            h._deliver(tokens, now)
            self._lengths[slot] = out.lengths[slot]
            if end is not None or out.done[slot]:
                self._release(slot, bool(out.done[slot]))
        if self.on_step is not None:
            self.on_step(len(active), spec, out)

    def _time_rounds(self, kind: tuple[int, SpecConfig | None, bool], seconds: float, ran: int) -> None:
        """A full step of ``kind`` ran ``ran`` rounds in ``seconds``: the recent time per round (``_rounds``)."""
        if ran:
            per = seconds / ran
            self._round_s[kind] = per if kind not in self._round_s else 0.5 * (self._round_s[kind] + per)

    def _rounds(self, kind: tuple[int, SpecConfig | None, bool]) -> int:
        """A full step's rounds for (rows, spec, greedy): ``rounds_per_step``, or fewer where that many would
        take longer than ``step_ms`` at the recent time per round (never fewer than one)."""
        per, most = self._round_s.get(kind), self.engine.rounds_per_step
        if not self.step_ms or per is None:
            return most
        return max(1, min(most, int(self.step_ms / 1e3 / per)))

    def _owed(self) -> bool:
        """Whether prompts wait for prefill that the next iteration could start: chunks in progress, or
        requests waiting while a slot is free."""
        if self._prefilling:
            return True
        with self._cv:
            return bool(self._waiting) and any(h is None for h in self._slots)

    def _release(self, slot: int, row_done: bool) -> None:
        """Frees a slot whose request ended (at a stop token: ``stop``, else ``length``); a device row
        that did not stop by itself is stopped at the next step."""
        h = self._slots[slot]
        if not row_done:
            self._stale.add(slot)
        self._free(slot, "stop" if h.tokens and h.tokens[-1] in h.stops else "length")

    def _prefilled(self, r: Request) -> int | None:
        """A slot held by a request of ``r``'s group whose prefill is ``r``'s prompt (None: prefill anew)."""
        if r.group is None:
            return None
        for slot, h in enumerate(self._slots):
            if h is not None and h.request.group == r.group and self.engine.prompt_of(slot) == r.prompt:
                return slot
        return None

    def _admit(self, cancel: np.ndarray) -> None:
        """Takes waiting requests into free slots while this step's prefill budget (the engine's ``chunk``
        tokens while streams decode) lasts, then spends it on the prompts in progress, oldest first."""
        # Prompts wait for no stream when none decodes: then the whole context's worth may be prefilled.
        decoding = any(h is not None and slot not in self._prefilling for slot, h in enumerate(self._slots))
        budget = self.engine.chunk if decoding else self.engine.max_len

        def owed() -> int:
            return sum(len(self._slots[s].request.prompt) - start for s, start in self._prefilling.items())

        while owed() < budget:
            free = [slot for slot, h in enumerate(self._slots) if h is None]
            if not free:
                break
            with self._cv:
                if not self._waiting:
                    break
                h = self._waiting.popleft()
            if h.cancelled:  # gone before it started
                h._finish(h._cancel, time.perf_counter())
                continue
            r = h.request
            if r.group is not None and any(self._slots[s].request.group == r.group for s in self._prefilling):
                budget = self._prefill(budget)  # its group's prompt first, so that it starts from that prefill
            src, slot, reuse = self._prefilled(r), free[0], 0
            if src is None and self._prefix is not None:
                slot, reuse = self._reuse_prefix(free, r.prompt)
            cancel[slot] = False  # the slot holds the new request now
            self._stale.discard(slot)
            if isinstance(self.schedule, Chooser):
                h.estimate = self.schedule.new_row(r.sampling.greedy)
            self._slots[slot] = h
            if src is not None:  # the copies of one prompt: all of it is in the source slot, but its last position,
                reuse = len(r.prompt) - 1  # recomputed for this request's first token and the drafter's last pair
                self.engine.copy_row(("slot", src), ("slot", slot), held=reuse)
                if self._prefix is not None:
                    self._prefix.set(("slot", slot), r.prompt[:reuse])
            self._prefilling[slot] = h.cached_tokens = reuse
        self._prefill(budget)

    def _reuse_prefix(self, free: list[int], prompt: tuple[int, ...]) -> tuple[int, int]:
        """Picks the slot for ``prompt`` and puts the longest cached prefix of it there (first keeping
        what that slot held and the request will overwrite in the pool, if no pool row holds it); returns
        (slot, positions reused). A free slot that holds the prefix itself takes the request if that widens
        no step (``rows_for``); else the lowest free slot takes a copy: a step over 16 rows instead of 1
        costs ~6x a row copy per round."""
        index = self._prefix
        row, reuse = index.match(prompt, prefer=[("slot", s) for s in free])
        busy = [s for s, h in enumerate(self._slots) if h is not None]
        slot = free[0]
        if (
            row is not None
            and row[0] == "slot"
            and row[1] in free
            and self.engine.rows_for([*busy, row[1]]) == self.engine.rows_for([*busy, slot])
        ):
            slot = row[1]
        held = index.tokens(("slot", slot))
        overwritten = held is not None and (row != ("slot", slot) or len(held) > reuse + 1)  # beyond what is reused
        if overwritten and index.worth_keeping(slot):
            victim = index.pool_victim(keep=row)
            self.engine.copy_row(("slot", slot), victim)
            index.set(victim, index.tokens(("slot", slot)))
        if row is not None and row != ("slot", slot):
            self.engine.copy_row(row, ("slot", slot), held=reuse)
        index.set(("slot", slot), prompt[:reuse])
        return slot, reuse

    def _prefill(self, budget: int) -> int:
        """Prefills prompts in progress, oldest first, within ``budget`` tokens; returns the budget left."""
        for slot in list(self._prefilling):
            h, start = self._slots[slot], self._prefilling[slot]
            r = h.request
            left = len(r.prompt) - start
            if budget < min(left, self.engine.chunk_sizes[0]):
                break
            end = start + min(left, budget)
            budget -= end - start
            self._prefilling[slot] = end
            if self._prefix is not None and end < len(r.prompt):
                self._prefix.set(("slot", slot), r.prompt[:end])
            self._run_prefill(
                [slot],
                lambda: [
                    self.engine.prefill(
                        slot, r.prompt, start, end, r.max_tokens, r.sampling, r.seed, stop_at_eos=not r.ignore_eos
                    )
                ],
            )
        return budget

    def _run_prefill(self, slots: list[int], program: Callable[[], list[tuple[int, bool] | None]]) -> None:
        """Runs a prefill program for the requests in ``slots``; once it gives a request's first token the
        request starts: it is delivered, and the request ends there if that already finishes it."""
        try:
            results = program()
        except Exception as exc:
            now = time.perf_counter()
            for slot in slots:
                h = self._slots[slot]
                self._prefilling.pop(slot, None)
                self._slots[slot] = None
                h._finish("error", now, str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}")
            if isinstance(exc, ConfigError):  # these requests' own problem; anything else fails the engine
                return
            raise
        for slot, got in zip(slots, results):
            if got is None:
                continue
            h = self._slots[slot]
            first, done = got
            self._prefilling.pop(slot, None)
            self._lengths[slot] = len(h.request.prompt)
            if self._prefix is not None:
                self._prefix.set(("slot", slot), h.request.prompt)
            h._deliver([first], time.perf_counter())
            if done or first in h.stops:
                self._release(slot, done)


def _stop_end(tokens: Sequence[int], stops: frozenset[int]) -> int | None:
    """How many of ``tokens`` to keep: through the first stop token; None when there is none."""
    for i, t in enumerate(tokens):
        if t in stops:
            return i + 1
    return None


def _rounds_within(accepted: Sequence[int], kept: int) -> list[int]:
    """The rounds (drafts accepted in each, emitting that + 1 tokens) that produced the first ``kept``
    tokens of a step."""
    rounds, emitted = [], 0
    for a in accepted:
        if emitted >= kept:
            break
        rounds.append(a)
        emitted += a + 1
    return rounds


__all__: Sequence[str] = ["Handle", "QueueFull", "Request", "Scheduler", "SpecSchedule"]
