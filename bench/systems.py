"""The systems the benchmark compares, each started on the same model, dtype and cores, and frozen while another
system is measured.

vLLM's worker busy-waits on its step queue for about a second after every step, on its core. So that one system's
leftover spinning never slows the next one, every system's engine processes are stopped (SIGSTOP) except while
that system is being measured; their servers, replicas and Ray itself keep running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil
from rich.console import Console

from app.config import EngineConfig, PDAppConfig
from app.tiny_model import resolve_model_source
from bench.load import Target
from kv.engine_identity import free_port

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def engine_processes(root_pid: int) -> list[psutil.Process]:
    """The vLLM engine processes (engine core and workers) below one server or replica process."""
    return [p for p in psutil.Process(root_pid).children(recursive=True) if p.name().startswith("VLLM::")]


@dataclass
class System:
    """One system under test: its request targets and the engine processes to freeze while others are measured."""

    name: str
    engines: list[psutil.Process] = field(default_factory=list)

    def freeze(self) -> None:
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        for proc in self.engines:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)


def cli_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """AsyncEngineArgs keyword arguments as `vllm serve` flags."""
    flags = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):  # a config section (e.g. structured_outputs_config): vLLM reads it as JSON
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


class VllmServer:
    """vLLM's own OpenAI server: one engine doing prefill and decode together, bound to `cores`."""

    def __init__(self, engine: EngineConfig, cores: str, log_dir: Path):
        self.port = free_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        env = {**os.environ, **engine.runtime_env.get("env_vars", {}), "VLLM_CPU_OMP_THREADS_BIND": cores}
        command = [sys.executable, "-m", "bench.vllm_cli", "serve",
                   resolve_model_source(engine.model_loading_config.model_source),
                   "--served-model-name", engine.model_loading_config.model_id, "--host", HOST,
                   "--port", str(self.port), *cli_flags(engine.engine_args)]
        self.log = open(log_dir / f"vllm-{cores}.log", "w")
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Until it serves; a server that exits (a flag it refused, say) fails at once, pointing at its log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.process.returncode}: see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            time.sleep(2)
        raise TimeoutError(f"{self.url} did not come up within {timeout_s:.0f} s")

    def engines(self) -> list[psutil.Process]:
        return engine_processes(self.process.pid)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and the engine processes it started
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.log.close()


