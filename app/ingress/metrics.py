"""The ingress's metrics, through Ray's metrics API: per transfer mode, how long requests take, how they end and how
many are in flight. Ray exports each as `ray_<name>` (README lists them as Prometheus shows them).

Every request is counted once under its outcome: refused before it started (mode `none`; `invalid` for a 4xx,
`shed` for a 429 -- its service class held its share of the slots --, `unavailable` for a 503), or once it ends: `ok`, `timeout` (504), `unavailable` (a leg's replica died under it and
no other could take it: 503 or an error event), `error` (an engine failed it), `cancelled` (the caller went away).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque

from ray.util import metrics

from app.flow.timeline import RequestTimeline

SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
TOKEN_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1]
NOT_STARTED = "none"


def refusal_outcome(status: int) -> str:
    if status == 503:
        return "unavailable"  # a leg has no running replica
    if status == 429:
        return "shed"  # turned away by the ingress's full queue (app/policy/admission.py)
    return "invalid" if status < 500 else "error"


class IngressMetrics:
    def __init__(self):
        by_mode = ("mode",)
        by_mode_and_class = ("mode", "class")  # the service class (app/config.py): SLOs are per class
        self.phase_seconds = metrics.Histogram(
            "pd_request_phase_seconds",
            description="Time a request spent in each phase (app/flow/timeline.py), by mode.",
            boundaries=[0.001, 0.0025, 0.005, *SECONDS[1:]], tag_keys=("phase", "mode"))
        self.first_token_seconds = metrics.Histogram(
            "pd_time_to_first_token_seconds", description="From a request's arrival to its first token sent.",
            boundaries=SECONDS, tag_keys=by_mode_and_class)
        self.output_token_seconds = metrics.Histogram(
            "pd_time_per_output_token_seconds",
            description="A request's mean time per output token after the first (requests with two tokens or more).",
            boundaries=TOKEN_SECONDS, tag_keys=by_mode_and_class)
        self.latency_seconds = metrics.Histogram(
            "pd_request_latency_seconds", description="From a request's arrival to its end, whatever the outcome.",
            boundaries=SECONDS, tag_keys=by_mode_and_class)
        self.requests = metrics.Counter(
            "pd_requests",
            description="Requests by mode, outcome, the reason for their mode (app/policy/mode_policy.py) and service "
            "class (refused ones under mode, reason and class `none`).",
            tag_keys=("mode", "outcome", "reason", "class"))
        self.in_flight_gauge = metrics.Gauge(
            "pd_requests_in_flight", description="Requests started and not yet ended, by mode.", tag_keys=by_mode)
        self._in_flight: Counter[str] = Counter()
        self.class_limit_gauge = metrics.Gauge(
            "pd_class_running_limit", description="How many requests of each service class an ingress replica runs "
            "at once now: its share of the slots, cut while more urgent requests miss their objectives "
            "(app/policy/admission.py).", tag_keys=("class",))

    def class_limits(self, limits: dict[str, int]) -> None:
        for pd_class, limit in limits.items():
            self.class_limit_gauge.set(limit, tags={"class": pd_class})

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    def refused(self, status: int) -> None:
        self.requests.inc(tags={"mode": NOT_STARTED, "outcome": refusal_outcome(status), "reason": NOT_STARTED,
                                "class": NOT_STARTED})

    def started(self, mode: str) -> None:
        self._in_flight[mode] += 1
        self.in_flight_gauge.set(self._in_flight[mode], tags={"mode": mode})

    def finished(self, mode: str, reason: str, pd_class: str, outcome: str, timeline: RequestTimeline,
                 num_output_tokens: int) -> None:
        self._in_flight[mode] -= 1
        self.in_flight_gauge.set(self._in_flight[mode], tags={"mode": mode})
        self.requests.inc(tags={"mode": mode, "outcome": outcome, "reason": reason, "class": pd_class})
        events, now = timeline.events, time.time()
        tags = {"mode": mode, "class": pd_class}
        self.latency_seconds.observe(now - events["arrival"], tags=tags)
        if outcome != "ok":
            return
        for phase, seconds in timeline.phases().items():
            self.phase_seconds.observe(seconds, tags={"phase": phase, "mode": mode})
        if "first_token_sent" in events:
            self.first_token_seconds.observe(events["first_token_sent"] - events["arrival"], tags=tags)
            if num_output_tokens > 1:
                per_token = (now - events["first_token_sent"]) / (num_output_tokens - 1)
                self.output_token_seconds.observe(per_token, tags=tags)


class EventLoopLag:
    """How late the ingress's event loop runs what is due: every chunk of every stream waits that long before it
    goes on. Sampled every `interval_s` while requests are in flight (an idle ingress does not wake for it); each
    sample goes to a histogram, and the recent ones to `summary()`."""

    def __init__(self, busy, interval_s: float = 0.01, keep: int = 100_000):
        self.busy, self.interval_s = busy, interval_s
        self.histogram = metrics.Histogram(
            "pd_ingress_event_loop_lag_seconds", description="How late the ingress's event loop woke a task that was "
            f"due (sampled every {interval_s * 1e3:g} ms while requests are in flight).", boundaries=TOKEN_SECONDS)
        self.recent: deque[float] = deque(maxlen=keep)
        self._task: asyncio.Task | None = None

    def watch(self) -> None:
        """Sample from now until nothing is in flight; a no-op while sampling already."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sample())

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while self.busy():
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - due)
            self.histogram.observe(lag)
            self.recent.append(lag)

    def summary(self) -> dict[str, float]:
        """The samples since the last summary, in milliseconds: how many, median, p99, worst; then forgets them."""
        lags = sorted(self.recent)
        self.recent.clear()
        if not lags:
            return {"samples": 0}
        at = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))] * 1e3  # noqa: E731
        return {"samples": len(lags), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": lags[-1] * 1e3}
