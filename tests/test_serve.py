"""The OpenAI-compatible server, end to end: a real uvicorn server on a loopback port, the official
``openai`` client, the served model loaded from checkpoint directories (serving_models.py).

Greedy responses are compared with ``eagle_jax.generate`` of the same prompt alone (fp32: token for
token). The server runs 4 slots and a schedule that changes the speculation depth with occupancy
(K=3 alone, K=1 from 3 busy slots, none with 4), so concurrent requests cross every program kind.
"""

from __future__ import annotations

import gc
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from serving_models import save_pair

import eagle_jax
from eagle_jax import SpecConfig
from eagle_jax.serving.server import Server, build_service, freeze_startup_heap

MODEL = "target"
SCHEDULE = "1:3,3:1,4:0"
MAX_LEN = 256
SOLO_NEW = 60  # the longest max_tokens the tests ask for


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(pair_dirs):
    t_dir, d_dir = pair_dirs
    service = build_service(
        t_dir, d_dir, spec=SCHEDULE, slots=4, max_len=MAX_LEN, rounds_per_step=2, max_queue=64, precompile=False
    )
    freeze_startup_heap()  # as eagle-jax-serve does before it listens
    srv = Server(service).start()
    yield srv
    srv.stop()
    gc.unfreeze()


def test_the_start_up_heap_is_frozen_out_of_the_collector(server):
    """What lived before the server listened (its models and programs) is out of the cyclic collector's
    generations: a full collection while serving does not walk it."""
    engine = server.service.scheduler.engine
    assert gc.get_freeze_count() > 0
    tracked = {id(o) for o in gc.get_objects()}
    assert id(engine) not in tracked and id(engine.programs) not in tracked
    fresh = [[]]  # allocated while serving: still collected
    assert id(fresh) in {id(o) for o in gc.get_objects()}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def solo(server):
    """Greedy output of ``eagle_jax.generate`` for one prompt alone, memoised: (token ids, text).

    One run of SOLO_NEW tokens per prompt serves every max_tokens up to it (a greedy output's first n
    tokens are its output for n), so the references compile one program per prompt length bucket."""
    svc = server.service
    engine = svc.scheduler.engine
    memo = {}

    def get(ids: list[int], max_tokens: int):
        assert max_tokens <= SOLO_NEW
        if tuple(ids) not in memo:
            res = eagle_jax.generate(
                engine.target,
                engine.drafter,
                [ids],
                max_new_tokens=SOLO_NEW,
                spec=SpecConfig(num_speculative_tokens=3),
                eos_token_id=list(engine.eos_ids),
            )
            memo[tuple(ids)] = res.tokens[0]
        tokens = memo[tuple(ids)][:max_tokens]
        return tokens, svc.tokenizer.decode(tokens, skip_special_tokens=True)

    return get


def _ids(server, text: str) -> list[int]:
    return server.service.tokenizer(text)["input_ids"]


# ------------------------------------------------------------------------------ completions and chat


def test_completion_greedy_equals_generate(server, client, solo):
    prompt = "the quick brown fox jumps over"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    tokens, text = solo(_ids(server, prompt), 40)
    assert r.choices[0].text == text and text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt),
        40,
        len(prompt) + 40,
    )
    spec = r.model_extra["speculation"]
    # Drafts were accepted (the Markov pair agrees often): fewer rounds than tokens.
    assert spec["rounds"] == len(spec["accepted_per_round"]) and spec["acceptance_length"] > 1.5
    assert sum(a + 1 for a in spec["accepted_per_round"]) == 40 - 1  # the first token comes from the prefill


def test_completion_token_prompt_and_stream(server, client, solo):
    ids = _ids(server, "a stream of tokens")
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == solo(ids, 30)[1]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == 30
        and chunks[-1].usage.prompt_tokens == len(ids)
    )
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # really streamed, not one blob


def test_chat_stream_and_nonstream(server, client, solo):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say something"}]
    ids = server.service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    expected = solo(ids, 25)[1]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=25, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 25
    stream = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=25,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    assert stream[-1].usage.total_tokens == len(ids) + 25


