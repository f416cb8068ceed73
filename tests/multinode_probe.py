"""Run by test_multinode.py in its own process (a Ray cluster of its own beside the session's): two raylets on this
machine, one offering `prefill_node`, one `decode_node`; the app from configs/cpu-two-nodes.yaml on them; a push and
a pull request. Prints one JSON line: where each engine runs, where its side channel listens, and what each request
reports."""

from __future__ import annotations

import json
import sys

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from app.builder import build_pd_app
from app.config import PDAppConfig
from kv.engine_identity import free_port


def main(config_path: str, prompt: str) -> None:
    import yaml

    raw = yaml.safe_load(open(config_path))
    raw["transfer"].update(lease_s=4, push_timeout_s=10)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = {role: cluster.add_node(num_cpus=1, resources={f"{role}_node": 1}) for role in ("prefill", "decode")}
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_pd_app(PDAppConfig.model_validate(raw)), name="pd", route_prefix="/")
        report = {"nodes": {role: node.node_id for role, node in nodes.items()},
                  "node_addresses": {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}}
        for role in ("prefill", "decode"):
            handle = serve.get_deployment_handle(f"{role.capitalize()}Server", app_name="pd")
            report[role] = {"node_id": handle.engine_info.remote().result()["node_id"],
                            "side_channel_host": handle.transfer_identity.remote().result()["side_channel_host"]}
        for mode in ("push", "pull"):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                                  headers={"x-kv-transfer-mode": mode},
                                  json={"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 4, "temperature": 0})
            report[mode] = {"status": response.status_code, "usage": response.json().get("usage")}
        print(json.dumps(report))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
