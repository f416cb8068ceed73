"""What the ingress sends to an engine replica and what comes back: plain data that crosses Ray without vLLM types
other than SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class PrefillResult:
    """Prefill's answer in pull mode: where the prompt's KV now lives."""

    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int


@dataclass
class EngineChunk:
    """One step of decode output: the new text and tokens since the previous chunk."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens the decode engine did not compute itself (with prefix caching off: tokens that arrived by transfer).
    num_cached_tokens: int = 0
