"""Configuration parsing and validation, including the GPU presets (validated here as configuration only)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.builder import build_app, engine_deployment, ingress_options, resolve_config_path
from app.config import PDAppConfig, cpu_set, load_config
from app.engine.server import DecodeServer, PrefillServer
from kv.engine_identity import TransferIdentity
from kv.transfer_config import build_kv_transfer_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CPU = CONFIGS / "cpu-tiny.yaml"
GPU_PRESETS = sorted(CONFIGS.glob("gpu-*.yaml"))
CPU_PRESETS = sorted(CONFIGS.glob("cpu-*.yaml"))


def raw_cpu_config() -> dict:
    return yaml.safe_load(CPU.read_text())


def test_cpu_default_binds_each_engine_to_its_own_core():
    config = load_config(CPU)
    assert config.prefill.cpu_cores == ["0"] and config.decode.cpu_cores == ["1"]
    assert config.prefill.placement_group_config.bundles == [{"CPU": 1}]
    assert config.prefill.engine_kwargs["enable_prefix_caching"] is False
    assert config.transfer.backends == ["UCX"] and config.transfer.kv_buffer_device == "cpu"


def test_cpu_engine_deployments_reserve_their_bundle():
    config = load_config(CPU)
    prefill = engine_deployment(PrefillServer, config.prefill)
    assert prefill.name == "PrefillServer"
    assert prefill.ray_actor_options["num_cpus"] == 1 and prefill.ray_actor_options["num_gpus"] == 0
    assert prefill.ray_actor_options["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert engine_deployment(DecodeServer, config.decode).name == "DecodeServer"


def test_serve_config_points_at_the_cpu_default():
    serve_config = yaml.safe_load((CONFIGS.parent / "serve_config.yaml").read_text())
    [application] = serve_config["applications"]
    assert application["import_path"] == "app.builder:build_app"
    assert resolve_config_path(application["args"]["config_file"]).resolve() == CPU.resolve()
    assert serve_config["http_options"] == {"host": "127.0.0.1", "port": 8000}


def test_app_builds_from_a_file_or_inline_config():
    assert build_app({"config_file": str(CPU)}) is not None
    assert build_app(raw_cpu_config()) is not None


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=[p.stem for p in GPU_PRESETS])
def test_gpu_preset_resolves_to_whole_nodes_and_efa(preset):
    config = load_config(preset)
    for side, server in ((config.prefill, PrefillServer), (config.decode, DecodeServer)):
        tp = side.engine_kwargs["tensor_parallel_size"]
        deployment = engine_deployment(server, side)
        bundles = deployment._replica_config.placement_group_bundles
        # One bundle per GPU, packed: a whole 8-GPU node per engine, so prefill and decode cannot share a node.
        assert [b["GPU"] for b in bundles] == [1] * tp == [1] * 8
        assert deployment._replica_config.placement_group_strategy == "STRICT_PACK"
        assert deployment.ray_actor_options["num_gpus"] == 0  # the replica's actor: a CPU share of bundle 0
        assert bundles[0]["CPU"] == bundles[1]["CPU"] + deployment.ray_actor_options["num_cpus"]
        assert side.engine_kwargs["distributed_executor_backend"] == "ray"
        assert side.engine_kwargs["enable_prefix_caching"] is False
        assert side.cpu_cores is None
    assert config.model_id == "Qwen/Qwen3-32B"
    kv_config = build_kv_transfer_config(config.transfer, TransferIdentity("engine-x", "127.0.0.1", 5555))
    assert kv_config.kv_connector_extra_config["backends"] == ["LIBFABRIC"]
    assert kv_config.kv_buffer_device == "cuda" and kv_config.kv_role == "kv_both"


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=[p.stem for p in GPU_PRESETS])
def test_gpu_preset_placement_is_accepted_by_vllms_ray_executor(preset):
    """On a Ray cluster declaring the GPUs (tests/gpu_layout_probe.py): the placement group is created, and vLLM's
    Ray-executor setup, run from the replica's bundle, accepts it; the old one-bundle layout it refuses."""
    done = subprocess.run([sys.executable, str(CONFIGS.parent / "tests" / "gpu_layout_probe.py"), str(preset)],
                          capture_output=True, text=True, cwd=CONFIGS.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["layout"]: r for r in map(json.loads, filter(lambda l: l.startswith("{"), done.stdout.splitlines()))}
    assert results["preset"]["error"] is None, results["preset"]
    assert "more than 1 GPU" in results["one-bundle-all-gpus"]["error"]


