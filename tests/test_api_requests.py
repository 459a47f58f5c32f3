"""Request forms real clients send (lm-evaluation-harness ``local-completions``, guidellm), end to end
through a real server: prompt lists and token prompts, stream_options, vLLM's stop and detokenization
fields, /tokenize and /detokenize, and the rule that no request field is silently ignored.

The served model is the Markov pair of serving_models.py with one twist: its character ``q`` is the EOS
and a special token of the tokenizer, so greedy text from ``abc`` reaches the EOS after a few tokens and
``skip_special_tokens`` / ``include_stop_str_in_output`` change what is returned.
"""

from __future__ import annotations

import json
import logging

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from engine_models import markov_pair
from serving_models import build_tokenizer

import eagle_jax
from eagle_jax import ConfigError, SpecConfig
from eagle_jax.serving import Request, Scheduler, SlotEngine, SpecSchedule, protocol
from eagle_jax.serving.server import Server, make_service
from eagle_jax.serving.text import TextStream

MODEL = "markov"
EOS_CHAR = "q"
MAX_LEN = 128
PROMPT = "abc"  # its greedy continuation reaches the EOS (checked by test_eos_and_ignore_eos)


def _tokenizer():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [EOS_CHAR]})  # an existing id becomes special
    return tok


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


@pytest.fixture(scope="module")
def server(pair):
    target, drafter = pair
    tok = _tokenizer()
    schedule = SpecSchedule.fixed(SpecConfig(num_speculative_tokens=2))
    # One slot: one row count, few programs to compile (requests sharing steps: the scheduler test below).
    service = make_service(
        target,
        drafter,
        tok,
        schedule,
        (tok.convert_tokens_to_ids(EOS_CHAR),),
        slots=1,
        max_len=MAX_LEN,
        rounds_per_step=2,
        model_name=MODEL,
        precompile=False,
    )
    srv = Server(service).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client, **kw):
    return client.completions.create(model=MODEL, temperature=0, **kw)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# --------------------------------------------------------------------------- EOS and stop fields


def test_eos_and_ignore_eos(server, client):
    tok = server.service.tokenizer
    plain = _complete(client, prompt=PROMPT, max_tokens=40)
    n = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and 1 < n < 40  # stopped at the EOS, which is counted
    through = _complete(
        client, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    text = through.choices[0].text
    assert through.choices[0].finish_reason == "length" and through.usage.completion_tokens == 40
    assert text.startswith(plain.choices[0].text + EOS_CHAR) and EOS_CHAR not in plain.choices[0].text
    # What follows the EOS is the model's own continuation: the same as from a prompt that ends there.
    ids = tok(PROMPT)["input_ids"] + tok(text[:n])["input_ids"]
    rest = _complete(
        client, prompt=ids, max_tokens=40 - n, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    assert rest.choices[0].text == text[n:]
    # skip_special_tokens (the default) drops the special EOS from the text, not from the tokens.
    skipped = _complete(client, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True})
    assert skipped.choices[0].text == text.replace(EOS_CHAR, "") and skipped.usage.completion_tokens == 40
    # include_stop_str_in_output: the EOS that ended the text is part of it (when special tokens are kept).
    kept = _complete(
        client,
        prompt=PROMPT,
        max_tokens=40,
        extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False},
    )
    assert kept.choices[0].text == plain.choices[0].text + EOS_CHAR and kept.usage.completion_tokens == n


def test_eos_per_row_beside_ignore_eos(pair):
    """A request that stops at EOS shares every step (one program) with one that ignores it: each row
    stops, or not, by its own flag."""
    target, drafter = pair
    tok = _tokenizer()
    eos = tok.convert_tokens_to_ids(EOS_CHAR)
    spec = SpecConfig(num_speculative_tokens=2)
    engine = SlotEngine(target, drafter, slots=2, max_len=MAX_LEN, specs=(spec,), rounds_per_step=2, eos_ids=(eos,))
    sched = Scheduler(engine, SpecSchedule.fixed(spec))
    prompt = tuple(tok(PROMPT)["input_ids"])
    stops, through = (
        sched.submit(Request(prompt, 40)),
        sched.submit(Request(prompt, 40, ignore_eos=True)),
    )  # slots 0 and 1
    sched.start()
    try:
        stops.wait(300), through.wait(300)
    finally:
        sched.stop()
    n = through.tokens.index(eos) + 1
    assert (stops.tokens, stops.finish_reason) == (through.tokens[:n], "stop")
    assert (len(through.tokens), through.finish_reason) == (40, "length")
    assert sum(a + 1 for a in stops.accepted[:-1]) < n - 1 <= sum(a + 1 for a in stops.accepted)
    assert len([k for k in engine.programs.keys() if k[0] == "step"]) == 1


