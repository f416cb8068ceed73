"""The dual-mode connector on one real prefill/decode pair: push and pull side by side, both arrival orders of a
push, aborts, leases and timeouts. Real engines, real NIXL."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import Counter

import httpx
import pytest
from vllm import SamplingParams

from app.builder import engine_deployment
from app.config import PDAppConfig
from app.engine.protocol import EngineChunk, EngineRequest, LegAccepted, PrefillResult
from app.engine.server import DecodeServer
from conftest import CASES, LEASE_S, PUSH_TIMEOUT_S, app_config, counter_growth, prompt_token_ids, wait_until
from kv.transfer_params import new_transfer_id, prefill_params, pull_decode_params, push_decode_params

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
IDLE_WITHIN_S = LEASE_S + PUSH_TIMEOUT_S + 10


def _complete(app, case, mode: str) -> dict:
    body = {"model": MODEL, "max_tokens": case.max_tokens, "temperature": 0, "return_token_ids": True}
    if case.prompt is not None:
        path, body = "/v1/completions", {**body, "prompt": case.prompt}
    else:
        path, body = "/v1/chat/completions", {**body, "messages": list(case.messages)}
    response = httpx.post(app.base_url + path, json=body, headers={"x-kv-transfer-mode": mode}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["x-kv-transfer-mode"] == mode
    return response.json()


def test_interleaved_concurrent_push_and_pull_match_the_colocated_engine(app, reference_outputs):
    jobs = [(case, mode) for case in CASES for mode in ("push", "pull")] * 2
    before = app.totals()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda job: _complete(app, *job), jobs))

    for (case, mode), result in zip(jobs, results):
        reference = reference_outputs[case.name]
        assert result["choices"][0]["token_ids"] == reference["token_ids"], (case.name, mode)
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == len(reference["prompt_token_ids"])

    pushes = sum(1 for _, mode in jobs if mode == "push")
    after = app.wait_for_totals(lambda t: t["prefill"]["kv_transfers"].get("push_transfers", 0)
                                >= before["prefill"]["kv_transfers"].get("push_transfers", 0) + pushes)
    grew = app.growth(before, after)
    prompt_tokens = sum(len(reference_outputs[case.name]["prompt_token_ids"]) for case, _ in jobs)
    assert grew["prefill"]["push_transfers"] == pushes and grew["prefill"]["pull_transfers"] == 0
    assert grew["decode"]["pull_transfers"] == len(jobs) - pushes and grew["decode"]["push_transfers"] == 0
    assert grew["decode"]["external_kv_transfer"] == prompt_tokens
    assert grew["decode"]["local_compute"] == len(jobs) - pushes  # each seeded pull computes its first token only
    assert app.wait_until_idle(IDLE_WITHIN_S)["decode"]["kv_cache_usage"] == 0


# -- push arrival orders, driven leg by leg through the engine deployments ----------------------------------------

def _legs(app, tokenizer, case):
    transfer_id = new_transfer_id()
    ids = prompt_token_ids(tokenizer, case)
    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens)
    identity = app.engine_call("prefill", "transfer_identity")
    request_id = f"order-{transfer_id}"
    prefill = EngineRequest(request_id, ids, params, prefill_params("push", transfer_id))
    decode = EngineRequest(request_id, ids, params, push_decode_params(transfer_id, identity, len(ids)))
    return prefill, decode


def _after_acceptance(stream) -> list:
    """A leg's messages after the replica's acknowledgement, which every leg sends first."""
    accepted, *messages = list(stream)
    assert isinstance(accepted, LegAccepted), accepted
    return messages


def _prefill(app, leg) -> list[PrefillResult]:
    return _after_acceptance(app.handles["prefill"].options(stream=True).prefill.remote(leg))


def _decode_chunks(handle, leg) -> list[EngineChunk]:
    return _after_acceptance(handle.options(stream=True).generate.remote(leg))


def _run_decode(app, leg) -> list[int]:
    return [t for chunk in _decode_chunks(app.handles["decode"], leg) for t in chunk.token_ids]


def test_push_with_decode_registering_first(app, tokenizer, reference_outputs):
    case = CASES[2]
    prefill_leg, decode_leg = _legs(app, tokenizer, case)
    before = app.totals()
    decoded: list[int] = []
    decode = threading.Thread(target=lambda: decoded.extend(_run_decode(app, decode_leg)))
    decode.start()
    # Decode allocates and sends its registration within milliseconds; prefill starts well after that (and well
    # inside the push timeout). An idle prefill engine reads the registration when it starts working.
    time.sleep(PUSH_TIMEOUT_S / 3)
    _prefill(app, prefill_leg)
    decode.join(timeout=60)
    assert decoded == reference_outputs[case.name]["token_ids"]
    grew = app.growth(before, app.wait_for_totals(
        lambda t: t["prefill"]["kv_transfers"].get("push_transfers", 0)
        > before["prefill"]["kv_transfers"].get("push_transfers", 0)))
    # the registration was at prefill before prefill finished, and waited there for it
    assert grew["prefill"]["registrations_first"] == 1 and grew["prefill"]["push_transfers"] == 1


def test_push_with_prefill_finishing_first(app, tokenizer, reference_outputs):
    case = CASES[1]
    prefill_leg, decode_leg = _legs(app, tokenizer, case)
    before = app.totals()
    _prefill(app, prefill_leg)  # prefill is done and holds its blocks under lease before decode even starts
    assert app.loads()["prefill"]["kv_cache_usage"] > 0
    assert _run_decode(app, decode_leg) == reference_outputs[case.name]["token_ids"]
    grew = app.growth(before, app.wait_for_totals(
        lambda t: t["prefill"]["kv_transfers"].get("push_transfers", 0)
        > before["prefill"]["kv_transfers"].get("push_transfers", 0)))
    assert grew["prefill"]["registrations_first"] == 0 and grew["prefill"]["push_transfers"] == 1
    assert grew["decode"]["external_kv_transfer"] == len(prefill_leg.prompt_token_ids)


def _timed_push(app, prompt: list[int]) -> dict[str, float]:
    """A push request's events on the wall clock (each from its arrival, which is taken as when it was sent)."""
    sent = time.time()
    response = httpx.post(app.base_url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        headers={"x-kv-transfer-mode": "push", "x-pd-timings": "1"})
    assert response.status_code == 200, response.text
    return {event: sent + ms / 1e3 for event, ms in response.json()["pd_timings"]["events_ms"].items()}


