"""The app end to end: real Ray, real vLLM engines on separate cores, real NIXL transfers."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from app.policy.service_class import default_classes
from conftest import CASES, ROOT, Case, app_config

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"


def _body(case: Case, **extra) -> tuple[str, dict]:
    common = {"model": MODEL, "max_tokens": case.max_tokens, "temperature": 0, "return_token_ids": True, **extra}
    if case.prompt is not None:
        return "/v1/completions", {**common, "prompt": case.prompt}
    return "/v1/chat/completions", {**common, "messages": list(case.messages)}


def _text_of(choice: dict) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _stream_choices(base_url: str, path: str, body: dict, headers: dict | None = None) -> list[dict]:
    """The choice of each streamed event, in order; the stream must end without an error event."""
    choices = []
    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            choices += event["choices"]
    return choices


def _stream_text(base_url: str, path: str, body: dict) -> str:
    return "".join((c["delta"].get("content") or "") if "delta" in c else c["text"]
                   for c in _stream_choices(base_url, path, body))


# A stop string that never matches: the request's output is unchanged, but it takes the unseeded path (decode samples
# the first token itself; see app/flow/first_token.py).
UNSEEDED = {"stop": ["<never-generated>"]}


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_greedy_output_equals_colocated_engine_and_kv_crossed(app, reference_outputs, case, mode, seeded):
    reference = reference_outputs[case.name]
    num_prompt_tokens = len(reference["prompt_token_ids"])
    before = app.totals()

    path, body = _body(case, **({} if seeded else UNSEEDED))
    response = httpx.post(app.base_url + path, json=body, headers={"x-kv-transfer-mode": mode}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["x-kv-transfer-mode"] == mode
    result = response.json()
    choice = result["choices"][0]
    assert result["usage"]["prompt_tokens"] == num_prompt_tokens  # the ingress tokenized as the reference did
    assert choice["token_ids"] == reference["token_ids"]
    assert _text_of(choice) == reference["text"]

    # Decode received every prompt token by transfer ...
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == num_prompt_tokens
    # ... by one transfer of the requested kind: push = a WRITE issued by prefill, pull = a READ issued by decode.
    issuer, bystander = ("prefill", "decode") if mode == "push" else ("decode", "prefill")
    after = app.wait_for_totals(lambda t: t[issuer]["kv_transfers"].get(f"{mode}_transfers", 0)
                                > before[issuer]["kv_transfers"].get(f"{mode}_transfers", 0))
    grew = app.growth(before, after)
    assert grew[issuer][f"{mode}_transfers"] == 1 and grew[issuer][f"{mode}_bytes"] > 0
    assert grew[bystander]["transfers"] == 0 and grew[issuer]["transfers"] == 1
    assert grew["decode"]["external_kv_transfer"] == num_prompt_tokens
    # ... and computed none of the prompt itself: only, in seeded pull, the first token that prefill sampled (decode's
    # prompt ends with it). Seeded push decode samples that token again from the prompt alone.
    assert grew["decode"]["local_compute"] == (1 if seeded and mode == "pull" else 0)
    assert grew["prefill"]["local_compute"] == num_prompt_tokens
    assert after["decode"]["kv_transfers"].get("failed_transfers", 0) == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_seeded_first_token_leaves_before_decode_answers_and_phases_are_ordered(app, mode):
    path, body = _body(CASES[2])
    response = httpx.post(app.base_url + path, json=body, timeout=120,
                          headers={"x-kv-transfer-mode": mode, "x-pd-timings": "1"})
    assert response.status_code == 200, response.text
    events = response.json()["pd_timings"]["events_ms"]
    at = lambda *names: [events[name] for name in names]  # noqa: E731
    assert at("arrival", "prefill_dispatched", "prefill_queued", "prefill_scheduled", "prefill_first_token",
              "prefill_answer", "first_token_sent") == sorted(at(
                  "arrival", "prefill_dispatched", "prefill_queued", "prefill_scheduled", "prefill_first_token",
                  "prefill_answer", "first_token_sent"))
    decode_order = ["decode_dispatched", "decode_queued", "decode_scheduled", "decode_first_token", "decode_answer",
                    "second_token_sent"]
    assert at(*decode_order) == sorted(at(*decode_order))
    # The first token went out before decode had produced anything: the hand-off is off the path to it.
    assert events["first_token_sent"] < events["decode_answer"]
    if mode == "pull":  # decode is chosen only after prefill answered (late binding) ...
        assert events["prefill_answer"] <= events["decode_dispatched"]
    else:  # ... push dispatches decode while prefill computes, so its registration is early
        assert events["decode_dispatched"] < events["prefill_first_token"]
    phases = response.json()["pd_timings"]["phases_ms"]
    assert set(phases) >= {"ingress", "to_prefill", "prefill_compute", "prefill_return", "to_decode", "kv_wait",
                           "decode_first_step", "ttft", "second_token_gap"}
    assert all(ms >= 0 for ms in phases.values())
    # Every chunk is stamped from the engine's step through its replica to the ingress, in that order.
    chunks = response.json()["pd_timings"]["chunks_s"]
    assert len(chunks) >= 2 and all(made <= sent <= got for made, sent, got in chunks)
    assert chunks == sorted(chunks)


def _stream_chunks(base_url: str, body: dict, headers: dict) -> list[list[int]]:
    """The token ids of each streamed chunk that carries tokens."""
    return [c["token_ids"] for c in _stream_choices(base_url, "/v1/completions", body, headers) if c["token_ids"]]


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
def test_a_stream_interval_merges_tokens_into_fewer_chunks_and_changes_no_token(app, mode):
    body = {"model": MODEL, "prompt": CASES[1].prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    each_step = _stream_chunks(app.base_url, body, {"x-kv-transfer-mode": mode})
    started = time.monotonic()
    merged = _stream_chunks(app.base_url, body, {"x-kv-transfer-mode": mode, "x-pd-stream-interval-ms": "200"})
    took_s = time.monotonic() - started
    assert sum(merged, []) == sum(each_step, [])
    # The first chunks go at once, then at most one per 200 ms (plus the last, once the request ends).
    assert len(merged) <= 3 + took_s / 0.2 + 1 < len(each_step), (len(merged), took_s, len(each_step))


@pytest.mark.parametrize("interval", ["abc", "", "-1", "1001", "nan", "inf"])
def test_a_stream_interval_that_is_not_a_valid_number_of_ms_gets_a_400(app, interval):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    response = httpx.post(app.base_url + "/v1/completions", json=body, headers={"x-pd-stream-interval-ms": interval},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-pd-stream-interval-ms"


def _timed(base_url: str, prompt: list[int], headers: dict, **body) -> tuple[str, dict[str, float]]:
    """The request's service class as answered, and its events on the wall clock (from its arrival, taken as when
    it was sent)."""
    sent = time.time()
    response = httpx.post(base_url + "/v1/completions", timeout=120, headers={"x-pd-timings": "1", **headers},
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    events = response.json()["pd_timings"]["events_ms"]
    return response.headers["x-pd-class"], {event: sent + ms / 1e3 for event, ms in events.items()}


def test_an_interactive_request_overtakes_batch_work_queued_on_the_engine(app):
    """The class reaches vLLM's priority scheduling: an interactive prompt arriving behind queued batch prompts
    is computed before those still waiting (first come, first served would compute it last)."""
    prompts = [[(i * 31 + k) % 3000 + 3 for k in range(1900)] for i in range(7)]  # ~0.4 s of prefill each here
    pull = {"x-kv-transfer-mode": "pull"}
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        batch = [pool.submit(_timed, app.base_url, p, pull, pd_class="batch") for p in prompts[:-1]]
        time.sleep(0.3)
        interactive = pool.submit(_timed, app.base_url, prompts[-1], {**pull, "x-pd-class": "interactive"},
                                  pd_class="batch")  # the header wins over the body
        (klass, first), batch = interactive.result(), [f.result() for f in batch]
    assert klass == "interactive" and {k for k, _ in batch} == {"batch"}
    waiting = [events for _, events in batch if events["prefill_scheduled"] > first["prefill_queued"]]
    assert waiting, "no batch prompt was still waiting when the interactive one arrived"
    assert all(first["prefill_scheduled"] <= events["prefill_scheduled"] + 0.05 for events in waiting), (first, waiting)


def _batch_stream(base_url: str, prompt: list[int], pd_class: str = "batch",
                  max_tokens: int = 200) -> tuple[httpx.Response, float, float]:
    """A long stream read to its end: the response (its body read), when its headers came (the ingress sends them
    once the request has a slot) and when it ended."""
    with httpx.stream("POST", base_url + "/v1/completions", timeout=120, headers={"x-pd-class": pd_class}, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as response:
        started = time.time()
        response.read()
    return response, started, time.time()


@contextlib.contextmanager
def _ingress(app, name: str, ingress: dict):
    """A second ingress on the shared app's engines, with its own ingress config, at /<name>."""
    from ray import serve

    from app.builder import ingress_options
    from app.config import PDAppConfig
    from app.ingress.server import OpenAIIngress

    config = PDAppConfig.model_validate({**app_config(), "ingress": ingress})
    serve.run(OpenAIIngress.options(name=f"Ingress-{name}", **ingress_options(config)).bind(
        app.handles["prefill"], app.handles["decode"], config), name=name, route_prefix=f"/{name}")
    try:
        yield app.base_url + f"/{name}"
    finally:
        serve.delete(name)