@pytest.mark.parametrize("bundles, error", [
    ({"bundles": [{"GPU": 8, "CPU": 32}]}, "one GPU each"),
    ({"bundle_per_worker": {"GPU": 1}, "bundles": [{"GPU": 1}]}, "exactly one of"),
    ({"bundles": [{"GPU": 1}] * 4}, "need as many GPU bundles"),
])
def test_gpu_placements_vllm_would_refuse_are_refused_at_config_time(bundles, error):
    raw = yaml.safe_load(GPU_PRESETS[0].read_text())
    raw["prefill"] = {**raw["prefill"], "placement_group_config": {**bundles, "strategy": "STRICT_PACK"}}
    with pytest.raises(ValidationError, match=error):
        PDAppConfig.model_validate(raw)


def _invalid(mutate) -> str:
    raw = raw_cpu_config()
    mutate(raw)
    with pytest.raises(ValidationError) as error:
        PDAppConfig.model_validate(raw)
    return str(error.value)


def test_sides_must_serve_the_same_model():
    assert "same model" in _invalid(lambda c: c["decode"].update(
        model_loading_config={"model_id": "other", "model_source": "/models/other"}))


def test_one_core_set_per_replica():
    assert "one per replica" in _invalid(lambda c: c["prefill"].update(
        deployment_config={"num_replicas": 2}))


def test_engine_kwargs_cannot_smuggle_a_connector():
    assert "kv_transfer_config" in _invalid(lambda c: c["decode"]["engine_kwargs"].update(
        kv_transfer_config={"kv_connector": "Other"}))


def test_cpu_engines_cannot_use_a_cuda_buffer():
    assert "kv_buffer_device" in _invalid(lambda c: c["transfer"].update(kv_buffer_device="cuda"))


def test_unknown_keys_and_modes_are_refused():
    assert "extra" in _invalid(lambda c: c.update(colour="blue")).lower()
    assert "default_mode" in _invalid(lambda c: c["transfer"].update(default_mode="teleport"))
    assert "backends" in _invalid(lambda c: c["transfer"].update(backends=["CARRIER_PIGEON"]))


def test_the_mode_policys_starting_costs_and_weights_are_configured_and_checked():
    raw = raw_cpu_config()
    raw["ingress"] = {**raw.get("ingress", {}), "mode_policy": {"stall_weight": 0.25, "prefill_s_per_token": 3e-5}}
    priors = PDAppConfig.model_validate(raw).ingress.mode_policy
    assert (priors.stall_weight, priors.prefill_s_per_token, priors.admit_step_s) == (0.25, 3e-5, 0.01)
    assert "hop_s" in _invalid(lambda c: c.setdefault("ingress", {}).update(mode_policy={"hop_s": {"push": 0.01}}))
    assert "stall_weight" in _invalid(lambda c: c.setdefault("ingress", {}).update(mode_policy={"stall_weight": -1}))
    assert "stal_weight" in _invalid(lambda c: c.setdefault("ingress", {}).update(mode_policy={"stal_weight": 1}))


def test_service_classes_default_to_interactive_and_batch_and_are_checked():
    ingress = PDAppConfig.model_validate(raw_cpu_config()).ingress
    assert ingress.default_class == "interactive"
    interactive, batch = ingress.classes["interactive"], ingress.classes["batch"]
    assert interactive.priority < batch.priority  # vLLM runs the lower number first
    assert interactive.ttft_slo_ms < batch.ttft_slo_ms and batch.ttft_weight < interactive.ttft_weight
    gold = {"gold": {"priority": -1, "ttft_slo_ms": 500, "tpot_slo_ms": 50}}
    custom = raw_cpu_config()
    custom["ingress"] = {"classes": gold, "default_class": "gold"}
    assert PDAppConfig.model_validate(custom).ingress.classes["gold"].ttft_weight == 1.0
    assert "default_class" in _invalid(lambda c: c.setdefault("ingress", {}).update(classes=gold))
    assert "class name" in _invalid(lambda c: c.setdefault("ingress", {}).update(
        classes={"Gold Tier": gold["gold"]}, default_class="Gold Tier"))
    assert "ttft_slo_ms" in _invalid(lambda c: c.setdefault("ingress", {}).update(
        classes={"gold": {"priority": 0, "tpot_slo_ms": 50}}, default_class="gold"))


