"""Request validation and response shapes of the OpenAI-compatible API, without engines."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.engine.protocol import EngineChunk
from app.ingress.openai_protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, ResponseWriter


def test_client_transfer_params_are_refused():
    with pytest.raises(ValidationError, match="kv_transfer_params"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "kv_transfer_params": {}})


def test_unknown_openai_fields_are_ignored_and_defaults_follow_openai():
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", "user": "u", "logit_bias": None})
    assert request.max_tokens == 16 and request.temperature == 1.0
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert chat.requested_max_tokens() is None


def test_chat_takes_max_completion_tokens_first():
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 7})
    assert chat.requested_max_tokens() == 7


@pytest.mark.parametrize("field", [{"max_tokens": 0}, {"temperature": 3}, {"top_p": 0}, {"n": 2}, {"echo": True},
                                   {"prompt": ""}, {"prompt": []}, {"logprobs": 2}])
def test_out_of_range_fields_are_refused(field):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **field})


def test_text_parts_are_joined_and_other_parts_refused():
    assert ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]).text() == "ab"
    with pytest.raises(APIError, match="only text"):
        ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]).text()


def test_sampling_params_carry_the_request():
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 0, "stop": ["\n"], "seed": 3})
    params = request.sampling_params(max_tokens=9)
    assert (params.max_tokens, params.temperature, params.stop, params.seed) == (9, 0.0, ["\n"], 3)


def test_response_shapes():
    chat = ResponseWriter("id-1", "m", chat=True, return_token_ids=False)
    whole = chat.whole("hi", [1, 2], "length", prompt_tokens=3, cached_tokens=3)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 3}}
    chunk = chat.chunk(EngineChunk(text="h", token_ids=[1]))
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"]["content"] == "h"
    completion = ResponseWriter("id-2", "m", chat=False, return_token_ids=True)
    choice = completion.whole("t", [4], "stop", 1, 0)["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("t", [4], "stop")
    usage_chunk = completion.usage_chunk(1, 4, 1)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_api_error_body_has_openai_shape():
    error = APIError(404, "nope", param="model", code="model_not_found")
    assert error.body() == {"error": {"message": "nope", "type": "invalid_request_error", "param": "model",
                                      "code": "model_not_found"}}


@pytest.mark.parametrize("field, value", [("tools", [{"type": "function"}]), ("response_format", {"type": "json"}),
                                          ("logit_bias", {"1": 5}), ("tool_choice", "auto")])
def test_fields_that_would_change_the_answer_are_refused_by_name(field, value):
    with pytest.raises(APIError, match=field) as refused:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    assert refused.value.status == 400 and refused.value.param == field


@pytest.mark.parametrize("field", [{"seed": 2**64}, {"top_k": 2**40}, {"repetition_penalty": float("inf")},
                                   {"temperature": float("nan")}])
def test_numbers_an_engine_could_not_hold_are_refused(field):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **field})