def _prompt(i: int, length: int = 64) -> list[int]:
    return [(i * 17 + k) % 3000 + 3 for k in range(length)]


def test_batch_past_its_share_waits_for_a_slot_while_an_interactive_request_runs_at_once(app):
    share = app_config()["decode"]["engine_kwargs"]["max_num_seqs"] // 2  # batch's max_share of one ingress's slots
    burst = share + 8
    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        batch = [pool.submit(_batch_stream, app.base_url, _prompt(i)) for i in range(burst)]
        time.sleep(1.0)  # the whole burst has arrived; 200 tokens take several seconds to stream
        klass, _ = _timed(app.base_url, [5] * 64, {"x-pd-class": "interactive"})
        interactive_done = time.time()
        answers = [f.result() for f in batch]
    assert [r.status_code for r, _, _ in answers] == [200] * burst
    started = sorted(started for _, started, _ in answers)
    first_ended = min(ended for _, _, ended in answers)
    # `share` streams started at once; the rest waited at the ingress until batch streams ended, while the
    # interactive request was served at once.
    assert started[share - 1] < interactive_done < started[share], (started, interactive_done)
    assert started[share] > first_ended - 1.0 and klass == "interactive", (started, first_ended)
    loads = app.wait_until_idle(timeout_s=60)
    assert all(load["kv_cache_usage"] == 0 and load["running"] == 0 for load in loads.values()), loads


