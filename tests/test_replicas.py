"""Several replicas per leg, routed by Serve's request router on the load engines report (app/flow/routing.py): the
1P2D preset's decode side (two decode replicas sharing core 1), with a second prefill replica for push pairing.
Real engines and transfers; the app runs beside the session's, in front of engines of its own. Last, one decode
replica is killed and the other serves every request after."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest
import yaml

from bench.systems import serve_actor_pids
from conftest import CASES, LEASE_S, PUSH_TIMEOUT_S, ROOT, own_app

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
NAME = "pd-nxm"


@pytest.fixture(scope="module")
def url(app):
    raw = yaml.safe_load((ROOT / "configs" / "cpu-1p2d.yaml").read_text())
    raw["transfer"].update(lease_s=LEASE_S, push_timeout_s=PUSH_TIMEOUT_S)
    raw["prefill"] = {**raw["prefill"], "deployment_config": {"num_replicas": 2}, "cpu_cores": ["0", "0"]}
    with own_app(app, raw, NAME) as url:
        yield url


def complete(url: str, mode: str, case) -> dict:
    body = {"model": MODEL, "prompt": case.prompt, "max_tokens": case.max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120,
                          headers={"x-kv-transfer-mode": mode, "x-pd-timings": "1"})
    assert response.status_code == 200, response.text
    return response.json()


def transferred_whole_prompt(result: dict) -> bool:
    usage = result["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


def test_decode_legs_go_to_the_replica_that_is_not_busy(url):
    busy_body = {"model": MODEL, "prompt": CASES[0].prompt, "max_tokens": 800, "ignore_eos": True, "temperature": 0,
                 "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=busy_body, timeout=300,
                      headers={"x-kv-transfer-mode": "local", "x-pd-timings": "1"}) as busy:
        events = busy.iter_lines()
        while not next(events).startswith("data: {"):
            pass  # decoding on one of the two decode replicas
        served = {mode: [complete(url, mode, CASES[1]) for _ in range(3)] for mode in ("pull", "local")}
        last = [json.loads(line[6:]) for line in events if line.startswith("data: {")][-1]
    busy_replica = last["pd_timings"]["replicas"]["decode"]
    chosen = {result["pd_timings"]["replicas"]["decode"] for results in served.values() for result in results}
    assert len(chosen) == 1 and busy_replica not in chosen, (busy_replica, chosen)
    # pull's KV crossed to the engine that served it, which computed none of the prompt itself
    assert all(transferred_whole_prompt(result) for result in served["pull"])


def test_push_registrations_reach_the_prefill_replica_that_computes(url):
    """Decode registers with the prefill replica that took the prefill leg (its first answer names it): with two
    prefill replicas, a registration sent anywhere else would get no WRITE and fail the request at its deadline."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: complete(url, "push", CASES[1]), range(8)))
    assert all(transferred_whole_prompt(result) for result in results)
    assert len({result["pd_timings"]["replicas"]["prefill"] for result in results}) == 2  # both prefill replicas
    assert all(result["choices"][0]["finish_reason"] == "length" for result in results)


def test_after_a_decode_replica_is_killed_requests_are_served_by_the_other(url):
    """Runs last here: it leaves one decode replica dead (Serve replaces it after the module)."""
    decode_pids = serve_actor_pids(f"SERVE_REPLICA::{NAME}#DecodeServer#")
    victim, victim_pid = sorted(decode_pids.items())[0]
    os.kill(victim_pid, signal.SIGKILL)
    served = []
    for mode in ("pull", "push", "local") * 2:
        started = time.monotonic()
        result = complete(url, mode, CASES[1])
        # Not held until Serve replaces the victim (a minute or more): at most a leg's wait for the dead replica
        # (replica_wait_s, 1 s) and the request itself; up to 2.5 s seen under CI's load.
        assert time.monotonic() - started < 10, mode
        served.append(result["pd_timings"]["replicas"]["decode"])
        assert mode == "local" or transferred_whole_prompt(result)
    assert victim.rsplit("#", 1)[1] not in served, served
