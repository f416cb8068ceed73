"""The transfer section of the app's configuration: which connector the engines run and how KV crosses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TransferMode = Literal["push", "pull", "local"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConnectorConfig(StrictModel):
    """Which vLLM KV connector every engine runs. Built-in connectors need only `name`."""

    name: str = "NixlConnector"
    module_path: str | None = Field(default=None, description="Import path of a connector outside vLLM.")


class TransferConfig(StrictModel):
    connector: ConnectorConfig = ConnectorConfig()
    default_mode: TransferMode = "pull"
    backends: list[Literal["UCX", "LIBFABRIC"]] = Field(default=["UCX"], min_length=1)
    kv_buffer_device: Literal["cpu", "cuda"] = "cpu"
    side_channel_host: str | None = Field(
        default=None, description="Address peers use to reach an engine; default: the node's IP."
    )
    connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, description="Extra kv_connector_extra_config entries (leases, timeouts, threads)."
    )

    @field_validator("connector_extra_config")
    @classmethod
    def _backends_have_one_home(cls, extra: dict[str, Any]) -> dict[str, Any]:
        if "backends" in extra:
            raise ValueError("set NIXL backends with transfer.backends, not connector_extra_config")
        return extra
