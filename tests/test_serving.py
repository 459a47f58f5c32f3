"""The slot engine and scheduler without HTTP: greedy equality with ``generate`` under continuous
batching (EOS and token limits, depth switching), seeds independent of the other slots, cancellation,
schedules, and the stop-string text stream."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_models import markov_pair
from serving_models import build_tokenizer

import eagle_jax
from eagle_jax import ConfigError, SpecConfig
from eagle_jax.decoding import chooser
from eagle_jax.decoding.chooser import Chooser
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.serving import Request, Scheduler, SlotEngine, SpecSchedule
from eagle_jax.serving.text import TextStream

SCHEDULE = SpecSchedule.parse("1:3,2:2,3:0")


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


@pytest.fixture(scope="module")
def eos(pair):
    """An EOS id that some greedy continuations reach within 30 tokens and others do not."""
    target, drafter = pair
    plain = eagle_jax.generate(target, None, [[1, 2, 3], [9, 8], [20, 21, 22, 23]], max_new_tokens=30)
    return plain.tokens[0][12]


def _scheduler(pair, eos_id, slots=3, rounds=3, schedule=SCHEDULE, start=True):
    target, drafter = pair
    engine = SlotEngine(
        target, drafter, slots=slots, max_len=96, specs=schedule.specs, rounds_per_step=rounds, eos_ids=(eos_id,)
    )
    sched = Scheduler(engine, schedule)
    return sched.start() if start else sched


def test_continuous_batching_equals_generate(pair, eos):
    """8 requests through 3 slots (admitted as others finish; depth 3/2/none by occupancy)."""
    target, drafter = pair
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 32, size=int(n)).tolist() for n in rng.integers(2, 40, size=8)]
    limits = [int(m) for m in rng.integers(1, 30, size=8)]
    sched = _scheduler(pair, eos, start=False)
    try:
        handles = [sched.submit(Request(tuple(p), m)) for p, m in zip(prompts, limits)]
        sched.start()
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    reasons = set()
    for p, m, h in zip(prompts, limits, handles):
        # One reference length for all (greedy: the first m tokens are the output for m), so the
        # references compile a program per prompt length bucket, not per limit.
        ref = eagle_jax.generate(
            target,
            drafter,
            [p],
            max_new_tokens=max(limits),
            spec=SpecConfig(num_speculative_tokens=3),
            eos_token_id=eos,
        ).tokens[0][:m]
        assert h.tokens == ref
        assert h.finish_reason == ("stop" if ref[-1] == eos else "length")
        reasons.add(h.finish_reason)
    assert reasons == {"stop", "length"}
    assert sum(h.accepted.count(2) + h.accepted.count(3) for h in handles) > 0  # multi-token rounds happened
    assert sched.engine.compile_events  # and were compiled once per program, counted


def test_auto_depth_in_slots_equals_generate(pair, eos):
    """The server's default (``--spec auto``): each step's depth from the costs measured at its row count
    and the busy requests' live acceptance. Outputs equal generate's; the deepest depth and a step
    without drafts per row count are measured by running them (the rest is modelled); steps without
    drafts observe the drafter (``probe``) and every request's estimate is updated from its own rounds."""
    target, drafter = pair
    auto = Chooser()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 32, size=int(n)).tolist() for n in rng.integers(2, 30, size=5)]
    steps = []
    sched = _scheduler(pair, eos, schedule=auto)
    sched.on_step = lambda active, spec, out: steps.append((spec, out.probe))
    try:
        handles = [sched.submit(Request(tuple(p), 24)) for p in prompts]
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    for p, h in zip(prompts, handles):
        ref = eagle_jax.generate(target, None, [p], max_new_tokens=24, eos_token_id=eos).tokens[0]
        assert h.tokens == ref and h.estimate is not None
    assert {chooser.depth_of(s) for s, _ in steps} >= {0, max(auto.depths)}  # the warm-up profile's two ends ran
    assert all(probe[:, 1].sum() > 0 for s, probe in steps if s is None)  # steps without drafts observed acceptance
    snap = auto.snapshot()  # what bench.serve reports of the chooser: the costs measured and the pooled acceptance
    assert any("x0@" in k for k in snap["costs"]["greedy"]) and len(snap["acceptance"]["greedy"]) == chooser.DEEPEST
    assert sum(h.accepted.count(2) + h.accepted.count(3) for h in handles) > 0
    assert auto.pooled[True].trials.sum() > 0  # every request's rounds joined the pooled estimate


