"""Transfer statistics per mode, and their Prometheus metrics.

vLLM's NIXL statistics say how many transfers happened, not which way. Here every completed transfer is also
recorded under its mode (prefill's WRITEs are push, decode's READs are pull), along with the push-only events: how
long a registration waited for its WRITE, registrations that arrived before prefill finished, and receives that
timed out. They travel the way vLLM's connector stats do (worker -> scheduler -> front end) and are exported by
vLLM's stat loggers, so with Ray's stat logger they reach Ray's Prometheus.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics

MODES = ("push", "pull")
_PER_MODE = ("transfer_duration", "bytes_transferred")
_EVENTS = ("registration_wait", "registrations_first", "push_timeouts", "late_writes_dropped", "pull_lease_expired",
           "push_withdrawn")


@dataclass
class DualModeStats(NixlKVConnectorStats):
    def reset(self) -> None:
        super().reset()
        self.data.update({f"{mode}_{key}": [] for mode in MODES for key in _PER_MODE})
        self.data.update({key: [] for key in _EVENTS})
        self._mode: str | None = None

    @contextlib.contextmanager
    def mode(self, mode: str):
        """Transfers completed inside this block are counted under `mode` too."""
        self._mode = mode
        try:
            yield
        finally:
            self._mode = None

    def record_transfer(self, res) -> None:
        super().record_transfer(res)
        if res is not None and self._mode is not None:
            self.data[f"{self._mode}_transfer_duration"].append(res.xferDuration / 1e6)
            self.data[f"{self._mode}_bytes_transferred"].append(res.totalBytes)

    def record_registration_wait(self, seconds: float) -> None:
        self.data["registration_wait"].append(seconds)

    def record_registration_first(self) -> None:
        self.data["registrations_first"].append(1)

    def record_push_timeout(self) -> None:
        self.data["push_timeouts"].append(1)

    def record_write_window_missed(self) -> None:
        self.data["late_writes_dropped"].append(1)

    def record_pull_lease_expired(self) -> None:
        self.data["pull_lease_expired"].append(1)

    def record_push_withdrawn(self) -> None:
        self.data["push_withdrawn"].append(1)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data[key] for key in _EVENTS)

    def reduce(self) -> dict[str, int | float]:
        summary = super().reduce()
        for mode in MODES:
            summary[f"Num {mode} transfers"] = len(self.data[f"{mode}_transfer_duration"])
        summary["Num push timeouts"] = len(self.data["push_timeouts"])
        summary["Num late push writes dropped"] = len(self.data["late_writes_dropped"])
        summary["Num pull reads refused past lease"] = len(self.data["pull_lease_expired"])
        summary["Num push registrations withdrawn"] = len(self.data["push_withdrawn"])
        return summary


class DualModePromMetrics(NixlPromMetrics):
    """vLLM's `vllm:nixl_*` metrics plus `vllm:kv_transfer_*` metrics labelled by mode."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine_and_mode(metric) -> dict[int, dict[str, Any]]:
            return {idx: {mode: metric.labels(*values, mode) for mode in MODES}
                    for idx, values in per_engine_labelvalues.items()}

        def per_engine(metric) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        by_mode = [*labelnames, "mode"]
        self.transfers = per_engine_and_mode(self._counter_cls(
            name="vllm:kv_transfers", documentation="KV transfers completed by this engine, by mode "
            "(push: WRITEs issued by prefill; pull: READs issued by decode).", labelnames=by_mode))
        self.bytes = per_engine_and_mode(self._counter_cls(
            name="vllm:kv_transfer_bytes", documentation="Bytes of KV moved by transfers this engine issued, by mode.",
            labelnames=by_mode))
        self.seconds = per_engine_and_mode(self._histogram_cls(
            name="vllm:kv_transfer_seconds", documentation="Duration of one KV transfer, by mode.",
            buckets=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0], labelnames=by_mode))
        self.registration_wait = per_engine(self._histogram_cls(
            name="vllm:kv_push_registration_wait_seconds",
            documentation="Push: time a decode registration waited at prefill before its WRITE was posted.",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0], labelnames=labelnames))
        self.registrations_first = per_engine(self._counter_cls(
            name="vllm:kv_push_registrations_before_prefill_done",
            documentation="Push: registrations that reached prefill before its prefill finished.",
            labelnames=labelnames))
        self.push_timeouts = per_engine(self._counter_cls(
            name="vllm:kv_push_timeouts", documentation="Push: decode receives that got no WRITE by the deadline.",
            labelnames=labelnames))
        self.pull_lease_expired = per_engine(self._counter_cls(
            name="vllm:kv_pull_reads_refused_past_lease",
            documentation="Pull: requests that reached decode too late to read prefill's KV (failed or recomputed).",
            labelnames=labelnames))
        self.late_writes_dropped = per_engine(self._counter_cls(
            name="vllm:kv_push_late_writes_dropped",
            documentation="Push: WRITEs prefill did not post because decode's registration had outlived the window.",
            labelnames=labelnames))
        self.push_withdrawn = per_engine(self._counter_cls(
            name="vllm:kv_push_registrations_withdrawn",
            documentation="Push: registrations decode withdrew (its request ended) before prefill WRITEs into them.",
            labelnames=labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for mode in MODES:
            durations = transfer_stats_data.get(f"{mode}_transfer_duration", ())
            if durations:
                self.transfers[engine_idx][mode].inc(len(durations))
                self.bytes[engine_idx][mode].inc(sum(transfer_stats_data[f"{mode}_bytes_transferred"]))
            for seconds in durations:
                self.seconds[engine_idx][mode].observe(seconds)
        for seconds in transfer_stats_data.get("registration_wait", ()):
            self.registration_wait[engine_idx].observe(seconds)
        if count := len(transfer_stats_data.get("registrations_first", ())):
            self.registrations_first[engine_idx].inc(count)
        if count := len(transfer_stats_data.get("push_timeouts", ())):
            self.push_timeouts[engine_idx].inc(count)
        if count := len(transfer_stats_data.get("pull_lease_expired", ())):
            self.pull_lease_expired[engine_idx].inc(count)
        if count := len(transfer_stats_data.get("late_writes_dropped", ())):
            self.late_writes_dropped[engine_idx].inc(count)
        if count := len(transfer_stats_data.get("push_withdrawn", ())):
            self.push_withdrawn[engine_idx].inc(count)
