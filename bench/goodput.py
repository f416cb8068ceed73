"""Goodput under open-loop load: requests per second that meet both their class's SLOs, per service class, for
every way of serving on the same cores, at rising arrival rates.

    python -m bench.goodput [--config configs/cpu-tiny.yaml] [--rates 1 2 3 4] [--window-s 20] [--drain-s 20]
                            [--arrivals poisson|onoff] [--interactive-share 0.7] [--out DIR] [--update-readme]

Systems, each fed the same arrivals at each rate:
- `vllm`: vLLM's own OpenAI server, one engine doing prefill and decode together, on the prefill side's cores;
  `vllm-x2`: two of them, one per side's cores, round-robin. Both schedule by priority, and each request carries its
  class's priority, as the app's engines do;
- `push`, `pull`, `local`: this app, every request in that mode;
- `threshold`: this app's fixed rule (local for short prompts or while prefill is backed up, else pull);
- `auto`: this app's mode policy.

Workload (seeded, so every system gets the same requests at a rate): arrivals open-loop -- Poisson, or on/off (bursts
at three times the rate, a third of the time); prompts log-uniform over 64-1,900 tokens; outputs heavy-tailed
(16 x Pareto(1.5) tokens, at most 512 and what the context leaves); a share of the requests interactive, the rest
batch, each with its class's SLOs from the config (`ingress.classes`). A request is sent at its arrival time whatever
happened to the earlier ones; one still unanswered `--drain-s` after the last arrival is cancelled and counted as
unfinished. The app's requests carry the class header; an answer of 429 or 503 is counted as shed (and must carry
Retry-After). After each of the app's cells, its engines must hold no request and no KV block.

Writes results.json, results.md and goodput.png into --out; --update-readme puts results.md into README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from tqdm import tqdm

from app.policy.mode_policy import MODES, SERVING
from app.policy.service_class import ServiceClass
from bench.load import Sample, Target, percentile, send
from bench.report import machine, update_readme
from bench.systems import ROOT, bench_config, side_by_side
from sim.workload import CLASSES, Arrival, arrivals

APP_SYSTEMS = SERVING  # this app, served each way
SYSTEMS = ("vllm", "vllm-x2", *APP_SYSTEMS)
IDLE_WAIT_S = 60  # a prefill lease is 30 s: KV still held after this is stranded


@dataclass
class Outcome:
    arrival: Arrival
    status: str  # done | shed | unfinished | error
    sample: Sample | None = None
    retry_after: bool = False  # a shed answer said when to come back
    detail: str = ""


def workload_seed(rate_index: int) -> int:
    """The seed of the arrivals at the run's rate_index-th rate (the simulator replays them from it)."""
    return rate_index


