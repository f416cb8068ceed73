"""A scenario: a workload and a cluster shape for the simulator, read from a YAML file in sim/scenarios/.

A scenario's arrival streams give their rates per decode replica, so one scenario runs at any shape (1P1D to
256P256D) with the load per replica unchanged; the streams are merged in time order, each seeded from the
scenario's seed and its place in the list."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from sim.profile import Strict
from sim.workload import OUTPUT_MAX, OUTPUT_SCALE, OUTPUT_SHAPE, PROMPT_TOKENS, Arrival, arrivals

SCENARIOS = Path(__file__).parent / "scenarios"


class Stream(Strict):
    """Open-loop arrivals over a stretch of the run."""

    pattern: Literal["poisson", "onoff"] = "poisson"
    rate_per_decode: PositiveFloat = Field(description="arrivals a second for each decode replica")
    start_s: float = Field(default=0.0, ge=0, description="when the stream begins, from the run's start")
    window_s: PositiveFloat | None = Field(default=None, description="how long it lasts; None: the whole run")
    interactive_share: float = Field(default=0.7, ge=0, le=1)
    prompt_tokens: tuple[PositiveInt, PositiveInt] = PROMPT_TOKENS  # log-uniform between the two
    output_scale: PositiveFloat = OUTPUT_SCALE  # output tokens: scale x Pareto(shape), at most output_max
    output_shape: PositiveFloat = OUTPUT_SHAPE
    output_max: PositiveInt = OUTPUT_MAX

    @model_validator(mode="after")
    def _ordered(self) -> Stream:
        if self.prompt_tokens[0] > self.prompt_tokens[1]:
            raise ValueError("prompt_tokens must be (shortest, longest)")
        return self


class Failure(Strict):
    """Replicas of one role die at once; each is replaced `replica_start_s` (the profile's) later."""

    at_s: float = Field(ge=0, description="when, from the run's start")
    role: Literal["prefill", "decode"]
    share: float = Field(gt=0, le=1, description="the share of the role's replicas that die (at least one)")

    def replicas(self, count: int) -> range:
        """Which of the role's `count` replicas die: the first ones."""
        return range(max(1, round(self.share * count)))


class Scenario(Strict):
    name: str
    description: str
    profile: str = Field(description="a profile in sim/profiles/ (or a path)")
    prefill: PositiveInt = 1
    decode: PositiveInt = 1
    window_s: PositiveFloat = Field(description="how long requests arrive")
    drain_s: float = Field(default=30.0, ge=0, description="after the last arrival, for the last ones to finish")
    streams: list[Stream] = Field(min_length=1)
    failures: list[Failure] = Field(default_factory=list)
    max_model_len: PositiveInt = 2048
    seed: int = 0

    def at_shape(self, prefill: int, decode: int) -> Scenario:
        return self.model_copy(update={"prefill": prefill, "decode": decode})

    def at_load(self, scale: float) -> Scenario:
        """The same scenario with every stream's rate times `scale`."""
        return self.model_copy(update={"streams": [s.model_copy(update={"rate_per_decode": s.rate_per_decode * scale})
                                                   for s in self.streams]})

    def with_requests(self, count: int) -> Scenario:
        """The same scenario stretched or shrunk in time for about `count` requests to arrive."""
        per_second = sum(s.rate_per_decode * self.decode * (s.window_s or self.window_s) / self.window_s
                         for s in self.streams)
        return self.with_window(count / per_second)

    def with_window(self, window_s: float) -> Scenario:
        """The same scenario stretched or shrunk in time (every stream's start and length, and every failure's
        moment, with it) to arrive for `window_s`."""
        stretch = window_s / self.window_s
        streams = [s.model_copy(update={"start_s": s.start_s * stretch,
                                        "window_s": s.window_s and s.window_s * stretch}) for s in self.streams]
        failures = [f.model_copy(update={"at_s": f.at_s * stretch}) for f in self.failures]
        return self.model_copy(update={"window_s": window_s, "streams": streams, "failures": failures})

    def requests(self) -> list[Arrival]:
        merged = []
        for i, stream in enumerate(self.streams):
            window_s = min(stream.window_s or self.window_s, self.window_s - stream.start_s)
            if window_s <= 0:
                continue
            got = arrivals(stream.rate_per_decode * self.decode, window_s, stream.pattern, stream.interactive_share,
                           self.max_model_len, seed=self.seed * 1000 + i, prompt_tokens=stream.prompt_tokens,
                           outputs=(stream.output_scale, stream.output_shape, stream.output_max))
            merged += [dataclasses.replace(a, at_s=a.at_s + stream.start_s) for a in got]
        return sorted(merged, key=lambda a: a.at_s)


def parse_shape(text: str) -> tuple[int, int]:
    """A command line's PREFILLxDECODE replicas, like 64x64."""
    prefill, _, decode = text.lower().partition("x")
    try:
        return int(prefill), int(decode)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is PREFILLxDECODE, like 64x64, not {text!r}") from None


def load_scenario(name_or_path: str) -> Scenario:
    path = Path(name_or_path)
    if not path.exists():
        path = SCENARIOS / f"{name_or_path}.yaml"
    return Scenario.model_validate(yaml.safe_load(path.read_text()))