def rsllm_pd_app(config: PDAppConfig):
    """Ray Serve LLM's `build_pd_openai_app` on the same engines: vLLM's own NixlConnector (pull), prefill on the
    prefill side's core and decode on the decode side's."""
    from ray.serve.llm import build_pd_openai_app

    def llm_config(engine: EngineConfig) -> dict[str, Any]:
        env = {**engine.runtime_env.get("env_vars", {}), "VLLM_CPU_OMP_THREADS_BIND": engine.cpu_cores[0],
               "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port(HOST))}
        return {
            "model_loading_config": {"model_id": engine.model_loading_config.model_id,
                                     "model_source": resolve_model_source(engine.model_loading_config.model_source)},
            "engine_kwargs": {**engine.engine_kwargs, "kv_transfer_config": {
                "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}},
            "placement_group_config": {"bundles": [{"CPU": 1}], "strategy": "STRICT_PACK"},
            "deployment_config": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
            "runtime_env": {"env_vars": env},
        }

    return build_pd_openai_app({"prefill_config": llm_config(config.prefill), "decode_config": llm_config(config.decode),
                                "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})


def serve_actor_pids(prefix: str) -> dict[str, int]:
    """Pids of the Ray actors whose names start with `prefix` (Serve names its replicas `SERVE_REPLICA::app#...`,
    its proxies `SERVE_PROXY_ACTOR-...` and its controller `SERVE_CONTROLLER_ACTOR`), by actor name."""
    import ray

    from ray.exceptions import RayActorError

    pids = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(prefix):
            try:
                handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                pids[actor["name"]] = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()))
            except (RayActorError, ValueError):
                pass  # died since it was listed (ValueError: its name is already gone)
    return pids


def serve_replica_pids(app_name: str) -> list[int]:
    """Pids of the replicas of every deployment of one Serve application."""
    return list(serve_actor_pids(f"SERVE_REPLICA::{app_name}#").values())


def bench_config(path: str) -> PDAppConfig:
    """A benchmark's `--config`: a preset's path or a file, read as `serve run` reads it."""
    from app.builder import resolve_config_path
    from app.config import load_config

    return load_config(resolve_config_path(path))


@contextlib.contextmanager
def app_on_own_cluster(config: PDAppConfig) -> Iterator[str]:
    """The app from `config` as Serve application `pd` on a Ray cluster of its own (a logical CPU per engine
    replica), until the block ends; yields its base URL."""
    import ray
    from ray import serve

    from app.builder import build_pd_app

    ray.init(address="local", num_cpus=config.prefill.max_replicas + config.decode.max_replicas,
             include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port(HOST)
        serve.start(http_options={"host": HOST, "port": port})
        serve.run(build_pd_app(config), name="pd", route_prefix="/")
        yield f"http://{HOST}:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@dataclass
class SideBySide:
    """The systems of one benchmark run, started and frozen: by name, each with where it takes requests."""

    systems: dict[str, tuple[System, Target]]
    app: System  # the app's engine processes (every app system shares them)
    handles: dict[str, Any]  # the app's engine deployments, by role

    def totals(self) -> dict[str, dict]:
        """The app's engine counters, by role."""
        return {role: h.transfer_totals.remote().result() for role, h in self.handles.items()}

    def loads(self) -> dict[str, dict]:
        return {role: h.load.remote().result() for role, h in self.handles.items()}


@contextlib.contextmanager
def side_by_side(config: PDAppConfig, app_headers: dict[str, dict[str, str]], log_dir: Path, console: Console,
                 rsllm: bool = False, floor_itl_s: float | None = None) -> Iterator[SideBySide]:
    """Plain vLLM (`vllm`: one server on the prefill side's cores; `vllm-x2`: one more on the decode side's), the
    app (one system per entry of `app_headers`: the headers its requests carry), optionally Ray Serve LLM PD
    (`rsllm-pd`) and Serve's floor (`serve-floor`), on a Ray cluster of this process's own; all torn down when the
    block ends. Started one after the other and each frozen once up: an idle engine with vLLM's NIXL progress thread
    spins on a core and would starve the others' start-up."""
    import ray
    from ray import serve

    from app.builder import build_pd_app

    plain = [VllmServer(config.prefill, config.prefill.cpu_cores[0], log_dir),
             VllmServer(config.decode, config.decode.cpu_cores[0], log_dir)]
    # Logical CPUs for both apps' engine bundles; the cores they run on are set by core binding.
    ray.init(address="local", num_cpus=2 + config.prefill.max_replicas + config.decode.max_replicas,
             include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    systems: dict[str, tuple[System, Target]] = {}
    starting = console.status(f"starting {', '.join(['two vLLM servers', 'the app'] + ['Ray Serve LLM PD'] * rsllm)} "
                              "(minutes on first use)")
    starting.start()
    try:
        port = free_port(HOST)
        serve.start(http_options={"host": HOST, "port": port})
        base, model = f"http://{HOST}:{port}", config.model_id
        for server in plain:
            server.wait_ready()
        systems["vllm"] = (System("vllm", plain[0].engines()), Target([plain[0].url], model))
        systems["vllm-x2"] = (System("vllm-x2", plain[0].engines() + plain[1].engines()),
                              Target([plain[0].url, plain[1].url], model))
        systems["vllm-x2"][0].freeze()
        serve.run(build_pd_app(config), name="pd", route_prefix="/pd")
        handles = {role: serve.get_deployment_handle(f"{role.capitalize()}Server", app_name="pd")
                   for role in ("prefill", "decode")}
        app = System("app", [p for pid in serve_replica_pids("pd") for p in engine_processes(pid)])
        app.freeze()
        for name, headers in app_headers.items():
            systems[name] = (app, Target([base + "/pd"], model, headers))
        if rsllm:
            serve.run(rsllm_pd_app(config), name="rsllm", route_prefix="/rsllm")
            rsllm_system = System("rsllm-pd", [p for pid in serve_replica_pids("rsllm") for p in engine_processes(pid)])
            rsllm_system.freeze()
            systems["rsllm-pd"] = (rsllm_system, Target([base + "/rsllm"], model))
        if floor_itl_s is not None:
            serve.run(serve_floor_app(floor_itl_s, config.stack_cpu_cores), name="floor", route_prefix="/floor")
            systems["serve-floor"] = (System("serve-floor"), Target([base + "/floor"], model))
        starting.stop()
        yield SideBySide(systems, app, handles)
    finally:
        starting.stop()
        for system, _ in systems.values():
            system.thaw()  # a stopped process would not see the shutdown's signals
        for server in plain:
            server.stop()
        serve.shutdown()
        ray.shutdown()


# Serve's default of 5 requests in flight per replica would queue a concurrency sweep at the floor's own ingress.
FLOOR_MAX_ONGOING = 1000


def serve_floor_app(itl_s: float, stack_cpu_cores: str | None):
    """Ray Serve's own floor under the app: the hops a streamed token crosses in the app -- Serve's HTTP proxy, an
    ingress replica, a handle stream from a second replica -- with no engine and no app logic behind them. The second
    replica streams a token every `itl_s` (first one at once); whatever the client sees above that pace is Serve's
    own cost, and the app's cost above Serve is the difference to the app's numbers in the same run. Its replicas
    are held to the cores the app's are."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import StreamingResponse

    from app.config import cpu_set, hold_process_to

    def hold() -> None:
        if stack_cpu_cores is not None:
            hold_process_to(cpu_set(stack_cpu_cores))

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=FLOOR_MAX_ONGOING)
    class FixedTokens:
        def __init__(self):
            hold()

        async def stream(self, n: int):
            for i in range(n):
                if i:
                    await asyncio.sleep(itl_s)
                yield i

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=FLOOR_MAX_ONGOING)
    class FloorIngress:
        def __init__(self, tokens):
            hold()
            self.tokens = tokens

        async def __call__(self, request: Request) -> StreamingResponse:
            body = await request.json()
            tokens = self.tokens.options(stream=True).stream.remote(body["max_tokens"])

            async def sse():
                async for i in tokens:
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": " x", "token_ids": [i]}]}) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

    return FloorIngress.bind(FixedTokens.bind())
