"""Chaos under load: engine replicas killed while mixed requests run, every answer checked.

    python -m bench.chaos [--minutes 10] [--config configs/cpu-1p2d.yaml] [--kill-every-s 60]
                          [--kill replica|engine-core|both] [--rate 1.5] [--hang-after-s 10]

Starts the app on a Ray cluster of its own and sends it open-loop (Poisson) requests at `--rate` per second: push,
pull, local and auto at random, streaming or not, a tenth of the streaming clients leaving after their first token; all
greedy, from a pool of prompts whose answers a colocated vLLM engine computed once up front. Every `--kill-every-s`
(once the app is back at full capacity) it SIGKILLs, by pid, a random engine replica's process (`replica`), or the
engine-core process inside a live replica (`engine-core`), or either at random (`both`).

It reports per window (from one kill to the next): requests sent, correct (token for token the reference, or its
prefix for a client that left), wrong, 503s, error events, hung (no first byte within `--hang-after-s`), other
failures, failures that do not name the failed leg, and the time until every engine deployment had all its
replicas running again. After the load, once the engines are idle, the KV blocks each replica still holds.
Exits 1 unless there were no wrong, hung, unnamed or other answers and no KV block is left in use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from app.tiny_model import corpus_lines
from bench.colocated_reference import colocated_outputs
from bench.systems import engine_processes, serve_actor_pids

APP = "pd"
ROLES = {"prefill": "PrefillServer", "decode": "DecodeServer"}
MODES = ("push", "pull", "local", "auto")  # auto: the mode policy decides (and serves local while prefill is down)
POOL = [(32, 16), (128, 32), (256, 8), (512, 32), (768, 16), (1024, 8), (1536, 16), (64, 48)]  # prompt, output


@dataclass
class Window:
    """The requests sent between one kill and the next."""

    kill: str
    started_at: float
    back_after_s: float | None = None
    outcomes: Counter = field(default_factory=Counter)


def prompt_pool(tokenizer) -> list[dict]:
    """Prompts of the lengths in POOL, cut from the built-in corpus, each with its output length."""
    tokens = tokenizer.encode(" ".join(corpus_lines()))
    return [{"prompt_token_ids": tokens[i * 97:i * 97 + length], "max_tokens": max_tokens}
            for i, (length, max_tokens) in enumerate(POOL)]


def names_a_leg(error: dict) -> bool:
    return any(role in error.get("message", "") for role in ROLES)


def error_of(response_body: bytes) -> dict:
    """The OpenAI error object of a refused request, or the body as its message (Serve's own back-pressure 503)."""
    try:
        return json.loads(response_body)["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": response_body.decode(errors="replace")}


async def answer(client: httpx.AsyncClient, url: str, body: dict, mode: str, leaves: bool,
                 answered: asyncio.Event) -> tuple[str, dict | None, list[int]]:
    """Sends one request: (how it ended, the error object if any, the tokens received). Sets `answered` at the
    first byte of the answer: the response, or the first event of a stream."""
    headers = {"x-kv-transfer-mode": mode}
    if not body["stream"]:
        response = await client.post(url + "/v1/completions", json=body, headers=headers)
        answered.set()
        if response.status_code != 200:
            return f"HTTP {response.status_code}", error_of(response.content), []
        return "done", None, response.json()["choices"][0]["token_ids"]
    tokens = []
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            answered.set()
            return f"HTTP {response.status_code}", error_of(await response.aread()), []
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            answered.set()
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return "error event", event["error"], tokens
            for choice in event.get("choices", ()):
                tokens += choice.get("token_ids") or []
            if leaves and tokens:
                return "left", None, tokens
    return "done", None, tokens


async def one_request(client: httpx.AsyncClient, url: str, model: str, case: dict, expected: list[int],
                      rng: random.Random, hang_after_s: float) -> str:
    """Sends one request and returns its outcome."""
    mode, stream = rng.choice(MODES), rng.random() < 0.5
    leaves = stream and rng.random() < 0.1
    body = {"model": model, "prompt": case["prompt_token_ids"], "max_tokens": case["max_tokens"], "temperature": 0,
            "return_token_ids": True, "stream": stream}
    answered = asyncio.Event()
    sent = asyncio.ensure_future(answer(client, url, body, mode, leaves, answered))
    first_byte = asyncio.ensure_future(answered.wait())
    await asyncio.wait({sent, first_byte}, timeout=hang_after_s, return_when=asyncio.FIRST_COMPLETED)
    first_byte.cancel()
    if not answered.is_set() and not sent.done():
        sent.cancel()  # the client gives up: the app sees it leave
        return "hung"
    try:
        how, error, tokens = await sent
    except httpx.HTTPError as e:
        return f"client error {type(e).__name__}"
    if how in ("done", "left"):
        return "correct" if tokens == (expected[:len(tokens)] if how == "left" else expected) else "wrong"
    if how == "HTTP 503" and error.get("code") != "engine_unavailable":
        return "503 back-pressure"
    if not names_a_leg(error):
        return "unnamed failure"
    return "503" if how == "HTTP 503" else ("error event" if how == "error event" else f"other: {how}")


def at_full_capacity(targets: dict[str, int]) -> bool:
    from ray import serve
    from ray.serve.schema import ReplicaState

    deployments = serve.status().applications[APP].deployments
    return all(sum(n for state, n in deployments[name].replica_states.items() if state == ReplicaState.RUNNING)
               == wanted for name, wanted in targets.items())


def replica_names() -> dict[str, int]:
    """The engine replicas' actor names, with their pids."""
    return {name: pid for deployment in ROLES.values()
            for name, pid in serve_actor_pids(f"SERVE_REPLICA::{APP}#{deployment}#").items()}


def kill_one(kind: str, rng: random.Random) -> str:
    """SIGKILLs a random engine replica's process, or the engine core inside one, and says what it killed."""
    name, pid = rng.choice(sorted(replica_names().items()))
    kind = rng.choice(("replica", "engine-core")) if kind == "both" else kind
    if kind == "engine-core":
        pid = next(p.pid for p in engine_processes(pid) if p.name() == "VLLM::EngineCore")
    os.kill(pid, signal.SIGKILL)
    return f"{kind} of {name.split('#')[1]} {name.rsplit('#', 1)[1][:8]}"


async def chaos(url: str, model: str, cases: list[dict], references: list[list[int]], args, targets: dict[str, int]
                ) -> list[Window]:
    rng = random.Random(args.seed)
    start = time.monotonic()
    end = start + args.minutes * 60
    windows = [Window("none (before the first kill)", start)]
    in_flight: set[asyncio.Task] = set()

    async def send(window: Window, client: httpx.AsyncClient) -> None:
        index = rng.randrange(len(cases))
        window.outcomes[await one_request(client, url, model, cases[index], references[index], rng,
                                          args.hang_after_s)] += 1

    async def killer() -> None:
        while True:
            await asyncio.sleep(args.kill_every_s)
            while not await asyncio.to_thread(at_full_capacity, targets):
                await asyncio.sleep(1)  # the last kill's replacement is still starting
            if time.monotonic() > end - 5:
                return
            before = set(await asyncio.to_thread(replica_names))
            killed = await asyncio.to_thread(kill_one, args.kill, rng)
            window = Window(killed, time.monotonic())
            windows.append(window)
            # Back once Serve has started a replacement (a replica actor that was not there before the kill: after
            # an engine-core kill too, Serve replaces the whole replica) and every deployment has all its replicas
            # running. The controller lists a killed replica as RUNNING until its health check fails, so the count
            # alone would say "back" at once.
            while (not set(await asyncio.to_thread(replica_names)) - before
                   or not await asyncio.to_thread(at_full_capacity, targets)):
                await asyncio.sleep(0.5)
            window.back_after_s = time.monotonic() - window.started_at

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
        kills = asyncio.ensure_future(killer())
        with tqdm(total=int(args.minutes * 60), unit="s", desc="chaos") as progress:
            while (now := time.monotonic()) < end:
                task = asyncio.ensure_future(send(windows[-1], client))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                await asyncio.sleep(rng.expovariate(args.rate))
                progress.n = int(now - start)
                progress.set_postfix_str(f"kills {len(windows) - 1}, in flight {len(in_flight)}")
        kills.cancel()
        await asyncio.gather(*in_flight)
    return windows


def kv_blocks_in_use(timeout_s: float) -> dict[str, int]:
    """Per engine replica, the KV blocks its engine holds, once every engine is idle (or the time is up): read from
    the load each replica reports to Serve's routers."""
    from ray import serve

    from app.flow.replica_view import ROUTERS

    handles = {role: serve.get_deployment_handle(name, app_name=APP) for role, name in ROLES.items()}
    blocks = {role: h.engine_info.remote().result()["num_kv_blocks"] for role, h in handles.items()}
    deadline = time.monotonic() + timeout_s
    while True:
        in_use = {f"{role} {replica_id.unique_id[:8]}": round(replica.routing_stats.get("kv_cache_usage", 0)
                                                               * blocks[role])
                  for role in ROLES for replica_id, replica in ROUTERS[APP, ROLES[role]].curr_replicas.items()}
        if not any(in_use.values()) or time.monotonic() > deadline:
            return in_use
        time.sleep(1)


def report(windows: list[Window], leftover: dict[str, int], console: Console) -> bool:
    columns = ["correct", "wrong", "503", "error event", "hung", "unnamed failure"]
    table = Table("window", "killed", "requests", *columns, "other", "back at full capacity after",
                  title="bench.chaos: outcomes per window (from one kill to the next)")
    totals = Counter()
    for i, window in enumerate(windows):
        totals.update(window.outcomes)
        other = sum(n for k, n in window.outcomes.items() if k not in columns)
        back = f"{window.back_after_s:.0f} s" if window.back_after_s is not None else "-"
        table.add_row(str(i), window.kill, str(sum(window.outcomes.values())),
                      *(str(window.outcomes[c]) for c in columns), str(other), back)
    other = sum(n for k, n in totals.items() if k not in columns)
    table.add_row("all", f"{len(windows) - 1} kills", str(sum(totals.values())), *(str(totals[c]) for c in columns),
                  str(other), "")
    console.print(table)
    if other:
        console.print("other outcomes:", {k: n for k, n in totals.items() if k not in columns})
    console.print("KV blocks in use after the drain:", leftover)
    return not (totals["wrong"] or totals["hung"] or totals["unnamed failure"] or other or any(leftover.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-1p2d.yaml")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--kill-every-s", type=float, default=60)
    parser.add_argument("--kill", choices=("replica", "engine-core", "both"), default="both")
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson arrivals)")
    parser.add_argument("--hang-after-s", type=float, default=10, help="no first byte by then: hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from app.builder import build_pd_app, resolve_config_path
    from app.config import load_config
    from app.tiny_model import resolve_model_source
    from kv.engine_identity import free_port

    config_path = resolve_config_path(args.config)
    config = load_config(config_path)
    console = Console(width=160)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(config.decode.model_loading_config.model_source))
    cases = prompt_pool(tokenizer)
    with console.status("computing the reference answers on a colocated engine"):
        references = [out["token_ids"] for out in colocated_outputs(config_path, cases)]
    targets = {ROLES[role]: getattr(config, role).max_replicas for role in ROLES}
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        with console.status("starting the app"):
            serve.run(build_pd_app(config), name=APP, route_prefix="/")
        windows = asyncio.run(chaos(f"http://127.0.0.1:{port}", config.model_id, cases, references, args, targets))
        with console.status("waiting for full capacity and idle engines"):
            while not at_full_capacity(targets):
                time.sleep(1)
            leftover = kv_blocks_in_use(timeout_s=config.transfer.lease_s + config.transfer.push_timeout_s + 10)
    finally:
        serve.shutdown()
        ray.shutdown()
    passed = report(windows, leftover, console)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "leftover": leftover,
                                        "windows": [{"kill": w.kill, "back_after_s": w.back_after_s,
                                                     "outcomes": w.outcomes} for w in windows]}, indent=1))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