def test_a_full_queue_turns_away_waiting_batch_for_an_interactive_request_with_429_and_retry_after(app):
    """An ingress of one slot and a queue of one: a batch stream runs, a second batch request waits, and an
    interactive request arriving then takes the waiting one's place (429, Retry-After: 1), runs once the first
    ends; one more request of either class finds nothing less urgent waiting and is turned away itself.
    Serve may hold 8 here and queue 8 (rather than 3x the one slot): a turned-away request still counts at Serve
    until its answer is out, and this test is about the ingress's answers, not Serve's 503 (the next test)."""
    ingress = {"slots": 1, "deployment_config": {"max_ongoing_requests": 8, "max_queued_requests": 8}}
    with _ingress(app, "one-slot", ingress) as url, concurrent.futures.ThreadPoolExecutor(5) as pool:
        running = pool.submit(_batch_stream, url, _prompt(1), max_tokens=600)  # alone, 4 s or more here
        time.sleep(0.3)
        waiting = pool.submit(_batch_stream, url, _prompt(2))
        time.sleep(0.3)
        interactive = pool.submit(_batch_stream, url, _prompt(3), "interactive")
        time.sleep(0.3)
        late = [pool.submit(_batch_stream, url, _prompt(4 + i), pd_class) for i, pd_class in
                enumerate(("batch", "interactive"))]
        answers = [f.result() for f in (running, waiting, interactive, *late)]
    assert [r.status_code for r, _, _ in answers] == [200, 429, 200, 429, 429], [r.text for r, _, _ in answers]
    for response, _, _ in answers[1:2] + answers[3:]:
        assert response.headers["retry-after"] == "1" and response.json()["error"]["code"] == "queue_full"
    (_, _, first_ended), (_, interactive_started, _) = answers[0], answers[2]
    assert interactive_started > first_ended - 0.5  # it waited for the one slot
    loads = app.wait_until_idle(timeout_s=60)
    assert all(load["kv_cache_usage"] == 0 and load["running"] == 0 for load in loads.values()), loads


