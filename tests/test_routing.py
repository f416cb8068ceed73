"""The request router's ranking, on stand-in replicas (the routing itself runs for real in test_replicas.py)."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

from ray.serve.request_router import RequestRouter

from app.flow.replica_view import ROUTERS, ReplicaView
from app.flow.routing import EngineLoadRouter
from app.policy.load_view import SENT_LEG_MAX_AGE_S, LegsSent, load_rank


def replica(name: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(name=name, routing_stats=stats, replica_id=SimpleNamespace(unique_id=name))


def router(failed: frozenset[str] = frozenset()) -> EngineLoadRouter:
    router = object.__new__(EngineLoadRouter)  # ranking reads only the replicas marked failed and the legs sent
    router.failed, router._sent = failed, LegsSent()
    return router


def ranks(*replicas, failed: frozenset[str] = frozenset(), by: EngineLoadRouter | None = None) -> list[list[str]]:
    by = by or router(failed)
    return [[r.name for r in rank] for rank in asyncio.run(by.choose_replicas(list(replicas)))]


def test_waiting_requests_rank_first_then_kv_in_use():
    assert ranks(replica("queued", waiting=2, running=1, kv_cache_usage=0.1),
                 replica("full", waiting=0, running=9, kv_cache_usage=0.8),
                 replica("light", waiting=0, running=9, kv_cache_usage=0.2)) == [["light"], ["full"], ["queued"]]


def test_a_decode_replica_with_fewer_streams_decoding_ranks_first():
    """A new stream there stalls fewer others; the mode policy binds push and local to the same replica."""
    assert ranks(replica("streaming", waiting=0, decoding=3, kv_cache_usage=0.1),
                 replica("quiet", waiting=0, decoding=0, kv_cache_usage=0.1),
                 replica("queued", waiting=1, decoding=0, kv_cache_usage=0.1)
                 ) == [["quiet"], ["queued"], ["streaming"]]


def test_equal_ranks_are_left_to_serves_count_of_requests_in_flight():
    """Running requests are not ranked on: Serve's own in-flight count, fresher than a report, picks among equals."""
    assert ranks(replica("a", waiting=0, running=5, kv_cache_usage=0.12),
                 replica("b", waiting=0, running=1, kv_cache_usage=0.08)) == [["a", "b"]]


def test_a_replica_that_has_not_reported_ranks_as_idle():
    assert load_rank({}) == (0, 0)
    assert ranks(replica("busy", waiting=1, kv_cache_usage=0.5), replica("new")) == [["new"], ["busy"]]


def test_a_replica_whose_engine_died_is_passed_over():
    assert ranks(replica("dead"), replica("busy", waiting=3), failed=frozenset({"dead"})) == [["busy"]]
    assert ranks(replica("dead"), failed=frozenset({"dead"})) == []  # Serve's router waits; the ingress does not


def test_legs_sent_since_a_report_count_until_a_newer_report():
    """A burst is ranked on what this process just sent, not only on reports from before it."""
    sender, reported = router(), time.time() - 0.1
    sender.sent("a", 500)
    a, b = replica("a", waiting=0, at=reported), replica("b", waiting=0, at=reported)
    assert sender.load(a) == {"waiting": 1, "queued_prefill_tokens": 500, "at": reported}
    assert ranks(a, b, by=sender) == [["b"], ["a"]]
    newer = replica("a", waiting=1, queued_prefill_tokens=500, at=time.time() + 0.01)  # the engine counts it now
    assert sender.load(newer)["waiting"] == 1 and sender.load(newer)["queued_prefill_tokens"] == 500


def test_a_replicas_view_holds_until_its_oldest_leg_sent_ages_out():
    sent, report = LegsSent(), {"waiting": 0, "at": 0.0}
    assert sent.counted_until("a") == math.inf
    sent.add("a", 100, now=1.0)
    sent.add("a", 200, now=1.5)
    assert sent.load("a", report, now=1.6)["waiting"] == 2 and sent.counted_until("a") == 1.0 + SENT_LEG_MAX_AGE_S
    later = sent.load("a", report, now=1.0 + SENT_LEG_MAX_AGE_S)
    assert later["waiting"] == 1 and sent.counted_until("a") == 1.5 + SENT_LEG_MAX_AGE_S
    assert sent.load("a", report, now=1.5 + SENT_LEG_MAX_AGE_S)["waiting"] == 0 and sent.counted_until("a") == math.inf


def test_a_replaced_replica_is_forgotten(monkeypatch):
    """Legs sent to and failures of a replica Serve no longer lists are dropped, so replacements do not pile up."""
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)  # Serve's own bookkeeping
    sender = router(failed=frozenset({"gone", "dead"}))
    sender.sent("gone", 100)
    sender.sent("kept", 200)
    sender.update_replicas([replica("kept"), replica("dead")])
    assert sender._sent.replicas() == {"kept"} and sender.failed == {"dead"}


def test_a_decided_leg_counts_on_its_role_until_a_replica_takes_it(monkeypatch):
    """The policy's view of a burst: legs decided on but not yet taken count on every replica of their role, then
    only on the replica that took them, and one never taken stops counting."""
    view = ReplicaView({role: SimpleNamespace(app_name="view-test", deployment_name=role)
                        for role in ("prefill", "decode")})
    for role in ("prefill", "decode"):
        routed = router()
        routed.populated, routed._replicas = True, {name: replica(name, at=time.time())
                                                    for name in (f"{role}-a", f"{role}-b")}
        monkeypatch.setitem(ROUTERS, ("view-test", role), routed)
    view.expect("prefill", 300)
    view.expect("prefill", 200)
    assert [(r.waiting, r.queued_prefill_tokens) for r in view.snapshot().prefill] == [(2, 500), (2, 500)]
    assert [r.queued_prefill_tokens for r in view.snapshot().decode] == [0, 0]
    view.sent("prefill", "prefill-b", 300)
    assert [(r.waiting, r.queued_prefill_tokens) for r in view.snapshot().prefill] == [(1, 200), (2, 500)]
    monkeypatch.setattr(time, "time", lambda now=time.time(): now + SENT_LEG_MAX_AGE_S + 0.1)
    assert [r.queued_prefill_tokens for r in view.snapshot().prefill] == [0, 0]
