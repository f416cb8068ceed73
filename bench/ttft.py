"""Time to first token per transfer mode, measured side by side in one run on the same engines.

    python -m bench.ttft [--config configs/cpu-tiny.yaml] [--lengths 128 1024 1900] [--repeats 10]

Starts a Ray cluster and the app (reporting cold start and memory), then sends streaming completions of fixed
prompt lengths, cycling through the modes request by request so that machine noise hits every mode alike.
`local` is the colocated baseline: the decode engine prefills the prompt itself, behind the same ingress.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time

import httpx
import psutil
from rich.console import Console
from rich.table import Table

MODE_HEADER = "x-kv-transfer-mode"


def first_token_seconds(client: httpx.Client, url: str, model: str, prompt: list[int], mode: str) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", url, json=body, headers={MODE_HEADER: mode}) as response:
        response.raise_for_status()
        assert response.headers[MODE_HEADER] == mode
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.perf_counter() - start
    raise RuntimeError("stream ended without a token")


def idle_cpu_percent(pids: dict[str, int], seconds: float = 10.0) -> dict[str, float]:
    """CPU used by each engine's whole process tree (replica, engine core, workers) while no request runs,
    in percent of one core."""
    def cpu_seconds(pid: int) -> float:
        root = psutil.Process(pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    time.sleep(seconds)
    return {role: 100 * (cpu_seconds(pid) - before[role]) / seconds for role, pid in pids.items()}


def report_idle_cpu(console: Console, when: str, idle: dict[str, float]) -> None:
    console.print(f"idle CPU {when}, % of one core: "
                  + ", ".join(f"{role} {pct:.1f}" for role, pct in idle.items()) + f" (pair: {sum(idle.values()):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 1900])
    parser.add_argument("--modes", nargs="+", default=None, help="default: every mode the connector serves")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import ray
    from ray import serve

    from app.builder import build_pd_app, resolve_config_path
    from app.config import load_config
    from kv.engine_identity import free_port

    config = load_config(resolve_config_path(args.config))
    modes = args.modes or list(config.transfer.modes)
    console = Console()
    used_before = psutil.virtual_memory().used
    started = time.perf_counter()
    port = free_port("127.0.0.1")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_pd_app(config), name="pd", route_prefix="/")
        cold_start = time.perf_counter() - started
        time.sleep(5)  # let the machine settle after start-up before sampling memory and latency
        memory_gib = (psutil.virtual_memory().used - used_before) / 2**30
        console.print(f"cold start (ray.init to app ready): {cold_start:.1f} s; memory used by the stack: "
                      f"{memory_gib:.1f} GiB")
        pids = {role: serve.get_deployment_handle(f"{role.capitalize()}Server", app_name="pd")
                .engine_info.remote().result()["pid"] for role in ("prefill", "decode")}
        report_idle_cpu(console, "after start-up", idle_cpu_percent(pids))

        url = f"http://127.0.0.1:{port}/v1/completions"
        rng = random.Random(0)
        samples: dict[tuple[int, str], list[float]] = {(n, m): [] for n in args.lengths for m in modes}
        with httpx.Client(timeout=120) as client:
            for n in args.lengths:
                for mode in modes:  # warm-up, not recorded
                    first_token_seconds(client, url, config.model_id, [rng.randrange(3, 4096) for _ in range(n)], mode)
                for _ in range(args.repeats):
                    for mode in modes:
                        prompt = [rng.randrange(3, 4096) for _ in range(n)]
                        samples[n, mode].append(first_token_seconds(client, url, config.model_id, prompt, mode))

        table = Table(title=f"TTFT p50 in ms ({args.repeats} requests per cell, modes interleaved)")
        table.add_column("prompt tokens", justify="right")
        for mode in modes:
            table.add_column(mode, justify="right")
        baseline = "local" if "local" in modes else None
        for mode in modes:
            if baseline and mode != baseline:
                table.add_column(f"{mode} / {baseline}", justify="right")
        for n in args.lengths:
            p50 = {m: statistics.median(samples[n, m]) * 1e3 for m in modes}
            ratios = [f"{p50[m] / p50[baseline]:.2f}x" for m in modes if baseline and m != baseline]
            table.add_row(str(n), *(f"{p50[m]:.0f}" for m in modes), *ratios)
        console.print(table)
        time.sleep(max(5.0, config.transfer.lease_s / 2))  # in-flight leases and notifications settle
        report_idle_cpu(console, "after the runs", idle_cpu_percent(pids))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