def test_an_interactive_request_missing_its_ttft_cuts_batchs_share_until_batch_requests_meet_theirs(app):
    """An interactive stream promised its first token within 1 ms misses it: the ingress halves batch's share of
    its 4 slots (2) to one, so of three batch streams sent while it runs, one runs and two wait; once that one ends
    having met its objectives, batch's share grows back to two and both start."""
    classes = {name: c.model_dump() for name, c in default_classes().items()}
    classes["interactive"]["ttft_slo_ms"] = 1
    with _ingress(app, "strict", {"slots": 4, "classes": classes}) as url, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        interactive = pool.submit(_batch_stream, url, _prompt(1), "interactive", max_tokens=600)  # 4 s or more
        time.sleep(1.0)  # its first token is out, late
        batch = [pool.submit(_batch_stream, url, _prompt(2 + i), max_tokens=50) for i in range(3)]
        answers = [f.result() for f in batch]
        interactive_ended = interactive.result()[2]
    assert [r.status_code for r, _, _ in answers] == [200] * 3, [r.text for r, _, _ in answers]
    starts, first_ended = sorted(started for _, started, _ in answers), min(ended for _, _, ended in answers)
    assert starts[1] > first_ended - 0.5 and abs(starts[2] - starts[1]) < 0.5, (starts, first_ended)
    assert interactive_ended > starts[2]  # still running: the share grew back, not made whole by an idle ingress


def test_past_the_ingress_and_its_queue_serve_answers_503_with_retry_after(app):
    """Serve itself holding one request at the ingress and queueing one: a third request in flight at once is
    refused by Serve at once, saying when to come back."""
    ingress = {"slots": 1, "deployment_config": {"max_ongoing_requests": 1, "max_queued_requests": 1}}
    with _ingress(app, "one-held", ingress) as url, concurrent.futures.ThreadPoolExecutor(4) as pool:
        # The held request first: sent together, Serve counts each one queued until its router assigns it, and may
        # refuse all but one.
        held = pool.submit(_batch_stream, url, _prompt(0), max_tokens=600)  # 4 s or more here
        time.sleep(1.0)
        others = [pool.submit(_batch_stream, url, _prompt(i)) for i in range(1, 4)]
        answers = [f.result() for f in (held, *others)]
    codes = sorted(r.status_code for r, _, _ in answers)
    assert answers[0][0].status_code == 200 and codes.count(200) >= 2 and 503 in codes, codes
    assert all(r.headers.get("retry-after") == "1" for r, _, _ in answers if r.status_code == 503)