def test_the_cpu_decode_engine_prefills_long_prompts_in_chunks():
    config = PDAppConfig.model_validate(raw_cpu_config())
    assert config.decode.prefill_chunk_tokens == 256 and config.prefill.prefill_chunk_tokens is None
    assert config.decode.engine_kwargs["max_model_len"] == config.prefill.engine_kwargs["max_model_len"]


@pytest.mark.parametrize("cores", ["", "a", "3-1", "1-", "0,,1"])
def test_stack_cpu_cores_must_be_a_core_list(cores):
    assert "core list" in _invalid(lambda c: c.update(stack_cpu_cores=cores))


def test_stack_cpu_cores_reads_vllms_core_list_syntax():
    assert cpu_set("0,2-3") == {0, 2, 3} and cpu_set(" 1 ") == {1}


def test_the_cpu_presets_that_hold_the_stack_keep_it_on_the_prefill_core():
    assert load_config(CPU).stack_cpu_cores is not None
    for preset in CPU_PRESETS:
        config = load_config(preset)
        if config.stack_cpu_cores is None:
            continue
        assert cpu_set(config.stack_cpu_cores) == cpu_set(config.prefill.cpu_cores[0]), preset.name
        assert all(cpu_set(config.stack_cpu_cores).isdisjoint(cpu_set(cores)) for cores in config.decode.cpu_cores)


def test_backends_have_one_place_in_the_config():
    assert "transfer section" in _invalid(lambda c: c["transfer"].update(
        connector_extra_config={"backends": ["UCX"]}))


def test_config_is_immutable_once_validated():
    config = load_config(CPU)
    with pytest.raises(ValidationError):
        config.transfer.default_mode = "push"
    assert copy.deepcopy(config) == config


@pytest.mark.parametrize("preset", [CPU, *GPU_PRESETS], ids=lambda p: p.stem)
def test_presets_run_the_dual_mode_connector_with_bounded_lifetimes(preset):
    config = load_config(preset)
    assert set(config.transfer.modes) == {"push", "pull", "local"}
    kv_config = build_kv_transfer_config(config.transfer, TransferIdentity("engine-x", "127.0.0.1", 5555))
    assert (kv_config.kv_connector, kv_config.kv_connector_module_path) == ("DualModeNixlConnector", "kv.connector")
    extra = kv_config.kv_connector_extra_config
    assert extra["side_channel_port"] == 5555  # the engine's own, not an environment variable (engine_identity.py)
    assert extra["push_registration_timeout"] == config.transfer.push_timeout_s < 60
    assert extra["kv_lease_duration"] == config.transfer.lease_s
    assert extra["progress_thread"] is False
    assert kv_config.kv_load_failure_policy == config.transfer.on_transfer_failure


def test_default_mode_must_be_served_by_the_connector():
    assert "not served" in _invalid(lambda c: c["transfer"].update(
        connector={"name": "NixlConnector", "module_path": None, "modes": ["pull"]}, default_mode="push"))


def test_deployments_admit_what_their_engines_run_at_once():
    config = load_config(CPU)
    max_num_seqs = config.decode.engine_kwargs["max_num_seqs"]
    assert engine_deployment(DecodeServer, config.decode).max_ongoing_requests == max_num_seqs
    assert engine_deployment(PrefillServer, config.prefill).max_ongoing_requests == max_num_seqs
    # The ingress runs as many requests as the decode replicas do and queues as many by class; Serve lets it hold
    # as many again (to turn away), and queues as many (a burst arriving at once passes through Serve's queue;
    # 503 with Retry-After: 1 past it).
    assert config.ingress_slots == max_num_seqs
    assert ingress_options(config) == {"max_ongoing_requests": 3 * max_num_seqs,
                                       "max_queued_requests": 3 * max_num_seqs,
                                       "backpressure_config": {"status_code": 503, "retry_after_s": 1},
                                       "ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": EXPORT_1S}}}


