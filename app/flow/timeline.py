"""Where a request's time goes: a timestamp at every hop, reported per request and as Prometheus histograms.

The ingress stamps what it sees (arrival, each leg dispatched, each leg's first answer back, first and second token
sent); each engine reports when it queued, first scheduled and first sampled the request (vLLM's own request stats).
All stamps are wall-clock seconds; on one node every process shares the clock, across nodes NTP skew applies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.policy.mode_policy import Decision

# Each phase runs from one event to another; a phase whose events did not happen in a request is left out.
PHASES: dict[str, tuple[str, str]] = {
    "ingress": ("arrival", "first_dispatch"),  # parse, tokenize, validate
    "to_prefill": ("prefill_dispatched", "prefill_queued"),  # Serve routing and the hop into the engine
    "prefill_queue": ("prefill_queued", "prefill_scheduled"),
    "prefill_compute": ("prefill_scheduled", "prefill_first_token"),
    "prefill_return": ("prefill_first_token", "prefill_answer"),  # back to the ingress
    "to_decode": ("decode_dispatched", "decode_queued"),
    "kv_wait": ("decode_queued", "decode_scheduled"),  # allocation, then the READ or the wait for a WRITE
    "decode_first_step": ("decode_scheduled", "decode_first_token"),
    "decode_return": ("decode_first_token", "decode_answer"),
    "ttft": ("arrival", "first_token_sent"),
    "second_token_gap": ("first_token_sent", "second_token_sent"),
}


@dataclass
class RequestTimeline:
    events: dict[str, float] = field(default_factory=lambda: {"arrival": time.time()})
    replicas: dict[str, str] = field(default_factory=dict)  # role -> the engine replica that served that leg
    decision: dict = field(default_factory=dict)  # the mode policy's choice, its reason and its predicted costs

    def mark(self, event: str) -> None:
        """Stamp `event` now, unless it happened already (only its first occurrence counts)."""
        self.events.setdefault(event, time.time())

    def add_engine(self, role: str, engine_events: dict[str, float]) -> None:
        for event, at in engine_events.items():
            self.events.setdefault(f"{role}_{event}", at)

    def taken(self, role: str, replica: str) -> None:
        """A replica of `role` took the request's leg (its first answer arrived). After a retry, the replica that
        took it last is the one that served it."""
        self.mark(f"{role}_taken")
        self.replicas[role] = replica

    def decided(self, decision: Decision, pd_class: str) -> None:
        """The mode's decision (app/policy/mode_policy.py), its predicted costs in milliseconds."""
        self.decision = {"mode": decision.mode, "reason": decision.reason, "class": pd_class, "predicted_ms": {
            option: {"ttft": round(cost.ttft_s * 1e3, 3), "stall": round(cost.stall_s * 1e3, 3)}
            for option, cost in decision.costs.items()}, "ruled_out": list(decision.ruled_out)}

    def first_token_from(self, role: str) -> None:
        """Which engine samples the first token the client gets: prefill (seeded), or decode -- also for a request
        whose sampling rules keep it off the seeded path (app/flow/first_token.py)."""
        self.decision["first_token"] = role

    def dispatched(self, role: str) -> None:
        self.mark(f"{role}_dispatched")
        self.mark("first_dispatch")

    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase that this request went through."""
        return {name: self.events[end] - self.events[start] for name, (start, end) in PHASES.items()
                if start in self.events and end in self.events}

    def report(self) -> dict[str, dict]:
        """Milliseconds: each event since arrival, in the order they happened, and each phase's duration; the
        replica that served each leg, and the mode's decision."""
        arrival = self.events["arrival"]
        ordered = sorted(self.events.items(), key=lambda item: item[1])
        return {"events_ms": {event: round((at - arrival) * 1e3, 3) for event, at in ordered},
                "phases_ms": {name: round(seconds * 1e3, 3) for name, seconds in self.phases().items()},
                "replicas": dict(self.replicas), "decision": self.decision}
