"""OpenAI request bodies (validated with pydantic) and the error body every failure answers with."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class APIError(Exception):
    """A client mistake (or a full queue): answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints; unknown fields are ignored as OpenAI's server does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's extension; 0 or -1 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list):
            if len(v) > 4:
                raise ValueError("at most 4 stop sequences are allowed")
            if not all(isinstance(s, str) for s in v):
                raise ValueError("stop sequences must be strings")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty / frequency_penalty are not supported (they would change the target's distribution)")
        if self.logprobs not in (None, False):
            raise ValueError("logprobs are not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
        elif v == "":
            raise ValueError("prompt is empty")
        return v

    @model_validator(mode="after")
    def _echo(self):
        if self.echo:
            raise ValueError("echo is not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
