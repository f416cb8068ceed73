"""A request that runs past `ingress.request_timeout_s`: a 504 (streaming: an error event), and both legs let go of
the engines at once. Served by a second ingress with a 1 s limit, in front of the session's engines."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import CASES, deploy_ingress

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
# 1,513 prompt tokens and 500 to decode: several seconds, well past the limit.
BODY = {"model": MODEL, "prompt": CASES[2].prompt, "max_tokens": 500, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def impatient_url(app):
    from ray import serve

    yield deploy_ingress(app, "pd-impatient", {"request_timeout_s": 1})
    serve.delete("pd-impatient")


def _let_go(app) -> None:
    loads = app.wait_until_nothing_scheduled(timeout_s=2.0)
    assert all(l["running"] == l["waiting"] == 0 for l in loads.values()), loads


@pytest.mark.parametrize("mode", ["pull", "push", "local"])
def test_a_request_past_its_limit_gets_a_504(app, impatient_url, mode):
    started = time.monotonic()
    response = httpx.post(impatient_url + "/v1/completions", json=BODY, headers={"x-kv-transfer-mode": mode},
                          timeout=60)
    assert response.status_code == 504, response.text
    assert response.json()["error"]["type"] == "timeout_error"
    assert time.monotonic() - started < 3
    _let_go(app)


def test_a_stream_past_its_limit_ends_with_an_error_event(app, impatient_url):
    """The limit passes after the stream's first events went out (a short prompt, 2,000 tokens to decode): the
    stream goes on to an error event and `[DONE]`, not a body cut off."""
    body = {**BODY, "prompt": CASES[0].prompt, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", impatient_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["type"] == "timeout_error"
    assert any(json.loads(event[len("data: "):]).get("choices") for event in events[:-2])  # tokens went out first
    _let_go(app)
