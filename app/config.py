"""What a deployment of the app looks like: the YAML schema, validated once when the application is built.

The two engine sections mirror Ray Serve LLM's `LLMConfig` (model_loading_config, engine_kwargs, deployment_config,
placement_group_config, runtime_env) so that a `build_pd_openai_app` user recognises them; `transfer` says how KV
crosses between the two sides.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from vllm.config import SchedulerConfig
from pydantic import Field, PositiveInt, field_validator, model_validator

from app.policy.mode_policy import CostPriors, ThresholdRule
from app.policy.service_class import ServiceClass, default_classes
from kv.config import StrictModel, TransferConfig


class ModelLoadingConfig(StrictModel):
    model_id: str = Field(description="The name clients use in the `model` field.")
    model_source: str = Field(description="A local path, a hub id, or `builtin://tiny-qwen3`; as in Ray Serve "
                              "LLM, model_id when not given.")

    @model_validator(mode="before")
    @classmethod
    def _source_defaults_to_id(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "model_source" not in raw and "model_id" in raw:
            return {**raw, "model_source": raw["model_id"]}
        return raw


class PlacementGroupConfig(StrictModel):
    """One placement group per replica. CPU engines run inside the replica's actor, which takes bundle 0. GPU
    engines run one worker per GPU, each in a bundle of its own (vLLM refuses a bundle with more than one GPU):
    give them `bundle_per_worker`, as in Ray Serve LLM, or one bundle per worker in `bundles`."""

    bundles: list[dict[str, float]] | None = Field(default=None, min_length=1)
    bundle_per_worker: dict[str, float] | None = None
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"

    @model_validator(mode="after")
    def _one_way_to_give_bundles(self) -> PlacementGroupConfig:
        if (self.bundles is None) == (self.bundle_per_worker is None):
            raise ValueError("placement_group_config takes exactly one of bundles and bundle_per_worker")
        return self

    def worker_bundles(self, world_size: int) -> list[dict[str, float]]:
        return self.bundles if self.bundles is not None else [dict(self.bundle_per_worker) for _ in range(world_size)]


class EngineConfig(StrictModel):
    """One side (prefill or decode) of the app: a Serve deployment whose replicas each own one vLLM engine."""

    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to vLLM's AsyncEngineArgs.")
    deployment_config: dict[str, Any] = Field(default_factory=dict, description="Serve deployment options.")
    placement_group_config: PlacementGroupConfig
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    cpu_cores: list[str] | None = Field(
        default=None,
        description="CPU engines only: the cores each replica's engine is bound to, one entry per replica, up to "
        "autoscaling's max_replicas (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax, e.g. '0' or '2-3').",
    )

    @field_validator("engine_kwargs")
    @classmethod
    def _no_transfer_config_in_engine_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        forbidden = {"model", "served_model_name", "kv_transfer_config"} & kwargs.keys()
        if forbidden:
            raise ValueError(
                f"engine_kwargs must not set {sorted(forbidden)}: the model comes from model_loading_config "
                "and the KV connector from the transfer section"
            )
        return kwargs

    @property
    def max_replicas(self) -> int:
        """The most replicas this engine may run: `num_replicas`, or with autoscaling its `max_replicas`."""
        autoscaling = self.deployment_config.get("autoscaling_config")
        if autoscaling is not None:
            return int(autoscaling.get("max_replicas", 1))
        return int(self.deployment_config.get("num_replicas", 1))

    @field_validator("deployment_config")
    @classmethod
    def _replica_count_is_bounded(cls, options: dict[str, Any]) -> dict[str, Any]:
        if options.get("num_replicas") == "auto":
            raise ValueError("num_replicas: auto leaves the most replicas to Serve's defaults; give "
                             "autoscaling_config with min_replicas and max_replicas instead")
        return options

    @property
    def engine_args(self) -> dict[str, Any]:
        """engine_kwargs with what the app's engines take unless told otherwise: priority scheduling, which the
        service classes' priorities need."""
        return {"scheduling_policy": "priority", **self.engine_kwargs}

    @property
    def max_num_seqs(self) -> int:
        """Requests one engine runs at once."""
        return int(self.engine_kwargs.get("max_num_seqs", SchedulerConfig.DEFAULT_MAX_NUM_SEQS))

    @property
    def prefill_chunk_tokens(self) -> int | None:
        """The most prompt tokens this engine computes for one request in a step while other requests run (vLLM's
        `long_prefill_token_threshold`, within `max_num_batched_tokens`); None: a whole prompt in one step."""
        limits = [int(self.engine_kwargs[key]) for key in ("long_prefill_token_threshold", "max_num_batched_tokens")
                  if self.engine_kwargs.get(key)]
        return min(limits, default=None)

    @property
    def world_size(self) -> int:
        """vLLM workers per engine: one per GPU."""
        return (int(self.engine_kwargs.get("tensor_parallel_size", 1))
                * int(self.engine_kwargs.get("pipeline_parallel_size", 1)))

    @property
    def uses_gpu(self) -> bool:
        return any(b.get("GPU", 0) > 0 for b in self.placement_group_config.worker_bundles(self.world_size))

    def placement_bundles(self) -> list[dict[str, float]]:
        return self.placement_group_config.worker_bundles(self.world_size)

    @model_validator(mode="after")
    def _gpu_bundles_fit_vllm(self) -> EngineConfig:
        """vLLM's Ray executor places one worker per bundle holding one GPU, and refuses bundles with more."""
        if not self.uses_gpu:
            return self
        gpu_bundles = [b for b in self.placement_bundles() if b.get("GPU", 0) > 0]
        if any(b["GPU"] > 1 for b in gpu_bundles):
            raise ValueError("a GPU engine's bundles may hold one GPU each (vLLM places one worker per bundle): "
                             "use placement_group_config.bundle_per_worker: {GPU: 1, CPU: ...}")
        if len(gpu_bundles) < self.world_size:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} workers need as "
                             f"many GPU bundles; placement_group_config gives {len(gpu_bundles)}")
        return self

    @model_validator(mode="after")
    def _one_core_set_per_replica(self) -> EngineConfig:
        if self.cpu_cores is not None and len(self.cpu_cores) != self.max_replicas:
            raise ValueError(
                f"cpu_cores lists {len(self.cpu_cores)} core sets for up to {self.max_replicas} replica(s); "
                "give exactly one per replica (with autoscaling, one per replica up to max_replicas)"
            )
        return self


