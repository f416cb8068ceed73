"""How one request travels through the engines: which legs run, in what order, with which transfer parameters."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.engine_protocol import EngineChunk, EngineRequest, PrefillResult
from kv.config import TransferConfig, TransferMode
from kv.transfer_params import new_transfer_id, prefill_params, pull_decode_params, push_decode_params


class UnsupportedMode(ValueError):
    pass


class EngineFailed(RuntimeError):
    """The decode engine ended the request with an error: its KV did not arrive (and the configured failure policy
    is to fail), or the engine failed it otherwise."""


class RequestFlow:
    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, transfer: TransferConfig):
        self.prefill = prefill.options(stream=True)
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
        if mode == "push":
            return self._push(request)
        if mode == "pull":
            return self._pull(request)
        return self._decode(request)

    async def _decode(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        stream = self.decode.generate.remote(request)
        try:
            async for chunk in stream:
                if chunk.finish_reason == "error":
                    raise EngineFailed(f"decode failed request {request.request_id} (e.g. its KV transfer failed)")
                yield chunk
        finally:
            stream.cancel()  # a no-op once finished; otherwise (client gone) decode aborts and frees its blocks

    def _prefill_leg(self, request: EngineRequest, mode: TransferMode, transfer_id: str) -> DeploymentResponseGenerator:
        leg = EngineRequest(request.request_id, request.prompt_token_ids, request.sampling_params,
                            prefill_params(mode, transfer_id))
        return self.prefill.prefill.remote(leg)

    async def _pull(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Prefill first; the decode replica is chosen only once prefill is done (late binding), then it READs."""
        prefill = self._prefill_leg(request, "pull", new_transfer_id())
        try:
            result: PrefillResult = [item async for item in prefill][-1]
        finally:
            prefill.cancel()
        decode_leg = EngineRequest(request.request_id, request.prompt_token_ids, request.sampling_params,
                                   pull_decode_params(result.kv_transfer_params))
        async for chunk in self._decode(decode_leg):
            yield chunk

    async def _push(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Both legs at once: as soon as the prefill replica is known, decode allocates blocks and registers them
        with it under a fresh transfer id, while prefill computes; prefill WRITEs the KV the moment it finishes."""
        transfer_id = new_transfer_id()
        prefill = self._prefill_leg(request, "push", transfer_id)
        finish_prefill = None
        try:
            prefill_identity = await prefill.__anext__()
            finish_prefill = asyncio.ensure_future(self._drain(prefill))
            decode_leg = EngineRequest(request.request_id, request.prompt_token_ids, request.sampling_params,
                                       push_decode_params(transfer_id, prefill_identity))
            async for chunk in self._decode(decode_leg):
                yield chunk
            await finish_prefill  # surfaces a prefill failure even if decode recovered by recomputing
        finally:
            prefill.cancel()
            if finish_prefill is not None:
                finish_prefill.cancel()

    @staticmethod
    async def _drain(stream: DeploymentResponseGenerator) -> None:
        async for _ in stream:
            pass
