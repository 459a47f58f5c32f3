"""The OpenAI-compatible HTTP layer: translates requests into ``Scheduler`` submissions and tokens into
responses and server-sent events. It never touches arrays; the engine thread never touches HTTP."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from eagle_jax.config import ConfigError
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.serving import Handle, QueueFull, Request, Scheduler
from eagle_jax.serving.metrics import Metrics
from eagle_jax.serving.protocol import APIError, ChatRequest, CompletionRequest
from eagle_jax.serving.text import TextStream

DISCONNECT_POLL_S = 0.5


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
        return model.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        where = f"{param}: " if param else ""
        raise APIError(400, f"{where}{msg}", param=param) from None


def _sampling(body) -> SamplingParams:
    return SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p)


class _Generation:
    """One request's path through the scheduler: submission, token events, text with stop strings."""

    def __init__(self, service: Service, prompt: list[int], max_tokens: int | None, body):
        limit = service.max_len
        if len(prompt) >= limit:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is {limit} tokens", param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - len(prompt)
        elif len(prompt) + max_tokens > limit:
            raise APIError(
                400, f"this model's context is {limit} tokens; the prompt has {len(prompt)} and max_tokens asks for {max_tokens} more",
                param="max_tokens", code="context_length_exceeded",
            )
        self.service, self.prompt, self.body = service, prompt, body
        self.text = TextStream(service.tokenizer, body.stops)
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        metrics = service.metrics

        def listener(h: Handle, tokens: list[int], finished: bool) -> None:  # engine thread
            if finished:
                metrics.on_finish(h)
            loop.call_soon_threadsafe(self.events.put_nowait, (tokens, finished))

        seed = body.seed if body.seed is not None else secrets.randbits(63)
        request = Request(tuple(prompt), int(max_tokens), _sampling(body), seed)
        try:
            self.handle = service.scheduler.submit(request, listener)
        except QueueFull as exc:
            metrics.requests.labels("rejected").inc()
            raise APIError(429, str(exc), code="queue_full", type_="server_overloaded") from None
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt") from None

    async def pieces(self, http: HTTPRequest) -> AsyncIterator[str]:
        """Released text as it comes; ends at the request's end or at a stop string."""
        while True:
            try:
                tokens, finished = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    self.handle.cancel()
                    return
                continue
            piece = self.text.push(tokens)
            if self.text.stopped:
                self.handle.cancel("stop")
                if piece:
                    yield piece
                return
            if finished:
                piece += self.text.finish()
                if piece:
                    yield piece
                return
            if piece:
                yield piece

    @property
    def finish_reason(self) -> str:
        if self.text.stopped:
            return "stop"
        reason = self.handle.finish_reason
        if reason == "error":
            raise APIError(500, f"generation failed: {self.handle.error}", type_="server_error")
        return reason if reason in ("stop", "length") else "stop"

    def usage(self) -> dict[str, int]:
        done = self.text.tokens_at_stop if self.text.stopped else len(self.handle.tokens)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": done, "total_tokens": len(self.prompt) + done}

    def speculation(self) -> dict[str, Any]:
        """Per-response acceptance statistics (an extra field beside OpenAI's)."""
        h = self.handle
        al, pos = h.acceptance(self.service.scheduler.engine.max_width - 1)
        return {"acceptance_length": round(al, 4), "rounds": len(h.accepted), "accepted_per_round": list(h.accepted),
                "position_acceptance": [round(x, 4) for x in pos]}


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="eagle_jax", version="0.1.0")
    name = service.model_name

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(404)
    async def _not_found(http, _exc):
        return JSONResponse(APIError(404, f"no route {http.method} {http.url.path}").body(), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(http, _exc):
        return JSONResponse(APIError(405, f"method {http.method} is not allowed on {http.url.path}").body(), status_code=405)

    @app.get("/health")
    async def health():
        s = service.scheduler
        return {"status": "ok", "slots": s.engine.slots, "active": s.active, "queue": s.queue_depth}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "eagle_jax", "max_model_len": service.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_model(body) -> None:
        if body.model != name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {name!r}", param="model", code="model_not_found")

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = _parse(await http.body(), CompletionRequest)
        check_model(body)
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = service.tokenizer(prompt)["input_ids"]
        else:
            vocab = service.scheduler.engine.target.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        gen = _Generation(service, ids, body.max_tokens, body)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, reason: str | None) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        if body.stream:
            return _sse(gen, http, lambda piece: chunk(piece, None), lambda: chunk("", gen.finish_reason))
        text = "".join([p async for p in gen.pieces(http)])
        out = chunk(text, gen.finish_reason)
        out["usage"], out["speculation"] = gen.usage(), gen.speculation()
        return out

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        body = _parse(await http.body(), ChatRequest)
        check_model(body)
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in body.messages]
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        if service.tokenizer.chat_template is None:
            raise APIError(400, f"the model {name!r} has no chat template; use /v1/completions", param="messages")
        try:
            ids = service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template's own checks (e.g. role order) are the client's mistake
            raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        gen = _Generation(service, list(ids), body.limit, body)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict, reason: str | None) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        if body.stream:
            return _sse(gen, http, lambda piece: chunk({"content": piece}, None), lambda: chunk({}, gen.finish_reason),
                        first=chunk({"role": "assistant", "content": ""}, None))
        text = "".join([p async for p in gen.pieces(http)])
        return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": gen.finish_reason}],
                "usage": gen.usage(), "speculation": gen.speculation()}

    return app


def _sse(gen: _Generation, http: HTTPRequest, piece_chunk: Callable[[str], dict], last_chunk: Callable[[], dict],
         first: dict | None = None) -> StreamingResponse:
    """OpenAI's server-sent events: one chunk per released piece, the finish chunk, usage if asked, [DONE]."""

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def events():
        try:
            if first is not None:
                yield event(first)
            async for piece in gen.pieces(http):
                yield event(piece_chunk(piece))
            try:
                last = last_chunk()
            except APIError as exc:
                yield event(exc.body())
                yield "data: [DONE]\n\n"
                return
            yield event(last)
            if gen.body.stream_options is not None and gen.body.stream_options.include_usage:
                usage = {k: v for k, v in last.items() if k != "choices"}
                usage.update(choices=[], usage=gen.usage(), speculation=gen.speculation())
                yield event(usage)
            yield "data: [DONE]\n\n"
        finally:
            if not gen.handle.finished and not gen.handle.cancelled:
                gen.handle.cancel()  # the client went away mid-stream

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
