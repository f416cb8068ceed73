"""The ingress decides the mode (app/policy/mode_policy.py), on the session's real engines: an ingress with
`default_mode: auto` in front of them. Every answer names its mode and the reason; the decision and its predicted
costs are in the timeline; a named mode is obeyed; whatever the policy picks, the output is the colocated engine's
and a disaggregated answer's prompt crossed as KV."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.policy.mode_policy import LOWEST_COST, REASONS, REQUESTED, RULE
from conftest import CASES, deploy_ingress

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
NAME = "pd-auto"


@pytest.fixture(scope="module")
def url(app):
    from ray import serve

    yield deploy_ingress(app, NAME, transfer={"default_mode": "auto"})
    serve.delete(NAME)


def complete(url: str, case, headers: dict | None = None) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": case.max_tokens, "temperature": 0, "return_token_ids": True}
    if case.prompt is not None:
        path, body = "/v1/completions", {**body, "prompt": case.prompt}
    else:
        path, body = "/v1/chat/completions", {**body, "messages": list(case.messages)}
    response = httpx.post(url + path, json=body, headers={"x-pd-timings": "1", **(headers or {})}, timeout=120)
    assert response.status_code == 200, response.text
    return response


def test_auto_answers_name_the_mode_and_reason_and_match_the_colocated_engine(url, reference_outputs):
    for case in CASES:
        response = complete(url, case)
        mode, reason = response.headers["x-kv-transfer-mode"], response.headers["x-kv-transfer-reason"]
        assert mode in ("push", "pull", "local") and reason in REASONS and reason != REQUESTED
        result = response.json()
        decision = result["pd_timings"]["decision"]
        assert (decision["mode"], decision["reason"]) == (mode, reason)
        assert set(decision["predicted_ms"]) == {"push", "pull", "local"}
        assert all(cost["ttft"] > 0 for cost in decision["predicted_ms"].values())
        reference = reference_outputs[case.name]
        assert result["choices"][0]["token_ids"] == reference["token_ids"], (case.name, mode)
        cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (0 if mode == "local" else len(reference["prompt_token_ids"])), (case.name, mode)


def test_the_cheapest_predicted_option_is_taken(url):
    """Unless the policy explores, the mode taken is the one with the lowest predicted cost for an interactive
    request (TTFT + stall, both weighted 1) among those no limit ruled out (push, while it would hold decode idle)."""
    for case in CASES[:3]:
        decision = complete(url, case).json()["pd_timings"]["decision"]
        if decision["reason"] == LOWEST_COST:
            scores = {mode: cost["ttft"] + cost["stall"] for mode, cost in decision["predicted_ms"].items()
                      if mode not in decision["ruled_out"]}
            assert decision["mode"] == min(scores, key=scores.get), decision


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
def test_a_named_mode_is_obeyed(url, mode):
    response = complete(url, CASES[1], {"x-kv-transfer-mode": mode})
    assert (response.headers["x-kv-transfer-mode"], response.headers["x-kv-transfer-reason"]) == (mode, REQUESTED)
    usage = response.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (0 if mode == "local" else usage["prompt_tokens"])


def test_auto_named_as_a_mode_leaves_it_to_the_policy_and_a_bad_mode_is_refused(url):
    response = complete(url, CASES[0], {"x-kv-transfer-mode": "auto"})
    assert response.headers["x-kv-transfer-reason"] != REQUESTED
    refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                         headers={"x-kv-transfer-mode": "teleport"}, timeout=30)
    assert refused.status_code == 400 and "teleport" in refused.json()["error"]["message"]


def test_the_decision_sees_streams_decoding_on_the_decode_engine(app, url):
    """The load the policy decides on comes from the engines' own reports: with a long stream decoding, a local
    prefill is predicted to stall it; with none, not."""
    app.wait_until_idle(timeout_s=30)
    time.sleep(1.0)  # a few load reports (every 0.2 s) since the engines went idle
    idle = complete(url, CASES[1]).json()["pd_timings"]["decision"]["predicted_ms"]
    assert idle["local"]["stall"] == 0
    body = {"model": MODEL, "prompt": CASES[0].prompt, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-kv-transfer-mode": "local"},
                      timeout=120) as stream:
        lines = stream.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        time.sleep(1.0)  # a few load reports (every 0.2 s) after the stream started decoding
        busy = complete(url, CASES[1]).json()["pd_timings"]["decision"]["predicted_ms"]
    assert busy["local"]["stall"] > 0, busy


def test_a_burst_spreads_over_the_engines(app, url):
    """Requests decided within the same few milliseconds each see the ones decided before them (queued on the
    engine that will prefill them), so a burst of long prompts does not all queue on one engine."""
    app.wait_until_idle(timeout_s=30)
    time.sleep(1.0)  # load reports since the engines went idle
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    prompts = [[100 + (n * 37 + k) % 3900 for k in range(1000)] for n in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda prompt: httpx.post(url + "/v1/completions", json={**body, "prompt": prompt},
                                                          timeout=120), prompts))
    assert all(answer.status_code == 200 for answer in answers), [a.text for a in answers if a.status_code != 200]
    served = [(answer.headers["x-kv-transfer-mode"], answer.headers["x-kv-transfer-reason"]) for answer in answers]
    assert len({mode for mode, _ in served}) > 1, served


def test_the_threshold_rule_serves_short_prompts_local_and_long_ones_pull(url):
    """`threshold` named per request: the configured rule (local below 1,000 prompt tokens, else pull), and a pulled
    prompt crossed as KV."""
    served = {}
    for tokens in (200, 1500):
        body = {"model": MODEL, "prompt": [(5 * i) % 3000 + 3 for i in range(tokens)], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        response = httpx.post(url + "/v1/completions", json=body, headers={"x-kv-transfer-mode": "threshold"},
                              timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["x-kv-transfer-reason"] == RULE
        served[tokens] = (response.headers["x-kv-transfer-mode"],
                          response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert served == {200: ("local", 0), 1500: ("pull", 1500)}
