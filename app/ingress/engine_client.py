"""vLLM's `EngineClient` over the app's legs, so that vLLM's own OpenAI serving classes run on the ingress: they
render the prompt, call `generate()`, and build every response from the `RequestOutput`s it yields, which are
assembled here from the chunks of the request's legs (prefill's seeded first token, then decode's stream; or the
local leg's).

Which legs serve a prompt is the ingress's business (admission, the mode decision, retries): the route that calls
vLLM's serving code names it for the duration of the call (`served_by`), and `generate()` asks it for the prompt's
chunks."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, AsyncIterator, Callable, Iterator

from vllm.config import VllmConfig
from vllm.engine.protocol import EngineClient
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers import renderer_from_config
from vllm.sampling_params import RequestOutputKind, SamplingParams

from app.engine.protocol import EngineChunk

# The chunks of one prompt's legs: (prompt token ids, sampling params, engine priority) -> chunks.
Legs = Callable[[list[int], SamplingParams, int], AsyncIterator[EngineChunk]]
_LEGS: ContextVar[Legs] = ContextVar("legs")


@contextlib.contextmanager
def served_by(legs: Legs) -> Iterator[None]:
    """vLLM's serving calls made inside this block get their chunks from `legs`."""
    token = _LEGS.set(legs)
    try:
        yield
    finally:
        _LEGS.reset(token)


class LegsEngineClient(EngineClient):
    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config, self.model_config = vllm_config, vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = None  # read only by vLLM's own engine and its multimodal paths

    def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, *, priority: int = 0,
                 **_: Any) -> AsyncIterator[RequestOutput]:
        # What an engine checks as it takes a request is checked here, before any leg starts, so that what it would
        # refuse (a grammar that does not compile, more logprobs than it keeps) is the client's 400 (ValueError).
        sampling_params.verify(self.model_config, None, self.vllm_config.structured_outputs_config,
                               self.renderer.tokenizer)
        # The legs are read now, in the calling route's context: the generator may be iterated from another task.
        chunks = _LEGS.get()(list(prompt["prompt_token_ids"]), sampling_params, priority)
        return _request_outputs(chunks, request_id, prompt, sampling_params.output_kind)

    # -- what vLLM's serving classes may ask of an engine, answered for the legs -------------------------------

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False  # a dead leg is the flow's to retry or report, request by request

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("the engine client over the legs never dies")

    def encode(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("pooling models are not served")

    async def abort(self, request_id: str | Any) -> None:
        pass  # a request's legs are aborted when its chunks are closed (app/flow/request_flow.py)

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        pass  # the app's transfer parameters never come from a client

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        pass

    async def check_health(self) -> None:
        pass

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    async def stop_profile(self) -> None:
        raise NotImplementedError

    async def reset_mm_cache(self) -> None:
        pass

    async def reset_encoder_cache(self) -> None:
        pass

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        return False

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    async def release_kv_cache_memory(self) -> None:
        raise NotImplementedError

    async def wake_up(self, *args: Any, **kwargs: Any) -> bool:
        raise NotImplementedError

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, *args: Any) -> bool:
        return False

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    async def resume_generation(self) -> None:
        raise NotImplementedError

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        pass


async def _request_outputs(chunks: AsyncIterator[EngineChunk], request_id: str, prompt: dict,
                           kind: RequestOutputKind) -> AsyncIterator[RequestOutput]:
    """The chunks as vLLM's engine would give them for `kind`: DELTA each chunk's new tokens, CUMULATIVE all so far
    at each chunk, FINAL_ONLY all of them once. The request's finish and stop reasons are the chunk's that had
    them (a leg may pass on an empty chunk after its last). With logprobs asked for, each token's come with it
    (the seeded first token's from prefill), and the cumulative logprob is their sum over the sampled tokens, as
    vLLM's engine keeps it."""
    so_far = EngineChunk(text="", token_ids=[])
    cumulative = None
    try:
        async for chunk in chunks:
            so_far.text, so_far.token_ids = so_far.text + chunk.text, so_far.token_ids + chunk.token_ids
            so_far.num_cached_tokens = max(so_far.num_cached_tokens, chunk.num_cached_tokens)
            if chunk.logprobs is not None:
                so_far.logprobs = (so_far.logprobs or []) + chunk.logprobs
                cumulative = (cumulative or 0.0) + sum(
                    step[token].logprob for token, step in zip(chunk.token_ids, chunk.logprobs))
            if chunk.finish_reason is not None:
                so_far.finish_reason, so_far.stop_reason = chunk.finish_reason, chunk.stop_reason
            if kind == RequestOutputKind.DELTA:
                yield _output(request_id, prompt, chunk, so_far.num_cached_tokens, cumulative)
            elif kind == RequestOutputKind.CUMULATIVE:
                yield _output(request_id, prompt, so_far, so_far.num_cached_tokens, cumulative)
        if kind == RequestOutputKind.FINAL_ONLY:
            yield _output(request_id, prompt, so_far, so_far.num_cached_tokens, cumulative)
    finally:
        await chunks.aclose()


def _output(request_id: str, prompt: dict, chunk: EngineChunk, cached: int, cumulative_logprob: float | None
            ) -> RequestOutput:
    completion = CompletionOutput(index=0, text=chunk.text, token_ids=list(chunk.token_ids),
                                  cumulative_logprob=cumulative_logprob, logprobs=chunk.logprobs,
                                  finish_reason=chunk.finish_reason, stop_reason=chunk.stop_reason)
    return RequestOutput(request_id=request_id, prompt=prompt.get("prompt"),
                         prompt_token_ids=list(prompt["prompt_token_ids"]), prompt_logprobs=None,
                         outputs=[completion], finished=chunk.finish_reason is not None, num_cached_tokens=cached)
