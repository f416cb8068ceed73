"""The ingress deployment: OpenAI-compatible HTTP in front of the prefill and decode deployments."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import AsyncIterator, TypeVar

from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from transformers import AutoTokenizer

from app.config import PDAppConfig
from app.engine_protocol import EngineChunk, EngineRequest
from app.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseWriter,
    SamplingFields,
)
from app.request_flow import RequestFlow, UnsupportedMode
from app.tiny_model import resolve_model_source
from kv.config import TransferMode

logger = logging.getLogger("ray.serve")
MODE_HEADER = "x-kv-transfer-mode"
Body = TypeVar("Body", bound=SamplingFields)


async def _parse(request: Request, model: type[Body]) -> Body:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from e


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, config: PDAppConfig):
        self.model_id = config.model_id
        self.timeout_s = config.ingress.request_timeout_s
        self.flow = RequestFlow(prefill, decode, config.transfer)
        self.engines = {"prefill": prefill, "decode": decode}
        # The ingress tokenizes once, so both legs see exactly the same prompt tokens.
        self.tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_source(config.decode.model_loading_config.model_source)
        )
        self._max_model_len: int | None = None

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={APIError: self._api_error})

    @staticmethod
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def max_model_len(self) -> int:
        if self._max_model_len is None:
            self._max_model_len = (await self.engines["decode"].engine_info.remote())["max_model_len"]
        return self._max_model_len

    # -- routes --------------------------------------------------------------------------------------------------

    async def models(self, request: Request) -> JSONResponse:
        card = {"id": self.model_id, "object": "model", "owned_by": "pd-serve", "max_model_len": await self.max_model_len()}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> JSONResponse:
        """Ready when both engine deployments answer; Serve itself restarts replicas that fail their health checks."""
        try:
            async with asyncio.timeout(5):
                loads = {role: await handle.load.remote() for role, handle in self.engines.items()}
        except Exception as e:  # noqa: BLE001 -- any failure to reach an engine means not ready
            return JSONResponse({"status": "unavailable", "reason": repr(e)}, status_code=503)
        return JSONResponse({"status": "ok", "load": loads})

    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer.encode(body.prompt)
        else:
            prompt_ids = self._checked_token_ids(body.prompt)
        return await self._respond(request, body, prompt_ids, f"cmpl-{uuid.uuid4().hex}", chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return await self._respond(request, body, prompt_ids, f"chatcmpl-{uuid.uuid4().hex}", chat=True)

    # -- shared ----------------------------------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}`.",
                           param="model", code="model_not_found")

    def _checked_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in token_ids):
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
        return token_ids

    async def _checked_max_tokens(self, body: SamplingFields, num_prompt_tokens: int) -> int:
        limit = await self.max_model_len()
        requested = body.requested_max_tokens()
        room = limit - num_prompt_tokens
        if room < 1 or (requested is not None and requested > room):
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + (requested or 1)} tokens ({num_prompt_tokens} in the prompt, "
                f"{requested or 1} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens" if room >= 1 else "prompt",
                code="context_length_exceeded",
            )
        return requested or room

    def _mode(self, request: Request) -> TransferMode:
        try:
            return self.flow.choose_mode(request.headers.get(MODE_HEADER))
        except UnsupportedMode as e:
            raise APIError(400, str(e), param=MODE_HEADER) from e

    async def _respond(self, http_request: Request, body: SamplingFields, prompt_ids: list[int], request_id: str,
                       chat: bool) -> Response:
        mode = self._mode(http_request)
        max_tokens = await self._checked_max_tokens(body, len(prompt_ids))
        engine_request = EngineRequest(request_id, prompt_ids, body.sampling_params(max_tokens))
        writer = ResponseWriter(request_id, self.model_id, chat, body.return_token_ids)
        chunks = self.flow.stream(engine_request, mode)
        headers = {MODE_HEADER: mode}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse_stream(chunks, writer, include_usage), media_type="text/event-stream",
                                     headers=headers)
        try:
            async with asyncio.timeout(self.timeout_s):
                text, token_ids, finish_reason, cached = "", [], None, 0
                async for chunk in chunks:
                    text += chunk.text
                    token_ids += chunk.token_ids
                    finish_reason = chunk.finish_reason or finish_reason
                    cached = chunk.num_cached_tokens or cached
        except TimeoutError as e:
            raise APIError(504, f"request did not finish within {self.timeout_s} s", "timeout_error") from e
        except Exception as e:
            logger.exception("request %s failed", request_id)
            raise APIError(500, f"request failed: {e}", "server_error") from e
        result = writer.whole(text, token_ids, finish_reason, len(prompt_ids))
        result["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return JSONResponse(result, headers=headers)

    async def _sse_stream(self, chunks: AsyncIterator[EngineChunk], writer: ResponseWriter,
                          include_usage: bool) -> AsyncIterator[str]:
        completion_tokens, prompt_tokens = 0, 0
        try:
            async with asyncio.timeout(self.timeout_s):
                async for chunk in chunks:
                    completion_tokens += len(chunk.token_ids)
                    prompt_tokens = chunk.num_prompt_tokens or prompt_tokens
                    yield _sse(writer.chunk(chunk))
        except Exception as e:  # the status line is already sent: report the failure in the stream itself
            logger.exception("stream %s failed", writer.request_id)
            kind = "timeout_error" if isinstance(e, TimeoutError) else "server_error"
            yield _sse(APIError(500, f"request failed: {e!r}", kind).body())
        else:
            if include_usage:
                yield _sse(writer.usage_chunk(prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"