EXPORT_1S = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def test_every_replica_exports_serves_metrics_once_a_second_unless_its_runtime_env_says_otherwise():
    raw = raw_cpu_config()
    raw["ingress"]["deployment_config"] = {"ray_actor_options": {"runtime_env": {
        "env_vars": {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100"}}}}
    config = PDAppConfig.model_validate(raw)
    for server, engine in ((PrefillServer, config.prefill), (DecodeServer, config.decode)):
        env = engine_deployment(server, engine).ray_actor_options["runtime_env"]["env_vars"]
        assert env == {**EXPORT_1S, "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert ingress_options(config)["ray_actor_options"]["runtime_env"]["env_vars"] == {
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100"}


def test_ingress_replicas_share_the_decode_capacity_and_explicit_options_win():
    raw = raw_cpu_config()
    raw["decode"]["deployment_config"] = {"num_replicas": 3}  # its own dict: YAML's anchor shares prefill's
    raw["decode"]["cpu_cores"] = ["1", "1", "1"]
    raw["ingress"]["deployment_config"] = {"num_replicas": 2, "max_queued_requests": 7}
    options = ingress_options(PDAppConfig.model_validate(raw))
    assert PDAppConfig.model_validate(raw).ingress_slots == 48  # 3 x 32 decode slots over 2 ingress replicas
    assert options["max_ongoing_requests"] == 3 * 48 and options["max_queued_requests"] == 7
    assert engine_deployment(DecodeServer, PDAppConfig.model_validate(raw).decode)._deployment_config.health_check_period_s == 2
    raw["decode"]["deployment_config"].update(max_ongoing_requests=5, health_check_period_s=7)
    decode = engine_deployment(DecodeServer, PDAppConfig.model_validate(raw).decode)
    assert decode.max_ongoing_requests == 5 and decode._deployment_config.health_check_period_s == 7


def test_autoscaling_passes_through_to_the_engine_deployment():
    raw = raw_cpu_config()
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}
    raw["decode"]["deployment_config"] = {"autoscaling_config": autoscaling}
    raw["decode"]["cpu_cores"] = ["1", "1", "1"]  # one per replica it may scale to
    config = PDAppConfig.model_validate(raw)
    decode = engine_deployment(DecodeServer, config.decode)._deployment_config
    assert (decode.autoscaling_config.min_replicas, decode.autoscaling_config.max_replicas) == (1, 3)
    # the ingress admits what the decode replicas can run once scaled out
    assert config.ingress_slots == 3 * config.decode.max_num_seqs

    raw["decode"]["cpu_cores"] = ["1"]
    with pytest.raises(ValidationError, match="up to 3 replica"):
        PDAppConfig.model_validate(raw)
    raw["decode"]["deployment_config"] = {"num_replicas": "auto"}
    with pytest.raises(ValidationError, match="autoscaling_config"):
        PDAppConfig.model_validate(raw)


def test_chat_parsers_are_vllms_registered_ones():
    raw = raw_cpu_config()
    assert load_config(CPU).ingress.chat.tool_call_parser == "hermes"
    for field, name in (("tool_call_parser", "hermes-ish"), ("reasoning_parser", "mind-reader")):
        with pytest.raises(ValidationError, match=f"{field} {name!r} is not one of vLLM's"):
            PDAppConfig.model_validate({**raw, "ingress": {"chat": {field: name}}})
    with pytest.raises(ValidationError, match="needs a tool_call_parser"):
        PDAppConfig.model_validate({**raw, "ingress": {"chat": {"enable_auto_tool_choice": True}}})


def test_the_plain_vllm_baseline_gets_the_engines_kwargs_as_flags_vllm_serve_reads():
    """bench's `vllm` peer is vLLM's own server on the same engine kwargs, config sections included."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench.systems import cli_flags

    engine = load_config(CPU).decode
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(cli_flags(engine.engine_args)))
    assert args.max_model_len == 2048 and args.enable_prefix_caching is False
    structured = args.structured_outputs_config
    assert (structured.backend, structured.disable_any_whitespace) == ("xgrammar", True)
