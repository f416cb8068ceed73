"""The ingress's view of which legs have a running replica, fed with Serve status objects (no cluster)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from ray.serve.schema import ReplicaState

from app.leg_health import LegHealth


def status(decode_running: int):
    deployments = {"PrefillServer": SimpleNamespace(replica_states={ReplicaState.RUNNING: 1}),
                   "DecodeServer": SimpleNamespace(replica_states={ReplicaState.RUNNING: decode_running,
                                                                   ReplicaState.STARTING: 1 - decode_running})}
    return SimpleNamespace(applications={"pd": SimpleNamespace(deployments=deployments)})


def handles():
    return {"prefill": SimpleNamespace(app_name="pd", deployment_name="PrefillServer"),
            "decode": SimpleNamespace(app_name="pd", deployment_name="DecodeServer")}


def test_a_leg_read_as_down_is_read_again_before_a_request_is_refused():
    readings = [status(0), status(1)]  # read while the engines start, then up

    def read_status():
        return readings.pop(0) if len(readings) > 1 else readings[0]

    health = LegHealth(handles(), period_s=3600, read_status=read_status)
    deadline = time.monotonic() + 5
    while health.replicas["decode"] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health.replicas["decode"] == 0
    time.sleep(0.3)  # older than a recheck allows
    assert asyncio.run(health.down(("prefill", "decode"))) == []


def test_a_leg_that_stays_down_is_reported():
    health = LegHealth(handles(), period_s=3600, read_status=lambda: status(0))
    health.refresh()
    time.sleep(0.3)
    assert asyncio.run(health.down(("prefill", "decode"))) == ["decode"]
    assert asyncio.run(health.down(("prefill",))) == []
