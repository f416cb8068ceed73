"""How one request travels through the engines: which legs run, in what order, with which transfer parameters, and
what happens when a replica fails under it."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import AsyncGenerator, AsyncIterator, Callable

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.engine.protocol import EngineChunk, EngineRequest, LegAccepted, PrefillResult, ReplicaUnavailable
from app.flow.first_token import after_seed, can_seed, prefill_sampling
from app.flow.replica_view import ReplicaView
from app.flow.timeline import RequestTimeline
from kv.config import POLICIES, TransferConfig, TransferMode
from kv.transfer_params import new_transfer_id, prefill_params, pull_decode_params, push_decode_params

# A request whose leg failed before anything reached the client is started again, on the replicas left, this many
# times in all.
MAX_ATTEMPTS = 3


class UnsupportedMode(ValueError):
    pass


class EngineFailed(RuntimeError):
    """An engine ended the request with an error: its KV did not arrive (and the configured failure policy is to
    fail), or the engine failed it otherwise."""


class PrefillFailed(EngineFailed):
    """A push request's prefill leg failed while decode was still waiting for its WRITE."""


class LegUnavailable(RuntimeError):
    """No replica of a leg's role could serve it: none took it in time, or the one that took it died (its actor, or
    its engine inside a live actor)."""

    def __init__(self, role: str, reason: str):
        super().__init__(f"the {role} leg failed: {reason}")
        self.role = role


class Leg:
    """One dispatched leg: its stream, and a deadline, running from dispatch, for a replica to take it (every leg's
    first message is `LegAccepted`). Replica failures come out of it as LegUnavailable."""

    def __init__(self, role: str, stream: DeploymentResponseGenerator, wait_s: float,
                 on_accepted: Callable[[str], None], on_dead_engine: Callable[[str, str], None]):
        self.role, self.stream, self._on_dead_engine = role, stream, on_dead_engine
        self.accepted: asyncio.Future[LegAccepted] = asyncio.ensure_future(self._accept(wait_s, on_accepted))

    async def _accept(self, wait_s: float, on_accepted: Callable[[str], None]) -> LegAccepted:
        try:
            async with asyncio.timeout(wait_s):
                accepted = await anext(self.stream)
            on_accepted(accepted.replica)
            return accepted
        except TimeoutError:
            # No replica took it: Serve's router holds it until one can (a replacement takes a minute or more).
            self.stream.cancel()
            raise LegUnavailable(self.role, f"no {self.role} replica took it within {wait_s:g} s") from None
        except Exception as e:
            raise self._failure(e) from e

    async def messages(self) -> AsyncIterator:
        """The leg's messages after `LegAccepted`."""
        replica = (await self.accepted).replica
        try:
            async for message in self.stream:
                yield message
        except Exception as e:
            failure = self._failure(e, replica)
            if failure is e:
                raise
            raise failure from e

    def _failure(self, error: Exception, replica: str | None = None) -> Exception:
        """`error` as LegUnavailable if it means the replica is gone; otherwise `error` itself."""
        dead_engine = getattr(error, "cause", error)  # Ray hands a replica's exception over wrapped, with its traceback
        if isinstance(dead_engine, ReplicaUnavailable):
            self._on_dead_engine(self.role, dead_engine.replica)
            return LegUnavailable(self.role, str(dead_engine))
        if isinstance(error, RayActorError):  # Serve's router drops that replica by itself
            return LegUnavailable(self.role, f"its replica {replica} died" if replica else "its replica died")
        return error

    def cancel(self) -> None:
        """A no-op once the leg is finished; otherwise the replica aborts it (and frees its blocks)."""
        self.stream.cancel()
        self.accepted.cancel()
        if self.accepted.done() and not self.accepted.cancelled():
            self.accepted.exception()  # seen: whatever ended the request was reported elsewhere


