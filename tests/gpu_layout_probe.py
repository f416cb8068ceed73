"""Run by test_config.py in its own process: the placement a GPU preset resolves to, on a Ray cluster that declares
GPUs (this machine has none), checked by vLLM's own Ray-executor setup from inside the replica's bundle, as it runs
when the engine starts there. Prints one JSON line per layout: accepted, or vLLM's error."""

from __future__ import annotations

import json
import sys

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote
def vllm_accepts_placement(tensor_parallel_size: int) -> str | None:
    from vllm.config import ParallelConfig
    from vllm.platforms import current_platform
    from vllm.v1.executor.ray_utils import initialize_ray_cluster

    type(current_platform).ray_device_key = "GPU"  # the CPU build names no device; on a GPU node this is "GPU"
    try:
        initialize_ray_cluster(ParallelConfig(tensor_parallel_size=tensor_parallel_size))
    except Exception as e:  # noqa: BLE001 -- reported to the test
        return f"{type(e).__name__}: {e}"
    return None


def check(bundles: list[dict], strategy: str, replica_options: dict, tensor_parallel_size: int) -> str | None:
    group = ray.util.placement_group(bundles, strategy=strategy)
    ray.get(group.ready(), timeout=60)
    try:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        return ray.get(vllm_accepts_placement.options(
            num_cpus=replica_options["num_cpus"], num_gpus=replica_options["num_gpus"],
            scheduling_strategy=strategy).remote(tensor_parallel_size))
    finally:
        ray.util.remove_placement_group(group)


def main(preset: str) -> None:
    from app.builder import engine_deployment
    from app.config import load_config
    from app.engine.server import PrefillServer

    engine = load_config(preset).prefill
    deployment = engine_deployment(PrefillServer, engine)
    replica = deployment._replica_config
    tp = int(engine.engine_kwargs["tensor_parallel_size"])
    ray.init(num_cpus=64, num_gpus=tp, include_dashboard=False, logging_level="ERROR")
    layouts = {
        "preset": (replica.placement_group_bundles, replica.placement_group_strategy, deployment.ray_actor_options),
        # What the preset used to resolve to: the replica's actor holding one bundle with the node's GPUs.
        "one-bundle-all-gpus": ([{"CPU": 32, "GPU": tp}], "STRICT_PACK", {"num_cpus": 32, "num_gpus": tp}),
    }
    for name, (bundles, strategy, options) in layouts.items():
        print(json.dumps({"layout": name, "bundles": bundles, "error": check(bundles, strategy, options, tp)}))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
