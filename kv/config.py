"""The transfer section of the app's configuration: which connector the engines run and how KV crosses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TransferMode = Literal["push", "pull", "local"]
# Policies, which choose a mode per request at the ingress (app/policy/mode_policy.py). `auto`: the mode predicted
# cheapest; `threshold`: a fixed rule on the prompt's length and prefill's queue.
AUTO = "auto"
POLICIES = (AUTO, "threshold")
ModeChoice = Literal["auto", "threshold", "push", "pull", "local"]
# `local`: no disaggregation, the decode engine prefills the prompt itself. It needs nothing from the connector.
LOCAL: TransferMode = "local"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConnectorConfig(StrictModel):
    """Which vLLM KV connector every engine runs: by default the project's dual-mode connector. vLLM's built-in
    `NixlConnector` (module_path null, modes [pull]) also works, for pull only."""

    name: str = "DualModeNixlConnector"
    module_path: str | None = Field(default="kv.connector", description="Import path of a connector outside vLLM.")
    modes: list[Literal["push", "pull"]] = Field(
        default=["push", "pull"], min_length=1, description="The transfer modes this connector serves."
    )


class TransferConfig(StrictModel):
    connector: ConnectorConfig = ConnectorConfig()
    default_mode: ModeChoice = Field(
        default=AUTO, description="The mode of a request that names none: a fixed mode, or a policy that decides per request "
        "(auto or threshold).")
    backends: list[Literal["UCX", "LIBFABRIC"]] = Field(default=["UCX"], min_length=1)
    kv_buffer_device: Literal["cpu", "cuda"] = "cpu"
    side_channel_host: str | None = Field(
        default=None, description="Address peers use to reach an engine; default: the node's IP."
    )
    push_timeout_s: float = Field(
        default=20.0, gt=0, description="Push: how long decode waits for prefill's WRITE after registering."
    )
    lease_s: int = Field(
        default=30, gt=0, description="How long prefill keeps the KV of a finished request for a decode to take."
    )
    seed_first_token: bool = Field(
        default=True,
        description="Stream the token prefill samples at once and let decode continue from the second token, so "
        "the KV hand-off is off the path to the first token (see app/flow/first_token.py for which requests qualify).",
    )
    on_transfer_failure: Literal["fail", "recompute"] = Field(
        default="fail", description="When KV does not arrive: fail the request, or let decode compute the prompt."
    )
    progress_thread: bool = Field(
        default=False,
        description="Run NIXL's progress thread (it polls without pause: a core per engine). Off, the engines' "
        "own steps drive transfers; turn it on for transports that need the passive side to progress.",
    )
    step_spin_s: float | None = Field(
        default=None, gt=0,
        description="How long an engine's processes spin after a step before they sleep until the next one "
        "(kv/step_spin.py). null keeps vLLM's 1 s, which suits engines with cores to spare; tens of milliseconds "
        "free the core soon after a request, for engines that share cores with other engines.",
    )
    connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, description="Extra kv_connector_extra_config entries (leases, timeouts, threads)."
    )

    @model_validator(mode="after")
    def _default_mode_is_served(self) -> TransferConfig:
        if self.default_mode not in (*POLICIES, *self.modes):
            raise ValueError(f"default_mode {self.default_mode!r} is not served by connector "
                             f"{self.connector.name!r} (modes: {list(self.modes)})")
        return self

    @property
    def modes(self) -> tuple[TransferMode, ...]:
        return (*self.connector.modes, LOCAL)

    @field_validator("connector_extra_config")
    @classmethod
    def _backends_have_one_home(cls, extra: dict[str, Any]) -> dict[str, Any]:
        owned = {"backends", "push_registration_timeout", "kv_lease_duration", "progress_thread",
                 "step_spin_s", "side_channel_port"} & extra.keys()
        if owned:
            raise ValueError(f"{sorted(owned)} are set by the transfer section's own fields or per engine, not "
                             "connector_extra_config")
        return extra
