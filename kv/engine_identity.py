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


def claim_identity(role: str, host: str) -> TransferIdentity:
    """A fresh identity for one engine, exported to vLLM's NIXL connector through its environment variables.

    Must run in the engine's own process before the engine starts: vLLM reads these when it builds the connector.
    """
    identity = TransferIdentity(f"{role}-{uuid.uuid4().hex[:12]}", host, free_port(host))
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = identity.side_channel_host
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(identity.side_channel_port)
    return identity
