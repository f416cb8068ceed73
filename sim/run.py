"""One scenario under one policy: the simulated app served its requests; what they add up to per service class
(goodput: requests a second that met both of their class's SLOs), and the policy's mode mix."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping

import numpy as np

from app.policy.mode_policy import PolicyConfig
from app.policy.service_class import ServiceClass, default_classes
from sim.clock import Clock
from sim.cluster import Served, SimApp
from sim.profile import load_profile
from sim.scenario import Scenario

PROGRESS_STEPS = 100  # the clock runs in this many stretches, each reported to `progress`


def simulate(scenario: Scenario, policy: str, classes: Mapping[str, ServiceClass] | None = None,
             progress: Callable[[float], None] | None = None) -> list[Served]:
    """Every request of the scenario through the simulated app; `progress` is told the virtual seconds run so
    far, now and then."""
    classes = classes or default_classes()
    clock = Clock()
    app = SimApp(load_profile(scenario.profile), scenario.prefill, scenario.decode, PolicyConfig(policy=policy),
                 classes, clock)
    requests = scenario.requests()
    for arrival in requests:
        app.submit(arrival)
    for failure in scenario.failures:
        for replica in failure.replicas(getattr(scenario, failure.role)):
            clock.at(failure.at_s, app.fail, failure.role, replica)
    end = (requests[-1].at_s if requests else 0.0) + scenario.drain_s
    for step in range(1, PROGRESS_STEPS + 1):
        clock.run(until=end * step / PROGRESS_STEPS)
        if progress is not None:
            progress(clock.now)
    return app.served


def summary(served: list[Served], window_s: float, classes: Mapping[str, ServiceClass] | None = None) -> dict:
    """Per class: arrived, shed, failed, unfinished, met, goodput (met a second of the window), attainment (met of
    arrived), TTFT p50/p99 and ITL p50 in ms; and the modes taken."""
    classes = classes or default_classes()
    out: dict = {"classes": {}, "modes": dict(Counter(s.mode for s in served if s.mode))}
    for name, service_class in classes.items():
        mine = [s for s in served if s.arrival.qos_class == name]
        if not mine:
            continue
        answered = [s for s in mine if s.token_times]
        met = sum(service_class.met(s.ttft_s, s.tpot_s) for s in answered if s.done)
        ttfts = [s.ttft_s * 1e3 for s in answered]
        gaps = [np.diff(s.token_times) for s in answered if len(s.token_times) > 1]
        itls = np.concatenate(gaps) * 1e3 if gaps else None
        out["classes"][name] = {
            "arrived": len(mine), "shed": sum(s.shed for s in mine), "failed": sum(s.failed for s in mine),
            "unfinished": sum(not s.done and not s.shed and not s.failed for s in mine), "met": met,
            "goodput_rps": met / window_s, "attainment": met / len(mine),
            "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p99_ms": float(np.percentile(ttfts, 99)) if ttfts else None,
            "itl_p50_ms": float(np.median(itls)) if itls is not None else None}
    return out
