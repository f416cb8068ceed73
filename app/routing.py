"""Which engine replica gets a leg: Ray Serve's request-router extension point, fed by the load engines report.

Each engine replica reports its engine's load (`EngineServer.record_routing_stats`: requests running and waiting in
the engine, share of KV cache in use) every `ROUTING_STATS_PERIOD_S`. The router ranks replicas by what Serve cannot
see itself: requests waiting inside the engine first (no room in its batch or its KV cache), then KV cache in use, in
tenths. Among replicas of equal rank, Serve picks the one with the fewest requests in flight, its own fresher count
of running work. A replica that has not reported yet (just started) ranks as idle.

Every leg is routed when it is dispatched, so the modes bind as they should:
- pull: the prefill replica on arrival; the decode replica only once prefill is done, by decode's load then;
- push: both on arrival; the decode leg registers with the prefill replica that took the prefill leg (its first
  answer is that replica's transfer identity, app/request_flow.py);
- local: the decode replica on arrival.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

ROUTING_STATS_PERIOD_S = 0.5


def load_rank(stats: dict[str, Any]) -> tuple[int, int]:
    """Lower ranks first: (requests waiting in the engine, KV cache in use in tenths)."""
    return int(stats.get("waiting", 0)), round(float(stats.get("kv_cache_usage", 0.0)) * 10)


class EngineLoadRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ranked = sorted((load_rank(replica.routing_stats), index, replica)
                        for index, replica in enumerate(candidate_replicas))
        return [[replica for _, _, replica in group] for _, group in groupby(ranked, key=lambda entry: entry[0])]