class ChatConfig(StrictModel):
    """How the ingress renders chat requests and parses their answers: `vllm serve`'s options of the same names."""

    chat_template: str | None = Field(
        default=None, description="A Jinja chat template in place of the tokenizer's: a file's path (relative paths "
        "from the project root) or the template itself. A template that renders `tools` lets clients send them.")
    enable_auto_tool_choice: bool = Field(
        default=False, description="Parse tool calls out of answers to requests with `tool_choice: auto` (or none "
        "named), with `tool_call_parser`. Without it such requests get a 400; `required` and a named function are "
        "served either way, held to the tools' schema by structured outputs.")
    tool_call_parser: str | None = Field(default=None, description="One of vLLM's registered tool parsers.")
    reasoning_parser: str | None = Field(
        default=None, description="One of vLLM's registered reasoning parsers: the answer's reasoning is returned "
        "apart from its content.")

    @model_validator(mode="after")
    def _parsers_are_vllms(self) -> ChatConfig:
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        for kind, name, manager in (("tool_call_parser", self.tool_call_parser, ToolParserManager),
                                    ("reasoning_parser", self.reasoning_parser, ReasoningParserManager)):
            if name is not None and name not in manager.list_registered():
                raise ValueError(f"{kind} {name!r} is not one of vLLM's: {sorted(manager.list_registered())}")
        return self


class IngressConfig(StrictModel):
    deployment_config: dict[str, Any] = Field(default_factory=dict)
    chat: ChatConfig = Field(default_factory=ChatConfig, description="Chat templates, tool calls and reasoning.")
    request_timeout_s: PositiveInt = Field(default=120, description="Upper bound on one request end to end.")
    replica_wait_s: float = Field(
        default=1.0, gt=0, description="How long a leg may wait for an engine replica to take it. Past that (no "
        "replica of its role can: they died or are being replaced) the request is tried on the replicas left, or "
        "gets a 503 with Retry-After.")
    max_request_bytes: PositiveInt = Field(default=4 * 2**20, description="Larger request bodies get a 413.")
    stream_interval_ms: float = Field(
        default=0, ge=0, le=1000, description="After a stream's first chunks, the decode replica passes on at most "
        "one chunk per this many milliseconds, holding whatever tokens the engine made meanwhile (0: a chunk per "
        "engine step). Fewer chunks cost every hop to the client less CPU; a client may ask for another interval "
        "with the `x-pd-stream-interval-ms` header.")
    mode_policy: CostPriors = Field(
        default_factory=CostPriors, description="Where the `auto` mode policy's learned costs start and how it "
        "weighs a request's TTFT against the stall it imposes on running streams (app/policy/mode_policy.py).")
    threshold_rule: ThresholdRule = Field(
        default_factory=ThresholdRule, description="The `threshold` policy's rule: local below a prompt length or "
        "while prefill is backed up, else its remote mode (app/policy/mode_policy.py).")
    classes: dict[str, ServiceClass] = Field(
        default_factory=default_classes, min_length=1, description="The service classes a request may name (the "
        "`x-pd-class` header, the body's `pd_class`, the handle API's `pd_class`).")
    default_class: str = Field(default="interactive", description="The class of a request that names none.")
    slots: PositiveInt | None = Field(
        default=None, description="Requests one ingress replica runs at once (each class at most its `max_share`); "
        "as many more wait in its queue, most urgent class first. Unset: its share of what the decode replicas run "
        "at once (`max_num_seqs` each), so that a request the ingress starts finds room on an engine.")
    api_key_env: str | None = Field(
        default=None,
        description="Name of an environment variable, set in the ingress replicas, holding the key clients must send "
        "as `Authorization: Bearer <key>` (OpenAI's scheme). Unset: no authentication.",
    )


    @field_validator("classes")
    @classmethod
    def _class_names_are_tokens(cls, classes: dict[str, ServiceClass]) -> dict[str, ServiceClass]:
        for name in classes:
            if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", name):
                raise ValueError(f"class name {name!r}: lower-case letters, digits, '-' and '_', at most 32")
        return classes

    @model_validator(mode="after")
    def _classes_are_defined(self) -> IngressConfig:
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of classes {sorted(self.classes)}")
        return self


