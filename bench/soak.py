"""Soak: many minutes of mixed-mode load with cancellations, then proof that nothing piled up.

    python -m bench.soak [--minutes 30] [--shapes fixed|random] [--concurrency 8] [--config configs/cpu-tiny.yaml]

Starts the app on a Ray cluster of its own and drives it: push, pull and local at random, and a share of clients that
go away before their first token or mid-stream. `--shapes random` draws prompt lengths from 8 to 1,500 tokens and 1
to 64 output tokens; `--shapes fixed` sends 512-token prompts for 32 tokens, so that memory which grows only with
new shapes (compiled kernels, allocator caches) shows apart from memory that grows with the number of requests.

Every `--sample-s` it samples the memory (RSS) of every process of the stack (Serve's proxy and controller, the
ingress and engine replicas, each engine's core and worker processes) and each engine connector's in-flight transfer
state. Once the load stops and the engines are idle, it writes `<out>/soak-<shapes>.json` and `.png` (RSS over time)
and prints each process's growth over the last `--window-min` minutes: flat means within 5%.
Exits 1 if a KV block is still in use or any transfer state is left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from bench.systems import ROOT, bench_config, engine_processes, serve_actor_pids

ROLES = ("prefill", "decode")
MODES = ("push", "pull", "local")
FLAT_WITHIN = 0.05  # a process whose RSS grew less than this over the window counts as flat
FIXED_SHAPE = (512, 32)  # prompt tokens, output tokens


def request_body(model: str, shapes: str, rng: random.Random) -> dict:
    prompt_len, max_tokens = FIXED_SHAPE if shapes == "fixed" else (rng.randint(8, 1500), rng.randint(1, 64))
    return {"model": model, "prompt": [rng.randrange(100, 4000) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]), "stream": True}


async def one_request(client: httpx.AsyncClient, url: str, body: dict, rng: random.Random) -> str:
    """One streaming completion; returns its outcome."""
    mode, leave = rng.choice(MODES), rng.choices(["never", "before-first-token", "mid-stream"], [70, 15, 15])[0]
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


def stack_processes(app_name: str) -> dict[str, psutil.Process]:
    """Every process of the serving stack, named by what it is: Serve's proxy and controller, each replica by its
    deployment, and each engine's core and worker processes under their replica's name."""
    processes = {}
    for prefix, label in (("SERVE_PROXY_ACTOR", "proxy"), ("SERVE_CONTROLLER_ACTOR", "controller")):
        for pid in serve_actor_pids(prefix).values():
            processes[label] = psutil.Process(pid)
    for name, pid in serve_actor_pids(f"SERVE_REPLICA::{app_name}#").items():
        deployment = name.split("#")[1]
        processes[deployment] = psutil.Process(pid)
        for engine in engine_processes(pid):
            processes[f"{deployment} {engine.name().removeprefix('VLLM::')}"] = engine
    return processes


def memory_mib(processes: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: p.memory_info().rss / 2**20 for name, p in processes.items() if p.is_running()}


async def soak(url: str, body_of, handles: dict, processes: dict, minutes: float, concurrency: int,
               sample_s: float) -> tuple[Counter, list[dict]]:
    start = time.monotonic()
    deadline = start + minutes * 60
    outcomes, samples = Counter(), []
    rng = random.Random(0)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            try:
                outcomes[await one_request(client, url, body_of(rng), rng)] += 1
            except httpx.HTTPError as e:
                outcomes[f"client error {type(e).__name__}"] += 1

    async def sampler() -> None:
        with tqdm(total=int(minutes * 60), unit="s", desc="soak") as progress:
            while time.monotonic() < deadline:
                state = {role: await h.transfer_state.remote() for role, h in handles.items()}
                samples.append({"minute": (time.monotonic() - start) / 60, "rss_mib": memory_mib(processes),
                                "transfer_state": state, "requests": sum(outcomes.values())})
                await asyncio.sleep(min(sample_s, max(0.0, deadline - time.monotonic())))
                progress.n = int(time.monotonic() - start)
                progress.set_postfix_str(", ".join(f"{k} {v}" for k, v in outcomes.most_common(3)))

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(sampler(), *(client_loop(client) for _ in range(concurrency)))
    return outcomes, samples


def growth_over_window(samples: list[dict], window_min: float) -> dict[str, tuple[float, float, float]]:
    """Per process: RSS (MiB) at the start of the last `window_min` minutes, at the end, and the growth between."""
    end = samples[-1]
    first = next(s for s in samples if s["minute"] >= end["minute"] - window_min)
    return {name: (first["rss_mib"][name], mib, mib / first["rss_mib"][name] - 1)
            for name, mib in end["rss_mib"].items() if name in first["rss_mib"]}


def plot(samples: list[dict], window_min: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (absolute, relative) = plt.subplots(1, 2, figsize=(13, 5))
    names = sorted(samples[-1]["rss_mib"], key=lambda n: -samples[-1]["rss_mib"][n])
    window_start = samples[-1]["minute"] - window_min
    for name in names:
        points = [(s["minute"], s["rss_mib"][name]) for s in samples if name in s["rss_mib"]]
        minutes, mib = zip(*points)
        absolute.plot(minutes, mib, label=name)
        base = next((m for t, m in points if t >= window_start), mib[0])
        relative.plot(minutes, [100 * (m / base - 1) for m in mib], label=name)
    absolute.set(xlabel="minutes", ylabel="RSS (MiB)", title="RSS per process")
    relative.set(xlabel="minutes", ylabel="% of RSS at the window's start",
                 title=f"growth over the last {window_min:g} min (flat: within ±5%)")
    relative.axvspan(window_start, samples[-1]["minute"], alpha=0.08)
    relative.axhline(5, linestyle=":", color="gray")
    relative.axhline(-5, linestyle=":", color="gray")
    relative.set_ylim(-20, 20)
    absolute.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--shapes", choices=("fixed", "random"), default="random")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--window-min", type=float, default=20, help="the growth reported is over this last stretch")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)

    import ray
    from ray import serve

    from app.builder import build_pd_app
    from kv.engine_identity import free_port

    config = bench_config(args.config)
    console = Console()
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        with console.status("starting the app"):
            serve.run(build_pd_app(config), name="pd", route_prefix="/")
        handles = {role: serve.get_deployment_handle(f"{role.capitalize()}Server", app_name="pd") for role in ROLES}
        processes = stack_processes("pd")
        outcomes, samples = asyncio.run(soak(
            f"http://127.0.0.1:{port}", lambda rng: request_body(config.model_id, args.shapes, rng), handles,
            processes, args.minutes, args.concurrency, args.sample_s))
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
    finally:
        serve.shutdown()
        ray.shutdown()

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"soak-{args.shapes}"
    title = (f"bench.soak --shapes {args.shapes}: {sum(outcomes.values())} requests in {args.minutes:g} min, "
             f"concurrency {args.concurrency}")
    stem.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "outcomes": outcomes, "samples": samples}, indent=1))
    plot(samples, args.window_min, title, stem.with_suffix(".png"))

    console.print(title)
    for outcome, n in sorted(outcomes.items()):
        console.print(f"  {outcome}: {n}")
    table = Table("process", "RSS at start", f"at -{args.window_min:g} min", "at end", "growth over window", "flat",
                  title="RSS (MiB)")
    for name, (window_start, end_mib, grew) in growth_over_window(samples, args.window_min).items():
        table.add_row(name, f"{samples[0]['rss_mib'].get(name, 0):.0f}", f"{window_start:.0f}", f"{end_mib:.0f}",
                      f"{grew:+.1%}", "yes" if abs(grew) <= FLAT_WITHIN else "NO")
    console.print(table)
    console.print("engines' loads once idle:", loads)
    console.print("in-flight transfer state, peak during the run:",
                  {role: {k: max(s["transfer_state"][role][k] for s in samples) for k in state[role]}
                   for role in ROLES})
    console.print("in-flight transfer state at the end:", state)
    console.print(f"wrote {stem}.json and {stem}.png")
    leaked = not idle or any(n for s in state.values() for n in s.values())
    sys.exit(1 if leaked else 0)


if __name__ == "__main__":
    main()