def test_stop_strings(server, client, solo):
    prompt = "stop strings cut the text"
    tokens, text = solo(_ids(server, prompt), 60)
    stop = text[20:23]
    cut = text.find(stop)
    assert cut >= 0 and len(text) > cut + 3
    decode = server.service.tokenizer.decode
    needed = next(n for n in range(1, len(tokens) + 1) if stop in decode(tokens[:n], skip_special_tokens=True))
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "@@"], stream=stream
        )
        if stream:
            r = list(r)
            got = "".join(c.choices[0].text for c in r)
            reason = r[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
            # Tokens up to the one that completed the stop string.
            assert r.usage.completion_tokens == needed
        assert (got, reason) == (text[:cut], "stop")


def test_sampled_request_is_reproducible_by_seed(client):
    kw = dict(model=MODEL, prompt="seeded sampling", max_tokens=20, temperature=1.0, top_p=0.9, extra_body={"top_k": 8})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in range(4)}
    assert a == b
    assert len(others | {a}) > 1


def test_32_concurrent_clients(server, client, solo):
    """Mixed prompt lengths and max_tokens, greedy and sampled together, over 4 slots: every greedy
    response equals its solo output; none fails."""
    rng = np.random.default_rng(7)
    letters = "abcdefghijklmnopqrstuvwxyz "
    jobs = []
    for i in range(32):
        n = int(rng.choice([3, 9, 20, 40]))
        prompt = "".join(rng.choice(list(letters), size=n))
        jobs.append((prompt, int(rng.choice([5, 17, 48])), i % 4 == 3))
    results: list = [None] * len(jobs)

    def run(i):
        prompt, max_tokens, sampled = jobs[i]
        try:
            kw = dict(temperature=0.8, seed=i) if sampled else dict(temperature=0)
            results[i] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **kw)
        except Exception as exc:  # noqa: BLE001 - counted below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    for (prompt, max_tokens, sampled), r in zip(jobs, results):
        assert r.usage.completion_tokens == max_tokens and r.choices[0].finish_reason == "length"
        if not sampled:
            assert r.choices[0].text == solo(_ids(server, prompt), max_tokens)[1], prompt
    assert server.service.scheduler.active == 0 and server.service.scheduler.queue_depth == 0


# ------------------------------------------------------------------------------------- bad requests

GOOD = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
BAD_REQUESTS = {
    "malformed-json": ("/v1/completions", b'{"model": "target", "prompt": ', 400, None),
    "not-an-object": ("/v1/completions", b"[1, 2]", 400, None),
    "missing-model": ("/v1/completions", {"prompt": "abc"}, 400, "model"),
    "missing-prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    "unknown-model": ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    "wrong-type": ("/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    "temperature-range": ("/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    "top-p-range": ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    "max-tokens-zero": ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    "n-0": ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    "logprobs-over-20": ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    "token-out-of-vocab": ("/v1/completions", {**GOOD, "prompt": [1, 2, 99]}, 400, "prompt"),
    "prompt-over-context": ("/v1/completions", {**GOOD, "prompt": "a" * MAX_LEN}, 400, "prompt"),
    "max-tokens-over-context": ("/v1/completions", {**GOOD, "max_tokens": MAX_LEN}, 400, "max_tokens"),
    "too-many-stops": ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    "chat-bad-role": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    "chat-no-messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    "chat-unknown-model": (
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
    ),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests(server, name):
    path, body, status, param = BAD_REQUESTS[name]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param and param.split(".")[0] in err["message"]


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10 * MAX_LEN)


def test_queue_bound_answers_429(pair_dirs):
    """With the scheduler not running, requests wait; past the bound they are refused, not dropped."""
    t_dir, d_dir = pair_dirs
    service = build_service(t_dir, d_dir, spec=SCHEDULE, slots=1, max_len=MAX_LEN, max_queue=2, precompile=False)
    srv = Server(service)
    srv.service.scheduler.start = lambda: srv.service.scheduler  # keep the engine idle: nothing leaves the queue
    srv.start()
    try:
        from eagle_jax.serving import Request

        waiting = [service.scheduler.submit(Request((1, 2, 3), 4)) for _ in range(2)]
        r = httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30)
        assert r.status_code == 429 and "waiting" in r.json()["error"]["message"]
        assert all(not h.finished for h in waiting) and service.scheduler.queue_depth == 2
    finally:
        srv.stop()


