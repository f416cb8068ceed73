"""What the ingress sends to an engine replica and what comes back: plain data that crosses Ray without vLLM types
other than SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class EngineChunk:
    """One step of output: the new text and tokens since the previous chunk."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # Prompt tokens the engine did not compute itself (with prefix caching off: tokens that arrived by transfer).
    num_cached_tokens: int = 0
    # First chunk only: when the engine queued, scheduled and produced the request's first token (wall clock, s),
    # and which replica's engine it was.
    engine_events: dict[str, float] = field(default_factory=dict)
    replica: str | None = None


@dataclass
class PrefillResult:
    """Prefill's answer: where the prompt's KV now lives (pull), and the first token prefill sampled."""

    kv_transfer_params: dict[str, Any] | None
    first: EngineChunk