def test_an_unknown_service_class_gets_a_400_that_names_the_classes(app):
    response = httpx.post(app.base_url + "/v1/completions", headers={"x-pd-class": "gold"}, timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "x-pd-class" and "batch" in error["message"] and "interactive" in error["message"]


def test_the_apps_own_processes_stay_off_the_decode_engines_core(app):
    """cpu-tiny holds each engine replica, all its threads, and its engine-core process to core 0
    (stack_cpu_cores); vLLM binds each engine's worker process to the engine's own core."""
    for role, core in (("prefill", 0), ("decode", 1)):
        replica = psutil.Process(app.engine_call(role, "engine_info")["pid"])
        assert os.sched_getaffinity(replica.pid) == {0}
        engine = {process.name(): process for process in replica.children(recursive=True)}
        assert os.sched_getaffinity(engine["VLLM::EngineCore"].pid) == {0}
        assert os.sched_getaffinity(engine["VLLM::Worker"].pid) == {core}
        assert all(os.sched_getaffinity(thread.id) == {0} for thread in replica.threads())


def test_concurrent_clients_all_decode_together(app):
    """More clients than Serve's default of 5 ongoing requests: every stream has its first token before any
    stream ends, and the decode engine runs them all at once."""
    clients, tokens = 16, 150
    body = {"model": MODEL, "prompt": CASES[1].prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    first_token_at, finished_at, most_running = [], [], [0]
    done = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", app.base_url + "/v1/completions", json=body, timeout=120,
                          headers={"x-kv-transfer-mode": "pull"}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            first_token_at.append(time.monotonic())
            for _ in lines:
                pass
        finished_at.append(time.monotonic())

    def watch_decode() -> None:
        while not done.is_set():
            most_running[0] = max(most_running[0], app.engine_call("decode", "load")["running"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_decode)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda _: stream(), range(clients)))
    finally:
        done.set()
        watcher.join()
    assert len(first_token_at) == len(finished_at) == clients
    assert max(first_token_at) < min(finished_at)
    assert most_running[0] == clients


def test_long_case_spans_eight_kv_blocks(app, reference_outputs):
    block_size = app.engine_call("decode", "engine_info")["block_size"]
    assert len(reference_outputs["long"]["prompt_token_ids"]) >= 8 * block_size
    assert len(reference_outputs["chat-long"]["prompt_token_ids"]) >= 8 * block_size


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=["completion", "chat"])
def test_streaming_yields_the_same_text_as_non_streaming(app, case):
    path, body = _body(case)
    whole = httpx.post(app.base_url + path, json=body, timeout=120).json()
    assert _stream_text(app.base_url, path, body) == _text_of(whole["choices"][0])


def test_openai_client_chat_completion(app, reference_outputs):
    client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="unused")
    case = CASES[3]
    completion = client.chat.completions.create(
        model=MODEL, messages=list(case.messages), max_tokens=case.max_tokens, temperature=0
    )
    assert completion.choices[0].message.content == reference_outputs[case.name]["text"]
    assert [m.id for m in client.models.list()] == [MODEL]


def test_health_reports_both_engines_ready(app):
    health = httpx.get(app.base_url + "/health", timeout=30)
    assert health.status_code == 200
    assert set(health.json()["load"]) == {"prefill", "decode"}


def test_each_engine_has_its_own_transfer_identity(app):
    prefill = app.engine_call("prefill", "transfer_identity")
    decode = app.engine_call("decode", "transfer_identity")
    assert prefill["engine_id"] != decode["engine_id"]
    assert (prefill["side_channel_host"], prefill["side_channel_port"]) != (
        decode["side_channel_host"], decode["side_channel_port"])
    assert app.engine_call("decode", "load").keys() == {"running", "waiting", "kv_cache_usage", "queued_prefill_tokens",
                                                         "decoding", "legs_taken", "at"}


