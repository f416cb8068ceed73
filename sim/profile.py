"""A hardware profile: what the simulator's engines, hops and hand-offs cost, read from a YAML file in
sim/profiles/. Every number says where it comes from (`sources`)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from sim.engine import EngineSpec

PROFILES = Path(__file__).parent / "profiles"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hops(Strict):
    """One-way latencies of the app's hops, in seconds."""

    ingress_s: float = Field(ge=0, description="arrival to the first leg's dispatch: parse, tokenize, decide")
    to_engine_s: float = Field(ge=0, description="a leg's dispatch to its engine's queue (Serve routing, the call)")
    to_client_s: float = Field(ge=0, description="a token from its engine step to the client")


class Handoff(Strict):
    fixed_s: float = Field(ge=0, description="a READ or WRITE of any size, with its notices")
    bytes_per_s: float = Field(gt=0)
    kv_bytes_per_token: int = Field(gt=0)

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens * self.kv_bytes_per_token / self.bytes_per_s


class Profile(Strict):
    name: str
    description: str
    prefill: EngineSpec
    decode: EngineSpec
    hops: Hops
    handoff: Handoff
    report_period_s: float = Field(default=0.2, gt=0, description="how often engines report their load")
    replica_start_s: float = Field(default=60.0, gt=0, description="a dead replica's replacement starting up")
    sources: dict[str, str] = Field(default_factory=dict, description="where each number comes from")


def load_profile(name_or_path: str) -> Profile:
    path = Path(name_or_path)
    if not path.exists():
        path = PROFILES / f"{name_or_path}.yaml"
    return Profile.model_validate(yaml.safe_load(path.read_text()))
