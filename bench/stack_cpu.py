"""Where the serving stack's CPU goes while streams flow, process by process and thread by thread, beside the gaps
between tokens that the client sees; and what the stack burns once it is idle.

    python -m bench.stack_cpu [--config configs/cpu-tiny.yaml] [--modes push pull local] [--stream-intervals MS ...]
                              [--concurrency 1 16] [--requests 12] [--tokens 150] [--prompt-tokens 128] [--idle-after 60]
                              [--idle-window 30] [--no-vllm] [--stack-free-too] [--out bench/results/stack_cpu.json]

Starts vLLM's own OpenAI server (one engine doing prefill and decode, on the decode engine's core: `vllm`), then
the app on a Ray cluster of its own, so every process of both stacks (Ray's own, Serve's controller and proxy, the
ingress and engine replicas, the vLLM engine processes) descends from this one, which is also the client. While
one system is measured, the other's engine processes are stopped (SIGSTOP), as in bench.peers. For each
concurrency and system (plain vLLM, then the app in each mode), sends `--requests` streaming requests (at least one
per concurrent slot), that many at a time, and reads every thread's CPU time (/proc/PID/task/TID/stat, through
psutil) before and after. Prints, per cell: the client-seen gaps (p99, each request's worst gap p50 / max, requests with a gap over 100 ms), TTFT
as the client saw it and as the ingress stamped it; for the app, where each gap of 50 ms or more came from (the
engine's steps, the decode replica, Serve's hop to the ingress, or the way from the ingress to the client, from
stamps the app reports per chunk) and how late the ingress's event loop ran; and each process role's CPU as a
share of one core over the cell's wall time, with its busiest threads. Last, the idle stack: CPU per role over `--idle-window` seconds,
starting `--idle-after` seconds after the last request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil
from ray import serve
from rich.console import Console
from rich.table import Table

from app.config import cpu_set, hold_process_to
from app.ingress.server import STREAM_INTERVAL_HEADER
from bench.load import Target, percentile, run_concurrent
from bench.peers import random_prompt
from bench.systems import System, VllmServer, app_on_own_cluster, bench_config

CLIENT = "client (this process)"
STALL_MS = 100
ATTRIBUTED_MS = 50  # client-seen gaps at least this long are traced to the hop that added the most to them
# The hops a chunk takes, each from the previous stamp to its own (app/ingress/server.py RequestOutput.chunk_stamps).
HOPS = ("engine step", "decode replica", "replica to ingress", "ingress to client")


def role(proc: psutil.Process, me: int) -> str:
    """What a process of the stack is: Ray sets a worker's title to `ray::<actor class>[.<method running>]`, Serve
    names replicas `ServeReplica:<app>:<deployment>`, vLLM names its engine processes `VLLM::...`, below the
    replica that owns them."""
    if proc.pid == me:
        return CLIENT
    title = " ".join(proc.cmdline()) or proc.name()
    if title.startswith("VLLM::"):
        parent = proc.parent()
        owner = role(parent, me) if parent is not None and parent.pid != me else "?"
        return f"{owner} > {title.split()[0]}"
    if "bench.vllm_cli" in title:
        return "plain vLLM server"
    if title.startswith("ray::"):
        return title.split()[0].split(".")[0].removeprefix("ray::")
    for known in ("gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if known in title:
            return f"ray {known.removesuffix('.py')}"
    return proc.name()


def hold_stack(cores: set[int]) -> None:
    """Hold every thread of the app's own processes -- its replicas and their engine-core processes, not the
    engines' workers, which vLLM binds to their cores -- to `cores`, as `stack_cpu_cores` does when they start."""
    me = psutil.Process()
    for proc in me.children(recursive=True):
        try:
            label = role(proc, me.pid)
            if label.startswith("ServeReplica:") and not label.endswith("VLLM::Worker"):
                hold_process_to(cores, proc.pid)
        except (psutil.NoSuchProcess, FileNotFoundError):
            continue


def thread_times() -> dict[tuple[int, int], tuple[str, str, float]]:
    """(pid, tid) -> (process role, thread name, CPU seconds so far) for this process and all below it."""
    me = psutil.Process()
    times = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            label = role(proc, me.pid)
            for thread in proc.threads():
                try:
                    with open(f"/proc/{proc.pid}/task/{thread.id}/comm") as comm:
                        # A process's first thread carries the process's title (Ray's `ray::IDLE`): call it main.
                        name = "main" if thread.id == proc.pid else comm.read().strip()
                except OSError:
                    continue  # the thread ended
                times[proc.pid, thread.id] = (label, name, thread.user_time + thread.system_time)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return times


