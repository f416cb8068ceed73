"""The connector's per-mode transfer metrics as Prometheus sees them: scraped from Ray's metrics export after real
requests, and equal to what the engines count themselves."""

from __future__ import annotations

from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import CASES, wait_until

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """Every sample on Ray's export: name -> {sorted labels: value}."""
    samples: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            samples[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_transfers_by_mode_reach_rays_prometheus(app):
    for mode in ("push", "pull"):
        body = {"model": MODEL, "prompt": CASES[0].prompt, "max_tokens": 4, "temperature": 0}
        response = httpx.post(app.base_url + "/v1/completions", json=body, headers={"x-kv-transfer-mode": mode},
                              timeout=60)
        assert response.status_code == 200, response.text
    totals = app.wait_for_totals(lambda t: t["prefill"]["kv_transfers"]["push_transfers"] > 0
                                 and t["decode"]["kv_transfers"]["pull_transfers"] > 0)
    # push transfers are prefill's WRITEs, pull transfers decode's READs
    expected = {"push": totals["prefill"]["kv_transfers"]["push_transfers"],
                "pull": totals["decode"]["kv_transfers"]["pull_transfers"]}

    def by_mode(samples):  # summed over engines: each mode is counted by one engine only
        found = defaultdict(float)
        for labels, value in samples.get("ray_vllm_kv_transfers_total", {}).items():
            found[dict(labels)["mode"]] += value
        return dict(found)

    samples = wait_until(lambda: scrape(app.metrics_url), lambda s: by_mode(s) == expected, timeout_s=30)
    assert by_mode(samples) == expected, sorted(samples)
    assert samples["ray_vllm_kv_transfer_bytes_total"] and samples["ray_vllm_kv_transfer_seconds_count"]
