"""A push request whose prefill leg dies: injected at the Serve-handle seam (a real prefill engine cannot be made to
fail on demand here). Decode must not wait out `push_timeout_s` for a WRITE that cannot come: the request fails at
once, or, with `on_transfer_failure: recompute`, decode computes the prompt itself and the answer stands."""

from __future__ import annotations

import asyncio
import time

import pytest
from vllm import SamplingParams

from app.engine_protocol import EngineChunk, EngineRequest
from app.request_flow import EngineFailed, RequestFlow
from app.timeline import RequestTimeline
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
    yield IDENTITY
    await asyncio.sleep(0.05)
    raise RuntimeError("prefill replica died")


async def push_leg_waiting_for_a_write():
    await asyncio.Event().wait()  # only cancellation ends it
    yield  # pragma: no cover


async def local_leg():
    for chunk in LOCAL_ANSWER:
        yield chunk


class FakeHandle:
    def __init__(self, role: str):
        self.role, self.calls = role, []
        self.prefill, self.generate = self, self

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
                                                       seed_first_token=seeded))
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
