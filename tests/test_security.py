"""Security defaults: optional API-key authentication on the ingress, through real HTTP."""

from __future__ import annotations

import httpx
import pytest

from conftest import app_config

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
KEY = "sk-test-4f0c2b"


@pytest.fixture(scope="module")
def authenticated_url(app):
    """A second ingress, requiring a key, in front of the session's engines (their handles are passed in)."""
    from ray import serve

    from app.config import PDAppConfig
    from app.ingress import OpenAIIngress

    config = app_config()
    config["ingress"] = {"api_key_env": "PD_TEST_API_KEY"}
    ingress = OpenAIIngress.options(
        name="AuthenticatedIngress",
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {"PD_TEST_API_KEY": KEY}}},
    ).bind(app.handles["prefill"], app.handles["decode"], PDAppConfig.model_validate(config))
    serve.run(ingress, name="pd-authenticated", route_prefix="/authenticated")
    yield app.base_url + "/authenticated"
    serve.delete("pd-authenticated")


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", KEY, "Bearer"])
def test_requests_without_the_key_get_a_401(authenticated_url, authorization):
    headers = {} if authorization is None else {"authorization": authorization}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for response in (httpx.post(authenticated_url + "/v1/completions", json=body, headers=headers, timeout=60),
                     httpx.get(authenticated_url + "/v1/models", headers=headers, timeout=60)):
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_requests_with_the_key_are_served_and_health_stays_open(authenticated_url):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    response = httpx.post(authenticated_url + "/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    assert httpx.get(authenticated_url + "/health", timeout=60).status_code == 200


def test_the_default_app_needs_no_key(app):
    assert httpx.get(app.base_url + "/v1/models", timeout=60).status_code == 200