# ---------------------------------------------------------------------- disconnects, metrics, health


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_disconnect_mid_stream_frees_the_slot(server, client, solo):
    before = _metric(server, 'eagle_requests_total{outcome="cancelled"}')
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": MAX_LEN - 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk received: hang up
    deadline = time.time() + 60
    while time.time() < deadline and (
        server.service.scheduler.active or _metric(server, 'eagle_requests_total{outcome="cancelled"}') == before
    ):
        time.sleep(0.05)
    assert server.service.scheduler.active == 0
    assert _metric(server, 'eagle_requests_total{outcome="cancelled"}') == before + 1
    # and the server still answers, correctly
    r = client.completions.create(model=MODEL, prompt="after the hang up", max_tokens=12, temperature=0)
    assert r.choices[0].text == solo(_ids(server, "after the hang up"), 12)[1]


def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 4
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "eagle_requests_total",
        "eagle_prompt_tokens_total",
        "eagle_generation_tokens_total",
        "eagle_time_to_first_token_seconds_bucket",
        "eagle_inter_token_latency_seconds_bucket",
        "eagle_queue_depth",
        "eagle_slots_occupied",
        "eagle_acceptance_length",
        'eagle_spec_accepted_position_total{position="0"}',
        'eagle_compile_events_total{program="step"}',
        "eagle_programs",
        "eagle_program_compile_seconds",
    ):
        assert name in text, name
    assert _metric(server, "eagle_acceptance_length") > 1.0
    assert _metric(server, 'eagle_compile_events_total{program="chunk"}') >= 1
    engine = server.service.scheduler.engine
    assert _metric(server, "eagle_programs") == len(engine.program_set())
    assert _metric(server, 'eagle_program_compile_seconds{program="prefill chunk of 32 tokens"}') > 0
    # every step is counted under the depth it ran
    assert _metric(server, "eagle_steps_by_depth_total") == _metric(server, "eagle_steps_total") > 0


def test_stored_programs_of_other_code_are_pruned_when_stale(tmp_path):
    """Traced programs are kept per version of the code; another version's are removed once they have
    stored nothing for ``STALE_DAYS`` (a version in use elsewhere keeps its recent ones), never the current's."""
    import os
    import time

    from eagle_jax import compile_cache

    root = tmp_path / "exported"
    month_ago = time.time() - 30 * 86400
    folders = {
        name: root / name for name in ("0123456789abcdef", "fedcba9876543210", compile_cache._code_digest()[:16])
    }
    for folder in folders.values():
        folder.mkdir(parents=True)
        (folder / "p.jaxexport").write_bytes(b"")
    for name in ("0123456789abcdef", compile_cache._code_digest()[:16]):
        os.utime(folders[name], (month_ago, month_ago))
    compile_cache.prune_exported(root)
    assert sorted(p.name for p in root.iterdir()) == sorted(["fedcba9876543210", compile_cache._code_digest()[:16]])


