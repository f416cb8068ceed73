"""How one engine is reached for KV transfer: its engine id and its NIXL side channel."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TransferIdentity:
    engine_id: str
    side_channel_host: str
    side_channel_port: int

    def as_dict(self) -> dict:
        return asdict(self)


def free_port(host: str) -> int:
    """A port the OS just handed out; the engine binds it moments later (the race is harmless in practice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def claim_identity(role: str, host: str, port_in_env: bool) -> TransferIdentity:
    """A fresh identity for one engine. Must run in the engine's own process before the engine starts.

    The host reaches vLLM's NIXL connector through its environment variable. The port does so only where
    `port_in_env` (vLLM's own connector reads it nowhere else): vLLM hashes that variable into its compile-cache
    key, so a port that differs per engine makes every engine compile its model afresh (minutes on CPU). The
    project's connector takes the port from its extra config (kv/transfer_config.py) instead.
    """
    identity = TransferIdentity(f"{role}-{uuid.uuid4().hex[:12]}", host, free_port(host))
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = identity.side_channel_host
    if port_in_env:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(identity.side_channel_port)
    return identity