def prompt_ids(requests: list[Arrival], seed: int) -> list[list[int]]:
    """Each request's prompt, as random token ids of its length (prefix caching is off: no two share a prefix)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(a.prompt_tokens)] for a in requests]


def met_slo(outcome: Outcome, slo: ServiceClass) -> bool:
    return outcome.sample is not None and slo.met(outcome.sample.ttft, outcome.sample.tpot)


async def run_cell(target: Target, requests: list[Arrival], prompts: list[list[int]], app: bool,
                   classes: dict[str, ServiceClass], drain_s: float) -> list[Outcome]:
    """Every request sent at its arrival time; the last ones given `drain_s` after the last arrival."""
    end = (requests[-1].at_s if requests else 0.0) + drain_s
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(arrival: Arrival, prompt: list[int]) -> Outcome:
            await asyncio.sleep(max(0.0, arrival.at_s - (time.perf_counter() - start)))
            headers, fields = ({"x-pd-class": arrival.qos_class, "x-pd-timings": "1"}, None) if app else \
                (None, {"priority": classes[arrival.qos_class].priority})
            try:
                sample = await asyncio.wait_for(send(client, target, prompt, arrival.max_tokens, headers,
                                                     fields), end - (time.perf_counter() - start))
                return Outcome(arrival, "done", sample)
            except httpx.HTTPStatusError as e:
                code = e.response.status_code
                if code in (429, 503):
                    return Outcome(arrival, "shed", retry_after="retry-after" in e.response.headers)
                return Outcome(arrival, "error", detail=f"HTTP {code}")
            except asyncio.TimeoutError:
                return Outcome(arrival, "unfinished")
            except (httpx.HTTPError, RuntimeError) as e:
                return Outcome(arrival, "error", detail=repr(e)[:200])

        return list(await asyncio.gather(*(one(a, p) for a, p in zip(requests, prompts))))


def cell_stats(outcomes: list[Outcome], classes: dict[str, ServiceClass], window_s: float) -> dict:
    stats: dict = {}
    for name in CLASSES:
        mine = [o for o in outcomes if o.arrival.qos_class == name]
        status = Counter(o.status for o in mine)
        met = sum(met_slo(o, classes[name]) for o in mine)
        ttfts = [o.sample.ttft * 1e3 for o in mine if o.sample]
        stats[name] = {"arrived": len(mine), **{s: status[s] for s in ("done", "shed", "unfinished", "error")},
                       "met": met, "goodput_rps": met / window_s, "attainment": met / len(mine) if mine else None,
                       "shed_without_retry_after": sum(o.status == "shed" and not o.retry_after for o in mine),
                       "ttft_p50": percentile(ttfts, 50) if ttfts else None,
                       "ttft_p99": percentile(ttfts, 99) if ttfts else None}
    done = [o.sample for o in outcomes if o.sample]
    itls = [gap * 1e3 for sample in done for gap in sample.itls]
    # every class together: what the simulator's fidelity is checked against (sim/)
    stats["all"] = {"done": len(done), "ttft_p50": percentile([s.ttft * 1e3 for s in done], 50) if done else None,
                    "ttft_p99": percentile([s.ttft * 1e3 for s in done], 99) if done else None,
                    "itl_p50": percentile(itls, 50) if itls else None}
    stats["decisions"] = dict(Counter(o.sample.decision["mode"] for o in outcomes
                                      if o.sample and o.sample.decision.get("mode")))
    stats["errors"] = sorted({o.detail for o in outcomes if o.status == "error"})[:5]
    return stats


def request_records(rate: float, system: str, outcomes: list[Outcome], classes: dict[str, ServiceClass]) -> list:
    """One line per request of a cell, for looking into why requests missed: its class, mode and the policy's
    predictions (the app's), what it took, and which objective it missed."""
    records = []
    for o in outcomes:
        record = {"rate": rate, "system": system, "class": o.arrival.qos_class, "prompt_tokens":
                  o.arrival.prompt_tokens, "max_tokens": o.arrival.max_tokens, "status": o.status}
        if o.sample is not None:
            slo = classes[o.arrival.qos_class]
            record |= {"ttft_ms": round(o.sample.ttft * 1e3, 1), "met_ttft": slo.met(o.sample.ttft),
                       "tpot_ms": None if o.sample.tpot is None else round(o.sample.tpot * 1e3, 1),
                       "met": slo.met(o.sample.ttft, o.sample.tpot), "decision": o.sample.decision,
                       "phases_ms": o.sample.phases_ms}
        records.append(record)
    return records


async def measure(run, classes: dict[str, ServiceClass], args, max_model_len: int, console: Console,
                  requests_log: Path) -> dict:
    results: dict = defaultdict(dict)
    order = random.Random(2)
    names = [n for n in SYSTEMS if n in run.systems]
    with tqdm(total=len(args.rates) * len(names), desc="systems x rates") as bar:
        for i, rate in enumerate(args.rates):
            requests = arrivals(rate, args.window_s, args.arrivals, args.interactive_share, max_model_len,
                                seed=workload_seed(i))
            prompts = prompt_ids(requests, seed=workload_seed(i))
            order.shuffle(names)  # no system always runs right after the same other one
            for name in names:
                system, target = run.systems[name]
                app = name in APP_SYSTEMS
                system.thaw()
                try:
                    outcomes = await run_cell(target, requests, prompts, app, classes, args.drain_s)
                    stats = cell_stats(outcomes, classes, args.window_s)
                    if app:  # nothing held once the last request ended
                        loads = await asyncio.to_thread(wait_idle, run)
                        stats["kv_left"] = any(l["kv_cache_usage"] > 0 or l["running"] or l["waiting"]
                                               for l in loads.values())
                finally:
                    system.freeze()
                results[name][rate] = stats
                with requests_log.open("a") as log:
                    log.writelines(json.dumps(r) + "\n" for r in request_records(rate, name, outcomes, classes))
                i_stats = stats["interactive"]
                bar.write(f"{rate:g}/s {name}: interactive {i_stats['met']}/{i_stats['arrived']} met, "
                          f"batch {stats['batch']['met']}/{stats['batch']['arrived']} met, "
                          f"{stats['batch']['shed']} batch shed")
                bar.update()
    return results


def wait_idle(run) -> dict:
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        loads = run.loads()
        idle = all(l["kv_cache_usage"] == 0 and not l["running"] and not l["waiting"] for l in loads.values())
        if idle or time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


# -- report ------------------------------------------------------------------------------------------------------

def best_fixed(cells: dict, rate) -> str:
    return max(MODES, key=lambda m: cells[m][rate]["interactive"]["goodput_rps"])


def knee(cells: dict, rates: list) -> float:
    """The rate at which the best fixed mode's interactive goodput peaks (past it, more load serves fewer users)."""
    return max(rates, key=lambda r: cells[best_fixed(cells, r)][r]["interactive"]["goodput_rps"])


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def markdown(results: dict) -> str:
    cells, rates = results["cells"], results["rates"]
    classes = results["classes"]
    names = [n for n in SYSTEMS if n in cells]
    lines = [f"Machine: {results['machine']}. Config `{results['config']}`, model `{results['model']}`. Run "
             f"{results['date']} with:", "", "```", results["command"], "```", "",
             f"{results['arrivals']} arrivals for {results['window_s']:g} s per cell, then at most "
             f"{results['drain_s']:g} s to finish; {results['interactive_share']:.0%} interactive. SLOs: " + "; ".join(
                 f"{n} TTFT {c['ttft_slo_ms']:g} ms and TPOT {c['tpot_slo_ms']:g} ms" for n, c in classes.items())
             + ". Goodput: requests per second of the window that met both.", "",
             "| rate /s | system | interactive goodput /s | interactive attainment | interactive TTFT p99 ms | "
             "batch goodput /s | batch attainment | batch shed | unfinished | decisions |", "|" + "---|" * 10]
    for rate in rates:
        for name in names:
            s = cells[name][str(rate)]
            i, b = s["interactive"], s["batch"]
            mix = ", ".join(f"{m} {n}" for m, n in sorted(s["decisions"].items(), key=lambda kv: -kv[1]))
            lines.append(f"| {rate:g} | {name} | {i['goodput_rps']:.2f} | {fmt_share(i['attainment'])} | "
                         f"{fmt_ms(i['ttft_p99'])} | {b['goodput_rps']:.2f} | {fmt_share(b['attainment'])} | "
                         f"{b['shed']} | {i['unfinished'] + b['unfinished']} | {mix} |")
    if all(m in cells for m in (*MODES, "auto")):
        at_knee = knee({m: {r: cells[m][str(r)] for r in rates} for m in cells}, rates)
        lines += ["", f"`auto`'s interactive goodput against the best fixed mode's and two plain engines' (knee: "
                  f"{at_knee:g}/s, where the best fixed mode's peaks):", "",
                  "| rate /s | best fixed | auto / best fixed | threshold / best fixed | auto / vllm-x2 | auto / vllm |",
                  "|---|---|---|---|---|---|"]
        for rate in rates:
            row = {n: cells[n][str(rate)]["interactive"]["goodput_rps"] for n in names}
            best = max(MODES, key=row.get)
            lines.append(f"| {rate:g} | {best} {row[best]:.2f} | {ratio(row['auto'], row[best])} | "
                         f"{ratio(row.get('threshold'), row[best])} | {ratio(row['auto'], row.get('vllm-x2'))} | "
                         f"{ratio(row['auto'], row.get('vllm'))} |")
    app_cells = [cells[n][str(r)] for n in names if n in APP_SYSTEMS for r in rates]
    shed = sum(c[k]["shed"] for c in app_cells for k in CLASSES)
    bare = sum(c[k]["shed_without_retry_after"] for c in app_cells for k in CLASSES)
    errors = sorted({e for n in names for r in rates for e in cells[n][str(r)]["errors"]})
    lines += ["", f"The app over the whole run: {shed} requests shed ({bare} without Retry-After); "
              f"KV or requests left on an engine after a cell: "
              f"{sum(c.get('kv_left', False) for c in app_cells)} of {len(app_cells)} cells; "
              f"errors: {', '.join(errors) if errors else 'none'}.", "", "![goodput and SLO attainment](goodput.png)"]
    return "\n".join(lines) + "\n"


def fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, rates = results["cells"], results["rates"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for col, qos in enumerate(CLASSES):
        for name, by_rate in cells.items():
            got = [by_rate[str(r)][qos] for r in rates]
            style = {"linewidth": 2.5} if name == "auto" else {}
            axes[0][col].plot(rates, [g["goodput_rps"] for g in got], marker="o", label=name, **style)
            axes[1][col].plot(rates, [100 * (g["attainment"] or 0) for g in got], marker="o", label=name, **style)
        axes[0][col].set(ylabel="goodput (requests/s meeting both SLOs)", title=qos)
        axes[1][col].set(xlabel="arrival rate (requests/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][1].legend()
    fig.suptitle(f"{results['config']}: {results['arrivals']} arrivals")
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 2, 3, 4], help="arrivals per second")
    parser.add_argument("--window-s", type=float, default=20)
    parser.add_argument("--drain-s", type=float, default=20)
    parser.add_argument("--arrivals", choices=("poisson", "onoff"), default="poisson")
    parser.add_argument("--interactive-share", type=float, default=0.7)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--out", type=Path, help="default: bench/results/goodput/<config's name>")
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped"))  # still tear down what was started
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = bench_config(args.config)
    name = Path(args.config).stem
    out = args.out or ROOT / "bench" / "results" / "goodput" / name
    out.mkdir(parents=True, exist_ok=True)
    classes = {n: config.ingress.classes[n] for n in CLASSES}
    console = Console()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    requests_log = log_dir / "requests.jsonl"
    console.print(f"logs of the plain vLLM servers, and every request of every cell (requests.jsonl): {log_dir}")
    headers = {n: {"x-kv-transfer-mode": n} for n in APP_SYSTEMS if n in args.systems}
    with side_by_side(config, headers, log_dir, console) as run:
        for plain in {"vllm", "vllm-x2"} - set(args.systems):
            run.systems.pop(plain)
        max_model_len = config.decode.engine_kwargs["max_model_len"]
        cells = asyncio.run(measure(run, classes, args, max_model_len, console, requests_log))

    results = {"machine": machine(), "config": args.config, "model": config.model_id,
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": "python -m bench.goodput " + " ".join(sys.argv[1:]),
               "rates": args.rates, "window_s": args.window_s, "drain_s": args.drain_s, "arrivals": args.arrivals,
               "interactive_share": args.interactive_share, "max_model_len": max_model_len,
               "seeds": [workload_seed(i) for i in range(len(args.rates))],
               "classes": {n: c.model_dump() for n, c in classes.items()},
               "cells": json.loads(json.dumps(cells))}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (out / "results.md").write_text(text)
    plot(results, out)
    if args.update_readme:
        update_readme(text, out, f"<!-- bench.goodput {name}: start -->", f"<!-- bench.goodput {name}: end -->")
    console.print(text)


if __name__ == "__main__":
    main()