def test_precompiled_server_compiles_nothing_while_serving(pair_dirs, tmp_path, monkeypatch):
    """``precompile`` builds the engine's whole program set (inserts and scoring per prompt bucket, steps
    per spec, greedy or not, rows and span) before serving; then no request compiles anything, whatever
    it asks (sampling, ignore_eos, penalties, logprobs with echo, any prompt length). With the persistent
    compilation cache on, a second engine loads every program from it instead of compiling."""
    import jax

    from eagle_jax import compile_cache
    from eagle_jax.decoding.engine import run_rounds
    from eagle_jax.serving import slot_programs

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {name: getattr(jax.config, name) for name in names}
    hits = []

    def listen(event, **kw):
        if event.endswith("cache_hits"):
            hits.append(event)

    jax.monitoring.register_event_listener(listen)
    t_dir, d_dir = pair_dirs
    try:
        compile_cache.enable(tmp_path / "xla")
        service = build_service(t_dir, d_dir, spec="1:2", slots=1, max_len=64, rounds_per_step=2, precompile=True)
        engine = service.scheduler.engine
        # prefill chunks of 8, 32 and the whole cache, the row read, the row copy, one scoring program, the step
        assert len(engine.compile_events) == len(engine.program_set()) == 3 + 1 + 1 + 1 + 1
        srv = Server(service).start()
        try:
            bodies = [
                dict(prompt="abc", max_tokens=12, temperature=0),
                dict(prompt="x" * 40, max_tokens=6, temperature=1.0, seed=1),
                dict(prompt="hello", max_tokens=10, ignore_eos=True, presence_penalty=0.5, logit_bias={"3": 2.0}),
                dict(prompt="score me", max_tokens=3, echo=True, logprobs=2, temperature=0),
            ]
            texts = []
            for body in bodies * 2:
                r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
            engine.wait_for_compiles()  # a program compiled in the background would count now
            assert len(engine.compile_events) == len(engine.program_set())
            assert _metric(srv, "eagle_compile_events_total") == len(engine.program_set())
        finally:
            srv.stop()
        # Each program is also stored as traced, so a restart neither traces nor compiles: the second
        # engine lowers the stored programs, loads their executables, and serves the same tokens.
        assert len(list((tmp_path / "xla" / "exported").rglob("*.jaxexport"))) == len(engine.program_set())
        hits.clear()
        traced = []
        monkeypatch.setattr(slot_programs, "run_rounds", lambda *a, **k: traced.append(1) or run_rounds(*a, **k))
        again = build_service(t_dir, d_dir, spec="1:2", slots=1, max_len=64, rounds_per_step=2, precompile=True)
        assert len(hits) >= len(engine.program_set()) and not traced
        srv = Server(again).start()
        try:
            for body, text in zip(bodies, texts):
                if body.get("temperature") != 0 and "seed" not in body:
                    continue  # unseeded sampling
                r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)
                assert r.json()["choices"][0]["text"] == text, body
            assert len(again.scheduler.engine.compile_events) == len(engine.program_set())
        finally:
            srv.stop()
    finally:
        jax.monitoring.unregister_event_listener(listen)
        compile_cache.disable()
        for name, value in old.items():
            jax.config.update(name, value)


def test_a_stopped_server_frees_its_service(pair_dirs):
    """A stopped and dropped ``Server`` takes its service (the engine's caches and programs) with it:
    nothing process-wide keeps it (FastAPI caches endpoint functions), so one process can serve one model
    after another (``bench.serve``)."""
    import gc
    import weakref

    t_dir, _ = pair_dirs
    srv = Server(build_service(t_dir, None, slots=1, max_len=64, precompile=False)).start()
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == t_dir.name
    srv.stop()
    engine = weakref.ref(srv.service.scheduler.engine)
    del srv
    gc.collect()
    assert engine() is None


def test_cli_serves_a_target_alone(pair_dirs, monkeypatch):
    """``eagle-jax-serve --target DIR --drafter none --spec none``: the target alone, its tokenizer, and the
    directory's name on /v1/models (no precompile, no compilation cache; the app is queried in process)."""
    import uvicorn
    from fastapi.testclient import TestClient

    from eagle_jax.cli.serve import main
    from eagle_jax.serving import server as server_module

    t_dir, _ = pair_dirs
    built, seen = {}, {}
    real = server_module.build_service

    def build(*args, **kwargs):
        built["service"] = real(*args, **kwargs)
        return built["service"]

    def run(app, **kwargs):
        seen["models"] = TestClient(app).get("/v1/models").json()

    monkeypatch.setattr(server_module, "build_service", build)
    monkeypatch.setattr(uvicorn, "run", run)
    main(
        [
            "--target",
            str(t_dir),
            "--drafter",
            "none",
            "--spec",
            "none",
            "--slots",
            "1",
            "--max-len",
            "64",
            "--no-precompile",
            "--compile-cache",
            "off",
        ]
    )
    service = built["service"]
    assert [m["id"] for m in seen["models"]["data"]] == [t_dir.name]
    assert service.scheduler.engine.drafter is None and service.scheduler.schedule.choose(1) is None
    assert service.tokenizer.decode(service.tokenizer("a fox")["input_ids"]) == "a fox"


