"""The OpenAI-compatible wire format: request bodies as validated models, response and chunk bodies, error bodies."""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from vllm import SamplingParams

from app.engine.protocol import EngineChunk

logger = logging.getLogger("ray.serve")

# Fields that change what the client gets back, which this server does not implement: a request that sets one is
# refused by name rather than answered as if it had not (null or empty counts as not set).
UNSUPPORTED_FIELDS = frozenset({
    "tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias", "top_logprobs",
    "best_of", "prompt_logprobs", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "allowed_token_ids", "bad_words", "audio", "modalities", "prediction", "web_search_options",
    "reasoning_effort", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "truncate_prompt_tokens", "logits_processors", "vllm_xargs",
})
# Fields that change nothing a client can observe here: accepted silently.
NO_EFFECT_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "priority",
                              "request_id"})
INT64_MAX = 2**63 - 1


class APIError(Exception):
    """An error the client caused or must learn about, rendered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):  # whole across Ray, to callers of the handle API
        return APIError, (self.status, self.message, self.type, self.param, self.code, self.headers)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored with a warning, as vLLM's own server does: OpenAI
    clients send many optional ones. Numbers are bounded so that nothing a client sends can overflow in an engine."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1)
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # The request's service class (app/config.py), unless the `x-pd-class` header names one.
    pd_class: str | None = Field(default=None, max_length=64)
    # Accepted only to refuse it clearly: transfer internals are the app's business, never the client's.
    kv_transfer_params: Any = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_fields(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        for name in sorted(UNSUPPORTED_FIELDS & raw.keys()):
            if raw[name] not in (None, {}, [], "") and not (name == "tool_choice" and raw[name] == "none"):
                raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_field")
        unknown = raw.keys() - cls.model_fields.keys() - UNSUPPORTED_FIELDS - NO_EFFECT_FIELDS
        if unknown:
            logger.warning("ignoring %d unknown request field(s): %s", len(unknown), sorted(unknown)[:10])
        return raw

    @field_validator("kv_transfer_params")
    @classmethod
    def _refuse_transfer_params(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("kv_transfer_params is set by the server and may not be supplied by clients")
        return None

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                stop=self.stop,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from e


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Literal[False] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseWriter:
    """Builds the bodies of one response, whole or chunk by chunk, for either endpoint."""

    def __init__(self, request_id: str, model: str, chat: bool, return_token_ids: bool):
        self.request_id, self.model, self.chat, self.return_token_ids = request_id, model, chat, return_token_ids
        self.created = int(time.time())

    def _envelope(self, object_: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_, "created": self.created, "model": self.model,
                "choices": [{"index": 0, **choice}]}

    def _choice(self, text: str, token_ids: list[int], finish_reason: str | None, streaming: bool) -> dict[str, Any]:
        if self.chat:
            key = "delta" if streaming else "message"
            choice = {key: {"role": "assistant", "content": text}, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"text": text, "finish_reason": finish_reason, "logprobs": None}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def chunk(self, chunk: EngineChunk) -> dict[str, Any]:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(object_, self._choice(chunk.text, chunk.token_ids, chunk.finish_reason, True))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", {})
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def whole(self, text: str, token_ids: list[int], finish_reason: str | None, prompt_tokens: int,
              cached_tokens: int) -> dict[str, Any]:
        object_ = "chat.completion" if self.chat else "text_completion"
        body = self._envelope(object_, self._choice(text, token_ids, finish_reason, False))
        body["usage"] = usage(prompt_tokens, len(token_ids), cached_tokens)
        return body


def validated(model: type[SamplingFields], raw: dict[str, Any]) -> SamplingFields:
    """`raw` as `model`, or a 400 naming the first field at fault."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from e


def as_request(request: SamplingFields | dict[str, Any]) -> SamplingFields:
    """A request model as given, or its dict validated (a dict with `messages` is a chat request)."""
    if isinstance(request, (CompletionRequest, ChatCompletionRequest)):
        return request
    if not isinstance(request, dict):
        raise APIError(400, f"expected a CompletionRequest, ChatCompletionRequest or dict, got {type(request).__name__}")
    return validated(ChatCompletionRequest if "messages" in request else CompletionRequest, request)