def test_stop_token_ids_and_stop_strings(server, client):
    tok = server.service.tokenizer
    plain = _complete(client, prompt=PROMPT, max_tokens=40).choices[0].text
    char = plain[3]
    cut = plain.index(char)
    for stream in (False, True):
        r = _complete(
            client,
            prompt=PROMPT,
            max_tokens=40,
            stream=stream,
            extra_body={"stop_token_ids": [tok.convert_tokens_to_ids(char)]},
        )
        got = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert got == plain[:cut]
    r = _complete(
        client,
        prompt=PROMPT,
        max_tokens=40,
        extra_body={"stop_token_ids": [tok.convert_tokens_to_ids(char)], "include_stop_str_in_output": True},
    )
    assert (
        r.choices[0].text == plain[: cut + 1]
        and r.choices[0].finish_reason == "stop"
        and r.usage.completion_tokens == cut + 1
    )
    # The speculative rounds reported are those that produced the returned tokens (cut mid-step).
    acc = r.model_extra["speculation"]["accepted_per_round"]
    assert sum(a + 1 for a in acc[:-1]) < cut <= sum(a + 1 for a in acc)
    stop = plain[1:3]
    for include, expected in ((False, plain[:1]), (True, plain[:3])):
        r = _complete(
            client, prompt=PROMPT, max_tokens=40, stop=[stop], extra_body={"include_stop_str_in_output": include}
        )
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")


# ----------------------------------------------------------------------------- prompt forms


def test_prompt_forms_one_choice_each(server, client):
    """A string, strings, token ids and lists of token ids: one choice per prompt, in order, each what that
    prompt alone returns (sampled ones too, with the same seed)."""
    tok = server.service.tokenizer
    texts = [PROMPT, "hello there", "xy"]
    ids = [tok(t)["input_ids"] for t in texts]
    # (sampled through EOS: the program guidellm's bodies use, one compilation fewer)
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=7, extra_body={"ignore_eos": True})):
        alone = [client.completions.create(model=MODEL, prompt=t, max_tokens=12, **kw) for t in texts]
        for prompt in (texts, ids):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **kw)
            assert [c.index for c in r.choices] == [0, 1, 2]
            assert [(c.text, c.finish_reason) for c in r.choices] == [
                (a.choices[0].text, a.choices[0].finish_reason) for a in alone
            ]
            assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
            assert r.usage.prompt_tokens == sum(map(len, ids))
    # Streamed: chunks of both choices, each with its index; each choice's text and finish as alone.
    chunks = list(client.completions.create(model=MODEL, prompt=texts[:2], max_tokens=12, temperature=0, stream=True))
    solo = [_complete(client, prompt=t, max_tokens=12).choices[0] for t in texts[:2]]
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == solo[i].text and mine[-1].finish_reason == solo[i].finish_reason


