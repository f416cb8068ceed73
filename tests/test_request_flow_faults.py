"""Leg failures injected at the Serve-handle seam: a push request whose prefill leg fails (a real prefill engine
cannot be made to fail on demand here), a leg no replica takes, and replicas whose engine is dead. The real replica
and engine kills are in test_replica_loss.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from vllm import SamplingParams

from app.engine.protocol import EngineChunk, EngineRequest, LegAccepted, PrefillResult, ReplicaUnavailable
from app.flow.replica_view import ROUTERS
from app.flow.request_flow import EngineFailed, LegUnavailable, RequestFlow
from app.flow.timeline import RequestTimeline
from kv.config import TransferConfig
from kv.transfer_params import MODE_KEY

IDENTITY = {"engine_id": "prefill-1", "side_channel_host": "127.0.0.1", "side_channel_port": 1, "tp_size": 1,
            "pp_size": 1}
LOCAL_ANSWER = [EngineChunk("a", [7]), EngineChunk("b", [8], finish_reason="length")]


class FakeStream:
    """What a streaming handle call returns: async iteration and cancel()."""

    def __init__(self, chunks):
        self._chunks = chunks
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self._chunks)

    def cancel(self):
        self.cancelled = True


async def prefill_that_dies():
    yield LegAccepted("prefill-a", IDENTITY)
    await asyncio.sleep(0.05)
    raise RuntimeError("prefill failed")


async def push_leg_waiting_for_a_write():
    yield LegAccepted("decode-a")
    await asyncio.Event().wait()  # only cancellation ends it


async def local_leg(replica="decode-a"):
    yield LegAccepted(replica)
    for chunk in LOCAL_ANSWER:
        yield chunk


class FakeHandle:
    app_name = "fault-test"

    def __init__(self, role: str):
        self.role, self.calls = role, []
        self.prefill, self.generate = self, self
        self.deployment_name = f"{role}-deployment"

    def options(self, **_):
        return self

    def remote(self, request: EngineRequest) -> FakeStream:
        self.calls.append(request)
        if self.role == "prefill":
            stream = FakeStream(prefill_that_dies())
        elif request.kv_transfer_params is None:
            stream = FakeStream(local_leg())
        else:
            stream = FakeStream(push_leg_waiting_for_a_write())
        self.calls[-1] = (request, stream)
        return stream


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_dead_prefill_ends_a_push_request_at_once(seeded, policy):
    prefill, decode = FakeHandle("prefill"), FakeHandle("decode")
    flow = RequestFlow(prefill, decode, TransferConfig(push_timeout_s=20, on_transfer_failure=policy,
                                                       seed_first_token=seeded), replica_wait_s=1)
    request = EngineRequest("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))

    async def run():
        return [chunk async for chunk in flow.stream(request, "push", RequestTimeline())]

    started = time.monotonic()
    if policy == "fail":
        with pytest.raises(EngineFailed, match="prefill failed"):
            asyncio.run(run())
    else:
        assert asyncio.run(run()) == LOCAL_ANSWER
    assert time.monotonic() - started < 2  # not push_timeout_s

    push_leg, push_stream = decode.calls[0]
    assert push_leg.kv_transfer_params[MODE_KEY] == "push" and push_stream.cancelled  # its blocks freed
    if policy == "recompute":
        local, _ = decode.calls[1]
        assert local.kv_transfer_params is None and local.prompt_token_ids == request.prompt_token_ids
    else:
        assert len(decode.calls) == 1


class Replicas:
    """What the flow reads of a deployment's router: the replicas a leg could go to, and those marked failed; and
    what it tells it: the legs each replica took."""

    populated = True

    def __init__(self, *replicas: str):
        self.replicas, self.failed = set(replicas), set()
        self.legs_sent: list[tuple[str, int]] = []

    def sent(self, replica: str, tokens_to_compute: int) -> None:
        self.legs_sent.append((replica, tokens_to_compute))

    def usable_replicas(self) -> set[str]:
        return self.replicas - self.failed

    def mark_failed(self, replica: str) -> None:
        self.failed.add(replica)


class ScriptedHandle(FakeHandle):
    """Each call takes the next of `legs`, a function that makes the leg's messages."""

    def __init__(self, role: str, legs):
        super().__init__(role)
        self.legs = iter(legs)

    def remote(self, request: EngineRequest) -> FakeStream:
        stream = FakeStream(next(self.legs)())
        self.calls.append((request, stream))
        return stream


