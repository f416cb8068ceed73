"""Tool calls in every mode, on the session's real engines, through the CPU preset's chat template (tools in hermes'
format) and vLLM's `hermes` tool parser: a named call is held to the tool's schema (`strict`) by a structural tag
from its first token; `auto` leaves it to the parser. Every mode gives the same answer, and the prompt crossed as
KV."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
MODES = ("push", "pull", "local", "auto")
# `strict`: the call's arguments are held to the tool's schema too, not only its envelope (OpenAI's field).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": [WEATHER],
        "max_tokens": 120, "temperature": 0, "return_token_ids": True}


def _chat(app, mode: str, **fields) -> dict:
    response = httpx.post(app.base_url + "/v1/chat/completions", json={**BODY, **fields},
                          headers={"x-kv-transfer-mode": mode}, timeout=120)
    assert response.status_code == 200, response.text
    result = response.json()
    cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
    taken = response.headers["x-kv-transfer-mode"]
    assert cached == (0 if taken == "local" else result["usage"]["prompt_tokens"]), (mode, taken)
    return result["choices"][0]


def test_a_named_tool_call_is_held_to_its_grammar_the_same_in_every_mode(app):
    """The call's envelope and arguments follow hermes' structural tag from the first token in every mode (pull
    unseeded, push seeded). The tag's grammar allows whitespace, which the tiny model writes until max_tokens, so
    the call does not close and the parser leaves it as content: what is checked is that the grammar held and
    every mode wrote the same."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    answers = {mode: _chat(app, mode, tool_choice=named) for mode in MODES}
    for mode, choice in answers.items():
        text = "".join((choice["message"].get("content") or "").split())
        assert text.startswith('<tool_call>{"name":"get_weather","arguments":{"city"'), (mode, choice["message"])
    assert len({tuple(choice["token_ids"]) for choice in answers.values()}) == 1


def test_auto_tool_choice_goes_through_the_parser_the_same_in_every_mode(app):
    answers = {mode: _chat(app, mode, tool_choice="auto") for mode in MODES}
    parsed = {json.dumps([choice["message"].get("content"), choice["message"].get("tool_calls") or []],
                         sort_keys=True) for choice in answers.values()}
    assert len(parsed) == 1, parsed
    assert len({tuple(choice["token_ids"]) for choice in answers.values()}) == 1
