"""The simulator against the real app: replay a bench.goodput run's arrivals (the same seeds) through the simulated
app with a profile, and compare TTFT p50/p99 and ITL p50 cell by cell.

    python -m sim.fidelity [--goodput bench/results/goodput/cpu-tiny/results.json] [--profile cpu-tiny]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from app.policy.mode_policy import SERVING, PolicyConfig
from app.policy.service_class import ServiceClass
from sim.clock import Clock
from sim.cluster import SimApp
from sim.profile import Profile, load_profile
from sim.workload import arrivals

METRICS = ("ttft_p50", "ttft_p99", "itl_p50")


def replay(run: dict, profile: Profile, prefill: int, decode: int) -> dict[str, dict[str, dict[str, float]]]:
    """The simulator's TTFT p50/p99 and ITL p50 (ms) for each of the run's app systems and rates."""
    classes = {name: ServiceClass(**c) for name, c in run["classes"].items()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for system in SERVING:
        if system not in run["cells"]:
            continue
        out[system] = {}
        for rate, seed in zip(run["rates"], run["seeds"]):
            requests = arrivals(rate, run["window_s"], run["arrivals"], run["interactive_share"], run["max_model_len"],
                                seed)
            simulated = SimApp(profile, prefill, decode, PolicyConfig(policy=system), classes, Clock())
            served = [s for s in simulated.run(requests, run["drain_s"]) if s.token_times]
            ttfts = [s.ttft_s * 1e3 for s in served]
            itls = [(b - a) * 1e3 for s in served for a, b in zip(s.token_times, s.token_times[1:])]
            out[system][str(rate)] = {"ttft_p50": float(np.percentile(ttfts, 50)),
                                      "ttft_p99": float(np.percentile(ttfts, 99)),
                                      "itl_p50": float(np.percentile(itls, 50)) if itls else 0.0}
    return out


def compare(run: dict, simulated: dict) -> list[dict]:
    """One row per system, rate and metric: real, simulated, and the simulated one's error against the real."""
    rows = []
    for system, by_rate in simulated.items():
        for rate, got in by_rate.items():
            real = run["cells"][system][rate]["all"]
            for metric in METRICS:
                if real.get(metric):
                    rows.append({"system": system, "rate": rate, "metric": metric, "real": real[metric],
                                 "sim": got[metric], "error": got[metric] / real[metric] - 1})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goodput", type=Path, default=Path("bench/results/goodput/cpu-tiny/results.json"))
    parser.add_argument("--profile", default="cpu-tiny")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    args = parser.parse_args()
    run = json.loads(args.goodput.read_text())
    rows = compare(run, replay(run, load_profile(args.profile), args.prefill, args.decode))
    print("| system | rate /s | metric | real ms | simulated ms | error |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['system']} | {row['rate']} | {row['metric']} | {row['real']:.0f} | {row['sim']:.0f} | "
              f"{row['error']:+.0%} |")
    within = sum(abs(row["error"]) <= 0.2 for row in rows)
    print(f"\n{within} of {len(rows)} cells within +-20%")


if __name__ == "__main__":
    main()
