"""Running totals of one engine, kept from vLLM's per-step stats: the replica's load for routing, and proof that KV
crossed (prompt tokens by source, NIXL transfers) for tests and the benchmark."""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def _connector_counts(kv_connector_stats: dict[str, Any]) -> Counter:
    """Sum the connector's per-step transfer records ({'bytes_transferred': [...], 'push_transfer_duration': [...],
    'num_failed_transfers': [...], ...}); the per-mode keys exist with the project's connector only."""
    data = kv_connector_stats.get("data", kv_connector_stats)
    counts = Counter()
    for prefix in ("", "push_", "pull_"):
        counts[f"{prefix}transfers"] += len(data.get(f"{prefix}transfer_duration", ()))
        counts[f"{prefix}bytes"] += int(sum(data.get(f"{prefix}bytes_transferred", ())))
    for key in ("num_failed_transfers", "num_failed_notifications", "num_failed_handshakes", "num_kv_expired_reqs",
                "registrations_first", "push_timeouts", "late_writes_dropped", "pull_lease_expired", "push_withdrawn"):
        counts[key.removeprefix("num_")] += len(data.get(key, ()))
    return counts


class RequestLoad:
    """The requests one replica's engine runs, as its server sees them: prompt tokens the engine has yet to compute
    (a request's, until its first output) and streams past their first token. vLLM's scheduler stats count
    requests, not the tokens a new prompt would queue behind, nor which of them are decoding."""

    def __init__(self):
        self._prefilling: dict[str, int] = {}
        self._decoding: set[str] = set()
        # Every leg taken changes the report, even one that starts and ends between two reads of it: the router
        # counts a leg it sent until a report newer than the leg arrives (app/flow/routing.py), and Serve passes a
        # report on only when it changed.
        self._taken = 0

    def started(self, request_id: str, tokens_to_compute: int) -> None:
        self._prefilling[request_id] = tokens_to_compute
        self._taken += 1

    def produced(self, request_id: str) -> None:
        if self._prefilling.pop(request_id, None) is not None:
            self._decoding.add(request_id)

    def ended(self, request_id: str) -> None:
        self._prefilling.pop(request_id, None)
        self._decoding.discard(request_id)

    def load(self) -> dict[str, int]:
        return {"queued_prefill_tokens": sum(self._prefilling.values()), "decoding": len(self._decoding),
                "legs_taken": self._taken}


class EngineStatsRecorder(StatLoggerBase):
    def __init__(self, vllm_config: VllmConfig | None = None, engine_index: int = 0):
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prompt_tokens = Counter({source: 0 for source in PROMPT_TOKEN_SOURCES})
        self.kv_transfers = Counter()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            if scheduler_stats.kv_connector_stats:
                self.kv_transfers.update(_connector_counts(scheduler_stats.kv_connector_stats))
        if iteration_stats is not None:
            for source in PROMPT_TOKEN_SOURCES:
                self.prompt_tokens[source] += iteration_stats.prompt_token_stats.get_by_source(source)

    def log_engine_initialized(self) -> None:
        pass

    def load(self) -> dict[str, Any]:
        return {"running": self.running, "waiting": self.waiting, "kv_cache_usage": self.kv_cache_usage}

    def totals(self) -> dict[str, Any]:
        return {"prompt_tokens_by_source": dict(self.prompt_tokens), "kv_transfers": dict(self.kv_transfers)}
