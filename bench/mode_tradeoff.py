"""The trade the mode policy weighs, measured: a probe prompt's TTFT against the stall it imposes on streams already
decoding, in every mode and under `auto`, side by side in one run.

    python -m bench.mode_tradeoff [--config configs/cpu-tiny.yaml] [--streams 0 6 16] [--burst 12]
                                  [--lengths 128 1024 1900] [--repeats 5] [--out bench/results/mode_tradeoff.json]

Starts the app on a Ray cluster of its own. Scenarios:
- K streams decoding, for each K in `--streams`: K long local streams keep the decode engine decoding (each
  restarted when it ends); then, `--repeats` times, one probe of each length is sent in each of push, pull, local
  and auto, interleaved, one at a time (4 output tokens);
- a burst (`--burst N`, 0 for none): on an idle app, `--repeats` times for each length and each mode, interleaved,
  N probes of that length sent at once.
Per probe: its TTFT as the ingress stamps it (`pd_timings`), as the client sees it, its prefill's compute time
(the prefill engine's own stamps), and the worst gap between two tokens of any background stream that overlaps the
probe. Prints medians per (scenario, length, mode), auto's choices, auto's ratio to the best fixed mode, and how
much slower a pull probe's prefill computes beside decoding streams than with none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from bench.load import Target, send
from bench.systems import app_on_own_cluster, bench_config

MODES = ("push", "pull", "local", "auto")
FIXED = MODES[:3]
PROBE_TOKENS = 4


class BackgroundStreams:
    """K local streams on the decode engine, each restarted when it ends; every token's arrival time is kept."""

    def __init__(self, target: Target, count: int, tokens: int):
        self.target, self.count, self.tokens = target, count, tokens
        self.arrivals: list[list[float]] = []  # per stream run: perf_counter times of its tokens
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._stream(n)) for n in range(self.count)]
        while sum(len(a) > 0 for a in self.arrivals) < self.count:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # a few load reports after every stream is decoding

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _stream(self, n: int) -> None:
        body = {"model": self.target.model, "prompt": [100 + n, 101, 102], "max_tokens": self.tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        headers = {**self.target.headers, "x-kv-transfer-mode": "local"}
        async with httpx.AsyncClient(timeout=600) as client:
            while True:
                times: list[float] = []
                self.arrivals.append(times)
                async with client.stream("POST", self.target.urls[0] + "/v1/completions", json=body,
                                         headers=headers) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and '"choices"' in line:
                            times.append(time.perf_counter())

    def worst_gap(self, start: float, end: float) -> float:
        """The longest wait for a token of any stream, over the gaps that overlap [start, end]."""
        return max((b - a for times in self.arrivals for a, b in zip(times, times[1:]) if b > start and a < end),
                   default=0.0)


async def probe(client: httpx.AsyncClient, target: Target, mode: str, prompt: list[int],
                background: BackgroundStreams) -> dict:
    moded = Target(target.urls, target.model, {**target.headers, "x-kv-transfer-mode": mode})
    started = time.perf_counter()
    sample = await send(client, moded, prompt, PROBE_TOKENS)
    ended = time.perf_counter()
    return {"mode": mode, "served": sample.decision.get("mode"), "reason": sample.decision.get("reason"),
            "ttft_ingress_ms": sample.phases_ms.get("ttft"), "ttft_client_ms": sample.ttft * 1e3,
            "prefill_compute_ms": sample.phases_ms.get("prefill_compute"),
            "worst_gap_ms": background.worst_gap(started, ended) * 1e3}


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 4000) for _ in range(length)]


