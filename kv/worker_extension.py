"""Methods added to each vLLM worker (vLLM's `worker_extension_cls`), called through the engine's collective RPC."""

from __future__ import annotations

from vllm.distributed.kv_transfer import get_kv_transfer_group


class TransferStateExtension:
    def transfer_state(self) -> dict[str, int]:
        """How many entries of each kind of in-flight transfer state this worker's connector holds."""
        return get_kv_transfer_group().connector_worker.pending_counts()