def cpu_set(cores: str) -> set[int]:
    """A core list in vLLM's VLLM_CPU_OMP_THREADS_BIND syntax ('0', '2-3', '0,2-3') as the set of its cores."""
    found = set()
    for part in cores.split(","):
        bounds = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        first, last = (int(bounds[1]), int(bounds[2] or bounds[1])) if bounds else (1, 0)
        if first > last:
            raise ValueError(f"{cores!r} is not a core list like '0', '2-3' or '0,2-3'")
        found.update(range(first, last + 1))
    return found


def hold_process_to(cores: set[int], pid: int | str = "self") -> None:
    """Hold every thread of process `pid` (this one by default), and so every thread and process it starts from now
    on, to `cores`. (A thread's affinity is its own: Serve runs a replica's constructor on a thread of its own.)"""
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(thread), cores)


class PDAppConfig(StrictModel):
    """The whole application: one prefill side, one decode side, the KV transfer between them, the ingress."""

    prefill: EngineConfig
    decode: EngineConfig
    transfer: TransferConfig = TransferConfig()
    ingress: IngressConfig = IngressConfig()
    stack_cpu_cores: str | None = Field(
        default=None, description="CPU engines only: the cores the app's own processes are held to -- the ingress, "
        "each engine replica and its engine-core process (each engine's compute threads stay on its cpu_cores). "
        "They take CPU with every token streamed: on a decode engine's core they slow every stream's steps, so put "
        "them on the prefill engines' cores. Ray's own processes (Serve's proxy and controller) are not covered; "
        "start Ray under `taskset` for those.")

    @field_validator("stack_cpu_cores")
    @classmethod
    def _a_core_list(cls, cores: str | None) -> str | None:
        if cores is not None:
            cpu_set(cores)
        return cores

    @model_validator(mode="after")
    def _both_sides_serve_one_model(self) -> PDAppConfig:
        if self.prefill.model_loading_config != self.decode.model_loading_config:
            raise ValueError("prefill and decode must load the same model (model_loading_config differs)")
        return self

    @model_validator(mode="after")
    def _buffer_matches_hardware(self) -> PDAppConfig:
        uses_gpu = self.prefill.uses_gpu or self.decode.uses_gpu
        if uses_gpu and (self.stack_cpu_cores or any(side.cpu_cores for side in (self.prefill, self.decode))):
            raise ValueError("cpu_cores and stack_cpu_cores apply to CPU engines only; GPU bundles were given")
        if not uses_gpu and self.transfer.kv_buffer_device != "cpu":
            raise ValueError("CPU engines keep KV in DRAM: transfer.kv_buffer_device must be 'cpu'")
        return self

    @property
    def model_id(self) -> str:
        return self.prefill.model_loading_config.model_id

    @property
    def ingress_slots(self) -> int:
        """Requests one ingress replica runs at once (every request holds its slot for its whole life): unless
        `ingress.slots` says otherwise, the ingress replicas together run as many as the decode replicas do."""
        if self.ingress.slots is not None:
            return self.ingress.slots
        replicas = int(self.ingress.deployment_config.get("num_replicas", 1))
        return math.ceil(self.decode.max_replicas * self.decode.max_num_seqs / replicas)


def load_config(path: str | Path) -> PDAppConfig:
    with open(path) as f:
        return PDAppConfig.model_validate(yaml.safe_load(f))
