"""The ingress's metrics, through Ray's metrics API: per transfer mode, how long requests take, how they end and how
many are in flight. Ray exports each as `ray_<name>` (README lists them as Prometheus shows them).

Every request is counted once under its outcome: refused before it started (mode `none`; `invalid` for a 4xx,
`unavailable` for a 503), or once it ends: `ok`, `timeout` (504), `unavailable` (a leg's replica died under it and
no other could take it: 503 or an error event), `error` (an engine failed it), `cancelled` (the caller went away).
"""

from __future__ import annotations

import time
from collections import Counter

from ray.util import metrics

from app.timeline import RequestTimeline

SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
TOKEN_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1]
NOT_STARTED = "none"


def refusal_outcome(status: int) -> str:
    if status == 503:
        return "unavailable"  # a leg has no running replica
    return "invalid" if status < 500 else "error"


class IngressMetrics:
    def __init__(self):
        by_mode = ("mode",)
        self.phase_seconds = metrics.Histogram(
            "pd_request_phase_seconds", description="Time a request spent in each phase (app/timeline.py), by mode.",
            boundaries=[0.001, 0.0025, 0.005, *SECONDS[1:]], tag_keys=("phase", "mode"))
        self.first_token_seconds = metrics.Histogram(
            "pd_time_to_first_token_seconds", description="From a request's arrival to its first token sent.",
            boundaries=SECONDS, tag_keys=by_mode)
        self.output_token_seconds = metrics.Histogram(
            "pd_time_per_output_token_seconds",
            description="A request's mean time per output token after the first (requests with two tokens or more).",
            boundaries=TOKEN_SECONDS, tag_keys=by_mode)
        self.latency_seconds = metrics.Histogram(
            "pd_request_latency_seconds", description="From a request's arrival to its end, whatever the outcome.",
            boundaries=SECONDS, tag_keys=by_mode)
        self.requests = metrics.Counter(
            "pd_requests", description="Requests by mode, outcome and the reason for their mode (app/mode_policy.py; "
            "refused ones under mode and reason `none`).", tag_keys=("mode", "outcome", "reason"))
        self.in_flight_gauge = metrics.Gauge(
            "pd_requests_in_flight", description="Requests started and not yet ended, by mode.", tag_keys=by_mode)
        self._in_flight: Counter[str] = Counter()

    def refused(self, status: int) -> None:
        self.requests.inc(tags={"mode": NOT_STARTED, "outcome": refusal_outcome(status), "reason": NOT_STARTED})

    def started(self, mode: str) -> None:
        self._in_flight[mode] += 1
        self.in_flight_gauge.set(self._in_flight[mode], tags={"mode": mode})

    def finished(self, mode: str, reason: str, outcome: str, timeline: RequestTimeline, num_output_tokens: int
                 ) -> None:
        self._in_flight[mode] -= 1
        self.in_flight_gauge.set(self._in_flight[mode], tags={"mode": mode})
        self.requests.inc(tags={"mode": mode, "outcome": outcome, "reason": reason})
        events, now = timeline.events, time.time()
        self.latency_seconds.observe(now - events["arrival"], tags={"mode": mode})
        if outcome != "ok":
            return
        for phase, seconds in timeline.phases().items():
            self.phase_seconds.observe(seconds, tags={"phase": phase, "mode": mode})
        if "first_token_sent" in events:
            self.first_token_seconds.observe(events["first_token_sent"] - events["arrival"], tags={"mode": mode})
            if num_output_tokens > 1:
                per_token = (now - events["first_token_sent"]) / (num_output_tokens - 1)
                self.output_token_seconds.observe(per_token, tags={"mode": mode})
