"""What a careless or hostile client can send: every such request gets a 4xx with a message, quickly, and nobody
else notices. Runs against the real app (real ingress, real engines)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.ingress.openai_protocol import UNSERVED

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
MAX_REQUEST_BYTES = 4 * 2**20  # the ingress default


def _post_raw(app, content, path: str = "/v1/completions", **headers) -> httpx.Response:
    return httpx.post(app.base_url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **headers})


def _still_serving(app) -> None:
    ok = httpx.post(app.base_url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "still there?", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


def _assert_client_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["message"]
    return error


RAW_BODIES = {
    "nested-100k-deep": b"[" * 100_000 + b"]" * 100_000,
    "nested-in-a-field": (b'{"model": "tiny-qwen3", "prompt": "hi", "metadata": ' + b"[" * 100_000 + b"]" * 100_000
                          + b"}"),
    "nan": b'{"model": "tiny-qwen3", "prompt": "hi", "temperature": NaN}',
    "infinity": b'{"model": "tiny-qwen3", "prompt": "hi", "repetition_penalty": Infinity}',
    "overflowing-float": b'{"model": "tiny-qwen3", "prompt": "hi", "repetition_penalty": 1e999}',
    "integer-of-5000-digits": b'{"model": "tiny-qwen3", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
    "seed-beyond-int64": b'{"model": "tiny-qwen3", "prompt": "hi", "seed": 18446744073709551616}',
    "top-k-beyond-int32": b'{"model": "tiny-qwen3", "prompt": "hi", "top_k": 4294967296}',
    "invalid-utf8": b'{"model": "tiny-qwen3", "prompt": "\xff\xfe\xfa"}',
    "empty": b"",
}


@pytest.mark.parametrize("name", RAW_BODIES)
def test_malformed_bodies_get_a_400(app, name):
    _assert_client_error(_post_raw(app, RAW_BODIES[name]), 400)
    _still_serving(app)


def test_oversized_bodies_get_a_413_declared_or_chunked(app):
    body = b'{"model": "tiny-qwen3", "prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}'
    assert _assert_client_error(_post_raw(app, body), 413)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit must hold while reading
        yield body[:1000]
        for i in range(1000, len(body), 2**16):
            yield body[i:i + 2**16]

    _assert_client_error(_post_raw(app, chunked()), 413)
    _still_serving(app)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing_and_stalls_no_one(app):
    huge = {"model": MODEL, "prompt": "lorem ipsum " * 300_000, "max_tokens": 4}  # 3.6 MB: under the body limit
    small = {"model": MODEL, "prompt": "The user asks the assistant", "max_tokens": 4, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        refused = [pool.submit(httpx.post, app.base_url + "/v1/completions", json=huge, timeout=60) for _ in range(3)]
        served = pool.submit(httpx.post, app.base_url + "/v1/completions", json=small, timeout=60)
        assert served.result().status_code == 200
        small_done = time.monotonic() - started
        for future in refused:
            assert _assert_client_error(future.result(), 400)["code"] == "context_length_exceeded"
        refused_done = time.monotonic() - started
    # Tokenizing one such prompt takes about 4 s here; refusing three, and serving the small request beside them,
    # takes a fraction of that.
    assert small_done < 3.0 and refused_done < 3.0, (small_done, refused_done)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "lorem ipsum " * 300_000}]}
    _assert_client_error(httpx.post(app.base_url + "/v1/chat/completions", json=chat, timeout=60), 400)


@pytest.mark.parametrize("field, value", [
    ("prompt_logprobs", 1),
    ("n", 2),
])
def test_fields_that_change_the_answer_are_refused_by_name(app, field, value):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    error = _assert_client_error(httpx.post(app.base_url + "/v1/chat/completions", json=body, timeout=60), 400)
    assert error["param"] == field and field in error["message"]


def test_fields_that_change_nothing_are_accepted(app):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "u-1", "metadata": {"k": "v"},
            "tools": None, "logit_bias": {}, "tool_choice": "none", "some_future_field": 1}
    response = httpx.post(app.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


# -- fuzzing --------------------------------------------------------------------------------------------------------

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
          "n", "stream", "stream_options", "return_token_ids", "echo", "logprobs", "suffix", "kv_transfer_params",
          "transfer_id", "remote_engine_id", "remote_block_ids", "top_logprobs", "response_format",
          "structured_outputs", "tools", "tool_choice", *sorted(UNSERVED)]
JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.text(max_size=40),
    st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, 2, -1, 2**31, 2**63, 1e308, MODEL, "", "\x00", "\ud7ff\ue000"]),
)
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4),
), max_leaves=12)
BODIES = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={"prompt": st.one_of(st.text(max_size=200), st.lists(st.integers(-10, 2**40), max_size=50), JSON_VALUES),
              "messages": st.one_of(
                  st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                  "content": st.one_of(st.text(max_size=100), JSON_VALUES)}),
                           max_size=3),
                  JSON_VALUES)},
).flatmap(lambda base: st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5).map(
    lambda extra: {**base, **extra, "max_tokens": _short(extra.get("max_tokens", 2)), "max_completion_tokens": 2}))


def _short(max_tokens):
    """Valid requests run on the engines: keep each one short (absurd values stay, to be refused)."""
    return 2 if isinstance(max_tokens, int) and 2 < max_tokens < 2**20 else max_tokens


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       mode=st.sampled_from([None, "push", "pull", "local", "PULL", "both", "pu ll"]))
def test_fuzzed_requests_get_an_answer_or_a_4xx_with_a_message(app, body, path, mode):
    headers = {} if mode is None else {"x-kv-transfer-mode": mode}
    response = httpx.post(app.base_url + path, json=body, headers=headers, timeout=60)
    if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text, response.text[:500]
    elif response.status_code == 200:
        assert response.json()["choices"], response.text
    else:
        assert 400 <= response.status_code < 500, (body, response.text[:500])
        assert response.json()["error"]["message"]


def test_after_the_fuzzing_no_kv_block_is_left_in_use(app):
    """Runs after the fuzz test (file order): every request it sent ended, and freed what it held."""
    loads = app.wait_until_idle(timeout_s=10)
    assert all(l["kv_cache_usage"] == 0 and l["running"] == l["waiting"] == 0 for l in loads.values()), loads
    _still_serving(app)
