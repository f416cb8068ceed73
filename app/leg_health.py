"""Which legs have a running replica right now, so that the ingress refuses a request it cannot serve (503 with a
retry hint) instead of leaving it queued in Serve's router until a replacement replica is up, which for an engine
takes minutes."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Mapping

from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ReplicaState, ServeStatus

logger = logging.getLogger("ray.serve")


def running_replicas(status: ServeStatus, app_name: str, deployment_name: str) -> int:
    """How many replicas of one deployment Serve's controller reports as RUNNING."""
    app = status.applications.get(app_name)
    deployment = app.deployments.get(deployment_name) if app is not None else None
    if deployment is None:
        return 0
    return sum(n for state, n in deployment.replica_states.items() if state == ReplicaState.RUNNING)


# A leg seen down is read again before a request is refused, unless the reading is this recent: the periodic one
# may predate a replica that just came up (at start-up, the ingress can read its engines' states before they run).
RECHECK_AFTER_S = 0.25


class LegHealth:
    """Running replica counts per leg, refreshed every `period_s` by a background thread. Until the first reading
    every leg counts as up."""

    def __init__(self, engines: Mapping[str, DeploymentHandle], period_s: float,
                 read_status: Callable[[], ServeStatus] = serve.status):
        self._targets = {role: (handle.app_name, handle.deployment_name) for role, handle in engines.items()}
        self._read_status, self.period_s = read_status, period_s
        self.replicas: dict[str, int | None] = {role: None for role in engines}
        self._read_at = 0.0
        # Daemon: it ends with the replica's process.
        threading.Thread(target=self._poll, name="leg-health", daemon=True).start()

    def refresh(self) -> None:
        status = self._read_status()
        for role, (app_name, deployment_name) in self._targets.items():
            self.replicas[role] = running_replicas(status, app_name, deployment_name)
        self._read_at = time.monotonic()

    async def down(self, roles: tuple[str, ...]) -> list[str]:
        """The legs among `roles` with no running replica, confirmed by a fresh reading."""
        down = [role for role in roles if self.replicas[role] == 0]
        if down and time.monotonic() - self._read_at > RECHECK_AFTER_S:
            await asyncio.to_thread(self.refresh)
            down = [role for role in roles if self.replicas[role] == 0]
        return down

    def _poll(self) -> None:
        while True:
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 -- the controller may be restarting; keep the last reading
                logger.warning("could not read the engines' replica states", exc_info=True)
            time.sleep(self.period_s)