def test_prompt_errors(server):
    good = {"model": MODEL, "max_tokens": 4}
    for prompt in ([], [[]], ["a", 1], [1, "a"], [[1, 2], "a"], [True], 3):
        r = _post(server, "/v1/completions", {**good, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    r = _post(server, "/v1/completions", {**good, "prompt": ["ok", "a" * MAX_LEN]})  # one prompt too long: none runs
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert server.service.scheduler.queue_depth == 0


# ------------------------------------------------------------------------------ stream_options


def test_guidellm_stream_bodies(server):
    """guidellm's exact bodies: usage on every chunk (continuous_usage_stats), a last usage-only chunk."""
    n = 10
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": n,
        "stop": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _events(server, "/v1/completions", body)
    *pieces, last = chunks
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": n,
        "total_tokens": 3 + n,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    counts = [c["usage"]["completion_tokens"] for c in pieces]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in pieces) and counts == sorted(counts) and counts[-1] == n
    assert pieces[-1]["choices"][0]["finish_reason"] == "length"
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": n,
        "stop": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _events(server, "/v1/chat/completions", chat)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["usage"]["completion_tokens"] == 0
    assert (
        all("usage" in c for c in chunks)
        and chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["completion_tokens"] == n
    )
    # include_usage alone: the usage only on the last chunk, null before (OpenAI's form).
    chunks = _events(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]


# ------------------------------------------------------------------------------- field policy


@pytest.mark.parametrize(
    "field,value",
    [
        ("best_of", 2),
        ("top_logprobs", 2),
        ("length_penalty", 2.0),
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["ab"]),
        ("suffix", "x"),
        ("response_format", {"type": "json_object"}),
        ("guided_regex", "a+"),
        ("bogus_field", 1),
    ],
)
def test_fields_that_would_change_the_output_are_refused(server, field, value):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field)


def test_default_values_and_no_effect_fields_are_accepted(server, caplog, monkeypatch):
    monkeypatch.setattr(protocol, "_logged", set())
    neutral = {
        "n": 1,
        "echo": False,
        "logprobs": None,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_tokens": 0,
        "best_of": 1,
        "top_p": None,
        "top_k": None,
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
    }
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="eagle_jax.serving"):
        for _ in range(2):
            r = _post(server, "/v1/completions", {**base, **neutral})
            assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _post(server, "/v1/completions", base).json()["choices"][0]["text"]
    logged = [rec.getMessage() for rec in caplog.records if "no effect" in rec.getMessage()]
    assert sorted(m.split("'")[1] for m in logged) == ["metadata", "store", "user"]  # once each, over two requests
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": False,
        "service_tier": "auto",
    }
    assert _post(server, "/v1/chat/completions", chat).status_code == 200
    for path, body in (
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}),  # needs logprobs: true
        ("/v1/completions", {**base, "logprobs": 21}),
        ("/v1/completions", {**base, "n": 0}),
    ):
        r = _post(server, path, body)
        assert r.status_code == 400, (body, r.text)


# --------------------------------------------------------------------------- logits processors


def test_penalties_equal_generate_with_the_same_processors(server, pair):
    """presence / frequency / repetition penalties, logit_bias (OpenAI's string keys), min_tokens and
    min_p reach the engine: the greedy text is plain decoding's under the same processors."""
    tok = server.service.tokenizer
    eos = tok.convert_tokens_to_ids(EOS_CHAR)
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    rules = dict(presence_penalty=0.3, frequency_penalty=0.5, repetition_penalty=1.4, min_tokens=9, min_p=0.1)
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "logit_bias": {str(a): 3.0, str(b): -100},
        **rules,
    }
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    ids = tok.encode(PROMPT, add_special_tokens=False)
    ref = eagle_jax.generate(
        pair[0], None, [ids], max_new_tokens=16, eos_token_id=[eos], logit_bias={a: 3.0, b: -100.0}, **rules
    ).tokens[0]
    plain = eagle_jax.generate(pair[0], None, [ids], max_new_tokens=16, eos_token_id=[eos]).tokens[0]
    assert ref != plain and len(ref) >= 9
    assert r.json()["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "presence_penalty": 1.0}
    assert _post(server, "/v1/chat/completions", chat).status_code == 200
    for bad, param in (
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, None),
        ({"min_tokens": 20, "max_tokens": 10}, None),
        ({"min_p": 1.5}, "min_p"),
    ):
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert param is None or r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------- logprobs, echo, n


