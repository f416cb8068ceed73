"""The design's question, per profile: for a prompt length and a skew of decode load, which mode serves best --
push (decode bound at arrival), pull (decode chosen after prefill) or local (no hand-off) -- and by how much.

    python -m sim.mode_map [--profiles cpu-tiny gpu-qwen3-32b-h100] [--shape 8x8] [--requests 3000]
                           [--out bench/results/sim]

Each cell runs the same arrivals under each fixed mode: every prompt of the cell's length, outputs of 16 x
Pareto(tail) tokens (the heavier the tail, the more a few long streams pile up on some decode replicas while
others stay light), arriving as fast as keeps a prefill engine of the profile busy 70% of the time with that
cell's prompts (one prefill replica per decode replica). A mode wins by the share of requests that met their SLOs, then, within
half a point, by the lower TTFT p90; the margin is the winner's against the runner-up on that same measure.
Writes mode-map.json and one mode-map-<profile>.png per profile into --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from app.policy.mode_policy import MODES
from app.policy.service_class import default_classes
from sim.profile import load_profile
from sim.run import simulate
from sim.scenario import Scenario, Stream, parse_shape

PROMPT_LENGTHS = (128, 256, 512, 1024, 1900)
TAILS = (3.0, 1.8, 1.3, 1.1)  # Pareto shapes of the output length: lighter to heavier
PROFILES = ("cpu-tiny", "gpu-qwen3-32b-h100")
PREFILL_BUSY = 0.7  # the share of a prefill engine's time the cell's prompts take
TIE = 0.005  # attainments this close count as equal


def cell(profile: str, prefill: int, decode: int, prompt_tokens: int, tail: float, requests: int) -> dict:
    """Each fixed mode's attainment and TTFT p90 on the cell's arrivals, the winner and its margin."""
    step = load_profile(profile).prefill.step
    rate_per_decode = PREFILL_BUSY / (step.fixed_s + prompt_tokens * step.prefill_s_per_token)
    scenario = Scenario(name="mode-map", description="", profile=profile, prefill=prefill, decode=decode,
                        window_s=1.0, drain_s=60.0, streams=[Stream(
                            rate_per_decode=rate_per_decode, prompt_tokens=(prompt_tokens, prompt_tokens),
                            output_shape=tail, output_max=2000)]).with_requests(requests)
    classes = default_classes()
    by_mode = {}
    for mode in MODES:
        served = simulate(scenario, mode, classes)
        met = sum(classes[s.arrival.qos_class].met(s.ttft_s, s.tpot_s) for s in served if s.done)
        ttfts = [s.ttft_s for s in served if s.token_times]
        by_mode[mode] = {"attainment": met / len(served),
                         "ttft_p90_ms": float(np.percentile(ttfts, 90)) * 1e3 if ttfts else float("inf")}
    top = max(m["attainment"] for m in by_mode.values())
    tied = sorted((m for m in MODES if top - by_mode[m]["attainment"] <= TIE), key=lambda m: by_mode[m]["ttft_p90_ms"])
    if len(tied) > 1:
        (winner, runner_up), measure = tied[:2], "ttft_p90"
        margin = by_mode[runner_up]["ttft_p90_ms"] / by_mode[winner]["ttft_p90_ms"] - 1
    else:
        winner, measure = tied[0], "attainment"
        runner_up = max((m for m in MODES if m != winner), key=lambda m: by_mode[m]["attainment"])
        margin = by_mode[winner]["attainment"] / max(by_mode[runner_up]["attainment"], 1e-9) - 1
    return {"rate_per_decode": rate_per_decode, "modes": by_mode, "winner": winner, "runner_up": runner_up,
            "margin": margin, "by": measure}


def mode_map(profile: str, prefill: int, decode: int, requests: int, lengths=PROMPT_LENGTHS, tails=TAILS) -> dict:
    return {"profile": profile, "shape": [prefill, decode], "requests": requests, "lengths": list(lengths),
            "tails": list(tails),
            "cells": [[cell(profile, prefill, decode, n, tail, requests) for n in lengths] for tail in tails]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"push": 0, "pull": 1, "local": 2}
    grid = np.array([[colours[c["winner"]] for c in row] for row in result["cells"]])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.imshow(grid, cmap=matplotlib.colors.ListedColormap(["#4c72b0", "#dd8452", "#55a868"]), vmin=0, vmax=2,
              aspect="auto")
    for i, row in enumerate(result["cells"]):
        for j, c in enumerate(row):
            text = (f"{c['winner']} = {c['runner_up']}" if c["margin"] < TIE else
                    f"{c['winner']}\n+{c['margin']:.0%} {'met' if c['by'] == 'attainment' else 'p90'}")
            ax.text(j, i, text,
                    ha="center", va="center", fontsize=8, color="white")
    ax.set_xticks(range(len(result["lengths"])), result["lengths"])
    ax.set_yticks(range(len(result["tails"])), [f"Pareto {t:g}" for t in result["tails"]])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("output tail (heavier: more decode skew)")
    p, d = result["shape"]
    ax.set_title(f"{result['profile']}, {p}P x {d}D, prefill {PREFILL_BUSY:.0%} busy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES))
    parser.add_argument("--shape", type=parse_shape, default=(8, 8), help="prefill x decode replicas")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/sim"))
    args = parser.parse_args()
    prefill, decode = args.shape
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for profile in args.profiles:
        result = mode_map(profile, prefill, decode, args.requests)
        plot(result, args.out / f"mode-map-{profile}.png")
        results.append(result)
        for tail, row in zip(result["tails"], result["cells"]):
            print(profile, f"Pareto {tail:g}:", "  ".join(f"{n}: {c['winner']} +{c['margin']:.0%} ({c['by']})"
                                                        for n, c in zip(result["lengths"], row)))
    (args.out / "mode-map.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
