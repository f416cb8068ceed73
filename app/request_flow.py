"""How one request travels through the engines: which legs run, in what order, with which transfer parameters."""

from __future__ import annotations

from typing import AsyncIterator

from ray.serve.handle import DeploymentHandle

from app.engine_protocol import EngineChunk, EngineRequest, PrefillResult
from kv.config import TransferMode
from kv.transfer_params import pull_decode_params, pull_prefill_params


class RequestFlow:
    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, default_mode: TransferMode):
        self.prefill = prefill
        self.decode = decode.options(stream=True)
        self.default_mode = default_mode

    def stream(self, request: EngineRequest, mode: TransferMode | None = None) -> AsyncIterator[EngineChunk]:
        mode = mode or self.default_mode
        if mode != "pull":
            raise NotImplementedError(f"transfer mode {mode!r} is not available with this connector")
        return self._pull(request)

    async def _pull(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Prefill first; the decode replica is chosen only once prefill is done (late binding), then it READs."""
        prefill_leg = EngineRequest(
            request.request_id, request.prompt_token_ids, request.sampling_params, pull_prefill_params()
        )
        result: PrefillResult = await self.prefill.prefill.remote(prefill_leg)
        decode_leg = EngineRequest(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            pull_decode_params(result.kv_transfer_params),
        )
        stream = self.decode.generate.remote(decode_leg)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()  # a no-op once finished; otherwise (client gone) decode aborts and frees its blocks