class RequestFlow:
    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, transfer: TransferConfig,
                 replica_wait_s: float):
        self.replicas = ReplicaView({"prefill": prefill, "decode": decode})
        self.prefill = prefill.options(stream=True)
        self.decode = decode.options(stream=True)
        self.replica_wait_s = replica_wait_s
        self.default_mode = transfer.default_mode
        self.modes = transfer.modes
        self.seed_first_token = transfer.seed_first_token
        self.recompute_on_failure = transfer.on_transfer_failure == "recompute"

    def requested_mode(self, requested: str | None) -> str | None:
        """The mode or policy a client named, checked; None where it named none."""
        if requested is None or requested in POLICIES:
            return requested
        if requested not in self.modes:
            raise UnsupportedMode(f"transfer mode {requested!r} is not served here; choose one of "
                                  f"{[*self.modes, *POLICIES]}")
        return requested

    def stream(self, request: EngineRequest, mode: TransferMode, timeline: RequestTimeline
               ) -> AsyncGenerator[EngineChunk, None]:
        """The request's chunks. A leg that fails before anything reached the client is tried again on another
        replica of its role, if one is left; otherwise LegUnavailable."""
        return self._retried(lambda: self._flow(request, mode, timeline), timeline)

    async def _retried(self, start: Callable[[], AsyncGenerator[EngineChunk, None]], timeline: RequestTimeline
                       ) -> AsyncGenerator[EngineChunk, None]:
        """`start()`'s chunks, started again (up to MAX_ATTEMPTS in all) when a leg failed before any chunk came
        and its role still has a replica that can take it."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            chunks, sent = start(), False
            try:
                async for chunk in chunks:
                    sent = True
                    yield chunk
                return
            except LegUnavailable as e:
                if sent or attempt == MAX_ATTEMPTS or not self.replicas.usable(e.role):
                    raise
                timeline.mark("retried")
            finally:
                await chunks.aclose()

    def _flow(self, request: EngineRequest, mode: TransferMode, timeline: RequestTimeline
              ) -> AsyncGenerator[EngineChunk, None]:
        if mode == "local":
            timeline.first_token_from("decode")
            return self._decode(self._dispatch_decode(request, timeline), timeline)
        seeded = self.seed_first_token and can_seed(request.sampling_params, mode)
        timeline.first_token_from("prefill" if seeded else "decode")
        if seeded and request.sampling_params.max_tokens == 1:
            return self._prefill_only(request, timeline)  # the first token is the whole answer: nothing to hand off
        return (self._push if mode == "push" else self._pull)(request, seeded, timeline)

    # -- legs ------------------------------------------------------------------------------------------------------

    def _leg(self, role: str, stream: DeploymentResponseGenerator, tokens_to_compute: int) -> Leg:
        """`tokens_to_compute`: the prompt tokens the leg's engine computes, which count in its replica's load from
        the moment it takes the leg (app/flow/replica_view.py)."""
        return Leg(role, stream, self.replica_wait_s,
                   lambda replica: self.replicas.sent(role, replica, tokens_to_compute), self.replicas.mark_failed)

    def _dispatch_decode(self, request: EngineRequest, timeline: RequestTimeline) -> Leg:
        timeline.dispatched("decode")
        local = request.kv_transfer_params is None
        return self._leg("decode", self.decode.generate.remote(request),
                         len(request.prompt_token_ids) if local else 0)

    async def _decode(self, leg: Leg, timeline: RequestTimeline, drop_first: EngineChunk | None = None
                      ) -> AsyncIterator[EngineChunk]:
        """Decode's chunks. `drop_first`: the first token was already sent (push, seeded) and decode samples it
        again; its copy must be the same token, and is left out."""
        try:
            timeline.taken("decode", (await leg.accepted).replica)
            async for chunk in leg.messages():
                if chunk.finish_reason == "error":
                    raise EngineFailed("decode failed the request (e.g. its KV transfer failed)")
                if chunk.engine_events:
                    timeline.add_engine("decode", chunk.engine_events)
                    timeline.mark("decode_answer")
                if drop_first is not None and chunk.token_ids:
                    if chunk.token_ids[0] != drop_first.token_ids[0]:
                        raise EngineFailed("decode's first token differs from the one prefill sent")
                    chunk = replace(chunk, token_ids=chunk.token_ids[1:],
                                    text=chunk.text.removeprefix(drop_first.text),
                                    logprobs=None if chunk.logprobs is None else chunk.logprobs[1:])
                    drop_first = None
                    if not chunk.token_ids and chunk.finish_reason is None:
                        continue
                yield chunk
        finally:
            leg.cancel()

    def _dispatch_prefill(self, request: EngineRequest, seeded: bool, timeline: RequestTimeline,
                          transfer: tuple[TransferMode, str] | None) -> Leg:
        """`transfer`: the mode and transfer id under which prefill keeps the prompt's KV; None keeps nothing."""
        leg = replace(request, sampling_params=prefill_sampling(request.sampling_params, seeded),
                      kv_transfer_params=prefill_params(*transfer) if transfer else None, stream_interval_s=0.0)
        timeline.dispatched("prefill")
        return self._leg("prefill", self.prefill.prefill.remote(leg), len(request.prompt_token_ids))

    @staticmethod
    async def _prefill_result(leg: Leg, timeline: RequestTimeline) -> PrefillResult:
        timeline.taken("prefill", (await leg.accepted).replica)
        result = None
        async for result in leg.messages():
            pass
        timeline.add_engine("prefill", result.first.engine_events)
        timeline.mark("prefill_answer")
        return result

    @staticmethod
    def _seed(request: EngineRequest, result: PrefillResult) -> EngineChunk:
        """Prefill's token as the client's first chunk. It keeps prefill's finish reason only if that token ends
        the request."""
        first = result.first
        ends = first.finish_reason == "stop" or request.sampling_params.max_tokens == 1
        return replace(first, finish_reason=first.finish_reason if ends else None, engine_events={})

    @staticmethod
    async def _succeeded(prefill_result: asyncio.Future) -> PrefillResult:
        try:
            return await prefill_result
        except LegUnavailable:
            raise
        except Exception as e:
            raise PrefillFailed(f"prefill failed the request: {e!r}") from e

    @staticmethod
    async def _unless_prefill_fails(chunks: AsyncIterator[EngineChunk], prefill_result: asyncio.Future
                                    ) -> AsyncIterator[EngineChunk]:
        """Decode's chunks, until prefill's leg fails first: then that failure at once (decode's leg is cancelled,
        which frees its blocks), rather than decode waiting out `push_timeout_s` for a WRITE that cannot come."""
        chunks = aiter(chunks)
        while True:
            if prefill_result.done() and prefill_result.exception() is None:
                async for chunk in chunks:  # prefill answered: nothing left to race each chunk against
                    yield chunk
                return
            step = asyncio.ensure_future(anext(chunks))
            if not prefill_result.done():
                await asyncio.wait({step, prefill_result}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done() and prefill_result.exception() is not None:
                step.cancel()
                await RequestFlow._succeeded(prefill_result)  # raises prefill's failure
            try:
                yield await step
            except StopAsyncIteration:
                return

    # -- flows -----------------------------------------------------------------------------------------------------

    async def _prefill_only(self, request: EngineRequest, timeline: RequestTimeline) -> AsyncIterator[EngineChunk]:
        leg = self._dispatch_prefill(request, True, timeline, transfer=None)
        try:
            yield self._seed(request, await self._prefill_result(leg, timeline))
        finally:
            leg.cancel()

    async def _pull(self, request: EngineRequest, seeded: bool,
                    timeline: RequestTimeline) -> AsyncIterator[EngineChunk]:
        """Prefill first; the decode replica is chosen only once prefill is done (late binding), then it READs.
        Seeded: the first token goes out as soon as prefill answers, and decode's prompt ends with it."""
        prefill = self._dispatch_prefill(request, seeded, timeline, ("pull", new_transfer_id()))
        try:
            result = await self._prefill_result(prefill, timeline)
        finally:
            prefill.cancel()
        location = pull_decode_params(result.kv_transfer_params)
        decode_leg = replace(request, kv_transfer_params=location)
        if seeded:
            first = self._seed(request, result)
            yield first
            if first.finish_reason is not None:
                return  # prefill's lease frees the KV no decode will take
            decode_leg = replace(decode_leg, prompt_token_ids=request.prompt_token_ids + first.token_ids,
                                 sampling_params=after_seed(request.sampling_params))
        async for chunk in self._pull_decode(decode_leg, timeline):
            yield chunk

    def _pull_decode(self, request: EngineRequest, timeline: RequestTimeline) -> AsyncGenerator[EngineChunk, None]:
        """Decode's leg of a pull request. Prefill keeps the KV leased until a decode engine has READ it, so a decode
        leg whose replica fails before it sent a token goes to another decode replica, which READs it afresh."""
        return self._retried(lambda: self._decode(self._dispatch_decode(request, timeline), timeline), timeline)

    async def _push(self, request: EngineRequest, seeded: bool,
                    timeline: RequestTimeline) -> AsyncIterator[EngineChunk]:
        """Both legs at once: as soon as the prefill replica is known, decode allocates blocks and registers them
        with it under a fresh transfer id, while prefill computes; prefill WRITEs the KV the moment it finishes.
        Seeded: prefill's token goes out as soon as prefill answers, and decode's copy of it is dropped."""
        transfer_id = new_transfer_id()
        prefill = self._dispatch_prefill(request, seeded, timeline, ("push", transfer_id))
        prefill_result, decode = None, None
        try:
            identity = (await prefill.accepted).transfer_identity
            prefill_result = asyncio.ensure_future(self._prefill_result(prefill, timeline))
            decode = self._dispatch_decode(replace(request, kv_transfer_params=push_decode_params(
                transfer_id, identity, len(request.prompt_token_ids))), timeline)
            first, sent = None, False
            try:
                if seeded:
                    first = self._seed(request, await self._succeeded(prefill_result))
                    sent = True
                    yield first
                    if first.finish_reason is not None:
                        return
                async for chunk in self._unless_prefill_fails(self._decode(decode, timeline, drop_first=first),
                                                              prefill_result):
                    sent = True
                    yield chunk
            except (PrefillFailed, LegUnavailable) as e:
                prefill_lost = isinstance(e, PrefillFailed) or e.role == "prefill"
                if sent or not prefill_lost or not self.recompute_on_failure:
                    raise
                # As the failure policy says for a transfer that cannot happen: decode computes the prompt itself.
                decode.cancel()
                async for chunk in self._decode(self._dispatch_decode(request, timeline), timeline):
                    yield chunk
        finally:
            prefill.cancel()
            if decode is not None:
                decode.cancel()
            if prefill_result is not None:
                prefill_result.cancel()
                if prefill_result.done() and not prefill_result.cancelled():
                    prefill_result.exception()  # decode's answer stands; a late prefill failure changes nothing