def _two_pushes_in_turn(app, prompt: list[int]) -> tuple[dict[str, float], dict[str, float]]:
    """Two push requests, the second sent while prefill computes the first."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_timed_push, app, prompt)
        time.sleep(0.1)
        second = pool.submit(_timed_push, app, prompt[::-1])
        return first.result(), second.result()


def test_push_kv_crosses_while_prefill_computes_the_next_prompt(app):
    """A finished push request's WRITE must start and end while the prefill engine computes its next prompt, not
    after it: on a CPU a step's forward pass returns only when done, and vLLM started a step's transfers after it."""
    before = app.totals()
    # Precondition: the second prompt queued during the first's step and most of it was computed in a later one.
    # Prefill is chunked (2,048 tokens a step), so when the engine picks up the first late, the second's head shares
    # its step and little is left to compute after it: then a new pair is sent (new prompts: none is in a prefix cache).
    for attempt in range(3):
        prompt = [(7 * i + 1009 * attempt) % 3000 + 3 for i in range(1900)]  # ~0.4 s of prefill; max_model_len 2048
        a, b = _two_pushes_in_turn(app, prompt)
        if b["prefill_queued"] < a["prefill_first_token"] < b["prefill_first_token"] - 0.1:
            break
    else:
        raise AssertionError(f"prefill never computed the second prompt after the first: {a}, {b}")
    # The first request's KV was at decode (its decode leg scheduled) before prefill finished the next prompt.
    assert a["decode_scheduled"] < b["prefill_first_token"], (a, b)
    sent = 2 * (attempt + 1)
    grew = app.growth(before, app.wait_for_totals(
        lambda t: t["prefill"]["kv_transfers"].get("push_transfers", 0)
        >= before["prefill"]["kv_transfers"].get("push_transfers", 0) + sent))
    assert grew["prefill"]["push_transfers"] == sent and grew["decode"]["external_kv_transfer"] == sent * len(prompt)


# -- bounded lifetimes ---------------------------------------------------------------------------------------------

def test_untaken_prefill_result_is_freed_at_lease_expiry(app, tokenizer):
    transfer_id = new_transfer_id()
    leg = EngineRequest(f"untaken-{transfer_id}", prompt_token_ids(tokenizer, CASES[2]),
                        SamplingParams(temperature=0.0, max_tokens=4), prefill_params("pull", transfer_id))
    before = app.totals()
    _prefill(app, leg)
    assert app.loads()["prefill"]["kv_cache_usage"] > 0  # held for a decode engine that never comes
    loads = app.wait_until_idle(LEASE_S + 10)
    assert loads["prefill"]["kv_cache_usage"] == 0
    grew = app.growth(before, app.wait_for_totals(
        lambda t: t["prefill"]["kv_transfers"].get("kv_expired_reqs", 0)
        > before["prefill"]["kv_transfers"].get("kv_expired_reqs", 0)))
    assert grew["prefill"]["kv_expired_reqs"] == 1


def _late_pull_decode_leg(app, tokenizer, case) -> EngineRequest:
    """A pull decode leg that reaches decode only after prefill's lease is over, as one queued behind a full decode
    replica would: prefill may have freed (and reused) the blocks by then."""
    transfer_id = new_transfer_id()
    ids = prompt_token_ids(tokenizer, case)
    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens)
    prefill_leg = EngineRequest(f"late-{transfer_id}", ids, params, prefill_params("pull", transfer_id))
    result = _prefill(app, prefill_leg)[-1]
    time.sleep(LEASE_S)
    return EngineRequest(f"late-{transfer_id}", ids, params, pull_decode_params(result.kv_transfer_params))


def _refused_reads(before: dict, read) -> Counter:
    return counter_growth(before, wait_until(read, lambda t: t["kv_transfers"].get("pull_lease_expired", 0)
                                             > before["kv_transfers"].get("pull_lease_expired", 0), timeout_s=5))


def test_pull_decode_arriving_after_the_lease_fails_and_never_reads(app, tokenizer):
    decode_leg = _late_pull_decode_leg(app, tokenizer, CASES[1])
    before = app.totals()
    chunks = _decode_chunks(app.handles["decode"], decode_leg)
    assert chunks[-1].finish_reason == "error" and not any(c.token_ids for c in chunks)
    grew = _refused_reads(before["decode"], lambda: app.totals()["decode"])
    assert grew["pull_lease_expired"] == 1 and grew["pull_transfers"] == 0
    assert app.wait_until_idle(IDLE_WITHIN_S)["decode"]["kv_cache_usage"] == 0


def test_pull_decode_arriving_after_the_lease_recomputes(recompute_decode, app, tokenizer, reference_outputs):
    case = CASES[1]
    decode_leg = _late_pull_decode_leg(app, tokenizer, case)
    before = recompute_decode.transfer_totals.remote().result()
    chunks = _decode_chunks(recompute_decode, decode_leg)
    assert [t for c in chunks for t in c.token_ids] == reference_outputs[case.name]["token_ids"]
    grew = _refused_reads(before, lambda: recompute_decode.transfer_totals.remote().result())
    assert grew["pull_lease_expired"] == 1 and grew["pull_transfers"] == 0
    assert grew["local_compute"] == len(decode_leg.prompt_token_ids)


def test_push_registration_without_write_times_out_and_fails(app, tokenizer):
    # A decode leg registered with prefill under a transfer id that no prefill leg carries: no WRITE ever comes.
    _, decode_leg = _legs(app, tokenizer, CASES[1])
    before = app.totals()
    started = time.monotonic()
    chunks = _decode_chunks(app.handles["decode"], decode_leg)
    waited = time.monotonic() - started
    assert PUSH_TIMEOUT_S <= waited < PUSH_TIMEOUT_S + 10
    assert chunks[-1].finish_reason == "error" and not any(c.token_ids for c in chunks)
    grew = app.growth(before, app.wait_for_totals(lambda t: t["decode"]["kv_transfers"].get("push_timeouts", 0)
                                                  > before["decode"]["kv_transfers"].get("push_timeouts", 0)))
    assert grew["decode"]["push_timeouts"] == 1 and grew["decode"]["local_compute"] == 0
    assert app.wait_until_idle(IDLE_WITHIN_S)["decode"]["kv_cache_usage"] == 0


@pytest.fixture(scope="module")
def recompute_decode(app):
    """A second decode engine beside the app's, configured to recompute the prompt when its KV does not arrive."""
    from ray import serve

    config = PDAppConfig.model_validate(app_config(on_transfer_failure="recompute"))
    name = "decode-recompute"
    handle = serve.run(engine_deployment(DecodeServer, config.decode).bind(config.decode, config.transfer),
                       name=name, route_prefix=None)
    yield handle
    serve.delete(name)