def _log_softmax_of(server, ids: list[int]) -> np.ndarray:
    """The target's log-softmax at every position of ``ids``, from its plain forward (the reference)."""
    logits, _ = server.service.scheduler.engine.target(jnp.asarray([ids], jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def test_echo_and_logprobs_are_the_targets_log_softmax(server, client):
    """lm-evaluation-harness's loglikelihood body (echo, logprobs 1, one new token, token-id prompts): every
    prompt token's log-probability (the first null) and the new token's, as the target's plain forward
    gives them (fp32: 1e-5), and the greedy token on top; the generated tokens' numbers equal those of
    the same tokens sent back as a prompt, speculation or not."""
    tok = server.service.tokenizer
    prompts = [tok("hello world")["input_ids"], tok(PROMPT)["input_ids"]]
    r = _post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompts,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 1,
            "temperature": 0,
            "seed": 1234,
        },
    ).json()
    for ids, c in zip(prompts, r["choices"]):
        lp = c["logprobs"]
        new = tok(c["text"][len(tok.decode(ids)) :])["input_ids"]
        full = ids + new
        assert len(new) == 1 and c["text"] == tok.decode(ids) + tok.decode(new)
        assert (
            lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["token_logprobs"]) == len(full)
        )
        ref = _log_softmax_of(server, full)
        np.testing.assert_allclose(lp["token_logprobs"][1:], ref[np.arange(len(full) - 1), full[1:]], atol=1e-5)
        top = lp["top_logprobs"][-1]  # the greedy new token is the most likely one
        assert list(top) == [tok.decode(new)] and top[tok.decode(new)] == lp["token_logprobs"][-1]
        assert lp["tokens"] == [tok.decode([t]) for t in full] and lp["text_offset"][1] == len(lp["tokens"][0])
    # Sampled with speculation, then the same tokens scored as a prompt: the same numbers.
    gen = _post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": PROMPT,
            "logprobs": 3,
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": True,
            "skip_special_tokens": False,
        },
    ).json()["choices"][0]
    ids = tok(PROMPT)["input_ids"] + tok(gen["text"])["input_ids"]
    echo = _post(
        server, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 1}
    ).json()
    again = echo["choices"][0]["logprobs"]
    n = len(gen["logprobs"]["tokens"])
    assert n == 12 and gen["logprobs"]["tokens"] == again["tokens"][len(ids) - n : len(ids)]
    np.testing.assert_allclose(
        gen["logprobs"]["token_logprobs"], again["token_logprobs"][len(ids) - n : len(ids)], atol=1e-6
    )
    assert all(
        3 <= len(t) <= 4 for t in gen["logprobs"]["top_logprobs"]
    )  # top 3, plus the sampled token if not among them
    ids_named = _post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": PROMPT,
            "logprobs": 0,
            "max_tokens": 2,
            "temperature": 0,
            "return_tokens_as_token_ids": True,
        },
    ).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in ids_named["tokens"])


def test_chat_logprobs_and_n(server, client):
    messages = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob and c.token == c.top_logprobs[0].token for c in content)  # greedy
    assert "".join(c.token for c in content).startswith(r.choices[0].message.content)
    # n copies: copy j samples with seed + j (so each is that request alone); greedy copies agree.
    many = client.completions.create(model=MODEL, prompt=[PROMPT, "xy"], n=3, max_tokens=8, temperature=1.0, seed=5)
    assert [c.index for c in many.choices] == list(range(6))
    for i, c in enumerate(many.choices):
        alone = client.completions.create(
            model=MODEL, prompt=[PROMPT, "xy"][i // 3], max_tokens=8, temperature=1.0, seed=5 + i % 3
        )
        assert c.text == alone.choices[0].text
    assert len({c.text for c in many.choices[:3]}) > 1
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].message.content == greedy.choices[
        1
    ].message.content
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    )
    assert chunks[0].choices[0].text == PROMPT
    assert (
        "".join(c.choices[0].text for c in chunks)
        == client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True).choices[0].text
    )


