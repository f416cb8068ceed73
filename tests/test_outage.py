"""A leg with no running replica: new requests get a 503 with a retry hint at once, rather than waiting in Serve's
router until the replacement is up, and /health names the leg that is down.

The leg that goes down is a stand-in deployment whose replacement takes a minute to start (a real engine's does
too, but killing the session's decode engine would cost every later test that minute); the ingress is the real one,
in front of the session's real prefill engine."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from conftest import deploy_ingress, wait_until

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
APP = "pd-outage"


def _stand_in_deployment():
    from ray import serve

    @serve.deployment(name="StandInDecode", health_check_period_s=1, health_check_timeout_s=2)
    class StandInDecode:
        """Starts at once the first time; a replacement replica takes `restart_s` to start."""

        def __init__(self, marker: str, restart_s: float):
            if os.path.exists(marker):
                time.sleep(restart_s)
            open(marker, "w").close()

        async def load(self) -> dict:
            return {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}

    return StandInDecode


@pytest.fixture
def outage_url(app, tmp_path):
    import ray
    from ray import serve

    url = deploy_ingress(app, APP, decode=_stand_in_deployment().bind(str(tmp_path / "started"), 60.0))
    wait_until(lambda: httpx.get(url + "/health", timeout=10).status_code, lambda code: code == 200, timeout_s=20)

    prefix = f"SERVE_REPLICA::{APP}#StandInDecode#"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(prefix):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    yield url
    serve.delete(APP, _blocking=False)


def test_requests_for_a_leg_being_replaced_get_a_503_at_once(outage_url):
    # Calls to the dead replica fail at once; Serve's controller reports it gone within its health check period.
    health = wait_until(lambda: httpx.get(outage_url + "/health", timeout=10),
                        lambda response: "down" in response.json(), timeout_s=20)
    assert health.status_code == 503 and health.json()["down"] == ["decode"], health.text
    assert health.headers["retry-after"]

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for mode in ("local", "pull", "push"):
        started = time.monotonic()
        response = httpx.post(outage_url + "/v1/completions", json=body, headers={"x-kv-transfer-mode": mode},
                              timeout=30)
        assert time.monotonic() - started < 2
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_unavailable" and response.headers["retry-after"]
