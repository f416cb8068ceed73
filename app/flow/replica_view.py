"""Which engine replicas of each leg can take a request right now, and how loaded they are, as this ingress process
sees them.

The source is the request router of each engine deployment in this process (app/flow/routing.py). Serve keeps it up to
date with the replicas its controller lists as running, and it drops a replica the moment any call to it finds its
actor dead, long before Serve's health check would. The ingress adds the replicas whose engine died inside a live
actor (they answer every leg with `ReplicaUnavailable`). So a leg with no usable replica is refused with a 503 at
once, instead of waiting in Serve's router until a replacement engine is up, which takes a minute or more.

The same routers hold each replica's last load report plus the legs this process sent it since: `snapshot()` is
what the mode policy decides on (app/policy/mode_policy.py), the very loads the routers rank replicas by. A leg the
policy has decided on but no replica has taken yet (its dispatch and the replica's answer take a few milliseconds)
counts too, on every replica of its role, until one takes it: so a burst of requests decided within those milliseconds
does not all see the same idle cluster and all go the same way.
"""

from __future__ import annotations

import time
from typing import Mapping

from ray.serve.handle import DeploymentHandle

from app.flow import routing  # a module: each imports the other
from app.policy.load_view import LegsExpected, replica_load
from app.policy.mode_policy import ClusterSnapshot, ReplicaLoad

# This process's router of each engine deployment, by (application, deployment), once its handle has been used.
# Each router adds itself when Serve creates it.
ROUTERS: dict[tuple[str, str], routing.EngineLoadRouter] = {}


class ReplicaView:
    def __init__(self, engines: Mapping[str, DeploymentHandle]):
        self._deployments = {role: (handle.app_name, handle.deployment_name) for role, handle in engines.items()}
        self._expected = {role: LegsExpected() for role in engines}

    def _router(self, role: str) -> routing.EngineLoadRouter | None:
        router = ROUTERS.get(self._deployments[role])
        return router if router is not None and router.populated else None

    def usable(self, role: str) -> int | None:
        """How many replicas of `role` a leg could go to now; None until this process has heard from Serve."""
        router = self._router(role)
        return None if router is None else len(router.usable_replicas())

    def down(self, roles: tuple[str, ...]) -> list[str]:
        """The legs among `roles` that no replica could take now."""
        return [role for role in roles if self.usable(role) == 0]

    def mark_failed(self, role: str, replica: str) -> None:
        """`replica`'s engine is dead: route no leg of `role` to it until Serve replaces it."""
        if (router := self._router(role)) is not None:
            router.mark_failed(replica)

    def replicas(self) -> dict[str, int | None]:
        return {role: self.usable(role) for role in self._deployments}

    def expect(self, role: str, tokens_to_compute: int) -> None:
        """A leg of `role` is decided on: it counts on every replica of `role` until one takes it."""
        self._expected[role].expect(tokens_to_compute, time.time())

    def sent(self, role: str, replica: str, tokens_to_compute: int) -> None:
        """A leg went to `replica`: it counts in that replica's load until the replica's own report does."""
        self._expected[role].taken(tokens_to_compute, time.time())
        if (router := self._router(role)) is not None:
            router.sent(replica, tokens_to_compute)

    def snapshot(self) -> ClusterSnapshot:
        """Every replica's load. A leg whose router has not heard from Serve yet shows one healthy replica of
        unknown load, so that requests go ahead and wait in Serve's router as they would without a policy."""
        return ClusterSnapshot(*(self._loads(role) for role in ("prefill", "decode")))

    def _loads(self, role: str) -> tuple[ReplicaLoad, ...]:
        router = self._router(role)
        if router is None:
            return (ReplicaLoad(f"{role}-unknown"),)
        expected = tuple(self._expected[role].pending(time.time()))
        return tuple(replica_load(replica.replica_id.unique_id, router.load(replica),
                                  replica.replica_id.unique_id not in router.failed, expected)
                     for replica in router.curr_replicas.values())
