"""The simulator's command line.

    python -m sim run SCENARIO [--shape 64x64] [--load 2.5] [--requests 100000] [--policies auto threshold ...]
                               [--profile P] [--seed N] [--json OUT]

Runs a scenario (sim/scenarios/<name>.yaml, or a path) under each policy, one after the other on the same
arrivals, and prints per service class the goodput, SLO attainment, TTFT and ITL, the mode mix, and how long each
run took on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from app.policy.mode_policy import SERVING
from sim.run import simulate, summary
from sim.scenario import load_scenario, parse_shape


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a scenario under each policy")
    run.add_argument("scenario")
    run.add_argument("--shape", type=parse_shape, help="prefill x decode replicas (default: the scenario's)")
    run.add_argument("--load", type=float, default=1.0, help="every stream's rate times this")
    run.add_argument("--requests", type=int, help="arrive for as long as this many requests take (about)")
    run.add_argument("--policies", nargs="+", choices=SERVING, default=list(SERVING))
    run.add_argument("--profile", help="default: the scenario's")
    run.add_argument("--seed", type=int, help="default: the scenario's")
    run.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)

    scenario = load_scenario(args.scenario)
    if args.shape:
        scenario = scenario.at_shape(*args.shape)
    if args.profile or args.seed is not None:
        scenario = scenario.model_copy(update={k: v for k, v in (("profile", args.profile), ("seed", args.seed))
                                               if v is not None})
    if args.load != 1.0:
        scenario = scenario.at_load(args.load)
    if args.requests:
        scenario = scenario.with_requests(args.requests)
    results = {"scenario": scenario.model_dump(mode="json"), "policies": {}}
    for policy in args.policies:
        started = time.perf_counter()
        with tqdm(total=round(scenario.window_s + scenario.drain_s), unit="virtual s", desc=policy,
                  leave=False) as bar:
            served = simulate(scenario, policy, progress=lambda now: bar.update(round(now) - bar.n))
        results["policies"][policy] = {**summary(served, scenario.window_s), "requests": len(served),
                                       "wall_s": time.perf_counter() - started}
    Console(width=180).print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


def table(results: dict) -> Table:
    scenario = results["scenario"]
    out = Table(title=f"{scenario['name']} at {scenario['prefill']}P x {scenario['decode']}D, profile "
                      f"{scenario['profile']}, {scenario['window_s']:.0f} s of arrivals")
    for column in ("policy", "class", "arrived", "shed", "failed", "met", "goodput /s", "attainment", "TTFT p50 ms",
                   "TTFT p99 ms", "ITL p50 ms", "modes", "wall s"):
        out.add_column(column, justify="left" if column in ("policy", "class", "modes") else "right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for policy, result in results["policies"].items():
        modes = " ".join(f"{mode} {n}" for mode, n in sorted(result["modes"].items()))
        for i, (name, c) in enumerate(result["classes"].items()):
            out.add_row(policy if i == 0 else "", name, str(c["arrived"]), str(c["shed"]), str(c["failed"]),
                        str(c["met"]),
                        f"{c['goodput_rps']:.1f}", f"{c['attainment']:.0%}", ms(c["ttft_p50_ms"]),
                        ms(c["ttft_p99_ms"]), ms(c["itl_p50_ms"]), modes if i == 0 else "",
                        f"{result['wall_s']:.1f}" if i == 0 else "")
    return out


if __name__ == "__main__":
    main()
