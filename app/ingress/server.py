"""The ingress deployment: OpenAI-compatible HTTP in front of the prefill and decode deployments."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import logging
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from vllm import SamplingParams
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.exceptions import VLLMValidationError

from app.config import PDAppConfig, cpu_set, hold_process_to
from app.engine.protocol import EngineChunk, EngineRequest
from app.flow.first_token import can_seed
from app.flow.request_flow import LegUnavailable, RequestFlow, UnsupportedMode
from app.flow.timeline import RequestTimeline
from app.ingress.engine_client import served_by
from app.ingress.metrics import EventLoopLag, IngressMetrics
from app.ingress.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, validated
from app.ingress.serving import build_serving
from app.policy.admission import SHED, WAITING, ClassAdmission, Ticket
from app.policy.mode_policy import Decision, ModePolicy, Observation, PolicyConfig, RequestFeatures
from kv.config import POLICIES, TransferMode

logger = logging.getLogger("ray.serve")
MODE_HEADER = "x-kv-transfer-mode"
REASON_HEADER = "x-kv-transfer-reason"  # why the request took its mode (app/policy/mode_policy.py)
# A client that sends `x-pd-timings: 1` gets the request's timeline (app/flow/timeline.py) in the response.
TIMINGS_HEADER = "x-pd-timings"
# A client may ask for another interval between a stream's chunks than the configured one (app/config.py).
STREAM_INTERVAL_HEADER = "x-pd-stream-interval-ms"
# The request's service class (app/config.py ServiceClass); a gateway's header wins over the body's `pd_class`.
CLASS_HEADER = "x-pd-class"
# A replacement engine replica takes a minute or more to start; clients that honour Retry-After come back then.
RETRY_LATER = {"Retry-After": "10"}
# A request turned away from a full queue may find room as soon as any running request ends.
RETRY_SOON = {"Retry-After": "1"}


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with a 413 as soon as it is known to exceed `limit` bytes."""
    too_large = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def _refuse_constant(name: str) -> None:
    raise APIError(400, f"request body is not valid JSON: {name} is not a number")