def cpu_use(before: dict, after: dict, wall_s: float) -> dict[str, dict]:
    """Per role: its share of one core over `wall_s`, and its threads' shares (threads of one name summed)."""
    roles: dict[str, dict] = defaultdict(lambda: {"core_pct": 0.0, "threads": Counter()})
    for key, (label, name, seconds) in after.items():
        used = seconds - before.get(key, (label, name, 0.0))[2]
        if used > 0:
            roles[label]["core_pct"] += 100 * used / wall_s
            roles[label]["threads"][name] += 100 * used / wall_s
    return {label: {"core_pct": use["core_pct"], "threads": dict(use["threads"].most_common())}
            for label, use in sorted(roles.items(), key=lambda item: -item[1]["core_pct"])}


async def cell(target: Target, system: str, concurrency: int, requests: int, tokens: int, prompt_tokens: int,
               rng: random.Random, loop_lag=None) -> dict:
    """`loop_lag`: asks the ingress for its event-loop lag since the last ask (None: not the app)."""
    prompts = [random_prompt(rng, prompt_tokens) for _ in range(max(requests, concurrency))]
    if loop_lag is not None:
        await loop_lag()  # forget what came before
    before, started = thread_times(), time.perf_counter()
    samples, _ = await run_concurrent(target, prompts, tokens, concurrency)
    wall_s = time.perf_counter() - started
    cpu = cpu_use(before, thread_times(), wall_s)
    lag = await loop_lag() if loop_lag is not None else None
    gaps = [gap * 1e3 for sample in samples for gap in sample.itls]
    worst = [max(sample.itls) * 1e3 for sample in samples]
    return {"system": system, "concurrency": concurrency, "requests": len(samples), "wall_s": wall_s,
            "gap_p99_ms": percentile(gaps, 99), "worst_gap_p50_ms": statistics.median(worst),
            "worst_gap_max_ms": max(worst), "stalled_requests": sum(w > STALL_MS for w in worst),
            "ttft_client_p50_ms": statistics.median(s.ttft * 1e3 for s in samples),
            "ttft_ingress_p50_ms": statistics.median(s.phases_ms.get("ttft", float("nan")) for s in samples),
            "stall_sources": stall_sources(samples), "ingress_loop_lag": lag,
            "cpu": cpu}


def stall_sources(samples) -> dict:
    """Each client-seen gap of ATTRIBUTED_MS or more between two chunks, split over the hops it crossed: the gap
    between the engine's steps, then how much longer each later hop took for the second chunk than for the first.
    The parts sum to the gap; the gap counts for the hop with the largest part."""
    counted, added, stalls = Counter(), defaultdict(float), 0
    for sample in samples:
        if len(sample.chunk_stamps) != len(sample.chunk_arrivals):
            continue  # not the app, or stamps lost
        stamps = [(*app_stamps, client) for app_stamps, client in zip(sample.chunk_stamps, sample.chunk_arrivals)]
        for before, after in zip(stamps, stamps[1:]):
            if (after[-1] - before[-1]) * 1e3 < ATTRIBUTED_MS:
                continue
            parts = [after[0] - before[0]] + [(after[i] - after[i - 1]) - (before[i] - before[i - 1])
                                              for i in range(1, len(HOPS))]
            stalls += 1
            counted[HOPS[max(range(len(HOPS)), key=parts.__getitem__)]] += 1
            for hop, part in zip(HOPS, parts):
                added[hop] += part * 1e3
    return {"stalls": stalls, "by_hop": {hop: {"stalls": counted[hop], "mean_ms": added[hop] / stalls if stalls
                                               else 0.0} for hop in HOPS}}


def idle_use(after_s: float, window_s: float) -> dict:
    time.sleep(after_s)
    before, started = thread_times(), time.perf_counter()
    time.sleep(window_s)
    wall_s = time.perf_counter() - started
    cpu = cpu_use(before, thread_times(), wall_s)
    for other in [CLIENT, *(label for label in cpu if label.startswith("plain vLLM"))]:
        cpu.pop(other, None)  # the client sleeps, and plain vLLM is not the app's stack
    return {"after_s": after_s, "window_s": window_s, "stack_core_pct": sum(r["core_pct"] for r in cpu.values()),
            "cpu": cpu}


