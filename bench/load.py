"""The client side of the benchmark: streaming OpenAI completions, timed token by token."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class Target:
    """Where one system under test takes requests: one or more base URLs (round-robin) and extra headers."""

    urls: list[str]
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    _next: int = 0

    def next_url(self) -> str:
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        return url


@dataclass
class Sample:
    ttft: float  # seconds from sending to the first token
    token_times: list[float]  # seconds since sending, one per streamed token
    phases_ms: dict[str, float] = field(default_factory=dict)  # the app's timeline, when asked for
    replicas: dict[str, str] = field(default_factory=dict)  # the app's replica that served each leg, likewise
    decision: dict = field(default_factory=dict)  # the app's mode decision (mode, reason, predicted costs), likewise
    # Per chunk with tokens: the app's stamps (engine made, replica sent, ingress got), likewise, and when the
    # client got it; all on the wall clock.
    chunk_stamps: list[list[float]] = field(default_factory=list)
    chunk_arrivals: list[float] = field(default_factory=list)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.ttft) / (n - 1) if n > 1 else None


async def send(client: httpx.AsyncClient, target: Target, prompt: list[int], max_tokens: int,
               headers: dict[str, str] | None = None, fields: dict | None = None) -> Sample:
    """One greedy streaming completion of exactly `max_tokens` tokens (EOS ignored), with the target's headers and
    these, and these body fields. An answer other than 2xx raises httpx.HTTPStatusError."""
    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **(fields or {})}
    start = time.perf_counter()
    times, arrivals, timings = [], [], {}
    async with client.stream("POST", target.next_url() + "/v1/completions", json=body,
                             headers={**target.headers, **(headers or {})}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"])
            if "pd_timings" in event:
                timings = event["pd_timings"]
            for choice in event.get("choices", ()):
                # One chunk may carry several tokens; each counts as arriving now.
                n = len(choice.get("token_ids") or ()) or (1 if choice.get("text") else 0)
                times += [time.perf_counter() - start] * n
                if n:
                    arrivals.append(time.time())
    if len(times) != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens, got {len(times)}")
    return Sample(times[0], times, timings.get("phases_ms", {}), timings.get("replicas", {}),
                  timings.get("decision", {}), timings.get("chunks_s", []), arrivals)


async def run_concurrent(target: Target, prompts: list[list[int]], max_tokens: int, concurrency: int
                         ) -> tuple[list[Sample], float]:
    """All prompts, at most `concurrency` in flight; returns the samples and the wall time."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def one(prompt):
            async with limit:
                return await send(client, target, prompt, max_tokens)

        start = time.perf_counter()
        samples = await asyncio.gather(*(one(p) for p in prompts))
        return list(samples), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))
