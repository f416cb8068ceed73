"""The OpenAI wire format as the app takes it: vLLM's own request models (the same `vllm serve` validates), and
the error the app answers in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError

# What vLLM's request models take that the legs do not carry yet, refused by name rather than answered as if it
# had not been asked (null, false, empty and the default count as not asked).
UNSERVED = {
    "prompt_logprobs": "prompt logprobs are not carried yet",
    "n": "more than one sample per prompt is not served yet", "use_beam_search": "beam search is not served",
    "echo": "echo is not served yet",
    "functions": "the deprecated `functions` are not served: send `tools`",
    "prompt_embeds": "prompt embeddings are not served", "mm_payload": "multimodal input is not served",
    "media_io_kwargs": "multimodal input is not served", "mm_processor_kwargs": "multimodal input is not served",
    "kv_transfer_params": "kv_transfer_params is set by the server and may not be supplied by clients",
    "ec_transfer_params": "ec_transfer_params is set by the server and may not be supplied by clients",
    "vllm_xargs": "vllm_xargs reach the engines' internals, which are the app's business",
}
# Integers vLLM's models take unbounded that an engine holds in fixed width.
ENGINE_BOUNDS = {"top_k": (-1, 2**31 - 1), "seed": (-2**63, 2**63 - 1)}
# Of UNSERVED, what no client may set at all, empty or not.
SET_BY_SERVER = ("kv_transfer_params", "ec_transfer_params", "vllm_xargs")
# The routes the app serves, by the request model each takes.
REQUEST_MODELS: dict[str, type[CompletionRequest | ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


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


def validated(raw: dict[str, Any], chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """`raw` as vLLM's request model for its route, or a 400 naming the first field at fault or not served."""
    model = REQUEST_MODELS["/v1/chat/completions" if chat else "/v1/completions"]
    try:
        body = model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from e
    except VLLMValidationError as e:  # vLLM's own checks across fields
        raise APIError(400, e.args[0], param=e.parameter) from e
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a validator of vLLM's that met a shape it
        raise APIError(400, f"the request body cannot be read: {e}") from e  # did not expect: the body's fault
    for name, (low, high) in ENGINE_BOUNDS.items():
        value = getattr(body, name, None)
        if value is not None and not low <= value <= high:
            raise APIError(400, f"{name}: must lie in [{low}, {high}]", param=name)
    for name, why in UNSERVED.items():
        value = getattr(body, name, None)
        field = model.model_fields.get(name)
        asked = value is not None if name in SET_BY_SERVER else (
            value not in (None, False, [], {}, "") and (field is None or value != field.default))
        if asked:
            raise APIError(400, f"{name}: {why}", param=name, code="unsupported_field")
    return body