def test_push_registration_without_write_times_out_and_recomputes(recompute_decode, app, tokenizer,
                                                                  reference_outputs):
    case = CASES[1]
    _, decode_leg = _legs(app, tokenizer, case)  # registers with the app's prefill, which never WRITEs
    before = recompute_decode.transfer_totals.remote().result()
    chunks = _decode_chunks(recompute_decode, decode_leg)
    assert [t for c in chunks for t in c.token_ids] == reference_outputs[case.name]["token_ids"]
    assert chunks[-1].finish_reason == "length"
    after = wait_until(lambda: recompute_decode.transfer_totals.remote().result(),
                       lambda t: t["kv_transfers"].get("push_timeouts", 0)
                       > before["kv_transfers"].get("push_timeouts", 0), timeout_s=5)
    grew = counter_growth(before, after)
    assert grew["push_timeouts"] == 1
    assert grew["local_compute"] == len(decode_leg.prompt_token_ids) and grew["external_kv_transfer"] == 0


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("when", ["before-transfer", "mid-stream"])
def test_client_abort_leaves_no_kv_blocks_in_use(app, mode, when):
    """The client goes away before prefill is done, or after tokens started flowing: both legs are aborted and,
    once idle, neither engine holds a KV block (prefill's lease covers a result that decode never took)."""
    # 1,513 prompt tokens and 500 to decode: several seconds of decoding that only an abort cuts short.
    body = {"model": MODEL, "prompt": CASES[2].prompt, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", app.base_url + "/v1/completions", json=body,
                      headers={"x-kv-transfer-mode": mode}, timeout=60) as response:
        assert response.status_code == 200
        if when == "mid-stream":
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
    # The aborts reached the engines: nothing runs or waits well before the request could have finished.
    loads = app.wait_until_nothing_scheduled(timeout_s=2.0)
    assert all(l["running"] == l["waiting"] == 0 for l in loads.values()), loads
    # Blocks that may still be written or read wait for their push deadline or lease.
    loads = app.wait_until_idle(IDLE_WITHIN_S)
    idle = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "queued_prefill_tokens": 0, "decoding": 0}
    assert {role: {key: load[key] for key in idle} for role, load in loads.items()} == {"prefill": idle, "decode": idle}
    # and the pair still serves
    assert _complete(app, CASES[0], mode)["choices"][0]["finish_reason"] == "length"


