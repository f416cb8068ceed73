"""The dual-mode NIXL connector that every engine of the app runs: push and pull requests side by side.

Load it into vLLM with `kv_connector: DualModeNixlConnector` and `kv_connector_module_path: kv.connector`. Each
request's `kv_transfer_params` carry `transfer_mode` (`push` or `pull`) and, for push, the `transfer_id` the
ingress generated; `kv/transfer_params.py` builds them. Scheduling and transfer work live in `kv/scheduler.py` and
`kv/worker.py`; this class only wires them to vLLM's connector interface (vLLM's NIXL facade does the forwarding).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

from kv.mode_stats import DualModePromMetrics, DualModeStats
from kv.scheduler import DualModeScheduler
from kv.worker import DualModeWorker


class DualModeNixlConnector(NixlBaseConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("the dual-mode connector does not support decode context parallelism (push cannot)")
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = DualModeScheduler(vllm_config, self.engine_id, kv_cache_config)
        else:
            self.connector_worker = DualModeWorker(vllm_config, self.engine_id, kv_cache_config)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.connector_worker.start_load_kv(self._connector_metadata)

    @classmethod
    def build_kv_connector_stats(cls, data=None) -> DualModeStats:
        return DualModeStats(data=data) if data is not None else DualModeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> DualModePromMetrics:
        return DualModePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
