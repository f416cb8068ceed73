"""Soak: minutes of mixed-mode load with cancellations, then proof that nothing piled up.

    python -m bench.soak [--minutes 10] [--concurrency 8] [--config configs/cpu-tiny.yaml]

Starts the app on a Ray cluster of its own and drives it: push, pull and local at random, prompt lengths from 8 to
1,500 tokens, 1 to 64 output tokens, and a share of clients that go away before their first token or mid-stream.
Every 30 s it samples the memory (RSS) of every process of the app (ingress, engine replicas, their engine and
worker processes) and the in-flight transfer state of each engine's connector. Once the load stops and the engines
are idle, it prints each process's memory over the run and the transfer state.
Exits 1 if a KV block is still in use or any transfer state is left.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from collections import Counter

import httpx
import psutil
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from bench.systems import engine_processes, serve_replica_pids

ROLES = ("prefill", "decode")
MODES = ("push", "pull", "local")
SAMPLE_EVERY_S = 30


async def one_request(client: httpx.AsyncClient, url: str, model: str, rng: random.Random) -> str:
    """One streaming completion; returns its outcome."""
    mode, leave = rng.choice(MODES), rng.choices(["never", "before-first-token", "mid-stream"], [70, 15, 15])[0]
    body = {"model": model, "prompt": [rng.randrange(100, 4000) for _ in range(rng.randint(8, 1500))],
            "max_tokens": rng.randint(1, 64), "temperature": rng.choice([0, 0.8]), "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"x-kv-transfer-mode": mode}) as response:
        if response.status_code != 200:
            return f"{mode}: HTTP {response.status_code}"
        if leave == "before-first-token":
            return f"{mode}: left before the first token"
        async for line in response.aiter_lines():
            if '"error"' in line:
                return f"{mode}: error event"
            if line.startswith("data: {") and leave == "mid-stream":
                return f"{mode}: left mid-stream"
    return f"{mode}: completed"


def memory_mb(processes: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: p.memory_info().rss / 2**20 for name, p in processes.items() if p.is_running()}


def app_processes(handles: dict) -> dict[str, psutil.Process]:
    """Every process of the app: its replicas (ingress included) and each engine's processes."""
    processes = {f"replica {pid}": psutil.Process(pid) for pid in serve_replica_pids("pd")}
    for role, handle in handles.items():
        for process in engine_processes(handle.engine_info.remote().result()["pid"]):
            processes[f"{role} {process.name()} {process.pid}"] = process
    return processes


async def soak(url: str, model: str, handles: dict, processes: dict, minutes: float, concurrency: int) -> tuple:
    deadline = time.monotonic() + minutes * 60
    outcomes, samples = Counter(), []
    rng = random.Random(0)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            try:
                outcomes[await one_request(client, url, model, rng)] += 1
            except httpx.HTTPError as e:
                outcomes[f"client error {type(e).__name__}"] += 1

    async def sampler() -> None:
        with tqdm(total=int(minutes * 60), unit="s", desc="soak") as progress:
            while time.monotonic() < deadline:
                await asyncio.sleep(SAMPLE_EVERY_S)
                state = {role: await h.transfer_state.remote() for role, h in handles.items()}
                samples.append((memory_mb(processes), state))
                progress.update(SAMPLE_EVERY_S)
                progress.set_postfix_str(", ".join(f"{k} {v}" for k, v in outcomes.most_common(3)))

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(sampler(), *(client_loop(client) for _ in range(concurrency)))
    return outcomes, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)

    import ray
    from ray import serve

    from app.builder import build_pd_app, resolve_config_path
    from app.config import load_config
    from kv.engine_identity import free_port

    config = load_config(resolve_config_path(args.config))
    console = Console()
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        with console.status("starting the app"):
            serve.run(build_pd_app(config), name="pd", route_prefix="/")
        handles = {role: serve.get_deployment_handle(f"{role.capitalize()}Server", app_name="pd") for role in ROLES}
        processes = app_processes(handles)
        outcomes, samples = asyncio.run(soak(f"http://127.0.0.1:{port}", config.model_id, handles, processes,
                                             args.minutes, args.concurrency))
        settle_s = config.transfer.lease_s + config.transfer.push_timeout_s + 10
        with console.status(f"waiting up to {settle_s} s for the engines to go idle"):
            end = time.monotonic() + settle_s
            while True:
                loads = {role: h.load.remote().result() for role, h in handles.items()}
                state = {role: h.transfer_state.remote().result() for role, h in handles.items()}
                idle = all(l["kv_cache_usage"] == 0 and l["running"] == l["waiting"] == 0 for l in loads.values())
                if (idle and not any(n for s in state.values() for n in s.values())) or time.monotonic() > end:
                    break
                time.sleep(1)
        final_memory = memory_mb(processes)
    finally:
        serve.shutdown()
        ray.shutdown()

    console.print(f"{sum(outcomes.values())} requests in {args.minutes:g} min at concurrency {args.concurrency}:")
    for outcome, n in sorted(outcomes.items()):
        console.print(f"  {outcome}: {n}")
    # RSS over the run (MiB): whether growth levels off (caches warming to new shapes) or keeps climbing (a leak).
    shown = samples[::max(1, len(samples) // 5)]
    table = Table("process", *(f"{(i * SAMPLE_EVERY_S * max(1, len(samples) // 5) + SAMPLE_EVERY_S) / 60:.1f} min"
                               for i in range(len(shown))), "end", "end - first", title="RSS (MiB)")
    for name, end_mb in final_memory.items():
        table.add_row(name, *(f"{s[0].get(name, 0):.0f}" for s in shown), f"{end_mb:.0f}",
                      f"{end_mb - samples[0][0][name]:+.0f}")
    console.print(table)
    console.print("engines' loads once idle:", loads)
    console.print("in-flight transfer state, peak during the run:",
                  {role: {k: max(s[1][role][k] for s in samples) for k in state[role]} for role in ROLES})
    console.print("in-flight transfer state at the end:", state)
    leaked = not idle or any(n for s in state.values() for n in s.values())
    sys.exit(1 if leaked else 0)


if __name__ == "__main__":
    main()
