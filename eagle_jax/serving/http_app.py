"""The OpenAI-compatible HTTP layer: translates requests into ``Scheduler`` submissions and tokens into
responses and server-sent events. It never touches arrays; the engine thread never touches HTTP."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from eagle_jax.config import ConfigError
from eagle_jax.decoding.calls import acceptance_summary
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.scoring import TokenLogprobs
from eagle_jax.serving import Handle, QueueFull, Request, Scheduler
from eagle_jax.serving.logprobs import TokenNames, chat_logprobs, completion_logprobs
from eagle_jax.serving.metrics import Metrics
from eagle_jax.serving.protocol import APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from eagle_jax.serving.text import TextStream

DISCONNECT_POLL_S = 0.5
MAX_REQUEST_BYTES = 8 * 2**20  # request bodies past this are refused (``create_app``)


@dataclass
class Service:
    """What the endpoints serve: one model (a target with or without its drafter) behind a scheduler."""

    scheduler: Scheduler
    tokenizer: Any
    model_name: str
    metrics: Metrics

    @property
    def max_len(self) -> int:
        return self.scheduler.engine.max_len


def _parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        where = f"{param}: " if param else ""
        raise APIError(400, f"{where}{msg}", param=param) from None
    body.screen()
    return body


def _sampling(body) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=tuple(body.logit_bias.items()),
        min_tokens=body.min_tokens,
    )


def _budget(service: Service, prompt: Sequence[int], max_tokens: int | None) -> int:
    """The tokens a request may generate (all the context leaves when max_tokens is not given)."""
    limit = service.max_len
    if len(prompt) >= limit:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens; this model's context is {limit} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - len(prompt)
    if len(prompt) + max_tokens > limit:
        raise APIError(
            400,
            f"this model's context is {limit} tokens; the prompt has {len(prompt)} and max_tokens asks for "
            f"{max_tokens} more",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


class _Generation:
    """One prompt's path through the scheduler: submission, token events, text with stop strings and tokens."""

    def __init__(
        self, service: Service, prompt: list[int], max_tokens: int, body, seed: int | None, group: int | None = None
    ):
        self.service, self.prompt, self.body = service, prompt, body
        self.events: asyncio.Queue = asyncio.Queue()
        self.received = 0  # tokens generated so far
        loop = asyncio.get_running_loop()
        metrics = service.metrics

        def listener(h: Handle, tokens: list[int], finished: bool) -> None:  # engine thread
            if finished:
                metrics.on_finish(h)
            loop.call_soon_threadsafe(self.events.put_nowait, (tokens, finished))

        seed = seed if seed is not None else secrets.randbits(63)
        request = Request(
            tuple(prompt),
            max_tokens,
            _sampling(body),
            seed,
            ignore_eos=body.ignore_eos,
            stop_token_ids=tuple(body.stop_token_ids),
            group=group,
        )
        self.text = TextStream(
            service.tokenizer,
            body.stops,
            stop_ids=request.stop_ids(service.scheduler.engine.eos_ids),
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
        )
        try:
            self.handle = service.scheduler.submit(request, listener)
        except QueueFull as exc:
            metrics.requests.labels("rejected").inc()
            raise APIError(429, str(exc), code="queue_full", type_="server_overloaded") from None
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt") from None

    async def pieces(self, http: HTTPRequest) -> AsyncIterator[tuple[str, int, int]]:
        """(released text, start, end): the text and the generated tokens ``start..end`` it was released
        with, as they come; ends at the request's end or at a stop string. Events that queued while the
        consumer was busy (e.g. scoring the previous piece) come as one piece."""
        while True:
            try:
                tokens, finished = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    self.handle.cancel()
                    return
                continue
            while not finished and not self.events.empty():
                more, finished = self.events.get_nowait()
                tokens = [*tokens, *more]
            start = self.received
            self.received += len(tokens)
            piece = self.text.push(tokens)
            if self.text.stopped:
                self.handle.cancel("stop")
                yield piece, start, max(start, self.text.tokens_at_stop)
                return
            if finished:
                piece += self.text.finish()
            yield piece, start, self.received
            if finished:
                return

    @property
    def finish_reason(self) -> str:
        if self.text.stopped:
            return "stop"
        reason = self.handle.finish_reason
        if reason == "error":
            raise APIError(500, f"generation failed: {self.handle.error}", type_="server_error")
        return reason if reason in ("stop", "length") else "stop"

    def usage(self) -> dict[str, int]:
        """So far (the stream's continuous usage) or in all (once the pieces are done)."""
        done = self.text.tokens_at_stop if self.text.stopped else self.received
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": done,
            "total_tokens": len(self.prompt) + done,
            "prompt_tokens_details": {"cached_tokens": self.handle.cached_tokens},
        }

    async def scores(self, end: int | None = None) -> tuple[list[int], TokenLogprobs]:
        """(prompt + the choice's first ``end`` tokens (all, once the generation ended), the target's scores
        of them)."""
        ids = self.prompt + self.handle.tokens[: self.usage()["completion_tokens"] if end is None else end]
        future = self.service.scheduler.run_on_engine(lambda engine: engine.score(ids))
        return ids, await asyncio.wrap_future(future)