async def dead_engine(replica: str):
    yield LegAccepted(replica)
    raise ReplicaUnavailable("decode", replica, "EngineCore died")


async def never_taken():
    await asyncio.Event().wait()  # Serve's router holding the leg: no replica can take it
    yield  # pragma: no cover


async def run_flow(flow: RequestFlow, mode: str, request: EngineRequest) -> list[EngineChunk]:
    return [chunk async for chunk in flow.stream(request, mode, RequestTimeline())]


LOCAL_REQUEST = EngineRequest("r2", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))


@pytest.fixture
def routers():
    """Stand-ins for the routers of the fake deployments, as the flow finds them."""
    replicas = {"prefill": Replicas("prefill-a"), "decode": Replicas("decode-a", "decode-b")}
    for role, view in replicas.items():
        ROUTERS[FakeHandle.app_name, f"{role}-deployment"] = view
    yield replicas
    for role in replicas:
        del ROUTERS[FakeHandle.app_name, f"{role}-deployment"]


def test_a_leg_no_replica_takes_fails_within_the_wait(routers):
    routers["decode"].replicas.clear()  # as after the only decode replica's actor died
    decode = ScriptedHandle("decode", [never_taken])
    flow = RequestFlow(FakeHandle("prefill"), decode, TransferConfig(), replica_wait_s=0.3)
    started = time.monotonic()
    with pytest.raises(LegUnavailable, match="no decode replica took it within 0.3 s"):
        asyncio.run(run_flow(flow, "local", LOCAL_REQUEST))
    assert time.monotonic() - started < 1 and decode.calls[0][1].cancelled  # no longer queued in Serve's router


def test_a_replica_whose_engine_died_is_passed_over_and_the_request_served_by_another(routers):
    decode = ScriptedHandle("decode", [lambda: dead_engine("decode-a"), lambda: local_leg("decode-b")])
    flow = RequestFlow(FakeHandle("prefill"), decode, TransferConfig(), replica_wait_s=1)
    assert asyncio.run(run_flow(flow, "local", LOCAL_REQUEST)) == LOCAL_ANSWER
    assert routers["decode"].failed == {"decode-a"} and len(decode.calls) == 2
    # Each replica that took the leg counts its prompt in its load until it reports it (app/flow/replica_view.py)
    assert routers["decode"].legs_sent == [("decode-a", 3), ("decode-b", 3)]


def test_without_another_replica_a_dead_engine_is_reported_as_unavailable(routers):
    routers["decode"].replicas.discard("decode-b")
    decode = ScriptedHandle("decode", [lambda: dead_engine("decode-a")])
    flow = RequestFlow(FakeHandle("prefill"), decode, TransferConfig(), replica_wait_s=1)
    with pytest.raises(LegUnavailable, match="the decode leg failed: the decode engine of replica decode-a is dead"):
        asyncio.run(run_flow(flow, "local", LOCAL_REQUEST))
    assert len(decode.calls) == 1 and flow.replicas.down(("decode",)) == ["decode"]


async def pull_prefill():
    yield LegAccepted("prefill-a")
    location = {"remote_block_ids": [[0]], "remote_engine_id": "prefill-1", "remote_request_id": "r3"}
    yield PrefillResult(location, EngineChunk("a", [7]))


def test_a_pull_decode_leg_goes_to_another_replica_after_the_first_token_was_sent(routers):
    """Prefill's KV stays leased until a decode engine READs it: a second decode replica can READ it afresh."""
    decode = ScriptedHandle("decode", [lambda: dead_engine("decode-a"), lambda: local_leg("decode-b")])
    flow = RequestFlow(ScriptedHandle("prefill", [pull_prefill]), decode, TransferConfig(), replica_wait_s=1)
    request = EngineRequest("r3", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    chunks = asyncio.run(run_flow(flow, "pull", request))
    assert [c.token_ids for c in chunks] == [[7], [7], [8]]  # the seeded token, then decode-b's answer
    (first_try, _), (second_try, _) = decode.calls
    assert first_try.kv_transfer_params == second_try.kv_transfer_params  # the same KV, read afresh
    # prefill computes the prompt; a decode leg that READs its KV computes none of it
    assert routers["prefill"].legs_sent == [("prefill-a", 3)]
    assert routers["decode"].legs_sent == [("decode-a", 0), ("decode-b", 0)]