def test_tree_speculation_in_slots_equals_generate(pair, eos):
    """EAGLE-2 trees in the slot engine: tree verification and the accepted-path cache moves act on the
    leading rows of the shared caches (a free slot above them untouched)."""
    target, drafter = pair
    tree = SpecConfig(method="tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)
    schedule = SpecSchedule.fixed(tree)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(20))]
    sched = _scheduler(pair, eos, slots=4, rounds=2, schedule=schedule)
    try:
        handles = [sched.submit(Request(tuple(p), 20)) for p in prompts]
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    for p, h in zip(prompts, handles):
        ref = eagle_jax.generate(target, drafter, [p], max_new_tokens=20, spec=tree, eos_token_id=eos)
        assert h.tokens == ref.tokens[0]
    assert max(a for h in handles for a in h.accepted) >= 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_steps_without_drafts_feed_the_drafter_lazily(pair, temperature):
    """A step without drafts writes only the drafter's cache in its rounds but the last, which computes
    its outputs (``Plan.lazy_feed``): after it the drafter's cache and outputs are those of feeding it in
    full every round, the first round probed the first draft, and the next step's drafts are the same."""
    target, drafter = pair

    class FedInFull(SlotEngine):
        def _plan(self, **kw):
            return super()._plan(**{**kw, "lazy_feed": False})

    sp = SamplingParams(temperature=temperature)
    prompts = [(1, 2, 3, 4), (9, 8), tuple(range(5, 25))]
    specs = (None, SpecConfig(num_speculative_tokens=2))
    states = []
    for cls in (SlotEngine, FedInFull):
        engine = cls(target, drafter, slots=4, max_len=96, specs=specs, rounds_per_step=3)
        for i, p in enumerate(prompts):
            engine.insert(i, p, 40, sp, seed=i)
        plain = engine.step(None, temperature == 0, rows=4)
        st = jax.device_get(
            (engine.state.d_logits, engine.state.d_feat, engine.state.d_cache)
        )  # the next step donates the state
        states.append((plain, *st, engine.step(specs[1], temperature == 0, rows=4)))
    (lazy, *lazy_drafter, lazy_next), (full, *full_drafter, full_next) = states
    assert lazy.tokens == full.tokens
    for a, b in zip(jax.tree.leaves(lazy_drafter), jax.tree.leaves(full_drafter)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(lazy.probe[:3, 1], 1.0)  # the first round probed
    np.testing.assert_array_equal(full.probe[:3, 1], 3.0)  # ... where full feeding probes every round
    assert lazy_next.tokens == full_next.tokens and lazy_next.accepted == full_next.accepted


def test_steps_are_short_while_a_prompt_is_prefilled_in_chunks(pair, eos):
    """While a long prompt is prefilled chunk by chunk, the running stream's steps run one round each
    (``ROUNDS_WHILE_PREFILLING``), so the next chunk follows one round later; once nothing is owed prefill,
    steps run ``rounds_per_step`` rounds again. Both requests' tokens are generate's."""
    from eagle_jax.serving.scheduler import ROUNDS_WHILE_PREFILLING

    target, drafter = pair
    engine = SlotEngine(
        target, drafter, slots=2, max_len=128, specs=SCHEDULE.specs, rounds_per_step=3, eos_ids=(), chunk=32
    )
    sched = Scheduler(engine, SCHEDULE)
    rounds_of_first: list[tuple[int, int]] = []  # (rounds the stream's row ran, requests prefilling) per step
    sched.on_step = lambda active, spec, out: rounds_of_first.append((len(out.accepted[0]), len(sched._prefilling)))
    short, long = [1, 2, 3], list(np.random.default_rng(1).integers(0, 32, size=100))
    sched.start()
    try:
        first = sched.submit(Request(tuple(short), 60))
        while len(first.tokens) < 4:
            first._finished.wait(0.01)
        second = sched.submit(Request(tuple(int(t) for t in long), 10))
        first.wait(300), second.wait(300)
    finally:
        sched.stop()
    spec = SpecConfig(num_speculative_tokens=3)
    for prompt, h, m in ((short, first, 60), (long, second, 10)):
        assert h.tokens == eagle_jax.generate(target, drafter, [prompt], max_new_tokens=m, spec=spec).tokens[0]
    during = [r for r, prefilling in rounds_of_first if prefilling]
    assert len(during) >= 2 and set(during) == {ROUNDS_WHILE_PREFILLING}, (
        rounds_of_first
    )  # 100 tokens: chunks over several steps
    assert max(r for r, _ in rounds_of_first) == 3


@pytest.mark.parametrize("step_ms", [0.0, 1e-3])
def test_steps_are_cut_to_step_ms(pair, eos, step_ms):
    """A full step runs rounds_per_step rounds, or as many as fit in ``step_ms`` at the time per round its
    rows and spec took last (at least one; a program's first run, which pays one-time costs, is not a time per
    round): with a step of a microsecond every step after the first two of its kind (its program not precompiled
    here) runs one round; with 0, every full step its rounds. Outputs are generate's either way."""
    target, drafter = pair
    engine = SlotEngine(target, drafter, slots=1, max_len=96, specs=(None,), rounds_per_step=4, eos_ids=())
    sched = Scheduler(engine, SpecSchedule.fixed(None), step_ms=step_ms)
    rounds: list[int] = []
    sched.on_step = lambda active, spec, out: rounds.append(len(out.accepted[0]))
    sched.start()
    try:
        h = sched.submit(Request((3, 1, 4), 21)).wait(300)  # the prefill's token, then 20 in steps
    finally:
        sched.stop()
    assert h.tokens == eagle_jax.generate(target, None, [[3, 1, 4]], max_new_tokens=21).tokens[0]
    assert rounds == ([4] * 5 if step_ms == 0 else [4, 4] + [1] * 12), rounds
    with pytest.raises(ConfigError, match="step_ms must be >= 0"):
        Scheduler(engine, SpecSchedule.fixed(None), step_ms=-1)


def test_a_short_steps_time_teaches_no_cost():
    """A one-round step while prompts are prefilled is mostly a step's fixed costs: the chooser learns
    acceptance from it, not a per-round cost (which would make the depth it ran look dear)."""
    auto = Chooser()
    est = auto.new_row(True)
    auto.observe(0, 4, 256, True, None, 1, [est], [[0]], [(1.0, 1.0)])
    assert not auto.costs[True].seconds and est.trials[0] > 0
    auto.observe(0, 4, 256, True, 0.5, 2, [est], [[0, 0]], [(2.0, 2.0)])
    assert auto.costs[True].measured(4, 0, 256) == pytest.approx(0.25)


def test_a_steps_time_is_timed_only_on_its_own_programs_later_runs(pair, eos):
    """Without precompiling, a step program's first run pays one-time costs (a chain's first step cost 2-3x its
    later ones on a CPU), and a covering program computes more rows: neither step's time is
    what its kind costs (``StepOutput.timed``), so ``--spec auto`` learns no cost from it (it would price a
    chain out, and a chain priced out never runs again to correct that)."""
    target, drafter = pair
    k1 = SpecConfig(num_speculative_tokens=1)
    engine = SlotEngine(target, drafter, slots=2, max_len=96, specs=(None, k1), rounds_per_step=2, eos_ids=(eos,))
    assert [engine.step(k1, False, 2).timed for _ in range(2)] == [False, True]
    engine.wait_for_compiles()
    assert not engine.step(k1, False, 1).timed  # the covering program ran while its own compiles
    engine.wait_for_compiles()
    assert [engine.step(k1, False, 1).timed for _ in range(2)] == [False, True]

    auto = Chooser()
    sched = _scheduler(pair, eos, schedule=auto, start=False)
    learnt, steps = [], []
    observe = auto.observe
    auto.observe = lambda depth, rows, span, greedy, seconds, *rest: (
        learnt.append(seconds),
        observe(depth, rows, span, greedy, seconds, *rest),
    )
    sched.on_step = lambda active, spec, out: steps.append(out.timed)
    sched.start()
    try:
        for h in [sched.submit(Request((3, 1, 4, 1, 5), 24, SamplingParams(1.0), seed=i)) for i in range(4)]:
            h.wait(300)
    finally:
        sched.stop()
    assert False in steps and any(s is not None for s in learnt)
    assert all(s is None for s, timed in zip(learnt, steps) if not timed)


def test_a_request_without_drafts_returns_to_speculation():
    """A request whose estimate dipped (40 rounds without an accepted draft) and whose steps without drafts then
    see the first draft accepted 3 times in 10 speculates again after a few steps (K=1 pays from 20%), not at once:
    the dip is not forgotten."""
    auto = Chooser(depths=(1, 3))
    for depth, per_round in ((0, 1.0), (1, 1.2), (3, 1.6), (chooser.DEEPEST, 2.4)):
        auto.costs[False].observe(1, depth, 512, 8 * per_round, 8)
    est = auto.new_row(False)
    est.observe([0] * 40, 1)
    steps = 0
    while auto.choose(1, False, [est], lambda d: 512) == chooser.PLAIN:
        auto.observe(0, 1, 512, False, None, 8, [est], [[0] * 8], [(0.3, 1.0)])  # 8 rounds, the first probed
        steps += 1
        assert steps <= 12
    assert steps >= 3


def test_costs_are_kept_per_span():
    """A round reading a longer cache span costs more: each span bucket keeps its own costs; a depth not seen at a
    span is read at the nearest span where it ran, and measured there once it runs."""
    auto = Chooser(depths=(1, 3))
    est = auto.new_row(True)
    est.observe([3] * 20, 3)  # every draft accepted: a chain of 3 emits ~4 tokens per round
    for depth, span, per_round in [(0, 256, 1.0), (chooser.DEEPEST, 256, 3.0), (3, 256, 2.0), (0, 1024, 2.0)]:
        auto.observe(depth, 8, span, True, 3 * per_round, 3, [est], [[min(depth, 3)] * 3], [(3.0, 3.0)])
    costs = auto.costs[True]
    assert costs.cost(8, 3, 256) == pytest.approx(2.0) and costs.cost(8, 0, 1024) == pytest.approx(2.0)
    assert costs.cost(8, 3, 1024) == pytest.approx(2.0)  # not run at 1024: its nearest span's
    assert costs.cost(8, 1, 256) == pytest.approx(1 + 1 / 3)  # never run: linear in K between 0 and 3
    assert auto.choose(8, True, [est], lambda d: 1024) == 3
    auto.observe(3, 8, 1024, True, 3 * 12.0, 3, [est], [[3] * 3])  # ... until it is measured dear there
    assert auto.choose(8, True, [est], lambda d: 1024) != 3
    assert auto.choose(8, True, [est], lambda d: 256) == 3  # the short span's costs are its own


def test_seeded_sampling_does_not_depend_on_other_slots(pair):
    """Each slot draws from its own key stream: at a fixed depth a seeded request samples the same tokens
    alone or among others (a depth change consumes randomness differently: same law, other draws)."""
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    req = Request((4, 5, 6, 7), 25, sp, seed=99)
    fixed = SpecSchedule.parse("1:3")
    alone = _scheduler(pair, eos_id=-1, schedule=fixed)
    try:
        a = alone.submit(req).wait(300).tokens
    finally:
        alone.stop()
    crowd = _scheduler(pair, eos_id=-1, schedule=fixed)
    try:
        others = [crowd.submit(Request((1, 2), 30, sp, seed=s)) for s in range(2)]
        b = crowd.submit(req).wait(300).tokens
        for h in others:
            h.wait(300)
    finally:
        crowd.stop()
    assert a == b and len(a) == 25


def test_cancel_frees_slot(pair):
    sched = _scheduler(pair, eos_id=-1, slots=1, rounds=1)
    try:
        long = sched.submit(Request((1, 2, 3), 90))
        queued = sched.submit(Request((5, 6), 4))
        while len(long.tokens) < 2:
            long._finished.wait(0.01)
        long.cancel()
        assert queued.wait(300).finish_reason == "length" and len(queued.tokens) == 4
        assert long.finish_reason == "cancelled" and len(long.tokens) < 90
    finally:
        sched.stop()


def test_engine_rejects_impossible_requests(pair):
    target, drafter = pair
    engine = SlotEngine(target, drafter, slots=2, max_len=64, specs=(None,))
    with pytest.raises(ConfigError, match="context limit of 64"):
        engine.check_prompt(list(range(30)), 40)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.check_prompt([1, 99], 4)
    with pytest.raises(ConfigError, match="not one of this engine's configured specs"):
        engine.step(SpecConfig(num_speculative_tokens=2), True)
    with pytest.raises(ConfigError, match="max_len must be in"):
        SlotEngine(target, drafter, max_len=10_000)
    with pytest.raises(ConfigError, match="no drafter"):
        SlotEngine(target, None, specs=(SpecConfig(),))


def test_precompiling_past_the_memory_map_limit_is_a_clear_error(pair, tmp_path, monkeypatch):
    """On the CPU each compiled program holds hundreds of memory maps; past vm.max_map_count LLVM would
    abort the process mid-compile, so precompile refuses first, naming the limit and the ways out."""
    import eagle_jax.serving.slots as slots  # where precompile looks the check up

    in_use = sum(1 for _ in open("/proc/self/maps"))  # this process's maps so far (the whole suite's programs)
    limit = tmp_path / "max_map_count"
    limit.write_text(f"{in_use + 2000}\n")  # room for a few programs, not for the engine's set
    real = slots.check_map_limit
    monkeypatch.setattr(slots, "check_map_limit", lambda n: real(n, str(limit)))
    engine = SlotEngine(*pair, slots=16, max_len=96, specs=(None, SpecConfig(num_speculative_tokens=3)))
    with pytest.raises(
        ConfigError, match=rf"vm.max_map_count \({in_use + 2000}\).*sysctl -w vm.max_map_count=\d+.*do not precompile"
    ):
        engine.precompile()
    assert not engine.compile_events  # refused before compiling anything
    real(1, str(limit))  # a few programs fit


def test_a_failed_compile_stops_precompile_with_its_error(pair):
    """Compiling several programs at once, one compile's error is what ``precompile`` raises (the programs
    not yet started are dropped), so a server does not start on a partial set."""
    engine = SlotEngine(*pair, slots=2, max_len=64)
    asked, real = [], engine.programs.compiled

    def compiled(key, build, args, donate_argnums=(2,)):
        asked.append(key)
        if key == ("copy",):
            raise RuntimeError("XLA could not compile the row copy")
        if key == ("row",):  # the prefill chunks' example arguments read a cache row with it
            return real(key, build, args, donate_argnums)

    engine.programs.compiled = compiled
    with pytest.raises(RuntimeError, match="could not compile the row copy"):
        engine.precompile(warm_up=False, workers=2)
    assert ("copy",) in asked and set(asked) <= set(engine.program_set())


def test_warm_up_runs_every_program_once_and_frees_the_slots(pair, eos):
    """``precompile`` (here two programs at a time) compiles each program of its set once, then runs each
    once (a program's first run pays one-time costs the first requests would otherwise pay): every step over
    live rows, and afterwards every slot is free and a request's output is what it would have been."""
    target, drafter = pair
    engine = SlotEngine(
        target,
        drafter,
        slots=2,
        max_len=64,
        specs=(None, SpecConfig(num_speculative_tokens=2)),
        rounds_per_step=2,
        eos_ids=(eos,),
    )
    with pytest.raises(ConfigError, match="compile workers must be >= 1"):
        engine.precompile(workers=0)
    engine.precompile(warm_up=False, workers=2)
    keys = engine.program_set()
    assert sorted(map(repr, engine.programs.keys())) == sorted(map(repr, keys)) and len(engine.compile_events) == len(
        keys
    )
    runs, emitted = {}, {}

    def counting(key, program):
        def run(*args):
            runs[key] = runs.get(key, 0) + 1
            out = program(*args)
            if key[0] == "step":
                emitted[key] = int(np.asarray(out.n_out).sum())
            return out

        return run

    engine.programs.programs = {k: counting(k, p) for k, p in engine.programs.programs.items()}
    engine.warm_up(keys)
    assert set(runs) == set(keys) and not engine.compile_events[len(keys) :]
    assert all(emitted[k] > 0 for k in keys if k[0] == "step"), emitted  # each step ran a round over live rows
    assert (
        bool(np.asarray(engine.state.done).all()) and not np.asarray(engine.state.length).any() and not engine._prompts
    )
    sched = Scheduler(engine, SpecSchedule.fixed(SpecConfig(num_speculative_tokens=2))).start()
    try:
        got = sched.submit(Request((5, 6, 7), 20)).wait(300).tokens
    finally:
        sched.stop()
    assert got == eagle_jax.generate(target, None, [[5, 6, 7]], max_new_tokens=20, eos_token_id=eos).tokens[0]


def test_spec_schedule():
    s = SpecSchedule.parse("1:5,4:3,9:0")
    assert [s.choose(n) for n in (1, 3, 4, 8, 9, 16)] == [SpecConfig(num_speculative_tokens=5)] * 2 + [
        SpecConfig(num_speculative_tokens=3)
    ] * 2 + [None] * 2
    assert s.specs == (SpecConfig(num_speculative_tokens=5), SpecConfig(num_speculative_tokens=3), None)
    for bad in ("2:3", "1:x", "0:3", "1:-1"):
        with pytest.raises(ConfigError):
            SpecSchedule.parse(bad)


def test_text_stream_stop_strings():
    tok = build_tokenizer()
    ids = tok("hello world, good day")["input_ids"]
    # Released text never runs into a stop string, even one split across deliveries.
    ts = TextStream(tok, ["ld, g", "zz"])
    out = "".join(ts.push([t]) for t in ids[:12])
    assert out == "hello wor"  # "ld," could still become the stop string: held back
    out += ts.push(ids[12:15])
    assert ts.stopped and out == "hello wor" and ts.tokens_at_stop == 14
    assert ts.push(ids[15:]) == "" and ts.finish() == ""
    # A held-back prefix is released when the stream ends without the stop string.
    ts = TextStream(tok, ["day!"])
    out = ts.push(ids)
    assert out == "hello world, good " and ts.finish() == "day" and not ts.stopped
    ts = TextStream(tok)
    assert ts.push(ids[:5]) == "hello" and ts.finish() == ""


def test_serve_spec_argument():
    from eagle_jax.serving.server import parse_spec

    vllm = parse_spec('{"model": "x", "method": "eagle3", "num_speculative_tokens": 3}', True)
    assert vllm.rules == ((1, SpecConfig(num_speculative_tokens=3)),)
    assert parse_spec("1:5,4:0", True).choose(4) is None
    assert isinstance(parse_spec(None, True), Chooser) and isinstance(parse_spec("auto", True), Chooser)
    assert parse_spec(None, False).rules == ((1, None),)
    with pytest.raises(ConfigError, match="no drafter"):
        parse_spec("1:3", False)
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_spec("{method: eagle3}", True)
    with pytest.raises(ConfigError, match="unknown fields"):
        parse_spec('{"method": "eagle3", "depth": 3}', True)


def test_exact_mode_in_slots(tmp_path):
    """``exact``: a bf16 pair served with the target in float32; each request's greedy output equals
    ``generate(..., exact=True)`` of its prompt alone, whatever shares its steps."""
    from engine_models import random_pair

    target, drafter = random_pair(vocab=48, hidden=32, logit_scale=4.0, layers=4)
    eagle_jax.save_target(target, tmp_path / "t", dtype="bfloat16")
    eagle_jax.save_drafter(drafter, tmp_path / "d", dtype="bfloat16")
    target = eagle_jax.load_target(tmp_path / "t")
    drafter = eagle_jax.load_drafter(tmp_path / "d", target)
    spec = SpecConfig(num_speculative_tokens=3)
    engine = SlotEngine(target, drafter, slots=3, max_len=64, specs=(spec,), rounds_per_step=2, exact=True)
    assert target.dtype == np.dtype("bfloat16") and engine.state.t_cache.k[0].dtype == np.float32
    sched = Scheduler(engine, SpecSchedule.fixed(spec)).start()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(20))]
    try:
        handles = [sched.submit(Request(tuple(p), 16)) for p in prompts]
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    for p, h in zip(prompts, handles):
        assert h.tokens == eagle_jax.generate(target, None, [p], max_new_tokens=16, exact=True).tokens[0]


