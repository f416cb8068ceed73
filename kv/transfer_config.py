"""The vLLM `KVTransferConfig` every engine of the app runs with, built from the app's transfer section."""

from __future__ import annotations

from vllm.config import KVTransferConfig

from kv.config import TransferConfig
from kv.engine_identity import TransferIdentity


# The key under which the project's connector finds its engine's side-channel port (kv/scheduler.py).
SIDE_CHANNEL_PORT_KEY = "side_channel_port"


def build_kv_transfer_config(transfer: TransferConfig, identity: TransferIdentity) -> KVTransferConfig:
    # Both sides run the same connector in role kv_both: which way KV flows is a per-request decision.
    return KVTransferConfig(
        kv_connector=transfer.connector.name,
        kv_connector_module_path=transfer.connector.module_path,
        kv_role="kv_both",
        engine_id=identity.engine_id,
        kv_buffer_device=transfer.kv_buffer_device,
        kv_load_failure_policy=transfer.on_transfer_failure,
        kv_connector_extra_config={
            **transfer.connector_extra_config,
            "backends": list(transfer.backends),
            "push_registration_timeout": transfer.push_timeout_s,
            "kv_lease_duration": transfer.lease_s,
            "progress_thread": transfer.progress_thread,
            "step_spin_s": transfer.step_spin_s,
            SIDE_CHANNEL_PORT_KEY: identity.side_channel_port,
        },
    )
