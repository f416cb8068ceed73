"""How one engine is reached for KV transfer: its engine id and its NIXL side channel."""

from __future__ import annotations

import os
import random
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


# Ports below this are Ray's: its workers listen on 10002-19999 by default.
LISTEN_PORTS_FROM = 20000


def ephemeral_ports() -> range:
    """The ports the OS hands to outgoing connections and to binds of port 0 (Linux's; IANA's elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except OSError:
        low, high = 49152, 65535
    return range(low, high + 1)


def free_port(host: str) -> int:
    """A port free now, for a listener that may bind it only minutes later (an engine binds its side channel once
    its model is compiled). A port from the ephemeral range would often be taken by then, by any outgoing
    connection on the machine; ports between Ray's and the ephemeral range are taken only by listeners that chose
    them, so the port is drawn from there at random (or from the OS where that gap is empty)."""
    gap = range(LISTEN_PORTS_FROM, ephemeral_ports().start)
    tries = random.sample(gap, min(len(gap), 64)) or [0]
    for port in tries:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port on {host}: tried {len(tries)} of {gap.start}-{gap.stop - 1} (or the OS's choice)")


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
