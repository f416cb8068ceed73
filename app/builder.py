"""Turns the validated configuration into a Ray Serve application: two engine deployments and the ingress."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.config import EngineConfig, PDAppConfig, load_config
from app.engine.server import DecodeServer, EngineServer, PrefillServer
from app.flow.routing import EngineLoadRouter
from app.ingress.server import OpenAIIngress
from app.policy.load_view import ROUTING_STATS_PERIOD_S
from app.rsllm_config import from_pd_serving_args

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# How often Serve asks an engine replica whether it is alive (its default is 10 s). Serve replaces a replica whose
# engine died after three failed checks, so this bounds how long a leg runs one replica short. (The ingress does not
# wait for it: app/flow/replica_view.py.) The check is one cheap call to the engine.
ENGINE_HEALTH_CHECK_PERIOD_S = 2
# Serve's replicas, and the handles inside them, export their metrics every 100 ms by default: ten wake-ups a second
# in every process of the app, idle or not. Once a second is as fresh as a Prometheus scrape needs. (A runtime_env
# in the config may still set it.)
SERVE_REPLICA_ENV = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def with_serve_env(actor_options: dict[str, Any]) -> dict[str, Any]:
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**SERVE_REPLICA_ENV, **runtime_env.get("env_vars", {})}
    return {**actor_options, "runtime_env": runtime_env}


def engine_deployment(server: type[EngineServer], engine: EngineConfig) -> serve.Deployment:
    """A replica takes as many requests as its engine runs at once (vLLM's `max_num_seqs`): more would only queue
    inside the engine, where Serve can no longer send them to a replica with room."""
    bundles = [dict(b) for b in engine.placement_bundles()]
    actor_options = {"runtime_env": engine.runtime_env, **engine.deployment_config.get("ray_actor_options", {})}
    if engine.uses_gpu:
        # vLLM's Ray executor runs one worker per GPU bundle of the placement group Serve gives the replica. The
        # replica's actor needs no GPU of its own: it takes a CPU share that is added to bundle 0, which also
        # keeps it on the node of the first worker.
        replica_cpus = actor_options.setdefault("num_cpus", 1)
        actor_options["num_gpus"] = 0
        bundles[0]["CPU"] = bundles[0].get("CPU", 0) + replica_cpus
    else:
        # The engine runs in the replica's process and children, which stay inside the actor's bundle 0.
        actor_options = {"num_cpus": bundles[0].get("CPU", 0), "num_gpus": 0, **actor_options}
    options = {"max_ongoing_requests": engine.max_num_seqs, "health_check_period_s": ENGINE_HEALTH_CHECK_PERIOD_S,
               "request_router_config": RequestRouterConfig(request_router_class=EngineLoadRouter,
                                                            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
               **engine.deployment_config}
    options.pop("ray_actor_options", None)
    return serve.deployment(server).options(
        **options,
        ray_actor_options=with_serve_env(actor_options),
        placement_group_bundles=bundles,
        placement_group_strategy=engine.placement_group_config.strategy,
    )


def ingress_options(config: PDAppConfig) -> dict[str, Any]:
    """An ingress replica runs `ingress_slots` requests and queues as many more by class (app/policy/admission.py);
    Serve lets it hold as many again, which it turns away at once when its queue is full, so that no request waits in
    Serve's own queue (first come, first served) behind batch work. Serve's queue counts every request not yet
    handed to a replica, so a burst arriving at once passes through it: it holds as many as the replicas do.
    Past even that, Serve answers 503 with a Retry-After header (back-pressure) rather than let it grow without
    bound."""
    slots = config.ingress_slots
    options = {"max_ongoing_requests": 3 * slots, "max_queued_requests": 3 * slots,
               "backpressure_config": {"status_code": 503, "retry_after_s": 1}, **config.ingress.deployment_config}
    return {**options, "ray_actor_options": with_serve_env(options.get("ray_actor_options", {}))}


def build_pd_app(config: PDAppConfig) -> Application:
    prefill = engine_deployment(PrefillServer, config.prefill).bind(config.prefill, config.transfer,
                                                                    config.stack_cpu_cores)
    decode = engine_deployment(DecodeServer, config.decode).bind(config.decode, config.transfer,
                                                                 config.stack_cpu_cores)
    return OpenAIIngress.options(**ingress_options(config)).bind(prefill, decode, config)


def resolve_config_path(path: str) -> Path:
    """Relative paths name a file under the working directory or, failing that, under the project root (Serve may
    build the app in a worker whose working directory is not the user's)."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return PROJECT_ROOT / candidate


def build_pd_openai_app(args: dict[str, Any]) -> Application:
    """Entry point for an application config written for Ray Serve LLM's `build_pd_openai_app`: only its
    `import_path` changes (app/rsllm_config.py says what maps and what is refused)."""
    return build_pd_app(from_pd_serving_args(args))


def build_app(args: dict[str, Any]) -> Application:
    """Entry point for `serve run` / `serve deploy`: args is either {config_file: path} or the configuration itself."""
    if set(args) == {"config_file"}:
        return build_pd_app(load_config(resolve_config_path(args["config_file"])))
    return build_pd_app(PDAppConfig.model_validate(args))
