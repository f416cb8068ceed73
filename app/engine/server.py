"""Prefill and decode replicas: each owns one vLLM engine, reports its KV-transfer identity and its load, and serves
one leg of a disaggregated request."""

from __future__ import annotations

import asyncio
import os
import time
from typing import AsyncIterator, Literal

import ray
from ray import serve
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

from app.config import EngineConfig, cpu_set, hold_process_to
from app.engine.protocol import EngineChunk, EngineRequest, LegAccepted, PrefillResult, ReplicaUnavailable
from app.engine.stats import EngineStatsRecorder, RequestLoad
from app.tiny_model import resolve_model_source
from kv.config import TransferConfig
from kv.engine_identity import claim_identity
from kv.transfer_config import build_kv_transfer_config

Role = Literal["prefill", "decode"]
# A stream's first chunks go on as the engine makes them, whatever its interval: its first token, decode's copy of a
# seeded first token (dropped at the ingress), and the token after it.
CHUNKS_AT_ONCE = 3


def _replica_rank() -> int:
    return serve.get_replica_context().rank.rank


class EngineServer:
    """One vLLM engine in one Serve replica. Subclasses add the leg they serve."""

    role: Role

    def __init__(self, engine: EngineConfig, transfer: TransferConfig, stack_cpu_cores: str | None = None):
        if stack_cpu_cores is not None:
            # Before the engine starts: its engine-core and worker processes inherit it (vLLM then binds the
            # worker's compute threads to the engine's own cores).
            hold_process_to(cpu_set(stack_cpu_cores))
        if engine.cpu_cores is not None:
            # vLLM's CPU backend binds its OpenMP threads here; without it two engines on one machine share every
            # core and decode slows by an order of magnitude.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine.cpu_cores[_replica_rank()]
            # oneDNN keeps every matmul primitive it creates, one per distinct batch size, up to 1024 of them:
            # under varied prompt lengths the engine's worker grew by gigabytes. vLLM's linear layers keep their
            # own few primitives each, so the global cache only adds memory (a runtime_env may still set it).
            os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
        self.replica = serve.get_replica_context().replica_id.unique_id
        host = transfer.side_channel_host or ray.util.get_node_ip_address()
        self.identity = claim_identity(self.role, host, port_in_env=transfer.connector.module_path is None)
        self.model_id = engine.model_loading_config.model_id
        self.stats = EngineStatsRecorder()
        self.requests = RequestLoad()
        self._last_load: tuple[dict, float] = ({}, time.time())
        args = AsyncEngineArgs(
            model=resolve_model_source(engine.model_loading_config.model_source),
            served_model_name=[self.model_id],
            kv_transfer_config=build_kv_transfer_config(transfer, self.identity),
            worker_extension_cls="kv.worker_extension.TransferStateExtension",
            **engine.engine_args,
        )
        self.engine = AsyncLLM.from_engine_args(
            args, stat_loggers=[RayPrometheusStatLogger, lambda vllm_config, engine_index: self.stats]
        )

    async def check_health(self) -> None:
        await self.engine.check_health()

    def transfer_identity(self) -> dict:
        parallel = self.engine.vllm_config.parallel_config
        return {**self.identity.as_dict(), "tp_size": parallel.tensor_parallel_size,
                "pp_size": parallel.pipeline_parallel_size}

    def load(self) -> dict:
        """The engine's load, stamped with when it last changed (the ingress adds what it sent since,
        app/flow/routing.py). An idle engine's report stays the same, so Serve's controller does not pass it on to
        every router."""
        load = {**self.stats.load(), **self.requests.load()}
        if load != self._last_load[0]:
            self._last_load = (load, time.time())
        return {**load, "at": self._last_load[1]}

    def record_routing_stats(self) -> dict:
        """What Serve's request router ranks this replica by, and the ingress's mode policy reads
        (app/flow/routing.py)."""
        return self.load()

    def transfer_totals(self) -> dict:
        return self.stats.totals()

    async def transfer_state(self) -> dict[str, int]:
        """In-flight transfer state held by the engine's workers, summed (kv/worker.py `pending_counts`)."""
        counts: dict[str, int] = {}
        for worker_counts in await self.engine.collective_rpc("transfer_state"):
            for key, n in worker_counts.items():
                counts[key] = counts.get(key, 0) + n
        return counts

    def engine_info(self) -> dict:
        return {
            "max_model_len": self.engine.model_config.max_model_len,
            "block_size": self.engine.vllm_config.cache_config.block_size,
            "num_kv_blocks": self.engine.vllm_config.cache_config.num_gpu_blocks,
            "pid": os.getpid(),  # the replica's process; the engine's processes are its children
            "node_id": ray.get_runtime_context().get_node_id(),
            "replica": self.replica,
        }

    async def _run(self, request: EngineRequest) -> AsyncIterator:
        params = request.sampling_params.clone()
        params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": request.kv_transfer_params}
        # A decode leg with transfer params gets its prompt's KV from prefill: it computes (next to) nothing itself.
        remote_kv = self.role == "decode" and request.kv_transfer_params is not None
        self.requests.started(request.request_id, 0 if remote_kv else len(request.prompt_token_ids))
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": request.prompt_token_ids}, params, request.request_id, priority=request.priority
            ):
                self.requests.produced(request.request_id)
                yield output
        except EngineDeadError as e:
            # Said in the ingress's terms: this replica can serve nothing until Serve replaces it (its health check
            # fails from now on), so the ingress passes it over and tries another.
            raise ReplicaUnavailable(self.role, self.replica, str(e)) from None
        finally:
            self.requests.ended(request.request_id)