def report(cells: list[dict], idle: dict | None, console: Console) -> None:
    gaps = Table(title="client-seen stream (ms)")
    for column in ("concurrency", "system", "requests", "gap p99", "worst gap p50", "worst gap max",
                   f"requests with a gap > {STALL_MS}", "TTFT client p50", "TTFT ingress p50"):
        gaps.add_column(column, justify="right")
    for c in cells:
        gaps.add_row(str(c["concurrency"]), c["system"], str(c["requests"]), f"{c['gap_p99_ms']:.0f}",
                     f"{c['worst_gap_p50_ms']:.0f}", f"{c['worst_gap_max_ms']:.0f}", str(c["stalled_requests"]),
                     f"{c['ttft_client_p50_ms']:.0f}", f"{c['ttft_ingress_p50_ms']:.0f}")
    console.print(gaps)
    sources = Table(title=f"where the client-seen gaps of {ATTRIBUTED_MS} ms or more came from: gaps traced to each "
                          "hop / mean ms that hop added to a gap")
    for column in ("concurrency", "system", "gaps", *HOPS, "ingress loop lag p99 / max (ms)"):
        sources.add_column(column, justify="right")
    for c in cells:
        if (lag := c["ingress_loop_lag"]) is None:
            continue
        by_hop = c["stall_sources"]["by_hop"]
        sources.add_row(str(c["concurrency"]), c["system"], str(c["stall_sources"]["stalls"]),
                        *(f"{by_hop[hop]['stalls']} / {by_hop[hop]['mean_ms']:.0f}" for hop in HOPS),
                        f"{lag.get('p99_ms', 0):.0f} / {lag.get('max_ms', 0):.0f}")
    console.print(sources)
    for c in cells:
        console.print(cpu_table(f"CPU, % of one core: {c['system']} at concurrency {c['concurrency']}, "
                                f"{c['wall_s']:.1f} s", c["cpu"]))
    if idle is not None:
        console.print(cpu_table(f"CPU of the idle stack, % of one core: {idle['window_s']:.0f} s from "
                                f"{idle['after_s']:.0f} s after the last request, "
                                f"{idle['stack_core_pct']:.1f}% in all", idle["cpu"]))


def cpu_table(title: str, cpu: dict[str, dict], threads: int = 4, floor_pct: float = 0.5) -> Table:
    table = Table(title=title)
    table.add_column("process")
    table.add_column("% core", justify="right")
    table.add_column("busiest threads (% core)")
    for label, use in cpu.items():
        if use["core_pct"] >= floor_pct:
            busiest = ", ".join(f"{name} {pct:.1f}" for name, pct in list(use["threads"].items())[:threads])
            table.add_row(label, f"{use['core_pct']:.1f}", busiest)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--modes", nargs="+", default=["push", "pull", "local"])
    parser.add_argument("--stream-intervals", type=float, nargs="+",
                        help="ms between a stream's chunks (the x-pd-stream-interval-ms header), each a system of its "
                             "own; default: the config's ingress.stream_interval_ms")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--idle-after", type=float, default=60, help="seconds; negative: no idle measurement")
    parser.add_argument("--idle-window", type=float, default=30)
    parser.add_argument("--no-vllm", action="store_true", help="leave plain vLLM out")
    parser.add_argument("--stack-free-too", action="store_true",
                        help="each app system also with its own processes free to run on every core (stack_cpu_cores "
                             "undone), to measure what holding them off the decode core gives")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/stack_cpu.json"))
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = bench_config(args.config)
    intervals = args.stream_intervals or [config.ingress.stream_interval_ms]
    console = Console(width=160)
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-stack-cpu-"))
    with console.status("starting the app and plain vLLM, then measuring"), app_on_own_cluster(config) as url:
        app = System("app", [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")])
        configured = cpu_set(config.stack_cpu_cores) if config.stack_cpu_cores else None
        variants = {"": configured, **({", stack free": set(range(os.cpu_count()))} if args.stack_free_too else {})}
        systems = {
            (mode if len(intervals) == 1 else f"{mode} @{interval:g} ms") + variant:
                (app, Target([url], config.model_id, {"x-pd-timings": "1", "x-kv-transfer-mode": mode,
                                                      STREAM_INTERVAL_HEADER: str(interval)}), cores)
            for mode in args.modes for interval in intervals for variant, cores in variants.items()}
        ingress = serve.get_app_handle("pd")
        plain = None
        try:
            if not args.no_vllm:
                # Started once the app is up, its engines stopped: started first, it kept the app's engines from
                # finishing their start.
                app.freeze()
                plain = VllmServer(config.decode, config.decode.cpu_cores[0], log_dir)
                plain.wait_ready()
                systems = {"vllm": (System("vllm", plain.engines()), Target([plain.url], config.model_id), None),
                           **systems}
            cells = []
            for concurrency in args.concurrency:
                for name, (system, target, cores) in systems.items():
                    for other, *_ in systems.values():
                        (other.thaw if other is system else other.freeze)()
                    if system is app and cores is not None:
                        hold_stack(cores)
                    asyncio.run(cell(target, name, 1, 1, 8, args.prompt_tokens, rng))  # warm-up, not kept
                    loop_lag = None if system is not app else ingress.event_loop_lag.remote
                    cells.append(asyncio.run(cell(target, name, concurrency, args.requests, args.tokens,
                                                  args.prompt_tokens, rng, loop_lag)))
            if configured is not None:
                hold_stack(configured)
            app.thaw()
            if plain is not None:
                systems["vllm"][0].freeze()
            idle = idle_use(args.idle_after, args.idle_window) if args.idle_after >= 0 else None
        finally:
            app.thaw()
            if plain is not None:
                plain.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cells": cells,
                                    "idle": idle}, indent=1))
    report(cells, idle, console)


if __name__ == "__main__":
    main()
