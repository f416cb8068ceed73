"""Answers held to a JSON schema in every mode, on the session's real engines: the same tokens as the colocated engine
under the same grammar, valid against the schema, the prompt crossed as KV. Pull takes its first token from decode
(a grammar follows the output's tokens, and decode would take the second for the first); greedy push keeps the
seeded first token, since its decode samples the first token again under the grammar."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import STRUCTURED_CASES

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
FIRST_TOKEN_FROM = {"push": "prefill", "pull": "decode", "local": "decode"}


def _request(case) -> tuple[str, dict]:
    body = {"model": MODEL, "max_tokens": case.max_tokens, "temperature": 0, "return_token_ids": True}
    if case.messages is not None:  # OpenAI's response_format
        return "/v1/chat/completions", {**body, "messages": list(case.messages), "response_format": {
            "type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}}}
    return "/v1/completions", {**body, "prompt": case.prompt, "structured_outputs": {"json": case.schema}}  # vLLM's


def _assert_follows(answer: dict, schema: dict) -> None:
    assert set(answer) == set(schema["required"]), answer
    for key, value in answer.items():
        rule = schema["properties"][key]
        assert value in rule["enum"] if "enum" in rule else isinstance(value, bool), (key, value)


@pytest.mark.parametrize("mode", ["push", "pull", "local", "auto"])
def test_a_json_schema_answer_is_the_colocated_engines_in_every_mode(app, reference_outputs, mode):
    for case in STRUCTURED_CASES:
        route, body = _request(case)
        response = httpx.post(app.base_url + route, json=body,
                              headers={"x-kv-transfer-mode": mode, "x-pd-timings": "1"}, timeout=120)
        assert response.status_code == 200, response.text
        result, reference = response.json(), reference_outputs[case.name]
        choice = result["choices"][0]
        text = choice["message"]["content"] if case.messages is not None else choice["text"]
        assert choice["token_ids"] == reference["token_ids"] and text == reference["text"], (case.name, mode)
        _assert_follows(json.loads(text), case.schema)
        taken = response.headers["x-kv-transfer-mode"]
        assert result["pd_timings"]["decision"]["first_token"] == FIRST_TOKEN_FROM[taken], (case.name, mode)
        cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (0 if taken == "local" else result["usage"]["prompt_tokens"]), (case.name, mode)


@pytest.mark.parametrize("rule", [{"regex": "("}, {"json": {"type": "wat"}}, {"choice": []}],
                         ids=["regex", "json-schema", "choice"])
def test_a_grammar_that_does_not_compile_is_the_clients_400_and_leaves_the_engines_idle(app, rule):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "structured_outputs": rule}
    response = httpx.post(app.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "Error(" not in error["message"], error
    loads = app.wait_until_nothing_scheduled(timeout_s=5.0)
    assert all(load["running"] == load["waiting"] == 0 for load in loads.values()), loads
