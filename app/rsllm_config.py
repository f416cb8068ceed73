"""An application config written for Ray Serve LLM's `build_pd_openai_app`, read as this app's configuration.

Its args (`prefill_config` and `decode_config` holding `LLMConfig` fields, `kv_transfer_config` inside each side's
`engine_kwargs`, `ingress_deployment_config`) map onto the app's own sections; the NIXL connector becomes the
dual-mode connector, so the same engines serve push, pull and local. A field that has no meaning here is refused
with a message that names it, never dropped. An optional `transfer` arg takes the app's own transfer settings
(modes, timeouts) on top of what `kv_transfer_config` says.
"""

from __future__ import annotations

from typing import Any

from app.config import PDAppConfig

# LLMConfig fields carried over as they are: the app's engine sections use the same names and shapes.
SAME_FIELDS = ("model_loading_config", "engine_kwargs", "deployment_config", "placement_group_config", "runtime_env")
# Fields accepted because their value changes nothing here, with the values that do so.
NO_EFFECT = {"llm_engine": ("vLLM",), "log_engine_metrics": (True, None), "server_cls": (None,),
             "lora_config": (None,), "accelerator_config": (None,), "callback_config": (None, {})}
# Ray Serve LLM picks NIXL side-channel ports from this base; the app's engines pick free ports themselves.
IGNORED_EXPERIMENTAL = {"NIXL_SIDE_CHANNEL_PORT_BASE"}
KV_TRANSFER_FIELDS = {"kv_connector", "kv_role", "kv_buffer_device", "kv_connector_extra_config"}
NIXL_CONNECTORS = {"NixlConnector", "DualModeNixlConnector"}


class UnsupportedField(ValueError):
    pass


def _engine_section(side: str, llm_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this app's engine section, the side's kv_transfer_config) for one LLMConfig dict."""
    section: dict[str, Any] = {}
    for key, value in llm_config.items():
        where = f"{side}.{key}"
        if key in SAME_FIELDS:
            section[key] = value
        elif key in NO_EFFECT:
            if value not in NO_EFFECT[key]:
                raise UnsupportedField(f"{where}: only {NO_EFFECT[key][0]!r} is supported here, got {value!r}")
        elif key == "accelerator_type":
            continue  # applied to the placement below
        elif key == "experimental_configs":
            if unknown := set(value) - IGNORED_EXPERIMENTAL:
                raise UnsupportedField(f"{where}: {sorted(unknown)} have no meaning here")
        else:
            raise UnsupportedField(f"{where} has no meaning in this app")
    engine_kwargs = dict(section.get("engine_kwargs", {}))
    kv_transfer = engine_kwargs.pop("kv_transfer_config", None)
    if kv_transfer is None:
        raise UnsupportedField(f"{side}.engine_kwargs.kv_transfer_config is required for P/D disaggregation")
    section["engine_kwargs"] = engine_kwargs
    # Ray Serve LLM's default placement: one GPU bundle per worker, packed on one node.
    section.setdefault("placement_group_config", {"bundle_per_worker": {"GPU": 1}, "strategy": "STRICT_PACK"})
    if accelerator := llm_config.get("accelerator_type"):  # as Ray Serve LLM does: a sliver of its resource per GPU
        placement = dict(section["placement_group_config"])
        resource = {f"accelerator_type:{accelerator}": 0.001}
        if "bundle_per_worker" in placement:
            placement["bundle_per_worker"] = {**placement["bundle_per_worker"], **resource}
        else:
            placement["bundles"] = [{**b, **resource} if b.get("GPU") else b for b in placement["bundles"]]
        section["placement_group_config"] = placement
    return section, kv_transfer


def _transfer_section(kv_transfer: dict[str, Any]) -> dict[str, Any]:
    if unknown := set(kv_transfer) - KV_TRANSFER_FIELDS:
        raise UnsupportedField(f"kv_transfer_config: {sorted(unknown)} have no meaning here")
    if kv_transfer.get("kv_connector") not in NIXL_CONNECTORS:
        raise UnsupportedField(f"kv_transfer_config.kv_connector: only NixlConnector is supported here, got "
                               f"{kv_transfer.get('kv_connector')!r}")
    extra = dict(kv_transfer.get("kv_connector_extra_config") or {})
    transfer: dict[str, Any] = {}
    if "backends" in extra:
        transfer["backends"] = extra.pop("backends")
    if extra:
        raise UnsupportedField(f"kv_transfer_config.kv_connector_extra_config: {sorted(extra)} have no meaning here")
    if "kv_buffer_device" in kv_transfer:
        transfer["kv_buffer_device"] = kv_transfer["kv_buffer_device"]
    return transfer  # kv_role does not matter: every engine of this app can send and receive


def from_pd_serving_args(args: dict[str, Any]) -> PDAppConfig:
    """This app's configuration for `build_pd_openai_app`'s args (the LLMConfigs given as dicts)."""
    known = {"prefill_config", "decode_config", "ingress_deployment_config", "ingress_cls_config", "transfer"}
    if unknown := set(args) - known:
        raise UnsupportedField(f"{sorted(unknown)} have no meaning in this app")
    if args.get("ingress_cls_config"):
        raise UnsupportedField("ingress_cls_config: this app's ingress is its own (app/ingress/server.py)")
    prefill, prefill_transfer = _engine_section("prefill_config", args["prefill_config"])
    decode, decode_transfer = _engine_section("decode_config", args["decode_config"])
    transfer = _transfer_section(prefill_transfer)
    if _transfer_section(decode_transfer) != transfer:
        raise UnsupportedField("prefill_config and decode_config must give the same kv_transfer_config backends "
                               "and kv_buffer_device")
    return PDAppConfig.model_validate({
        "prefill": prefill,
        "decode": decode,
        # Every request pulled, as build_pd_openai_app serves them; `transfer: {default_mode: auto}` hands the choice
        # to the mode policy.
        "transfer": {"default_mode": "pull", **transfer, **args.get("transfer", {})},
        "ingress": {"deployment_config": args.get("ingress_deployment_config") or {}},
    })