def test_streamed_logprobs_are_the_unstreamed_ones(server):
    """Streamed chunks carry the logprobs of the tokens they were released with: concatenated in order they
    are the unstreamed answer's (sampled with a seed; completions with echo and a stop string, and chat)."""

    def merged(chunks: list[dict], keys: tuple[str, ...]) -> dict:
        out = {k: [] for k in keys}
        for c in chunks:
            for ch in c["choices"]:
                for k in keys:
                    out[k] += (ch["logprobs"] or {}).get(k, [])
        return out

    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for extra in ({"echo": True}, {"stop": ["e"]}, {}):
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 14,
            "temperature": 1.0,
            "seed": 7,
            "logprobs": 2,
            **extra,
        }
        whole = _post(server, "/v1/completions", body).json()["choices"][0]
        chunks = _events(server, "/v1/completions", {**body, "stream": True})
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
        got = merged(chunks, keys)
        for k in ("tokens", "text_offset"):
            assert got[k] == whole["logprobs"][k], extra
        # the numbers within float32 rounding: a chunk scores its prefix in a shorter program
        np.testing.assert_allclose(
            np.array(got["token_logprobs"], float), np.array(whole["logprobs"]["token_logprobs"], float), atol=1e-5
        )
        assert [t and sorted(t) for t in got["top_logprobs"]] == [
            t and sorted(t) for t in whole["logprobs"]["top_logprobs"]
        ]
        assert sum(bool(c["choices"][0]["logprobs"]) for c in chunks) > 1  # not all in one chunk
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = _post(server, "/v1/chat/completions", chat).json()["choices"][0]
    chunks = _events(server, "/v1/chat/completions", {**chat, "stream": True})
    got = merged(chunks, ("content",))["content"]
    assert [(c["token"], [t["token"] for t in c["top_logprobs"]]) for c in got] == [
        (c["token"], [t["token"] for t in c["top_logprobs"]]) for c in whole["logprobs"]["content"]
    ]
    np.testing.assert_allclose(
        [c["logprob"] for c in got], [c["logprob"] for c in whole["logprobs"]["content"]], atol=1e-5
    )
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole["message"]["content"]


def test_serving_examples_run(server):
    """serve/EXAMPLES.md: every curl body is answered 200 and every python block runs, in order, against
    this server (its address and model name put in)."""
    import re
    from pathlib import Path

    text = (
        (Path(__file__).parents[1] / "serve" / "EXAMPLES.md").read_text().replace("http://127.0.0.1:8000", server.url)
    )
    text = text.replace('"target"', f'"{MODEL}"')
    blocks = re.findall(r"```(bash|python)\n(.*?)```", text, re.S)
    assert sum(kind == "bash" for kind, _ in blocks) >= 8 and sum(kind == "python" for kind, _ in blocks) >= 9
    scope: dict = {}
    posted = 0
    for kind, code in blocks:
        if kind == "python":
            exec(compile(code, "EXAMPLES.md", "exec"), scope)
            continue
        for url, body in re.findall(r"(http://\S+?)\s.*?-d '(.*?)'", code, re.S):
            r = _post(server, url[len(server.url) :], json.loads(body))
            assert r.status_code == 200, (url, body, r.text)
            posted += 1
    assert posted == text.count("curl -s")


