"""Which engine replica gets a leg: Ray Serve's request-router extension point, fed by the load engines report.

Each engine replica reports its engine's load (`EngineServer.record_routing_stats`: requests running and waiting in
the engine, share of KV cache in use, prompt tokens queued, streams decoding) every `ROUTING_STATS_PERIOD_S`,
stamped with when that load last changed (Serve's controller passes a report on to the routers only when it
changed). The router adds the legs this process sent the replica since then (`load`), so that a burst is not ranked
on a picture from before it; the ingress's mode policy reads the same loads (app/flow/replica_view.py). The router ranks
replicas by what Serve cannot see itself: requests waiting inside the engine plus streams it is decoding first (a
new leg waits behind the former and, on a decode engine, its prompt or KV admission stalls the latter; the mode
policy picks the decode replica it binds in the same order), then KV cache in use, in tenths. Among replicas of
equal rank, Serve picks the one with the fewest requests in flight, its own fresher count of running work. A
replica that has not reported yet (just started) ranks as idle.

Every leg is routed when it is dispatched, so the modes bind as they should:
- pull: the prefill replica on arrival; the decode replica only once prefill is done, by decode's load then;
- push: both on arrival; the decode leg registers with the prefill replica that took the prefill leg (its first
  answer is that replica's transfer identity, app/flow/request_flow.py);
- local: the decode replica on arrival.

The router of each engine deployment lives in the process that holds the handle (the ingress), one per deployment
there. It is also that process's freshest view of which replicas can take a leg (app/flow/replica_view.py): Serve gives
it the replicas its controller lists as running, and tells it the moment a call to one finds its actor dead; the
ingress adds the replicas whose engine it saw die inside a live actor. The router passes over both until Serve's
controller stops listing them.

The load arithmetic and the ranking are app/policy/load_view.py's, which the simulator runs too.
"""

from __future__ import annotations

import time
from itertools import groupby
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from app.policy.load_view import LegsSent, load_rank

# A module, not a name from it: Serve pickles this module by value into every process that routes, so a registry
# defined here would be a private copy there, never the one the ingress reads.
from app.flow import replica_view


class EngineLoadRouter(FIFOMixin, RequestRouter):
    def __init__(self, deployment_id, *args, **kwargs):
        super().__init__(deployment_id, *args, **kwargs)
        self.populated = False  # whether Serve has told this router its replicas yet
        self.failed: frozenset[str] = frozenset()  # replicas (unique ids) seen dead, or whose engine died
        self._sent = LegsSent()
        replica_view.ROUTERS[deployment_id.app_name, deployment_id.name] = self

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.populated = True
        # A replica that Serve no longer lists has been replaced: nothing left to pass over or to count legs for.
        listed = {replica.replica_id.unique_id for replica in replicas}
        self.failed &= listed
        self._sent.keep_only(listed)

    def mark_failed(self, replica: str) -> None:
        self.failed |= {replica}

    def on_replica_actor_died(self, replica_id) -> None:
        # Serve drops a dead replica only until its controller next lists the deployment's replicas, which it does
        # with the dead one among them until its health check fails: keep passing it over until then.
        super().on_replica_actor_died(replica_id)
        self.mark_failed(replica_id.unique_id)

    def sent(self, replica: str, tokens_to_compute: int) -> None:
        """This process sent `replica` a leg whose engine will compute that many prompt tokens."""
        self._sent.add(replica, tokens_to_compute, time.time())

    def load(self, replica: RunningReplica) -> dict[str, Any]:
        """The replica's last report, plus the legs sent to it since, as waiting requests and queued tokens."""
        return self._sent.load(replica.replica_id.unique_id, replica.routing_stats, time.time())

    def usable_replicas(self) -> set[str]:
        """The replicas a leg could be routed to now."""
        return {replica_id.unique_id for replica_id in self.curr_replicas} - self.failed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ranked = sorted((load_rank(self.load(replica)), index, replica)
                        for index, replica in enumerate(candidate_replicas)
                        if replica.replica_id.unique_id not in self.failed)
        return [[replica for _, _, replica in group] for _, group in groupby(ranked, key=lambda entry: entry[0])]
