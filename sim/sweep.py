"""Goodput and SLO attainment against load: each scenario at one shape and profile, at rising loads (every stream's
rate times k), under each policy on the same arrivals -- is `auto` at least as good as the best fixed mode?

    python -m sim.sweep [--scenarios steady bursty ...] [--shape 64x64] [--profile gpu-qwen3-32b-h100]
                        [--loads 8 16 24] [--window-s 3] [--out bench/results/sim/sweep-gpu-64x64]

Writes results.json, table.md (per scenario and load: each policy's goodput, the best fixed mode and auto's ratio
to it) and sweep.png (goodput and interactive attainment against load, one column per scenario) into --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from app.policy.mode_policy import MODES, SERVING
from sim.run import simulate, summary
from sim.scenario import SCENARIOS, load_scenario, parse_shape


def sweep(name: str, shape: tuple[int, int], profile: str, loads: list[float], window_s: float,
          policies: tuple[str, ...] = SERVING) -> dict:
    """Per load, per policy: goodput over all classes (met a second), interactive attainment and TTFT p99, modes."""
    base = load_scenario(name).at_shape(*shape).model_copy(update={"profile": profile})
    out = {"scenario": name, "shape": list(shape), "profile": profile, "window_s": window_s, "loads": {}}
    for load in loads:
        scenario = base.at_load(load).with_window(window_s)
        cells = {}
        for policy in policies:
            started = time.perf_counter()
            result = summary(simulate(scenario, policy), scenario.window_s)
            classes = result["classes"]
            interactive = classes.get("interactive", {})
            cells[policy] = {"goodput_rps": sum(c["goodput_rps"] for c in classes.values()),
                             "attainment": sum(c["met"] for c in classes.values())
                             / sum(c["arrived"] for c in classes.values()),
                             "interactive_attainment": interactive.get("attainment"),
                             "interactive_ttft_p99_ms": interactive.get("ttft_p99_ms"),
                             "modes": result["modes"], "wall_s": time.perf_counter() - started}
        best = max((m for m in MODES if m in cells), key=lambda m: cells[m]["goodput_rps"], default=None)
        out["loads"][f"{load:g}"] = {
            "offered_rps": len(scenario.requests()) / scenario.window_s, "policies": cells, "best_fixed": best,
            "auto_vs_best": (cells["auto"]["goodput_rps"] / cells[best]["goodput_rps"]
                             if best and "auto" in cells and cells[best]["goodput_rps"] else None)}
    return out


def rate(per_second: float) -> str:
    return f"{per_second:.0f}" if per_second >= 10 else f"{per_second:.3g}"


def table(results: list[dict]) -> str:
    """Markdown: one row per scenario and load."""
    policies = list(next(iter(results[0]["loads"].values()))["policies"])
    lines = ["| scenario | load | offered /s | " + " | ".join(f"{p}: goodput /s (met)" for p in policies)
             + " | best fixed | auto / best |",
             "|---|---|---|" + "---|" * len(policies) + "---|---|"]
    for result in results:
        for load, row in result["loads"].items():
            cells = " | ".join(f"{rate(row['policies'][p]['goodput_rps'])} ({row['policies'][p]['attainment']:.0%})"
                               for p in policies)
            ratio = "-" if row["auto_vs_best"] is None else f"{row['auto_vs_best']:.2f}x"
            lines.append(f"| {result['scenario']} | {load} | {rate(row['offered_rps'])} | {cells} | "
                         f"{row['best_fixed']} | {ratio} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(3.6 * len(results), 6), squeeze=False)
    for column, result in enumerate(results):
        loads = [float(k) for k in result["loads"]]
        policies = next(iter(result["loads"].values()))["policies"]
        for policy in policies:
            rows = [result["loads"][k]["policies"][policy] for k in result["loads"]]
            style = {"linewidth": 2.5, "color": "black"} if policy == "auto" else {"linewidth": 1.2}
            axes[0][column].plot(loads, [r["goodput_rps"] for r in rows], marker="o", label=policy, **style)
            axes[1][column].plot(loads, [r["interactive_attainment"] or 0 for r in rows], marker="o", **style)
        axes[0][column].set_title(result["scenario"])
        axes[1][column].set_xlabel("load (x the scenario's rates)")
        axes[1][column].set_ylim(0, 1.05)
    axes[0][0].set_ylabel("goodput (met SLOs /s)")
    axes[1][0].set_ylabel("interactive SLO attainment")
    axes[0][0].legend(fontsize=8)
    p, d = results[0]["shape"]
    fig.suptitle(f"{results[0]['profile']}, {p}P x {d}D, {results[0]['window_s']:g} s of arrivals a point")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m sim.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=sorted(p.stem for p in SCENARIOS.glob("*.yaml")))
    parser.add_argument("--shape", type=parse_shape, default=(64, 64))
    parser.add_argument("--profile", default="gpu-qwen3-32b-h100")
    parser.add_argument("--loads", nargs="+", type=float, default=[8, 16, 24])
    parser.add_argument("--window-s", type=float, default=3.0, help="how long requests arrive at each point")
    parser.add_argument("--policies", nargs="+", choices=SERVING, default=list(SERVING))
    parser.add_argument("--out", type=Path, default=Path("bench/results/sim/sweep-gpu-64x64"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in tqdm(args.scenarios, desc="scenarios"):
        results.append(sweep(name, args.shape, args.profile, args.loads, args.window_s, tuple(args.policies)))
        (args.out / "results.json").write_text(json.dumps(results, indent=1))  # kept as it goes: sweeps are long
    (args.out / "table.md").write_text(table(results) + "\n")
    plot(results, args.out / "sweep.png")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
