"""Security defaults: optional API-key authentication on the ingress, through real HTTP."""

from __future__ import annotations

import httpx
import pytest

from conftest import deploy_ingress

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"
KEY = "sk-test-4f0c2b"


@pytest.fixture(scope="module")
def authenticated_url(app):
    """A second ingress, requiring a key, in front of the session's engines."""
    from ray import serve

    yield deploy_ingress(app, "pd-authenticated", {"api_key_env": "PD_TEST_API_KEY"},
                         env_vars={"PD_TEST_API_KEY": KEY})
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
