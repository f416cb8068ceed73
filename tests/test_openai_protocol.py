"""The wire format the app takes -- vLLM's own request models -- and what it refuses by name, without engines."""

from __future__ import annotations

import pytest

from app.ingress.openai_protocol import SET_BY_SERVER, UNSERVED, APIError, validated

PROMPT = {"model": "m", "prompt": "x"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def test_the_request_models_are_vllms_with_its_defaults():
    completion = validated(PROMPT, chat=False)
    assert type(completion).__module__.startswith("vllm.") and completion.max_tokens == 16
    chat = validated({**CHAT, "max_tokens": 5, "max_completion_tokens": 7}, chat=True)
    assert type(chat).__module__.startswith("vllm.") and chat.max_completion_tokens == 7


@pytest.mark.parametrize("name", SET_BY_SERVER)
def test_transfer_internals_are_refused_even_empty(name):
    with pytest.raises(APIError) as refused:
        validated({**PROMPT, name: {}}, chat=False)
    assert (refused.value.status, refused.value.param) == (400, name)


@pytest.mark.parametrize("field, value, chat", [
    ("prompt_logprobs", 1, False),
    ("n", 2, False), ("echo", True, False),
])
def test_what_the_legs_do_not_carry_yet_is_refused_by_name(field, value, chat):
    with pytest.raises(APIError) as refused:
        validated({**(CHAT if chat else PROMPT), field: value}, chat=chat)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, field, "unsupported_field")
    assert UNSERVED[field] in refused.value.message


@pytest.mark.parametrize("field", [{"n": 1}, {"logprobs": 5}, {"echo": False}, {"response_format": {"type": "json_object"}},
                                   {"logit_bias": {"5": 1.0}}, {"bad_words": ["x"]}, {"stop": ["\n"]}])
def test_what_asks_nothing_the_legs_lack_is_taken(field):
    validated({**PROMPT, **field} if "response_format" not in field else {**CHAT, **field},
              chat="response_format" in field)


@pytest.mark.parametrize("body, param", [({"model": "m"}, "prompt"), ({**PROMPT, "temperature": "hot"}, "temperature")])
def test_an_invalid_body_gets_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as refused:
        validated(body, chat=False)
    assert refused.value.status == 400 and refused.value.param.startswith(param)


def test_api_error_body_has_openai_shape():
    error = APIError(404, "nope", param="model", code="model_not_found")
    assert error.body() == {"error": {"message": "nope", "type": "invalid_request_error", "param": "model",
                                      "code": "model_not_found"}}