class _AppServer:
    """``create_app`` over the running server's service with other options, on a port of its own (the scheduler
    is the module server's)."""

    def __init__(self, service, **options):
        import uvicorn

        from eagle_jax.serving.http_app import create_app

        self._server = uvicorn.Server(
            uvicorn.Config(
                create_app(service, **options), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
            )
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self._server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join()


def test_an_api_key_guards_the_v1_routes(server, monkeypatch):
    """With ``--api-key`` every /v1/* route needs ``Authorization: Bearer KEY``: the official client with the key
    is served, without it or with a wrong one gets OpenAI's 401 (``AuthenticationError``), and malformed headers
    get the same 401 body; /health and /metrics stay open."""
    with _AppServer(server.service, api_key="s3cret") as url:
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=120)
        assert (
            good.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0).choices[0].text is not None
        )
        assert [m.id for m in good.models.list().data] == [MODEL]
        for key in ("wrong", "s3cret "[:-1] + "x"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).models.list()
        for headers in (
            {},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
            {"Authorization": "Bearer"},
            {"Authorization": "Bearer s3cret extra"},
            {"Authorization": "bearer  wrong"},
        ):
            r = httpx.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1}, headers=headers
            )
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
        assert (
            httpx.get(url + "/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        )  # the scheme is case-blind
    with pytest.raises(eagle_jax.ConfigError, match="API key is empty"):
        from eagle_jax.serving.http_app import create_app

        create_app(server.service, api_key=" ")


def test_limits_are_refused_before_any_work_is_queued(server):
    """A body over the size limit, a prompt over the context and max_tokens past it each get a 400 naming
    what is wrong, and nothing reaches the scheduler."""
    scheduler = server.service.scheduler
    submitted, real = [], scheduler.submit
    scheduler.submit = lambda *a, **k: submitted.append(a) or real(*a, **k)
    try:
        with _AppServer(server.service, max_request_bytes=2000) as url:
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 3000, "max_tokens": 1})
            assert r.status_code == 400 and "limit of 2000" in r.json()["error"]["message"], r.text
            r = httpx.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": [[1] * (MAX_LEN + 1)], "max_tokens": 1}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": MAX_LEN})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    finally:
        scheduler.submit = real
    assert not submitted


def test_list_programs_prints_the_set_and_exits(pair_dirs, capsys, tmp_path):
    """``eagle-jax-serve --list-programs`` prints the programs a start compiles, with their shapes, and
    compiles nothing."""
    from eagle_jax import compile_cache
    from eagle_jax.cli.serve import main
    from eagle_jax.serving.server import is_loopback

    t_dir, d_dir = pair_dirs
    try:
        main(
            [
                "--target",
                str(t_dir),
                "--drafter",
                str(d_dir),
                "--spec",
                "1:2,2:1",
                "--slots",
                "4",
                "--max-len",
                "64",
                "--compile-cache",
                str(tmp_path / "xla"),
                "--list-programs",
            ]
        )
    finally:
        compile_cache.disable()
    head, *lines = capsys.readouterr().out.strip().splitlines()
    assert head.startswith(f"{len(lines)} programs (4 slots x 64 tokens")
    steps = [line for line in lines if line.strip().startswith("step,")]
    assert len(steps) == 2 * 2 and all("verified positions" in line for line in steps)  # K=2 and K=1, over 1 and 4 rows
    assert any("prefill chunk of 32 tokens" in line for line in lines) and not list(
        (tmp_path / "xla").rglob("*.jaxexport")
    )
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
