"""How the ingress sees each engine replica's load: the replica's last report, plus the legs this process sent it
since, plus the legs decided on for its role that no replica has taken yet; and how replicas rank by it.

Pure: the time is passed in, nothing is read or sent here. The request routers and the ingress's replica view
(app/flow/routing.py, app/flow/replica_view.py) run it on the wall clock; the simulator (sim/) runs the same code
on its own.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Mapping

from app.policy.mode_policy import ReplicaLoad

ROUTING_STATS_PERIOD_S = 0.2
# A leg sent to a replica counts on top of its report until a report of a load that changed after the leg was sent
# arrives (the leg reached the engine), or this long after.
SENT_LEG_MAX_AGE_S = 5 * ROUTING_STATS_PERIOD_S


def load_rank(stats: Mapping[str, Any]) -> tuple[int, int]:
    """Lower ranks first: (requests waiting in the engine and streams it is decoding, KV cache in use in tenths)."""
    return int(stats.get("waiting", 0)) + int(stats.get("decoding", 0)), \
        round(float(stats.get("kv_cache_usage", 0.0)) * 10)


class LegsSent:
    """Per replica, the legs sent to it that its last report may not count yet: (when, prompt tokens to compute)."""

    def __init__(self):
        self._legs: dict[str, list[tuple[float, int]]] = {}

    def add(self, replica: str, tokens_to_compute: int, now: float) -> None:
        self._legs.setdefault(replica, []).append((now, tokens_to_compute))

    def keep_only(self, replicas: Iterable[str]) -> None:
        """Forget the replicas not listed (replaced ones)."""
        listed = set(replicas)
        self._legs = {replica: legs for replica, legs in self._legs.items() if replica in listed}

    def replicas(self) -> set[str]:
        return set(self._legs)

    def counted_until(self, replica: str) -> float:
        """When the oldest leg that `load` last counted for `replica` ages out (inf if none): till then, and till
        another leg or report, `load` gives the same."""
        legs = self._legs.get(replica)
        return legs[0][0] + SENT_LEG_MAX_AGE_S if legs else math.inf

    def load(self, replica: str, report: Mapping[str, Any], now: float) -> dict[str, Any]:
        """The replica's report, plus the legs sent to it since the load it reports last changed, as waiting
        requests and queued tokens."""
        stats = dict(report)
        oldest = max(stats.get("at", 0.0), now - SENT_LEG_MAX_AGE_S)
        legs = self._legs[replica] = [leg for leg in self._legs.get(replica, ()) if leg[0] > oldest]
        if legs:
            stats["waiting"] = stats.get("waiting", 0) + len(legs)
            stats["queued_prefill_tokens"] = stats.get("queued_prefill_tokens", 0) + sum(t for _, t in legs)
        return stats


class LegsExpected:
    """The legs of one role decided on that no replica has taken yet (their dispatch takes a few milliseconds):
    each counts on every replica of the role until one takes it, or for SENT_LEG_MAX_AGE_S (its request failed
    first)."""

    def __init__(self):
        self._legs: deque[tuple[float, int]] = deque()

    def expect(self, tokens_to_compute: int, now: float) -> None:
        self._legs.append((now, tokens_to_compute))

    def taken(self, tokens_to_compute: int, now: float) -> None:
        legs = self.pending(now)
        if (leg := next((leg for leg in legs if leg[1] == tokens_to_compute), None)) is not None:
            legs.remove(leg)

    def pending(self, now: float) -> deque[tuple[float, int]]:
        while self._legs and self._legs[0][0] <= now - SENT_LEG_MAX_AGE_S:
            self._legs.popleft()
        return self._legs


def replica_load(replica: str, stats: Mapping[str, Any], healthy: bool,
                 expected: Iterable[tuple[float, int]]) -> ReplicaLoad:
    """What the mode policy reads of one replica: its load as the router sees it, and its role's expected legs."""
    expected = list(expected)
    return ReplicaLoad(replica, healthy=healthy, running=stats.get("running", 0),
                       waiting=stats.get("waiting", 0) + len(expected),
                       queued_prefill_tokens=stats.get("queued_prefill_tokens", 0) + sum(t for _, t in expected),
                       kv_cache_usage=stats.get("kv_cache_usage", 0.0), decoding=stats.get("decoding", 0))