def test_served_model_name(tmp_path):
    """The default /v1/models name: a .gguf file's stem, a directory's name, a named model's or Hub repo's name."""
    from eagle_jax.serving.server import served_name

    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(28))
    (tmp_path / "ckpt").mkdir()
    assert served_name(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert served_name(str(tmp_path / "ckpt") + "/") == "ckpt"
    assert served_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert served_name("org/name") == "name"


def test_n_choices_share_one_prefill(pair, eos):
    """Requests of one group (the ``n`` choices of one prompt) start from the first one's prefill: its
    cache row copied, only the last prompt position computed again, and every choice is what the same
    request alone gives (greedy: plain decoding; sampled: its own seed's tokens at the same depth)."""
    target, drafter = pair
    prompt = (3, 1, 4, 1, 5, 9, 2, 6)
    sp = SamplingParams(temperature=1.0)
    schedule = SpecSchedule.parse("1:3")
    engine = SlotEngine(target, drafter, slots=4, max_len=96, specs=schedule.specs, rounds_per_step=3, eos_ids=(eos,))
    sched = Scheduler(engine, schedule)
    computed, real = [], sched.engine.prefill  # prompt positions each prefill computes

    def counted(slot, prompt, start, end, *a, **k):
        computed.append(end - start)
        return real(slot, prompt, start, end, *a, **k)

    sched.engine.prefill = counted
    greedy = [sched.submit(Request(prompt, 20, group=1)) for _ in range(3)]
    sampled = [sched.submit(Request(prompt, 20, sp, seed=40 + j, group=2)) for j in range(3)]
    sched.start()  # admits greedy 1 (prefilled), 2 and 3 (copies), sampled 1 (prefilled); the rest as slots free up
    try:
        for h in greedy + sampled:
            h.wait(300)
        assert len(computed) == 6 and computed.count(1) >= 2 and set(computed) == {1, len(prompt)}, computed
        alone = [sched.submit(Request(prompt, 20, sp, seed=40 + j)) for j in range(3)]
        for h in alone:
            h.wait(300)
    finally:
        sched.stop()
    ref = eagle_jax.generate(target, None, [list(prompt)], max_new_tokens=20, eos_token_id=eos).tokens[0]
    assert all(h.tokens == ref for h in greedy)
    assert [h.tokens for h in sampled] == [h.tokens for h in alone]
    assert len({tuple(h.tokens) for h in sampled}) > 1
