"""A Ray Serve LLM `build_pd_openai_app` application config, run here with only its import_path changed: what maps
onto the app's configuration, and what is refused by name."""

from __future__ import annotations

import json

import pytest
import yaml
from ray.serve._private.utils import import_attr

from app.rsllm_config import UnsupportedField, from_pd_serving_args

# The shape of Ray Serve LLM's prefill/decode example (its docs' serve config), import_path changed; decode
# repeats prefill's fields but for its replica counts.
PORTED = """
applications:
  - name: pd-disaggregation
    route_prefix: /
    import_path: app.builder:build_pd_openai_app   # was: ray.serve.llm:build_pd_openai_app
    args:
      prefill_config: &side
        model_loading_config:
          model_id: Qwen/Qwen3-0.6B
        accelerator_type: H100
        engine_kwargs:
          tensor_parallel_size: 2
          kv_transfer_config:
            kv_connector: NixlConnector
            kv_role: kv_both
        deployment_config:
          autoscaling_config:
            min_replicas: 2
            max_replicas: 4
      decode_config:
        <<: *side
        deployment_config:
          autoscaling_config:
            min_replicas: 6
            max_replicas: 10
"""


def ported_args() -> dict:
    """A fresh copy whose two sides share no objects (YAML's merge key shares them, and deepcopy keeps that)."""
    return json.loads(json.dumps(yaml.safe_load(PORTED)["applications"][0]["args"]))


def test_rays_pd_example_builds_with_only_its_import_path_changed():
    application = yaml.safe_load(PORTED)["applications"][0]
    built = import_attr(application["import_path"])(application["args"])
    assert built is not None
    config = from_pd_serving_args(ported_args())
    assert config.transfer.connector.name == "DualModeNixlConnector" and set(config.transfer.modes) == {
        "push", "pull", "local"}
    assert config.transfer.default_mode == "pull"  # what NixlConnector users had
    assert config.decode.deployment_config["autoscaling_config"]["max_replicas"] == 10
    # Ray Serve LLM's placement: one GPU bundle per worker, with a sliver of the accelerator type's resource
    assert config.prefill.placement_bundles() == [{"GPU": 1, "accelerator_type:H100": 0.001}] * 2
    assert "kv_transfer_config" not in config.prefill.engine_kwargs


def test_nixl_backends_and_buffer_device_map_to_the_transfer_section():
    args = ported_args()
    for side in ("prefill_config", "decode_config"):
        args[side]["engine_kwargs"]["kv_transfer_config"].update(
            kv_buffer_device="cuda", kv_connector_extra_config={"backends": ["LIBFABRIC"]})
    args["transfer"] = {"default_mode": "push"}
    config = from_pd_serving_args(args)
    assert config.transfer.backends == ["LIBFABRIC"] and config.transfer.kv_buffer_device == "cuda"
    assert config.transfer.default_mode == "push"


@pytest.mark.parametrize("change, named", [
    (lambda a: a["prefill_config"].update(lora_config={"dynamic_lora_loading_path": "s3://x"}),
     "prefill_config.lora_config"),
    (lambda a: a["decode_config"]["engine_kwargs"]["kv_transfer_config"].update(kv_connector="LMCacheConnectorV1"),
     "kv_connector"),
    (lambda a: a["decode_config"]["engine_kwargs"].pop("kv_transfer_config"), "decode_config.engine_kwargs"),
    (lambda a: a["prefill_config"].update(experimental_configs={"stream_batching_interval_ms": 10}),
     "stream_batching_interval_ms"),
    (lambda a: a.update(ingress_cls_config={"ingress_cls": "my.Ingress"}), "ingress_cls_config"),
    (lambda a: a.update(proxy_cls_config={}), "proxy_cls_config"),
    (lambda a: a["prefill_config"].update(tokenizer_pool_size=4), "prefill_config.tokenizer_pool_size"),
])
def test_fields_without_a_meaning_here_are_refused_by_name(change, named):
    args = ported_args()
    change(args)
    with pytest.raises(UnsupportedField, match=named.replace(".", r"\.")):
        from_pd_serving_args(args)
