"""The Python handle API: another Serve application in the same cluster (README's example, run as written) calls
the app through its handle, streaming and not; errors and cancellation behave as over HTTP."""

from __future__ import annotations

import pytest

from app.ingress.openai_protocol import APIError, ChatCompletionRequest
from conftest import APP_NAME, CASES, readme_example

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def storyteller(app):
    from ray import serve

    assert APP_NAME == "pd"  # the name README's example calls
    namespace: dict = {}
    exec(compile(readme_example("handle"), "README.md:handle", "exec"), namespace)  # noqa: S102 -- our own README
    handle = serve.run(namespace["app"], name="storyteller", route_prefix=None)
    yield handle
    serve.delete("storyteller")


@pytest.fixture
def pd():
    from ray import serve

    return serve.get_app_handle(APP_NAME)


def test_another_serve_app_calls_through_the_handle(app, storyteller, reference_outputs):
    case = CASES[2]  # > 1,024 prompt tokens
    expected = reference_outputs[case.name]
    before = app.totals()

    body = storyteller.tell.remote(case.prompt, case.max_tokens).result()
    assert body["choices"][0]["text"] == expected["text"]
    # decode computed none of the prompt itself: all of it arrived by transfer
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(expected["prompt_token_ids"])

    assert storyteller.tell_streaming.remote(case.prompt, case.max_tokens).result() == expected["text"]
    transfers = (("prefill", "push_transfers"), ("decode", "pull_transfers"))  # prefill WRITEs, decode READs
    totals = app.wait_for_totals(lambda t: all(app.growth(before, t)[role][kind] for role, kind in transfers))
    grew = app.growth(before, totals)
    assert grew["prefill"]["push_transfers"] == 1 and grew["decode"]["pull_transfers"] == 1
    assert grew["decode"]["local_compute"] <= 1  # at most the token prefill seeded (pull)


def test_typed_requests_and_usage_in_the_stream(pd, reference_outputs):
    case = CASES[3]
    request = ChatCompletionRequest(model=MODEL, messages=list(case.messages), max_tokens=case.max_tokens,
                                    temperature=0, return_token_ids=True, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(pd.options(stream=True).create_stream.remote(request, mode="push"))
    # vLLM's stream opens with the assistant's role alone, no tokens yet
    tokens = [t for c in chunks[:-1] for t in c["choices"][0].get("token_ids") or ()]
    assert tokens == reference_outputs[case.name]["token_ids"]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


@pytest.mark.parametrize("request_body, mode, status, param", [
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens"),
    ({"model": "other", "prompt": "hi"}, None, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, None, 400, "n"),
    ({"model": MODEL, "prompt": "hi"}, "teleport", 400, "x-kv-transfer-mode"),
    ({"model": MODEL, "prompt": "hi", "stream": True}, None, 400, "stream"),
])
def test_bad_requests_raise_the_error_http_would_answer(pd, request_body, mode, status, param):
    with pytest.raises(APIError) as raised:
        pd.create.remote(request_body, mode=mode).result()
    assert raised.value.status == status and raised.value.body()["error"]["param"] == param


def test_the_service_class_is_a_handle_argument(pd):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "pd_class": "interactive"}
    answer = pd.create.remote(body, timings=True, pd_class="batch").result()
    assert answer["pd_timings"]["decision"]["class"] == "batch"  # the argument wins over the body, as the header does
    assert pd.create.remote(body, timings=True).result()["pd_timings"]["decision"]["class"] == "interactive"
    with pytest.raises(APIError) as raised:
        pd.create.remote(body, pd_class="gold").result()
    assert raised.value.status == 400 and raised.value.body()["error"]["param"] == "x-pd-class"
    assert set(pd.service_classes.remote().result()["classes"]) == {"interactive", "batch"}


def test_cancelling_a_handle_call_aborts_both_legs(app, pd):
    body = {"model": MODEL, "prompt": CASES[2].prompt, "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    stream = pd.options(stream=True).create_stream.remote(body, mode="pull")
    next(stream)  # tokens are flowing
    stream.cancel()
    # nothing runs or waits well before the 500 tokens could have been decoded
    loads = app.wait_until_nothing_scheduled(timeout_s=2.0)
    assert all(l["running"] == l["waiting"] == 0 for l in loads.values()), loads