def _to_wall() -> float:
    """What to add to a monotonic stamp to put it on the wall clock. vLLM stamps a request's events in its
    engine-core process with the monotonic clock, which every process on a node shares."""
    return time.time() - time.monotonic()


def engine_events(output) -> dict[str, float]:
    """When the engine queued, first scheduled and first sampled for this request, on the wall clock."""
    stats = output.metrics
    if stats is None:
        return {}
    to_wall = _to_wall()
    stamps = {"queued": stats.queued_ts, "scheduled": stats.scheduled_ts, "first_token": stats.first_token_ts}
    return {event: ts + to_wall for event, ts in stamps.items() if ts}


def engine_chunk(output) -> EngineChunk:
    completion = output.outputs[0]
    # The step that made the chunk's last token (several steps' tokens merge when the replica reads late).
    made = output.metrics.last_token_ts + _to_wall() if output.metrics is not None else 0.0
    return EngineChunk(text=completion.text, token_ids=list(completion.token_ids),
                       finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                       logprobs=None if completion.logprobs is None else list(completion.logprobs),
                       num_cached_tokens=output.num_cached_tokens or 0, made_at=made)


class PrefillServer(EngineServer):
    role = "prefill"

    async def prefill(self, request: EngineRequest) -> AsyncIterator[LegAccepted | PrefillResult]:
        """Yield at once that this replica took the leg, with its engine's transfer identity (a push decode leg
        registers with it while prefill runs); then, once the prompt is computed, where its KV lives and the one
        token prefill sampled."""
        request.sampling_params = request.sampling_params.clone()
        request.sampling_params.max_tokens = 1
        request.sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
        computed = asyncio.ensure_future(self._last_output(request))  # the engine starts before the identity leaves
        try:
            yield LegAccepted(self.replica, self.transfer_identity())
            final = await computed
        finally:
            computed.cancel()  # the caller went away: abort the prefill (a no-op once it is done)
        first = engine_chunk(final)
        first.engine_events, first.sent_at = engine_events(final), time.time()
        yield PrefillResult(final.kv_transfer_params, first)

    async def _last_output(self, request: EngineRequest):
        final = None
        async for final in self._run(request):
            pass
        return final


class DecodeServer(EngineServer):
    role = "decode"

    async def generate(self, request: EngineRequest) -> AsyncIterator[LegAccepted | EngineChunk]:
        """Yield at once that this replica took the leg, then stream the completion; with remote-prefill params the
        prompt's KV is loaded, not recomputed."""
        request.sampling_params = request.sampling_params.clone()
        request.sampling_params.output_kind = RequestOutputKind.DELTA
        yield LegAccepted(self.replica)
        sent = 0
        async for output in self._run(request):
            chunk = engine_chunk(output)
            if sent == 0:
                chunk.engine_events = engine_events(output)
            chunk.sent_at = time.time()
            yield chunk
            sent += 1
            if request.stream_interval_s and sent >= CHUNKS_AT_ONCE:
                # Whatever the engine makes meanwhile waits in vLLM's output collector, merged into one chunk.
                await asyncio.sleep(chunk.sent_at + request.stream_interval_s - time.time())
