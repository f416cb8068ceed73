"""Fit this machine's profile from the app's own measurements: a bench.peers run's per-request phases
(app/flow/timeline.py) and its concurrency sweep.

    python -m sim.fit [--peers bench/results/results.json] [--name cpu-tiny] [--out sim/profiles/cpu-tiny.yaml]

- each engine's step: a least-squares line of its prompt compute time over prompt length (prefill's from push and
  pull, `prefill_compute`; decode's from local, `decode_first_step`), and per decoding request, the rise of pull's
  ITL p50 from the lowest concurrency to the highest, per stream;
- hops: the phases `ingress`, `to_prefill` / `to_decode` (to an engine) and `prefill_return` / `decode_return`
  (back towards the client), medians;
- the hand-off: pull's `kv_wait` (allocation and READ) less one decode step, a line over prompt length; KV bytes per
  token from the run's transfer counters.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from sim.profile import PROFILES

MIN_STEP_S = 0.001


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope, both at least 0."""
    xs, ys = zip(*points)
    if len(set(xs)) < 2:
        return max(statistics.mean(ys), 0.0), 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return max(intercept, 0.0), max(slope, 0.0)


def fit(peers: dict, name: str) -> dict:
    lat, conc = peers["latency"], peers["concurrency"]
    lengths = peers["lengths"]

    def phases(mode: str, phase: str) -> list[tuple[int, float]]:
        return [(n, lat[mode][str(n)]["phases_p50_ms"][phase] / 1e3) for n in lengths
                if phase in lat[mode][str(n)].get("phases_p50_ms", {})]

    def median_phase(modes: tuple[str, ...], phase: str) -> float:
        return statistics.median(s for m in modes for _, s in phases(m, phase))

    prefill_fixed, prefill_per_token = line(phases("push", "prefill_compute") + phases("pull", "prefill_compute"))
    decode_fixed, decode_per_token = line(phases("local", "decode_first_step"))
    levels = sorted(int(c) for c in conc["pull"])
    low, high = levels[0], levels[-1]
    per_request = max((conc["pull"][str(high)]["itl_p50"] - conc["pull"][str(low)]["itl_p50"]) / 1e3
                      / max(high - low, 1), 0.0)
    step_after_read = decode_fixed + per_request
    handoff_fixed, handoff_per_token = line([(n, max(s - step_after_read, 0.0)) for n, s in phases("pull", "kv_wait")])
    kv_bytes = round(peers["kv_check"]["kv_bytes_per_token"])
    engine = {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "block_size": 16, "num_blocks": 4096}
    return {
        "name": name,
        "description": f"Fitted by sim.fit from bench.peers run {peers['date']} ({peers['machine']}; model "
                       f"{peers['model']}, {peers['dtype']}).",
        "prefill": {**engine, "step": {"fixed_s": max(prefill_fixed, MIN_STEP_S),
                                       "prefill_s_per_token": prefill_per_token,
                                       "decode_s_per_request": per_request}},
        "decode": {**engine, "long_prefill_token_threshold": 256,
                   "step": {"fixed_s": max(decode_fixed, MIN_STEP_S), "prefill_s_per_token": decode_per_token,
                            "decode_s_per_request": per_request}},
        "hops": {"ingress_s": median_phase(("push", "pull", "local"), "ingress"),
                 "to_engine_s": median_phase(("push", "pull"), "to_prefill"),
                 "to_client_s": median_phase(("push", "pull", "local"), "decode_return")},
        "handoff": {"fixed_s": handoff_fixed,
                    "bytes_per_s": kv_bytes / handoff_per_token if handoff_per_token > 0 else 1e12,
                    "kv_bytes_per_token": kv_bytes},
        "report_period_s": 0.2,
        "sources": {"everything": f"fitted from `{peers['command']}` ({peers['date']})",
                    "engine limits": "configs/cpu-tiny.yaml's engine_kwargs; num_blocks assumed (1 GiB of KV space)"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=Path, default=Path("bench/results/results.json"))
    parser.add_argument("--name", default="cpu-tiny")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    profile = fit(json.loads(args.peers.read_text()), args.name)
    out = args.out or PROFILES / f"{args.name}.yaml"
    out.write_text(yaml.safe_dump(profile, sort_keys=False, width=120))
    print(yaml.safe_dump(profile, sort_keys=False, width=120))


if __name__ == "__main__":
    main()
