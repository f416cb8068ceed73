"""How one request travels through the engines: which legs run, in what order, with which transfer parameters."""

from __future__ import annotations

from typing import AsyncIterator

from ray.serve.handle import DeploymentHandle

from app.engine_protocol import EngineChunk, EngineRequest, PrefillResult
from kv.config import TransferConfig, TransferMode
from kv.transfer_params import pull_decode_params, pull_prefill_params


class UnsupportedMode(ValueError):
    pass


class RequestFlow:
    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, transfer: TransferConfig):
        self.prefill = prefill
        self.decode = decode.options(stream=True)
        self.default_mode = transfer.default_mode
        self.modes = transfer.modes

    def choose_mode(self, requested: str | None) -> TransferMode:
        if requested is None:
            return self.default_mode
        if requested not in self.modes:
            raise UnsupportedMode(f"transfer mode {requested!r} is not served here; choose one of {list(self.modes)}")
        return requested

    def stream(self, request: EngineRequest, mode: TransferMode) -> AsyncIterator[EngineChunk]:
        if mode == "local":
            return self._decode(request)
        return self._pull(request)

    async def _decode(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        stream = self.decode.generate.remote(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()  # a no-op once finished; otherwise (client gone) decode aborts and frees its blocks

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
        async for chunk in self._decode(decode_leg):
            yield chunk