_GROUPS = itertools.count()  # ids of the groups of ``n`` choices of one prompt (``Request.group``)


def _start(service: Service, prompts: list[list[int]], max_tokens: int | None, body) -> list[_Generation]:
    """Submits ``body.n`` generations per prompt (choice index = prompt index * n + copy; copy j samples
    with ``seed + j``; the copies share the prompt's prefill), all or none (each prompt checked against the
    context first)."""
    budgets = [_budget(service, p, max_tokens) for p in prompts]
    gens: list[_Generation] = []
    try:
        for prompt, budget in zip(prompts, budgets):
            group = next(_GROUPS) if body.n > 1 else None
            for copy in range(body.n):
                seed = None if body.seed is None else (body.seed + copy) % 2**63
                gens.append(_Generation(service, prompt, budget, body, seed, group))
    except APIError:
        for gen in gens:
            gen.handle.cancel()
        raise
    return gens


def _total_usage(gens: Sequence[_Generation]) -> dict[str, int]:
    usages = [g.usage() for g in gens]
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {
        **total,
        "prompt_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)},
    }


def _speculation(service: Service, gens: Sequence[_Generation]) -> dict[str, Any]:
    """Acceptance statistics over the response's generations (an extra field beside OpenAI's)."""
    accepted = [a for g in gens for a in g.handle.accepted]
    al, pos = acceptance_summary(accepted, service.scheduler.engine.max_width - 1)
    return {
        "acceptance_length": round(al, 4),
        "rounds": len(accepted),
        "accepted_per_round": accepted,
        "position_acceptance": [round(x, 4) for x in pos],
    }


# ``fmt(scores, ids, start, end, offset)``: the ``logprobs`` object of entries ``start..end`` of a scored
# sequence (prompt + generated tokens), text offsets counted from ``offset``.
LogprobsFormat = Callable[[TokenLogprobs, list[int], int, int, int], dict]


async def _logprobs(gens: Sequence[_Generation], body, fmt: LogprobsFormat, echo: bool = False) -> list[dict | None]:
    """Each ended generation's ``logprobs`` object (from the prompt's start with echo, else from its end),
    or None per choice when the request did not ask for them."""
    if not body.wants_logprobs:
        return [None] * len(gens)
    out = []
    for g in gens:
        ids, scores = await g.scores()
        out.append(fmt(scores, ids, 0 if echo else len(g.prompt), len(ids), 0))
    return out


async def _merged(
    gens: Sequence[_Generation], http: HTTPRequest
) -> AsyncIterator[tuple[int, tuple[str, int, int] | None]]:
    """(index, piece) from every generation as they come (``_Generation.pieces``); (index, None) once
    generation ``index`` ended."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: _Generation) -> None:
        try:
            async for piece in gen.pieces(http):
                queue.put_nowait((i, piece))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        for _ in range(len(gens)):
            while True:
                i, piece = await queue.get()
                yield i, piece
                if piece is None:
                    break
    finally:
        for task in tasks:
            task.cancel()


async def _texts(gens: Sequence[_Generation], http: HTTPRequest) -> list[str]:
    texts = [""] * len(gens)
    async for i, piece in _merged(gens, http):
        if piece:
            texts[i] += piece[0]
    return texts


_CHAT_RESERVED: frozenset[str] | None = None


def _template_kwargs(tokenizer, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs: variables for the template, never apply_chat_template's own arguments."""
    global _CHAT_RESERVED
    if _CHAT_RESERVED is None:
        _CHAT_RESERVED = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    clash = sorted(set(kwargs or {}) & _CHAT_RESERVED)
    if clash:
        raise APIError(400, f"chat_template_kwargs: {clash} are not template variables", param="chat_template_kwargs")
    return dict(kwargs or {})


def _chat_ids(service: Service, body, add_special_tokens: bool) -> list[int]:
    """The prompt of chat messages: the template rendered, then tokenized (as vLLM does)."""
    tok = service.tokenizer
    try:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in body.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    if tok.chat_template is None:
        raise APIError(
            400, f"the model {service.model_name!r} has no chat template; use /v1/completions", param="messages"
        )
    kwargs = _template_kwargs(tok, body.chat_template_kwargs)
    try:
        text = tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # the template's own checks (e.g. role order) are the client's mistake
        raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from None
    return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])


