"""A seeded push request, its legs scripted at the Serve-handle seam: decode samples the first token again, and its
copy is left out whole -- text, id and logprobs -- also when decode's replica read it late, merged with the next
token into one chunk (real engines rarely do that on demand; tests/test_logprobs.py has the real path)."""

from __future__ import annotations

import asyncio

from vllm import SamplingParams
from vllm.logprobs import Logprob

from app.engine.protocol import EngineChunk, EngineRequest, LegAccepted, PrefillResult
from app.flow.request_flow import RequestFlow
from kv.config import TransferConfig
from test_request_flow_faults import IDENTITY, ScriptedHandle, run_flow

PREFILL_STEP = {7: Logprob(-0.5, rank=1)}
DECODE_STEPS = [{7: Logprob(-0.5001, rank=1)}, {8: Logprob(-0.25, rank=1)}]


async def prefill_leg():
    yield LegAccepted("prefill-a", IDENTITY)
    yield PrefillResult({"remote_engine_id": "prefill-1"}, EngineChunk("a", [7], logprobs=[PREFILL_STEP]))


async def decode_leg_read_late():
    yield LegAccepted("decode-a")
    yield EngineChunk("ab", [7, 8], logprobs=DECODE_STEPS, finish_reason="length")


def test_decodes_copy_of_the_seeded_token_is_left_out_with_its_logprobs():
    flow = RequestFlow(ScriptedHandle("prefill", [prefill_leg]), ScriptedHandle("decode", [decode_leg_read_late]),
                       TransferConfig(seed_first_token=True), replica_wait_s=1)
    request = EngineRequest("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, logprobs=1))
    first, rest = asyncio.run(run_flow(flow, "push", request))
    assert (first.text, first.token_ids, first.logprobs) == ("a", [7], [PREFILL_STEP])
    assert (rest.text, rest.token_ids, rest.logprobs, rest.finish_reason) == ("b", [8], DECODE_STEPS[1:], "length")
