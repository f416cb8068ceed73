"""Time to first token on several decode replicas, with and without one of them kept busy.

    python -m bench.busy_replica [--config configs/cpu-1p2d.yaml] [--requests 20] [--prompt-tokens 512]

Starts the app on a Ray cluster of its own. It sends `--requests` short requests in each mode and in `auto`, one
after another, the modes interleaved, first with every decode replica idle, then while one long request keeps a
decode replica decoding, and prints TTFT p50/p99 and the share of requests each decode replica took (from
`x-pd-timings`), side by side from one run. On a 2-core machine the decode replicas share a core, so the busy one also slows the other: the numbers show
where the router sends requests, and what the shared core costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
from collections import Counter

import httpx
from rich.console import Console
from rich.table import Table

from bench.load import Target, percentile, send
from bench.systems import app_on_own_cluster, bench_config

MODES = ("push", "pull", "local", "auto")


async def measure(target: Target, prompts: list[list[int]], max_tokens: int) -> dict[str, tuple[list, Counter]]:
    """Each prompt in every mode, the modes interleaved in a fresh order per prompt, so that all of them see the
    same conditions: per mode, the TTFTs and the decode replicas that served them."""
    rng = random.Random(len(prompts))
    samples: dict[str, list] = {mode: [] for mode in MODES}
    async with httpx.AsyncClient(timeout=120) as client:
        for prompt in prompts:
            for mode in rng.sample(MODES, len(MODES)):
                moded = Target(target.urls, target.model, {**target.headers, "x-kv-transfer-mode": mode})
                samples[mode].append(await send(client, moded, prompt, max_tokens))
    return {mode: ([s.ttft for s in got], Counter(s.replicas.get("decode") for s in got))
            for mode, got in samples.items()}


async def busy_decode(target: Target, tokens: int, started: asyncio.Event) -> str:
    """One long local request; sets `started` once it is decoding; returns the decode replica that ran it."""
    body = {"model": target.model, "prompt": [101, 102, 103], "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    headers = {**target.headers, "x-kv-transfer-mode": "local"}
    replica = None
    async with httpx.AsyncClient(timeout=600) as client:
        async with client.stream("POST", target.urls[0] + "/v1/completions", json=body, headers=headers) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    started.set()
                    event = json.loads(line[len("data: "):])
                    replica = event.get("pd_timings", {}).get("replicas", {}).get("decode", replica)
    return replica


async def run(target: Target, prompts: list[list[int]], max_tokens: int, busy_tokens: int) -> tuple[dict, str, bool]:
    """TTFTs and decode replicas per (mode, condition); the busy decode replica; whether it stayed busy throughout."""
    results = {(mode, "all idle"): got for mode, got in (await measure(target, prompts, max_tokens)).items()}
    started = asyncio.Event()
    busy = asyncio.ensure_future(busy_decode(target, busy_tokens, started))
    await started.wait()
    busy_results = await measure(target, prompts, max_tokens)
    results |= {(mode, "one decode replica busy"): got for mode, got in busy_results.items()}
    stayed_busy = not busy.done()  # the long request outlasted the measurement
    return results, await busy, stayed_busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-1p2d.yaml")
    parser.add_argument("--requests", type=int, default=20, help="per mode")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--busy-tokens", type=int, default=2000)
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = bench_config(args.config)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    console = Console(width=120)
    with console.status("starting the app"), app_on_own_cluster(config) as url:
        target = Target([url], config.model_id, {"x-pd-timings": "1"})
        asyncio.run(measure(target, prompts[:2], args.max_tokens))  # warm-up
        with console.status("measuring"):
            results, busy_replica, stayed_busy = asyncio.run(run(target, prompts, args.max_tokens, args.busy_tokens))

    table = Table("mode", "decode replicas", "TTFT p50 ms", "TTFT p99 ms", "requests per decode replica",
                  title=f"{args.requests} requests of {args.prompt_tokens} prompt tokens, one at a time",
                  caption=f"busy: decode replica {busy_replica}, decoding {args.busy_tokens} tokens"
                          f" ({'throughout' if stayed_busy else 'NOT throughout: raise --busy-tokens'})")
    for (mode, condition), (ttfts, replicas) in results.items():
        busy = condition != "all idle"
        shares = ", ".join(f"{r}{' (busy)' if busy and r == busy_replica else ''}: {n}"
                           for r, n in replicas.most_common())
        table.add_row(mode, condition, f"{percentile(ttfts, 50) * 1e3:.1f}", f"{percentile(ttfts, 99) * 1e3:.1f}",
                      shares)
    console.print(table)


if __name__ == "__main__":
    main()
