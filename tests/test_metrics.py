"""Metrics as Prometheus sees them, scraped from Ray's metrics export after real requests: the connector's per-mode
transfer counts (equal to what the engines count themselves), the ingress's per-mode latency and outcome metrics,
and every metric and label the shipped Grafana dashboard queries."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import CASES, ROOT, wait_until

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

    # Only this app's two engines: other tests' engines (gone or not) have series of their own.
    replicas = [app.engine_call(role, "engine_info")["replica"] for role in ("prefill", "decode")]

    def by_mode(samples):  # summed over the two engines: each mode is counted by one engine only
        found = defaultdict(float)
        for labels, value in samples.get("ray_vllm_kv_transfers_total", {}).items():
            if any(replica in label for _, label in labels for replica in replicas):
                found[dict(labels)["mode"]] += value
        return dict(found)

    samples = wait_until(lambda: scrape(app.metrics_url), lambda s: by_mode(s) == expected, timeout_s=30)
    assert by_mode(samples) == expected, sorted(samples)
    assert samples["ray_vllm_kv_transfer_bytes_total"] and samples["ray_vllm_kv_transfer_seconds_count"]


def series(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(value for key, value in samples.get(name, {}).items() if labels.items() <= dict(key).items())


def test_ingress_metrics_by_mode_and_outcome(app):
    before = scrape(app.metrics_url)
    sent = {"pull": 2, "push": 1}
    classes = {"pull": "interactive", "push": "batch"}
    for mode, count in sent.items():
        for _ in range(count):
            body = {"model": MODEL, "prompt": CASES[1].prompt, "max_tokens": 8, "temperature": 0}
            response = httpx.post(app.base_url + "/v1/completions", json=body,
                                  headers={"x-kv-transfer-mode": mode, "x-pd-class": classes[mode]}, timeout=60)
            assert response.status_code == 200, response.text
    assert httpx.post(app.base_url + "/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404

    def grew(samples, name, **labels):
        return series(samples, name, **labels) - series(before, name, **labels)

    def counted(samples):
        return ({mode: grew(samples, "ray_pd_requests_total", mode=mode, outcome="ok", **{"class": classes[mode]})
                 for mode in sent} == sent
                and grew(samples, "ray_pd_requests_total", mode="none", outcome="invalid") == 1
                # while they ran, the ingress sampled its event loop's lag
                and grew(samples, "ray_pd_ingress_event_loop_lag_seconds_count") > 0)

    after = wait_until(lambda: scrape(app.metrics_url), counted, timeout_s=30)
    assert counted(after), {name: dict(v) for name, v in after.items() if name.startswith("ray_pd_requests")}
    for mode, count in sent.items():
        for histogram in ("time_to_first_token", "time_per_output_token", "request_latency"):
            name = f"ray_pd_{histogram}_seconds"
            assert grew(after, f"{name}_count", mode=mode, **{"class": classes[mode]}) == count, (name, mode)
            mean = grew(after, f"{name}_sum", mode=mode) / count
            assert 0 < mean < 30, (name, mode, mean)
        assert series(after, "ray_pd_requests_in_flight", mode=mode) == 0
    for pd_class in set(classes.values()):  # each class's running limit, as the ingress's queue holds it now
        assert series(after, "ray_pd_class_running_limit", **{"class": pd_class}) >= 1, pd_class


def test_dashboard_queries_only_exported_metrics_and_labels(app):
    """Every metric in configs/grafana-dashboard.json is on Ray's export with the labels its queries group by.
    Counters of rare events appear only once they happened; those must at least be declared by the connector."""
    dashboard = json.loads((ROOT / "configs" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    samples = scrape(app.metrics_url)
    declared = {"ray_" + name.replace(":", "_") + "_total" for name in
                re.findall(r'name="(vllm:[a-z_]+)"', (ROOT / "kv" / "mode_stats.py").read_text())}
    for expr in exprs:
        for name in re.findall(r"\bray_[a-z_]+", expr):
            if name not in samples:
                assert name in declared, f"{name} (in {expr!r}) is neither exported nor declared"
                continue
            for grouping in re.findall(r"by \(([^)]*)\)", expr):
                labels = {label.strip() for label in grouping.split(",")} - {"le"}
                seen = set().union(*(dict(key) for key in samples[name]))
                assert labels <= seen, f"{expr!r}: {name} has labels {sorted(seen)}"