async def _parse_object(request: Request, limit: int) -> dict:
    body = await _read_body(request, limit)
    try:
        raw = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError as e:
        raise APIError(400, "request body is nested too deeply") from e
    except ValueError as e:  # malformed JSON, invalid UTF-8, integers too long to convert
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise APIError(400, "request body must be a JSON object")
    return raw


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, config: PDAppConfig):
        if config.stack_cpu_cores is not None:
            hold_process_to(cpu_set(config.stack_cpu_cores))
        self.model_id = config.model_id
        self.timeout_s = config.ingress.request_timeout_s
        self.max_request_bytes = config.ingress.max_request_bytes
        self.stream_interval_ms = config.ingress.stream_interval_ms
        self.classes, self.default_class = config.ingress.classes, config.ingress.default_class
        self.admission = ClassAdmission(config.ingress_slots, config.ingress_slots, self.classes)
        self._woken: dict[Ticket, asyncio.Future] = {}  # waiting requests, each woken when it runs or is shed
        self._ttft_due: dict[Ticket, asyncio.TimerHandle] = {}  # each request's TTFT deadline, until it leaves
        self.api_key = _api_key(config.ingress.api_key_env)
        self.flow = RequestFlow(prefill, decode, config.transfer, config.ingress.replica_wait_s)
        self.policy = ModePolicy(PolicyConfig(
            policy=config.transfer.default_mode, modes=config.transfer.modes, priors=config.ingress.mode_policy,
            rule=config.ingress.threshold_rule, decode_chunk_tokens=config.decode.prefill_chunk_tokens,
            ttft_weight={name: c.ttft_weight for name, c in self.classes.items()}))
        self.engines = {"prefill": prefill, "decode": decode}
        self.metrics = IngressMetrics()
        # The ingress renders and tokenizes once (vLLM's renderer), so both legs see exactly the same prompt tokens.
        self.serving = build_serving(self.model_id, config.decode, config.ingress.chat)
        model_config = self.serving.client.model_config
        self.vocab_size, self.max_model_len = model_config.get_vocab_size(), model_config.max_model_len
        vocab = self.serving.client.renderer.tokenizer.get_vocab()
        self.max_prompt_chars = self.max_model_len * max(map(len, vocab))
        self.loop_lag = EventLoopLag(busy=lambda: self.metrics.in_flight > 0)

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={APIError: self._api_error})

    @staticmethod
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    # -- routes --------------------------------------------------------------------------------------------------

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse((await self.serving.models.show_available_models()).model_dump())

    async def health(self, request: Request) -> JSONResponse:
        """Ready when both engine deployments answer; Serve itself restarts replicas that fail their health checks."""
        replicas = self.flow.replicas.replicas()
        if down := self.flow.replicas.down(tuple(self.engines)):
            return JSONResponse({"status": "unavailable", "down": down, "replicas": replicas}, status_code=503,
                                headers=RETRY_LATER)
        try:
            async with asyncio.timeout(self.flow.replica_wait_s):
                loads = {role: await handle.load.remote() for role, handle in self.engines.items()}
        except Exception as e:  # noqa: BLE001 -- any failure to reach an engine means not ready
            reason = "an engine did not answer in time" if isinstance(e, TimeoutError) else f"an engine failed: {e}"
            return JSONResponse({"status": "unavailable", "reason": reason, "replicas": replicas}, status_code=503,
                                headers=RETRY_LATER)
        return JSONResponse({"status": "ok", "load": loads, "replicas": replicas})

    async def completions(self, request: Request) -> Response:
        return await self._served(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._served(request, chat=True)

    async def _served(self, request: Request, chat: bool) -> Response:
        timeline = RequestTimeline()  # it arrived: reading its body is part of its time to first token
        with self._counting_refusals():
            self._authorize(request)
            raw = await _parse_object(request, self.max_request_bytes)
        headers = request.headers
        legs, answer = await self._serve(raw, chat, headers.get(MODE_HEADER), headers.get(CLASS_HEADER),
                                         headers.get(STREAM_INTERVAL_HEADER),
                                         headers.get(TIMINGS_HEADER, "").lower() in ("1", "true"), timeline)
        if isinstance(answer, dict):
            return JSONResponse(answer, headers=legs.headers())
        return StreamingResponse(answer, media_type="text/event-stream", headers=legs.headers())

    async def _serve(self, raw: dict, chat: bool, mode: str | None, pd_class: str | None,
                     stream_interval: str | float | None, report_timings: bool, timeline: RequestTimeline
                     ) -> tuple[PromptLegs, dict | AsyncIterator[str]]:
        """The request answered by vLLM's own serving code over the legs (app/ingress/serving.py): its body read
        as vLLM's request model, its response built by vLLM -- the whole body, or the stream's events. A refusal
        by the ingress (its queue, a replica down, the mode or class asked for) raises APIError with its status:
        a stream is handed back only once its first event is known."""
        with self._counting_refusals():
            self._check_text_can_fit(raw.get("messages") if chat else raw.get("prompt"))
            body = validated(raw, chat)
            legs = PromptLegs(self, self._requested(mode), self._service_class(pd_class, raw.get("pd_class")),
                              self._stream_interval_s(stream_interval), report_timings, timeline)
            serving = self.serving.chat.create_chat_completion if chat else self.serving.completion.create_completion
            with served_by(legs):
                try:
                    result = await serving(body, None)
                except VLLMValidationError as e:  # vLLM's checks on the sampling parameters it derives
                    raise APIError(400, e.args[0], param=e.parameter) from e
                except (ValueError, TypeError) as e:  # what vLLM's preprocessing could not take, as its server says
                    raise APIError(400, str(e)) from e
            if legs.refusal is not None:
                raise legs.refusal
            if isinstance(result, ErrorResponse):
                error = result.error
                raise APIError(error.code, error.message,
                               "invalid_request_error" if error.code < 500 else "server_error", error.param)
            if not body.stream:
                return legs, {**result.model_dump(), **legs.timings()}
            first = await anext(result)
            if legs.refusal is not None:
                await result.aclose()
                raise legs.refusal
            return legs, _with_timings(first, result, legs)

    # -- Python handle API: for other Serve apps and Ray tasks (`serve.get_app_handle(...)`; README) ---------------

    async def event_loop_lag(self) -> dict[str, float]:
        """How late this replica's event loop ran due tasks while requests were in flight, since the last call
        (app/ingress/metrics.py EventLoopLag; bench/stack_cpu.py reads it). On the loop, like the sampling."""
        return self.loop_lag.summary()

    def transfer_modes(self) -> dict:
        """The modes this app serves and the one a request without a mode gets."""
        return {"modes": list(self.flow.modes), "default": self.flow.default_mode}

    def service_classes(self) -> dict:
        """The service classes a request may name, with their SLOs and priorities, and the default one."""
        return {"classes": {name: c.model_dump() for name, c in self.classes.items()}, "default": self.default_class}

    async def create(self, request: dict | CompletionRequest | ChatCompletionRequest, mode: str | None = None,
                     timings: bool = False, pd_class: str | None = None) -> dict:
        """The response body `POST /v1/completions` or `/v1/chat/completions` would return, for its request body or
        vLLM's request model (a body with `messages` is a chat request). `mode` picks the transfer mode as the
        `x-kv-transfer-mode` header does, `pd_class` the service class as `x-pd-class` does. Errors raise
        APIError, with the status HTTP would answer."""
        timeline, request = RequestTimeline(), _as_body(request)
        if request.get("stream"):
            raise APIError(400, "stream is true: call create_stream with handle.options(stream=True)",
                           param="stream")
        _, answer = await self._serve(request, "messages" in request, mode, pd_class, None, timings, timeline)
        return answer

    async def create_stream(self, request: dict | CompletionRequest | ChatCompletionRequest, mode: str | None = None,
                            timings: bool = False, stream_interval_ms: float | None = None,
                            pd_class: str | None = None) -> AsyncIterator[dict]:
        """The chunk bodies HTTP would stream (without the `data:` framing and `[DONE]`), through
        `handle.options(stream=True)`. A failure after the first chunk raises APIError from the stream. Cancelling
        the call aborts the request's legs. `stream_interval_ms` is the `x-pd-stream-interval-ms` header's,
        `pd_class` the `x-pd-class` header's."""
        timeline, body = RequestTimeline(), {**_as_body(request), "stream": True}
        _, events = await self._serve(body, "messages" in body, mode, pd_class, stream_interval_ms, timings,
                                      timeline)
        async for event in events:
            data = event.removeprefix("data: ").strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                raise APIError(error.get("code") or 500, error["message"], error.get("type", "server_error"),
                               error.get("param"))
            yield chunk

    # -- shared ----------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _counting_refusals(self):
        """A request refused before it starts is counted as such (app/ingress/metrics.py)."""
        try:
            yield
        except APIError as e:
            self.metrics.refused(e.status)
            raise

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)",
                           code="invalid_api_key")

    def _check_text_can_fit(self, prompt: Any) -> None:
        """No token spans more characters than the longest vocabulary entry, so a prompt of more characters than the
        context times that cannot fit: refused before anyone spends time tokenizing it (its JSON text counts,
        which is never shorter than the prompt)."""
        if prompt is None or isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return
        if len(json.dumps(prompt, ensure_ascii=False)) > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                           "cannot fit in it.", param="messages" if isinstance(prompt, list) else "prompt",
                           code="context_length_exceeded")

    def _check_vocabulary(self, prompt_ids: list[int]) -> None:
        """What vLLM's engine checks of a prompt before it takes it (its input processor), checked here: the legs
        hand the engines token ids."""
        if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) < self.vocab_size:
            raise APIError(400, f"prompt token ids must lie in [0, {self.vocab_size})", param="prompt")

    def _requested(self, requested: str | None) -> str | None:
        """The client's mode or policy (None: the configured one), if the legs it needs for sure have a replica that
        can take it (else a 503 at once, before anything that needs an engine: queued in Serve's router, the request
        would wait for a replacement replica, which takes a minute to start)."""
        try:
            mode = self.flow.requested_mode(requested)
        except UnsupportedMode as e:
            raise APIError(400, str(e), param=MODE_HEADER) from e
        named = self.flow.default_mode if mode is None else mode
        if down := self.flow.replicas.down(("decode",) if named in (*POLICIES, "local") else ("prefill", "decode")):
            raise _unavailable(f"no {' or '.join(down)} replica can take requests (Serve is replacing it)")
        return mode

    def _service_class(self, named: str | None, in_body: str | None) -> str:
        """The request's service class: the header's (or the handle argument's), else the body's, else the
        default."""
        name = named or in_body or self.default_class
        if name not in self.classes:
            raise APIError(400, f"unknown service class {name!r}; this app serves {sorted(self.classes)}",
                           param=CLASS_HEADER if named else "pd_class", code="unknown_service_class")
        return name

    def _decide(self, requested: str | None, prompt_ids: list[int], params,
                pd_class: str) -> Decision:
        """The mode policy's decision on this request, from the load the routers see now."""
        features = RequestFeatures(len(prompt_ids), params.max_tokens, requested, pd_class,
                                   seeded=self.flow.seed_first_token and can_seed(params, "pull"))
        decision = self.policy.decide(features, self.flow.replicas.snapshot())
        if decision.mode is None:
            raise _unavailable(f"no replica can take this request's legs ({decision.reason})")
        # The engine that computes the prompt: counted in its role's load from now, not once a replica takes it.
        self.flow.replicas.expect("decode" if decision.mode == "local" else "prefill", len(prompt_ids))
        return decision

    def _learn(self, admitted: Admitted) -> None:
        """A served request's timeline teaches the policy its costs (app/policy/mode_policy.py, CostModel.observe)."""
        seen = Observation.from_phases(admitted.mode, admitted.output.num_prompt_tokens, admitted.decision,
                                       admitted.output.timeline.phases())
        if seen is not None:
            self.policy.model.observe(seen)

    def _stream_interval_s(self, asked: str | float | None) -> float:
        """The interval between a stream's chunks that the client asked for (header or handle argument), checked;
        else the configured one."""
        if asked is None:
            return self.stream_interval_ms / 1e3
        try:
            ms = float(asked)
        except (TypeError, ValueError):
            ms = float("nan")
        if not 0 <= ms <= 1000:  # NaN included
            raise APIError(400, f"{STREAM_INTERVAL_HEADER} must be a number of milliseconds from 0 to 1000",
                           param=STREAM_INTERVAL_HEADER)
        return ms / 1e3

    async def _start(self, request_id: str, prompt_ids: list[int], params: SamplingParams, requested: str | None,
                     pd_class: str, stream_interval_s: float, report_timings: bool,
                     timeline: RequestTimeline) -> Admitted:
        """One prompt started on its legs, once the queue gives it a slot and the policy a mode."""
        engine_request = EngineRequest(request_id, prompt_ids, params, stream_interval_s=stream_interval_s,
                                       priority=self.classes[pd_class].priority)
        ticket = await self._slot(pd_class, timeline)
        try:
            decision = self._decide(requested, prompt_ids, params, pd_class)
        except BaseException:
            self._leave(ticket)
            raise
        timeline.decided(decision, pd_class)
        admitted = Admitted(
            request_id=request_id,
            chunks=self.flow.stream(engine_request, decision.mode, timeline),
            output=RequestOutput(len(prompt_ids), timeline, report_timings),
            mode=decision.mode,
            decision=decision,
            pd_class=pd_class,
            ticket=ticket,
        )
        # The slot is given back when the request ends (`_run`), or when its answer is dropped unread (on the
        # event loop, which owns the queue, whichever thread collects it).
        admitted.release_slot = weakref.finalize(admitted, asyncio.get_running_loop().call_soon_threadsafe,
                                                 self._leave, ticket)
        return admitted

    async def _slot(self, pd_class: str, timeline: RequestTimeline) -> Ticket:
        """A running slot for a request of `pd_class`, once the queue gives it one (app/policy/admission.py); a 429 with
        Retry-After if the queue turns it away, a 503 if no slot frees within the request timeout. From its
        arrival on, a request with no first token out by its class's TTFT objective is a miss, told to the queue
        then, whether it still waits or runs: the less urgent classes yield while it matters, not once the late
        token finally comes."""
        ticket, shed = self.admission.arrive(pd_class)
        self._wake(shed)
        due_in = timeline.events["arrival"] + self.classes[pd_class].ttft_slo_ms / 1e3 - time.time()
        self._ttft_due[ticket] = asyncio.get_running_loop().call_later(max(0.0, due_in), self._ttft_passed, ticket,
                                                                       timeline)
        if ticket.state == WAITING:
            self._woken[ticket] = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._woken[ticket]
            except TimeoutError:
                self.admission.judged(ticket, met=False)
                self._leave(ticket)
                raise APIError(503, f"no request slot freed within {self.timeout_s} s; retry shortly",
                               "service_unavailable", code="queue_timeout", headers=RETRY_SOON) from None
            except BaseException:  # the caller went away while it waited, or just as it was given a slot
                self._leave(ticket)
                raise
            finally:
                del self._woken[ticket]
        if ticket.state == SHED:
            self._forget_ttft(ticket)
            raise APIError(429, f"this server's queue is full of requests as urgent as class {pd_class!r} or more; "
                           "retry shortly", "rate_limit_error", code="queue_full", headers=RETRY_SOON)
        return ticket

    def _leave(self, ticket: Ticket) -> None:
        self._forget_ttft(ticket)
        self._wake(self.admission.leave(ticket))

    def _forget_ttft(self, ticket: Ticket) -> None:
        due = self._ttft_due.pop(ticket, None)  # None: it passed
        if due is not None:
            due.cancel()

    def _ttft_passed(self, ticket: Ticket, timeline: RequestTimeline) -> None:
        self._ttft_due.pop(ticket)
        if "first_token_sent" not in timeline.events:
            self.admission.judged(ticket, met=False)

    def _wake(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            woken = self._woken.get(ticket)
            if woken is not None and not woken.done():
                woken.set_result(None)

    async def _run(self, admitted: Admitted) -> AsyncIterator[EngineChunk]:
        """The request's chunks, recorded in its output: APIError 504 past the time limit, 500 if it fails. However
        this ends (finished, failed, timed out, the caller gone), the request's legs are aborted then."""
        outcome = "cancelled"  # unless it gets further than the caller did
        self.metrics.started(admitted.mode)
        self.loop_lag.watch()
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            while True:
                # The deadline is entered around each step, in the task that takes it: one stream's steps are taken
                # by different tasks (the route takes the first event, the response's task the rest), and a
                # timeout held across a yield would cancel whichever task entered it.
                async with asyncio.timeout_at(deadline):
                    chunk = await anext(admitted.chunks, None)
                if chunk is None:
                    break
                admitted.output.add(chunk)
                yield chunk
            outcome = "ok"
        except TimeoutError as e:
            outcome = "timeout"
            raise APIError(504, f"request did not finish within {self.timeout_s} s", "timeout_error") from e
        except LegUnavailable as e:
            outcome = "unavailable"
            raise _unavailable(str(e)) from e
        except Exception as e:
            outcome = "error"
            logger.exception("request %s failed", admitted.request_id)
            raise APIError(500, f"request failed: {e!r}", "server_error") from e
        finally:
            if outcome == "ok":
                self._judge(admitted)
                self.metrics.class_limits(self.admission.limits)
            admitted.release_slot()
            await admitted.chunks.aclose()
            self.metrics.finished(admitted.mode, admitted.decision.reason, admitted.pd_class, outcome,
                                  admitted.output.timeline, len(admitted.output.token_ids))
            if outcome == "ok":
                self._learn(admitted)

    def _judge(self, admitted: Admitted) -> None:
        """Tells the queue whether the request that ended met its class's objectives (ingress-seen), unless its
        TTFT deadline already told a miss (app/policy/admission.py cuts or grows the less urgent classes' shares)."""
        events = admitted.output.timeline.events
        if admitted.ticket.judged or "first_token_sent" not in events:
            return
        num_tokens = len(admitted.output.token_ids)
        tpot_s = (time.time() - events["first_token_sent"]) / (num_tokens - 1) if num_tokens > 1 else None
        ttft_s = events["first_token_sent"] - events["arrival"]
        self.admission.judged(admitted.ticket, met=self.classes[admitted.pd_class].met(ttft_s, tpot_s))


class PromptLegs:
    """One request's prompts, each served by the legs as vLLM's serving code asks for them (app/ingress/
    engine_client.py): its slot in the ingress's queue, its mode, its flow; and what its response needs of them --
    the mode headers, the timings, and a refusal, which must set the response's status."""

    def __init__(self, ingress: OpenAIIngress, requested: str | None, pd_class: str, stream_interval_s: float,
                 report_timings: bool, timeline: RequestTimeline):
        self.ingress, self.requested, self.pd_class = ingress, requested, pd_class
        self.stream_interval_s, self.report_timings, self.timeline = stream_interval_s, report_timings, timeline
        self.started: list[Admitted] = []
        self.refusal: APIError | None = None

    async def __call__(self, prompt_ids: list[int], params: SamplingParams, priority: int
                       ) -> AsyncIterator[EngineChunk]:
        try:
            self.ingress._check_vocabulary(prompt_ids)
            admitted = await self.ingress._start(f"leg-{uuid.uuid4().hex}", prompt_ids, params, self.requested,
                                                 self.pd_class, self.stream_interval_s, self.report_timings,
                                                 self.timeline)
            self.started.append(admitted)
            async for chunk in self.ingress._run(admitted):
                yield chunk
        except APIError as e:
            self.refusal = self.refusal or e
            raise

    def headers(self) -> dict[str, str]:
        first = self.started[0]
        return {MODE_HEADER: first.mode, REASON_HEADER: first.decision.reason, CLASS_HEADER: first.pd_class}

    def timings(self) -> dict:
        return self.started[0].output.timings() if self.started else {}

    def cached_tokens(self) -> int:
        return sum(admitted.output.num_cached_tokens for admitted in self.started)


async def _with_timings(first: str, rest: AsyncIterator[str], legs: PromptLegs) -> AsyncIterator[str]:
    """vLLM's stream, with the request's timings as one more event before `[DONE]` when asked for. A failure the
    ingress raised mid-stream (a leg down, the time limit) is told as the app's error, with its status and code,
    in place of vLLM's rendering of the exception."""
    yield first
    async for event in rest:
        if event.startswith('data: {"error"') and legs.refusal is not None:
            event = _sse(legs.refusal.body())
        elif '"prompt_tokens_details":{' in event:
            event = _with_transferred(event, legs)
        if event == "data: [DONE]\n\n" and (timings := legs.timings()):
            yield _sse({"object": "pd.timings", **timings})
        yield event


def _with_transferred(event: str, legs: PromptLegs) -> str:
    """A stream's usage with the prompt tokens whose KV decode took by transfer (`cached_tokens`, as in a whole
    body). vLLM's stream takes that count from a request's first output, which is prefill's seeded token, sent
    before decode took the KV; the count so far stands in for it."""
    body = json.loads(event.removeprefix("data: "))
    body["usage"]["prompt_tokens_details"]["cached_tokens"] = legs.cached_tokens()
    return _sse(body)


def _as_body(request: dict | CompletionRequest | ChatCompletionRequest) -> dict:
    """A handle call's request as the body HTTP would carry."""
    if isinstance(request, (CompletionRequest, ChatCompletionRequest)):
        return request.model_dump(exclude_unset=True)
    if not isinstance(request, dict):
        raise APIError(400, f"expected a request body (dict) or vLLM's CompletionRequest or ChatCompletionRequest, "
                       f"got {type(request).__name__}")
    return request


def _unavailable(reason: str) -> APIError:
    return APIError(503, f"{reason}; retry shortly", "service_unavailable", code="engine_unavailable",
                    headers=RETRY_LATER)


def _api_key(env_var: str | None) -> str | None:
    if env_var is None:
        return None
    key = os.environ.get(env_var)
    if not key:
        raise ValueError(f"ingress.api_key_env names {env_var}, which is not set (or empty) in the ingress replica")
    return key


@dataclass
class Admitted:
    """A request that passed its checks and started: its chunks, and what its answer is built with."""

    request_id: str
    chunks: AsyncGenerator[EngineChunk, None]
    output: RequestOutput
    mode: TransferMode
    decision: Decision
    pd_class: str
    ticket: Ticket  # its place in the ingress's queue, told whether the request met its class's objectives
    release_slot: weakref.finalize | None = None


class RequestOutput:
    """What one request has produced so far, and the stamps of its first tokens going out; with timings asked
    for, every chunk's stamps too."""

    def __init__(self, num_prompt_tokens: int, timeline: RequestTimeline, report_timings: bool):
        self.num_prompt_tokens, self.timeline, self.report_timings = num_prompt_tokens, timeline, report_timings
        self.text, self.token_ids, self.finish_reason, self.num_cached_tokens = "", [], None, 0
        # Per chunk with tokens: when the engine made it, its replica sent it and the ingress got it (wall clock).
        self.chunk_stamps: list[tuple[float, float, float]] = []

    def add(self, chunk: EngineChunk) -> None:
        if chunk.token_ids:
            self.timeline.mark("second_token_sent" if self.token_ids else "first_token_sent")
            if self.report_timings:
                self.chunk_stamps.append((chunk.made_at, chunk.sent_at, time.time()))
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)

    def timings(self) -> dict:
        if not self.report_timings:
            return {}
        return {"pd_timings": {**self.timeline.report(), "chunks_s": self.chunk_stamps}}