async def measure(target: Target, streams: list[int], burst: int, lengths: list[int], repeats: int,
                  rng: random.Random) -> list[dict]:
    results = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=burst + 8)) as client:
        for count in streams:
            background = BackgroundStreams(target, count, 1800)
            await background.start()
            try:
                for repeat in range(repeats):
                    for length in lengths:
                        prompt = random_prompt(rng, length)
                        for mode in rng.sample(MODES, len(MODES)):  # interleaved, in a fresh order each time
                            result = await probe(client, target, mode, prompt, background)
                            results.append({"scenario": f"{count} streams", "length": length, "repeat": repeat,
                                            **result})
            finally:
                await background.stop()
        if burst:
            idle = BackgroundStreams(target, 0, 0)
            for repeat in range(repeats):
                for length in lengths:
                    for mode in rng.sample(MODES, len(MODES)):
                        probes = [probe(client, target, mode, random_prompt(rng, length), idle) for _ in range(burst)]
                        results += [{"scenario": f"burst of {burst}", "length": length, "repeat": repeat, **result}
                                    for result in await asyncio.gather(*probes)]
    return results


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def report(results: list[dict], console: Console) -> str:
    """Prints the table; returns it as markdown."""
    columns = ["scenario", "prompt tokens", *(f"{m} TTFT" for m in MODES), *(f"{m} gap" for m in MODES),
               "auto / best TTFT", "auto / best gap", "auto chose"]
    table = Table(*columns, title="probe TTFT p50 (ingress stamp) and the background streams' worst gap p50, ms")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for scenario in dict.fromkeys(r["scenario"] for r in results):  # in the order measured
        for length in sorted({r["length"] for r in results}):
            cell = {m: [r for r in results if (r["scenario"], r["length"], r["mode"]) == (scenario, length, m)]
                    for m in MODES}
            ttft = {m: median(cell[m], "ttft_ingress_ms") for m in MODES}
            gap = {m: median(cell[m], "worst_gap_ms") for m in MODES}
            best_ttft, best_gap = min(ttft[m] for m in FIXED), min(gap[m] for m in FIXED)
            chose = Counter(r["served"] for r in cell["auto"])
            row = [scenario, str(length), *(f"{ttft[m]:.0f}" for m in MODES), *(f"{gap[m]:.0f}" for m in MODES),
                   f"{ttft['auto'] / best_ttft:.2f}x", f"{gap['auto'] / best_gap:.2f}x" if best_gap else "-",
                   ", ".join(f"{m} {n}" for m, n in chose.most_common())]
            table.add_row(*row)
            lines.append("| " + " | ".join(row) + " |")
    console.print(table)
    return "\n".join(lines + ["", *prefill_slowdown(results)])


def prefill_slowdown(results: list[dict]) -> list[str]:
    """A pull probe's prefill compute p50 in each scenario against the scenario with no background streams: the
    prefill engine has its core, but the streams' serving stack may share it."""
    pulls = [r for r in results if r["mode"] == "pull" and r["prefill_compute_ms"] is not None]
    idle = {length: median([r for r in pulls if (r["scenario"], r["length"]) == ("0 streams", length)],
                           "prefill_compute_ms")
            for length in {r["length"] for r in pulls if r["scenario"] == "0 streams"}}
    lines = ["| scenario | prompt tokens | pull prefill compute p50, ms | vs no streams |", "|---|---|---|---|"]
    for scenario in dict.fromkeys(r["scenario"] for r in pulls):
        for length in sorted({r["length"] for r in pulls if r["scenario"] == scenario}):
            ms = median([r for r in pulls if (r["scenario"], r["length"]) == (scenario, length)], "prefill_compute_ms")
            lines.append(f"| {scenario} | {length} | {ms:.0f} | "
                         f"{f'{ms / idle[length]:.2f}x' if length in idle else '-'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--streams", type=int, nargs="*", default=[0, 6, 16])
    parser.add_argument("--burst", type=int, default=12, help="probes sent at once in the burst scenario; 0: none")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 1900])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/mode_tradeoff.json"))
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = bench_config(args.config)
    console = Console(width=160)
    with console.status("starting the app, then measuring"), app_on_own_cluster(config) as url:
        target = Target([url], config.model_id, {"x-pd-timings": "1"})
        rng = random.Random(args.seed)
        asyncio.run(measure(target, [0], 0, [128], 1, rng))  # warm-up
        results = asyncio.run(measure(target, args.streams, args.burst, args.lengths, args.repeats, rng))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                   indent=1))
    console.print(report(results, console))


if __name__ == "__main__":
    main()