def test_prefix_caching_reports_cached_tokens(server, client):
    """A prompt seen before (as another request's prompt or its prompt and reply) is prefilled from the
    cached prefix: the same text, ``usage.prompt_tokens_details.cached_tokens`` and the /metrics counters."""
    system = "the quick brown fox jumps over the lazy dog and then some " * 2
    first = client.completions.create(model=MODEL, prompt=system + "abc", max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt=system + "abd", max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert (
        again.usage.prompt_tokens_details.cached_tokens == len(system) + 1
    )  # "ab" shared, the last shared position recomputed
    solo = _engine_text(server, system + "abd")
    assert again.choices[0].text == solo
    metrics = httpx.get(server.url + "/metrics").text
    hits = float(
        next(line.split()[-1] for line in metrics.splitlines() if line.startswith("eagle_prefix_cache_hits_total"))
    )
    assert hits >= len(system) + 1


def _engine_text(server, prompt: str) -> str:
    tok = server.service.tokenizer
    target = server.service.scheduler.engine.target
    ids = tok(prompt)["input_ids"]
    out = eagle_jax.generate(target, None, [ids], max_new_tokens=8, eos_token_id=[tok.convert_tokens_to_ids(EOS_CHAR)])
    return tok.decode(out.tokens[0], skip_special_tokens=True)


# ----------------------------------------------------------------------- /tokenize, /detokenize


def test_tokenize_and_detokenize(server):
    tok = server.service.tokenizer
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "hello", "return_token_strs": True}).json()
    assert r == {"count": 5, "max_model_len": MAX_LEN, "tokens": tok("hello")["input_ids"], "token_strs": list("hello")}
    assert (
        _post(server, "/tokenize", {"prompt": "test", "add_special_tokens": False}).json()["tokens"]
        == tok("test")["input_ids"]
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    r = _post(server, "/tokenize", {"messages": messages}).json()
    assert tok.decode(r["tokens"]) == "user hi. assistant yo. assistant " and r["count"] == len(r["tokens"])
    r = _post(
        server, "/tokenize", {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    ).json()
    assert tok.decode(r["tokens"]) == "user hi. assistant yo"
    assert _post(server, "/detokenize", {"model": MODEL, "tokens": tok("a q")["input_ids"]}).json() == {"prompt": "a q"}
    info = httpx.get(server.url + "/tokenizer_info", timeout=60).json()  # what lm-eval's remote tokenizer reads
    assert (
        info["eos_token"] == tok.eos_token
        and info["chat_template"] == tok.chat_template
        and info["model_max_length"] == MAX_LEN
    )
    for path, body, param in (
        ("/tokenize", {"prompt": "x", "messages": messages}, None),
        ("/tokenize", {}, None),
        ("/detokenize", {"tokens": [0, 10_000]}, "tokens"),
        ("/detokenize", {"model": "other", "tokens": [1]}, "model"),
        ("/tokenize", {"messages": messages, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ):
        r = _post(server, path, body)
        assert r.status_code in (400, 404) and (param is None or r.json()["error"]["param"] == param), r.text


# ----------------------------------------------------------------------------------- units


def test_text_stream_stop_tokens_and_special_tokens():
    tok = _tokenizer()
    q = tok.convert_tokens_to_ids(EOS_CHAR)
    ids = tok("ab")["input_ids"] + [q]
    assert TextStream(tok, stop_ids={q}).push(ids) == "ab"
    assert TextStream(tok, stop_ids={q}, include_stop=True, skip_special_tokens=False).push(ids) == "abq"
    assert TextStream(tok, stop_ids={q}, include_stop=True).push(ids) == "ab"  # a special token is skipped anyway
    assert TextStream(tok, skip_special_tokens=False).push(ids + ids) == "abqabq"
    ts = TextStream(tok, ["b", "ab"], include_stop=True)
    assert ts.push(tok("xaby")["input_ids"]) == "xab" and ts.stopped  # the earliest match, the longest there


class _Built(Exception):
    """Ends ``main`` once it has decided what to build (nothing is loaded)."""


def test_cli_drafter_none_ignores_the_profiles_schedule(tmp_path, monkeypatch, caplog):
    """``eagle-jax-serve --profile P --drafter none``: P's speculation schedule is for its drafter; the
    target is served alone with plain decoding and one log line says so (no --spec was given)."""
    from eagle_jax.cli.serve import main
    from eagle_jax.serving import server as server_module
    from eagle_jax.serving.server import parse_spec

    seen = {}

    def build(target, drafter, *, spec=None, **kwargs):
        seen.update(drafter=drafter, schedule=parse_spec(spec, drafter is not None))
        raise _Built

    monkeypatch.setattr(server_module, "build_service", build)
    profile = tmp_path / "profile.yaml"
    profile.write_text("target: target\ndrafter: drafter\nspec: '1:3,2:1'\nslots: 1\n")
    with pytest.raises(_Built):
        main(["--profile", str(profile), "--compile-cache", "off"])
    assert seen["drafter"] and seen["schedule"].choose(1) == SpecConfig(num_speculative_tokens=3)
    with caplog.at_level(logging.INFO, logger="serve"), pytest.raises(_Built):
        main(["--profile", str(profile), "--drafter", "none", "--compile-cache", "off"])
    assert seen["drafter"] is None and seen["schedule"].rules == ((1, None),)
    assert [r for r in caplog.records if "'1:3,2:1' is ignored" in r.getMessage()]
    with pytest.raises(
        ConfigError, match="--spec '1:3' was given but no drafter"
    ):  # an explicit --spec still needs one
        parse_spec("1:3", drafter_present=False)
