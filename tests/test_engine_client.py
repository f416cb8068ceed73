"""The legs' chunks as vLLM's serving code reads them (app/ingress/engine_client.py): pure assembly, no engines."""

from __future__ import annotations

import asyncio
import math

from vllm.logprobs import Logprob
from vllm.sampling_params import RequestOutputKind

from app.engine.protocol import EngineChunk
from app.ingress.engine_client import _request_outputs

PROMPT = {"prompt": "hi", "prompt_token_ids": [1, 2]}


def _step(token: int, logprob: float, other: int) -> dict[int, Logprob]:
    return {token: Logprob(logprob, rank=1), other: Logprob(logprob - 1.0, rank=2)}


# A seeded first token (prefill's, with its logprobs), then decode's two in one chunk and a finish.
CHUNKS = [
    EngineChunk(text="a", token_ids=[7], logprobs=[_step(7, -0.5, 8)]),
    EngineChunk(text="bc", token_ids=[9, 10], logprobs=[_step(9, -0.25, 8), _step(10, -1.0, 8)],
                num_cached_tokens=2),
    EngineChunk(text="", token_ids=[], logprobs=[], finish_reason="length"),
]


def _outputs(kind: RequestOutputKind, chunks: list[EngineChunk]) -> list:
    async def run():
        async def legs():
            for chunk in chunks:
                yield chunk
        return [output async for output in _request_outputs(legs(), "r", PROMPT, kind)]
    return asyncio.run(run())


def test_final_output_carries_every_tokens_logprobs_and_their_sum():
    [final] = _outputs(RequestOutputKind.FINAL_ONLY, CHUNKS)
    completion = final.outputs[0]
    assert completion.token_ids == [7, 9, 10] and completion.text == "abc" and final.finished
    assert [sorted(step) for step in completion.logprobs] == [[7, 8], [8, 9], [8, 10]]
    assert math.isclose(completion.cumulative_logprob, -1.75) and final.num_cached_tokens == 2


def test_delta_outputs_carry_each_chunks_own_logprobs():
    deltas = _outputs(RequestOutputKind.DELTA, CHUNKS)
    assert [len(d.outputs[0].logprobs) for d in deltas] == [1, 2, 0]
    assert [d.outputs[0].cumulative_logprob for d in deltas] == [-0.5, -1.75, -1.75]


def test_without_logprobs_asked_there_are_none():
    chunks = [EngineChunk(text="a", token_ids=[7]), EngineChunk(text="", token_ids=[], finish_reason="stop")]
    [final] = _outputs(RequestOutputKind.FINAL_ONLY, chunks)
    assert final.outputs[0].logprobs is None and final.outputs[0].cumulative_logprob is None
