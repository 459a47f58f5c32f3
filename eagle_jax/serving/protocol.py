"""OpenAI (and vLLM) request bodies, validated with pydantic, and the error body every failure answers with.

Every request field is accounted for: a field is implemented (declared on a model below), has no effect
on the output (``NO_EFFECT``: accepted, logged once per name), or would change the output and is not
implemented (``NOT_IMPLEMENTED``: refused with 400 naming it unless its value is the no-op default).
A field in none of these is refused as OpenAI's API does, rather than ignored.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from eagle_jax.decoding.penalties import MAX_LOGIT_BIAS
from eagle_jax.decoding.scoring import MAX_TOP_LOGPROBS

log = logging.getLogger("eagle_jax.serving")


class APIError(Exception):
    """A client mistake (or a full queue): answered with ``status`` and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Fields that do not change what is generated (bookkeeping, routing, caching, logprob formatting).
NO_EFFECT = frozenset(
    {
        "user",
        "metadata",
        "service_tier",
        "store",
        "safety_identifier",
        "prompt_cache_key",
        "priority",
        "request_id",
        "cache_salt",
        "kv_transfer_params",
        "parallel_tool_calls",
        "prediction",
    }
)

# Fields that would change the output and are not implemented, with the values that leave it unchanged.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "return_token_ids": (None, False),
    "length_penalty": (None, 1),
    "use_beam_search": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None,),
    "spaces_between_special_tokens": (None, True),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "vllm_xargs": (None,),
    "prompt_embeds": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "chat_template": (None,),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
}

_logged: set[str] = set()


def _nullable(field: FieldInfo) -> bool:
    return field.annotation is None or type(None) in get_args(field.annotation)


def _same(value: Any, default: Any) -> bool:
    """``value == default`` without Python's True == 1 == 1.0 (``logprobs: 0`` asks for logprobs)."""
    if isinstance(value, bool) or isinstance(default, bool) or value is None or default is None:
        return value is default
    return value == default


def screen_fields(extra: dict[str, Any]) -> None:
    """Accounts for the fields a request model did not declare (see the module docstring)."""
    for name, value in extra.items():
        if name in NO_EFFECT:
            if name not in _logged:
                _logged.add(name)
                log.info("request field %r has no effect on the output here: accepted (logged once)", name)
        elif name in NOT_IMPLEMENTED:
            if not any(_same(value, d) for d in NOT_IMPLEMENTED[name]):
                allowed = " or ".join(json.dumps(d) for d in NOT_IMPLEMENTED[name])
                raise APIError(400, f"{name}: not supported by this server (only {allowed} is accepted)", param=name)
        else:
            raise APIError(400, f"{name}: unrecognized request field", param=name)


class _Screened(BaseModel):
    """A request body whose undeclared fields are kept for ``screen_fields``; null means the default."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        # OpenAI's clients send null for "not given" (e.g. "temperature": null): the field's default where
        # null is no value of the field (where it is, as max_tokens': no limit, it stays).
        if isinstance(data, dict):
            return {
                k: v
                for k, v in data.items()
                if v is not None or k not in cls.model_fields or _nullable(cls.model_fields[k])
            }
        return data

    def screen(self) -> None:
        screen_fields(self.model_extra or {})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the usage and no choices (OpenAI)
    continuous_usage_stats: bool = False  # the usage so far on every chunk (vLLM)
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels: nothing to pad here


class _Sampling(_Screened):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's extension; 0 or -1 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1)  # choices per prompt: copy j samples with seed + j when a seed is given
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:<id>"
    # Logits processors on the target's verification logits (decoding/penalties.py), as vLLM defines them
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)  # OpenAI sends the token ids as strings
    min_tokens: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(v)}")
        bad = [x for x in v.values() if not -100.0 <= x <= 100.0]
        if bad:
            raise ValueError(f"bias values must be in [-100, 100], got {bad[:3]}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list):
            if len(v) > 4:
                raise ValueError("at most 4 stop sequences are allowed")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return False

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def _token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class CompletionRequest(_Sampling):
    # One or more prompts (OpenAI's four forms), each a string or token ids; one choice per prompt.
    prompt: list[str | list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. around a text prompt
    echo: bool = False  # the prompt's text before the completion (and its tokens in logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v):
        if isinstance(v, str):
            v = [v]
        elif _token_list(v) and v:
            v = [v]
        if not isinstance(v, list) or not (all(isinstance(p, str) for p in v) or all(_token_list(p) for p in v)):
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")
        if not v or any(len(p) == 0 for p in v):
            raise ValueError("a prompt is empty")
        return v


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


class _ChatPrompt(_Screened):
    """How messages become a prompt (vLLM's chat fields, shared by chat completions and /tokenize)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last (assistant) message
    add_special_tokens: bool = False  # the template writes BOS etc. itself
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template


class ChatRequest(_Sampling, _ChatPrompt):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_ChatPrompt):
    """vLLM's POST /tokenize: a ``prompt`` (text) or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Screened):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]
