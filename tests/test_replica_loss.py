"""Engine replicas that die under the app, for real: a replica's process SIGKILLed by pid, or the engine core inside a
live replica. The app here has engines of its own, one prefill and one decode replica, with Serve's default
health-check period (10 s), so nothing relies on Serve noticing a death soon. Every request gets its answer, or a
503 with Retry-After, within 2 s; a stream in flight ends with an error event naming the failed leg; once Serve
has replaced the replica, requests are served again with their KV crossing. (Several replicas per leg, where the
requests after a kill go to the replica left: test_replicas.py.)"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from bench.systems import engine_processes, serve_actor_pids
from conftest import CASES, app_config, own_app

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
APP = "pd-loss"
ANSWER_WITHIN_S = 2.0
# A stream whose replica is killed under it ends with an error event in 0.1-0.2 s here, but once took 5.1 s in CI
# (the death noticed late, cause not yet found): this bound is there to catch a hang.
STREAM_ENDS_WITHIN_S = 10.0
RECOVERY_WITHIN_S = 240  # Serve sees the death within its health-check period, then a new engine starts
MODES = ("push", "pull", "local")


@pytest.fixture(scope="module")
def url(app):
    config = app_config()
    for role in ("prefill", "decode"):
        config[role] = {**config[role], "deployment_config": {"num_replicas": 1, "health_check_period_s": 10}}
    with own_app(app, config, APP) as url:
        yield url


def replica_pid(deployment: str) -> int:
    (pid,) = serve_actor_pids(f"SERVE_REPLICA::{APP}#{deployment}#").values()
    return pid


def engine_core_pid(deployment: str) -> int:
    (core,) = [p for p in engine_processes(replica_pid(deployment)) if p.name() == "VLLM::EngineCore"]
    return core.pid


def body(**fields) -> dict:
    return {"model": MODEL, "prompt": CASES[1].prompt, "max_tokens": 4, "temperature": 0, **fields}


def kill_during_stream(url: str, mode: str, pid: int) -> tuple[float, dict]:
    """A long stream; `pid` is SIGKILLed once its first token arrived. Returns how long the stream took to end
    after the kill, and its error event."""
    with httpx.stream("POST", url + "/v1/completions", json=body(max_tokens=1500, ignore_eos=True, stream=True),
                      headers={"x-kv-transfer-mode": mode}, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
        ended_after_s = time.monotonic() - killed_at
    errors = [event["error"] for event in events if "error" in event]
    assert errors, f"the stream ended without an error event: {events[-1:]}"
    assert "Traceback" not in errors[0]["message"] and len(errors[0]["message"]) < 200, errors[0]  # said, not dumped
    return ended_after_s, errors[0]


def answers_until_recovered(url: str, modes: tuple[str, ...], transferred: tuple[str, ...]) -> list[tuple]:
    """Requests in `modes`, one after another, until each mode has been served again after a 503 (or the time is
    up). Every one must be answered within ANSWER_WITHIN_S: 200, or 503 with Retry-After. Each answer is (mode
    asked, status, seconds, mode served, its reason)."""
    answers, deadline, recovered = [], time.monotonic() + RECOVERY_WITHIN_S, set()
    while recovered != set(modes) and time.monotonic() < deadline:
        for mode in modes:
            started = time.monotonic()
            response = httpx.post(url + "/v1/completions", json=body(), headers={"x-kv-transfer-mode": mode},
                                  timeout=30)
            took_s = time.monotonic() - started
            answers.append((mode, response.status_code, round(took_s, 2), response.headers.get("x-kv-transfer-mode"),
                            response.headers.get("x-kv-transfer-reason")))
            assert took_s < ANSWER_WITHIN_S, answers
            if response.status_code == 503:
                assert response.headers["retry-after"] and response.json()["error"]["code"] == "engine_unavailable"
                recovered.discard(mode)
                continue
            assert response.status_code == 200, (answers, response.text)
            if mode in transferred:  # served again: the whole prompt arrived on decode as KV
                usage = response.json()["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"], usage
            recovered.add(mode)
        time.sleep(0.5)
    assert recovered == set(modes), f"not served again within {RECOVERY_WITHIN_S} s: {answers[-6:]}"
    return answers


def test_the_only_decode_replica_killed_during_a_push_stream(url):
    ended_after_s, error = kill_during_stream(url, "push", replica_pid("DecodeServer"))
    assert ended_after_s < STREAM_ENDS_WITHIN_S and error["code"] == "engine_unavailable"
    assert "the decode leg failed" in error["message"], error
    answers = answers_until_recovered(url, MODES, transferred=("push", "pull"))
    assert {status for _, status, *_ in answers} == {503, 200}, answers


def test_the_only_prefill_replica_killed_under_pull_and_push_requests(url):
    """Requests in flight when prefill dies are answered (served, or 503) within 2 s of the kill; local requests
    need no prefill and are served throughout. Requests that leave the mode to the policy (`auto`) are served
    local, with that reason, once the ingress sees the prefill leg down; pull and push, named, get the 503."""
    def send(mode: str) -> tuple[int, float]:
        response = httpx.post(url + "/v1/completions", json=body(prompt=CASES[2].prompt),
                              headers={"x-kv-transfer-mode": mode}, timeout=30)
        return response.status_code, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        in_flight = [pool.submit(send, mode) for mode in ("pull", "push", "pull", "push")]
        time.sleep(0.2)  # their long prompts are being computed, one after another
        os.kill(replica_pid("PrefillServer"), signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = [future.result() for future in in_flight]
    assert all(status in (200, 503) and at - killed_at < ANSWER_WITHIN_S for status, at in outcomes), outcomes
    answers = answers_until_recovered(url, ("pull", "push", "local", "auto"), transferred=("push", "pull"))
    assert all(status == 200 for mode, status, *_ in answers if mode == "local"), answers
    assert {status for mode, status, *_ in answers if mode in ("pull", "push")} == {503, 200}, answers
    seen_down = [n for n, (mode, _, _, served, reason) in enumerate(answers)
                 if mode == "auto" and (served, reason) == ("local", "prefill_unavailable")]
    assert seen_down, answers
    last_refused = max(n for n, (mode, status, *_) in enumerate(answers) if mode in ("pull", "push") and status == 503)
    assert all(status == 200 for mode, status, *_ in answers[seen_down[0]:last_refused] if mode == "auto"), answers


def test_the_decode_engine_core_killed_inside_its_live_replica(url):
    replica = replica_pid("DecodeServer")
    ended_after_s, error = kill_during_stream(url, "local", engine_core_pid("DecodeServer"))
    assert ended_after_s < STREAM_ENDS_WITHIN_S and error["code"] == "engine_unavailable"
    assert "engine of replica" in error["message"] and "is dead" in error["message"], error
    answers = answers_until_recovered(url, MODES, transferred=("push", "pull"))
    assert {status for _, status, *_ in answers} == {503, 200}, answers
    assert replica_pid("DecodeServer") != replica  # Serve replaced the replica whose engine died