def test_push_abandoned_while_waiting_for_its_write_frees_decode_at_once(app, tokenizer):
    """Decode registered its blocks with prefill, then its caller went away: decode withdraws the registration and
    frees the blocks on prefill's answer, long before its push deadline. Prefill, idle meanwhile, then gets the
    request after all: it must not WRITE into the blocks decode freed."""
    prefill_leg, decode_leg = _legs(app, tokenizer, CASES[2])
    before = app.totals()
    stream = app.handles["decode"].options(stream=True).generate.remote(decode_leg)
    assert wait_until(app.loads, lambda l: l["decode"]["kv_cache_usage"] > 0, timeout_s=10)["decode"]["kv_cache_usage"] > 0
    stream.cancel()
    cancelled = time.monotonic()
    loads = app.wait_until_idle(timeout_s=PUSH_TIMEOUT_S)
    assert loads["decode"]["kv_cache_usage"] == 0
    assert time.monotonic() - cancelled < PUSH_TIMEOUT_S / 4
    _prefill(app, prefill_leg)  # holds its blocks under lease: the withdrawn registration is gone
    app.wait_until_idle(LEASE_S + 10)
    grew = app.growth(before, app.wait_for_totals(
        lambda t: t["prefill"]["kv_transfers"].get("kv_expired_reqs", 0)
        > before["prefill"]["kv_transfers"].get("kv_expired_reqs", 0)))
    assert grew["prefill"]["push_withdrawn"] == 1 and grew["prefill"]["push_transfers"] == 0
    assert grew["decode"]["push_timeouts"] == 0 and grew["prefill"]["kv_expired_reqs"] == 1


def test_idle_engines_hold_no_transfer_state(app):
    """Last in this module, after its aborts, lease expiries and push timeouts: once the engines are idle, neither
    connector still tracks any request (kv/worker.py `pending_counts`). Registrations for push requests that prefill
    never finished (aborted, or made up by the tests above) are pruned at each step once past the write window: a
    request after that window is the step that does it."""
    app.wait_until_idle(IDLE_WITHIN_S)
    time.sleep(PUSH_TIMEOUT_S)
    _complete(app, CASES[0], "pull")
    states = wait_until(lambda: {role: app.engine_call(role, "transfer_state") for role in ("prefill", "decode")},
                        lambda s: not any(n for state in s.values() for n in state.values()), timeout_s=IDLE_WITHIN_S)
    left = {role: {kind: n for kind, n in state.items() if n} for role, state in states.items()}
    assert not any(left.values()), left
