"""Logprobs in every mode, on the session's real engines: each token's top-5 logprobs as the colocated engine gives
them (within 1e-4), whole and streamed, completions and chat. Seeded, the first token's come from prefill (push and
pull); unseeded (a stop string keeps a request off the seeded path), decode's own; either way the prompt crossed as
KV."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import CASES, REFERENCE_LOGPROBS

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
TOLERANCE = 1e-4
# A stop string the tiny model never writes: the answer is the same, but a stop string rules out seeding
# (app/flow/first_token.py), so the first token's logprobs come from decode.
UNSEEDED = {"stop": ["@@@@"]}


def _body(case, extra: dict) -> tuple[str, dict]:
    body = {"model": MODEL, "max_tokens": case.max_tokens, "temperature": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True, **extra}
    if case.prompt is not None:
        return "/v1/completions", {**body, "prompt": case.prompt, "logprobs": REFERENCE_LOGPROBS}
    return "/v1/chat/completions", {**body, "messages": list(case.messages), "logprobs": True,
                                    "top_logprobs": REFERENCE_LOGPROBS}


def _token_steps(choice: dict, chat: bool) -> list[tuple[float, dict[str, float]]]:
    """Per token: its logprob and the top logprobs by token id, from a whole choice or a stream's chunks."""
    logprobs = choice["logprobs"]
    if chat:
        return [(step["logprob"], {top["token"]: top["logprob"] for top in step["top_logprobs"]})
                for step in logprobs["content"]]
    return list(zip(logprobs["token_logprobs"], logprobs["top_logprobs"]))


def _assert_matches(steps: list[tuple[float, dict[str, float]]], token_ids: list[int], reference: dict, label):
    assert token_ids == reference["token_ids"], label
    assert len(steps) == len(token_ids), label
    for position, ((logprob, top), token, expected) in enumerate(zip(steps, token_ids, reference["logprobs"])):
        expected = {f"token_id:{t}": value for t, value in expected.items()}
        assert abs(logprob - expected[f"token_id:{token}"]) <= TOLERANCE, (label, position)
        assert len(top) >= REFERENCE_LOGPROBS and set(top) <= set(expected), (label, position, top, expected)
        assert all(abs(value - expected[t]) <= TOLERANCE for t, value in top.items()), (label, position)


@pytest.mark.parametrize("path", ["seeded", "unseeded"])
@pytest.mark.parametrize("mode", ["push", "pull", "local", "auto"])
def test_logprobs_match_the_colocated_engine(app, reference_outputs, mode, path):
    for case in CASES:
        route, body = _body(case, UNSEEDED if path == "unseeded" else {})
        response = httpx.post(app.base_url + route, json=body, headers={"x-kv-transfer-mode": mode}, timeout=120)
        assert response.status_code == 200, response.text
        result, chat = response.json(), case.messages is not None
        choice = result["choices"][0]
        _assert_matches(_token_steps(choice, chat), choice["token_ids"], reference_outputs[case.name], (case.name,
                                                                                                       mode, path))
        taken = response.headers["x-kv-transfer-mode"]
        cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (0 if taken == "local" else result["usage"]["prompt_tokens"]), (case.name, mode, path)


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
def test_streamed_logprobs_match_the_colocated_engine(app, reference_outputs, mode):
    """A stream's chunks carry each token's logprobs once: the seeded first token's in its own chunk, decode's
    copy of it (push) left out."""
    for case in (CASES[1], CASES[3]):
        route, body = _body(case, {"stream": True})
        chat, steps, token_ids = case.messages is not None, [], []
        with httpx.stream("POST", app.base_url + route, json=body, headers={"x-kv-transfer-mode": mode},
                          timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[len("data: "):])["choices"]:
                    if choice.get("logprobs"):
                        steps += _token_steps(choice, chat)
                    token_ids += choice.get("token_ids") or []
        _assert_matches(steps, token_ids, reference_outputs[case.name], (case.name, mode))