def _prompt_ids(service: Service, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        return list(service.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    vocab = service.scheduler.engine.target.config.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)


def _service(http: HTTPRequest) -> Service:
    return http.app.state.service


async def _body(http: HTTPRequest) -> bytes:
    """The request body, refused past the app's ``max_request_bytes`` (before it is parsed or queued)."""
    limit = http.app.state.max_request_bytes
    raw = await http.body()
    if len(raw) > limit:
        raise APIError(
            400,
            f"the request body has {len(raw)} bytes, more than this server's limit of {limit} "
            f"(eagle-jax-serve --max-request-bytes)",
            code="request_too_large",
        )
    return raw


def _authorized(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <api_key>`` (compared in constant time)."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


def create_app(service: Service, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The OpenAI-compatible app over ``service``. ``api_key``: every ``/v1/*`` route then needs
    ``Authorization: Bearer <api_key>`` (``/health``, ``/metrics`` and the tokenizer routes stay open, as in
    vLLM); ``max_request_bytes``: larger request bodies are refused with a 400."""
    if api_key is not None and not api_key.strip():
        raise ConfigError("the API key is empty: give a non-empty key, or none to serve without one")
    if max_request_bytes < 1:
        raise ConfigError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    app = FastAPI(title="eagle_jax", version="0.1.0")
    # The endpoints get the service from the app (``Depends(_service)``), never from a closure: FastAPI
    # caches endpoint functions process-wide, so a closure would keep the service's engine (its caches and
    # programs) alive after the app is gone, and a process that serves one model after another runs out.
    app.state.service = service
    app.state.max_request_bytes = int(max_request_bytes)
    name = service.model_name

    if api_key is not None:

        @app.middleware("http")
        async def _check_key(http: HTTPRequest, call_next):
            if http.url.path.startswith("/v1/") and not _authorized(http.headers.get("authorization"), api_key):
                error = APIError(
                    401,
                    "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                return JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await call_next(http)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(404)
    async def _not_found(http, _exc):
        return JSONResponse(APIError(404, f"no route {http.method} {http.url.path}").body(), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(http, _exc):
        return JSONResponse(
            APIError(405, f"method {http.method} is not allowed on {http.url.path}").body(), status_code=405
        )

    @app.get("/health")
    async def health(service: Service = Depends(_service)):
        s = service.scheduler
        return {"status": "ok", "slots": s.engine.slots, "active": s.active, "queue": s.queue_depth}

    @app.get("/v1/models")
    async def models(service: Service = Depends(_service)):
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "eagle_jax", "max_model_len": service.max_len}
            ],
        }

    @app.get("/metrics")
    async def metrics(service: Service = Depends(_service)):
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_model(body) -> None:
        if body.model != name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, service: Service = Depends(_service)):
        body = _parse(await _body(http), CompletionRequest)
        check_model(body)
        prompts = [_prompt_ids(service, p, body.add_special_tokens) for p in body.prompt]
        gens = _start(service, prompts, body.max_tokens, body)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        # echo: the prompt as sent (a text prompt) or as its tokens read (token ids), before each choice
        echoed = [
            (p if isinstance(p, str) else service.tokenizer.decode(ids)) if body.echo else ""
            for p, ids in zip(body.prompt, prompts)
            for _ in range(body.n)
        ]

        def envelope(choices: list[dict]) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": name, "choices": choices}

        def choice(i: int, text: str | None, reason: str | None, logprobs: dict | None = None) -> dict:
            return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": reason}

        names = TokenNames(service.tokenizer, body.return_tokens_as_token_ids)
        fmt = lambda scores, ids, start, end, offset: completion_logprobs(
            scores, ids, start, body.logprobs, names, end, offset
        )
        if body.stream:
            return _sse(service, gens, http, body, envelope, choice, fmt, prefixes=echoed if body.echo else None)
        texts = await _texts(gens, http)
        logprobs = await _logprobs(gens, body, fmt, echo=body.echo)
        out = envelope(
            [
                choice(i, echoed[i] + text, g.finish_reason, lp)
                for i, (g, text, lp) in enumerate(zip(gens, texts, logprobs))
            ]
        )
        out["usage"], out["speculation"] = _total_usage(gens), _speculation(service, gens)
        return out

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest, service: Service = Depends(_service)):
        body = _parse(await _body(http), ChatRequest)
        check_model(body)
        gens = _start(service, [_chat_ids(service, body, body.add_special_tokens)], body.limit, body)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def envelope(choices: list[dict]) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name, "choices": choices}

        def choice(i: int, text: str | None, reason: str | None, logprobs: dict | None = None) -> dict:
            return {
                "index": i,
                "delta": {} if text is None else {"content": text},
                "logprobs": logprobs,
                "finish_reason": reason,
            }

        names = TokenNames(service.tokenizer, body.return_tokens_as_token_ids)
        fmt = lambda scores, ids, start, end, _offset: chat_logprobs(
            scores, ids, start, body.top_logprobs or 0, names, end
        )
        if body.stream:
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(gens))
            ]
            return _sse(service, gens, http, body, envelope, choice, fmt, first=first)
        texts = await _texts(gens, http)
        logprobs = await _logprobs(gens, body, fmt)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": g.finish_reason,
            }
            for i, (g, text, lp) in enumerate(zip(gens, texts, logprobs))
        ]
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": _total_usage(gens),
            "speculation": _speculation(service, gens),
        }

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest, service: Service = Depends(_service)):
        """vLLM's: the prompt's token ids (a text prompt, or chat messages through the template)."""
        body = _parse(await _body(http), TokenizeRequest)
        if body.model is not None:
            check_model(body)
        if body.messages is not None:
            ids = _chat_ids(service, body, bool(body.add_special_tokens))
        else:
            ids = _prompt_ids(service, body.prompt, body.add_special_tokens is not False)
        strs = service.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": service.max_len, "tokens": ids, "token_strs": strs}

    @app.get("/tokenizer_info")
    async def tokenizer_info(service: Service = Depends(_service)):
        """vLLM's: the tokenizer's special tokens and chat template (lm-evaluation-harness's remote
        tokenizer reads it, then tokenizes through /tokenize and /detokenize)."""
        tok = service.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
            "model_max_length": service.max_len,
            "vocab_size": len(tok),
            "add_bos_token": getattr(tok, "add_bos_token", None),
            "add_eos_token": getattr(tok, "add_eos_token", None),
        }

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest, service: Service = Depends(_service)):
        """vLLM's: the text of token ids, special tokens included."""
        body = _parse(await _body(http), DetokenizeRequest)
        if body.model is not None:
            check_model(body)
        size = len(service.tokenizer)
        if any(not 0 <= t < size for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be in [0, {size})", param="tokens")
        return {"prompt": service.tokenizer.decode(body.tokens)}

    return app


def _sse(
    service: Service,
    gens: list[_Generation],
    http: HTTPRequest,
    body,
    envelope: Callable[[list[dict]], dict],
    choice: Callable[..., dict],
    fmt: LogprobsFormat,
    first: list[dict] | None = None,
    prefixes: list[str] | None = None,
) -> StreamingResponse:
    """OpenAI's server-sent events: per generation, its ``first`` chunk (chat: the role) or its prefix
    (completions' echo: the prompt), a chunk per released piece and its finish chunk; then the usage chunk
    if asked (``include_usage``), and [DONE]. vLLM's ``continuous_usage_stats`` adds each chunk's
    generation's usage so far to it (with or without ``include_usage``, which vLLM requires).

    With logprobs each chunk carries those of the tokens it was released with (a chunk may then have no
    text: a token whose text is held back, or a stop token), and the echo prefix those of the prompt; the
    chunks' entries, in order, are the unstreamed answer's. They come from scoring the sequence so far once
    per chunk, so pieces that arrive while a chunk is scored are merged into the next one."""
    offsets = [0] * len(gens)  # completions' text_offset: the characters of each choice's logprob tokens so far

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def chunk(c: dict, gen: _Generation) -> dict:
        out = envelope([c])
        if body.continuous_usage:
            out["usage"] = gen.usage()
        elif body.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last
        return out

    async def logprobs(i: int, start: int, end: int) -> dict | None:
        """Choice i's entries start..end of prompt + generated tokens."""
        if not body.wants_logprobs or end <= start:
            return None
        ids, scores = await gens[i].scores(end - len(gens[i].prompt))
        lp = fmt(scores, ids, start, end, offsets[i])
        offsets[i] += sum(len(t) for t in lp.get("tokens", ()))
        return lp

    async def events():
        try:
            for i, gen in enumerate(gens):
                if first is not None:
                    yield event(chunk(first[i], gen))
                if prefixes is not None and (prefixes[i] or body.wants_logprobs):
                    yield event(chunk(choice(i, prefixes[i], None, await logprobs(i, 0, len(gen.prompt))), gen))
            async for i, piece in _merged(gens, http):
                if piece is None:
                    try:
                        reason = gens[i].finish_reason
                    except APIError as exc:
                        yield event(exc.body())
                        yield "data: [DONE]\n\n"
                        return
                    yield event(chunk(choice(i, None, reason), gens[i]))
                    continue
                text, start, end = piece
                p = len(gens[i].prompt)
                lp = await logprobs(i, p + start, p + end)
                if text or lp is not None:
                    yield event(chunk(choice(i, text, None, lp), gens[i]))
            if body.include_usage:
                last = envelope([])
                last.update(usage=_total_usage(gens), speculation=_speculation(service, gens))
                yield event(last)
            yield "data: [DONE]\n\n"
        finally:
            for gen in gens:
                if not gen.handle.finished and not gen.handle.cancelled:
                    gen.handle.cancel()  # the client went away mid-stream

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