def test_an_idle_engine_reports_the_same_load_until_its_load_changes(app):
    """Serve's controller passes a replica's report on to every router only when it changed."""
    reports = [app.engine_call("decode", "load")]
    deadline = time.monotonic() + 30  # whatever the tests before left running ends
    while time.monotonic() < deadline and (len(reports) < 2 or reports[-1] != reports[-2]):
        time.sleep(0.5)
        reports.append(app.engine_call("decode", "load"))
    assert reports[-1] == reports[-2], reports
    body = {"model": MODEL, "prompt": CASES[1].prompt, "max_tokens": 60, "ignore_eos": True}
    _stream_text(app.base_url, "/v1/completions", body)  # long enough for Serve to read the load while it runs
    time.sleep(1)
    assert app.engine_call("decode", "load")["at"] > reports[-1]["at"]


BAD_REQUESTS = {
    "malformed-json": ("/v1/completions", b'{"model": "tiny-qwen3", "prompt": ', 400),
    "not-an-object": ("/v1/completions", b"[1, 2]", 400),
    "missing-prompt": ("/v1/completions", {"model": MODEL}, 400),
    "missing-messages": ("/v1/chat/completions", {"model": MODEL}, 400),
    "unknown-model": ("/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404),
    "zero-max-tokens": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    "negative-max-tokens": ("/v1/chat/completions",
                            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400),
    "prompt-over-context": ("/v1/completions", {"model": MODEL, "prompt": [5] * 2100, "max_tokens": 4}, 400),
    "completion-over-context": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400),
    "token-out-of-vocab": ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400),
    "client-kv-transfer-params": ("/v1/completions", {"model": MODEL, "prompt": "hi", "kv_transfer_params": {
        "do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "evil"}}, 400),
    "bad-temperature": ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_request_gets_a_clear_4xx_and_the_app_keeps_serving(app, name):
    path, body, status = BAD_REQUESTS[name]
    if isinstance(body, bytes):
        response = httpx.post(app.base_url + path, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(app.base_url + path, json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"

    ok = httpx.post(app.base_url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "still there?", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_transfer_mode_is_chosen_per_request_and_reported(app, reference_outputs):
    case = CASES[1]
    path, body = _body(case)
    before = app.totals()
    local = httpx.post(app.base_url + path, json=body, headers={"x-kv-transfer-mode": "local"}, timeout=120)
    assert local.status_code == 200 and local.headers["x-kv-transfer-mode"] == "local"
    assert local.json()["choices"][0]["token_ids"] == reference_outputs[case.name]["token_ids"]
    assert local.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    default = httpx.post(app.base_url + path, json=body, timeout=120)
    assert default.headers["x-kv-transfer-mode"] == "pull"
    # The counters settle a moment after each response; the pull request's READ, counted after the local request's
    # own counts, is the fence: once it shows, everything local did shows too, and local moved no KV.
    grew = app.growth(before, app.wait_for_totals(lambda t: t["decode"]["kv_transfers"].get("pull_transfers", 0)
                                                  > before["decode"]["kv_transfers"].get("pull_transfers", 0)))
    assert grew["decode"]["transfers"] == grew["decode"]["pull_transfers"] == 1 and grew["prefill"]["transfers"] == 0
    assert grew["prefill"]["local_compute"] == len(reference_outputs[case.name]["prompt_token_ids"])  # pull's only

    unknown = httpx.post(app.base_url + path, json=body, headers={"x-kv-transfer-mode": "teleport"}, timeout=60)
    assert unknown.status_code == 400 and "teleport" in unknown.json()["error"]["message"]


def test_vllm_bench_serve_runs_against_the_app_unchanged(app, tmp_path):
    """vLLM's own serving benchmark drives the app as it would a vLLM server."""
    from app.tiny_model import build_tiny_model

    num_prompts = 6
    done = subprocess.run(
        [sys.executable, "-m", "bench.vllm_cli", "bench", "serve", "--base-url", app.base_url,
         "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(build_tiny_model()),
         "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
         "--num-prompts", str(num_prompts), "--save-result", "--result-dir", str(tmp_path),
         "--result-filename", "result.json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == num_prompts and result["total_output_tokens"] == num_prompts * 8
