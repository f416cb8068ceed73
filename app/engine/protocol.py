"""What the ingress sends to an engine replica and what comes back: plain data that crosses Ray without vLLM types
other than SamplingParams and Logprob."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams
from vllm.logprobs import Logprob


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict[str, Any] | None = None
    # Decode passes on at most one chunk per this many seconds after the first ones (app/engine/server.py).
    stream_interval_s: float = 0.0
    # vLLM's priority scheduling: each engine runs waiting requests of a lower number first (the request's service
    # class, app/config.py ServiceClass).
    priority: int = 0


@dataclass
class LegAccepted:
    """The first message of every leg, sent the moment a replica takes it, so that the ingress knows within a short
    deadline whether any replica did. Prefill's carries its engine's transfer identity, which a push decode leg
    registers its blocks with."""

    replica: str
    transfer_identity: dict[str, Any] | None = None


class ReplicaUnavailable(RuntimeError):
    """Raised by a replica whose engine has died (its actor lives on until Serve replaces it): no request it takes
    can be served."""

    def __init__(self, role: str, replica: str, reason: str):
        super().__init__(f"the {role} engine of replica {replica} is dead: {reason}")
        self.role, self.replica, self.reason = role, replica, reason

    def __reduce__(self):  # whole across Ray
        return ReplicaUnavailable, (self.role, self.replica, self.reason)


@dataclass
class EngineChunk:
    """One step of output: the new text and tokens since the previous chunk."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token that ended it (vLLM's CompletionOutput's)
    # Asked for (`logprobs`): per token, the sampled token's and the top ones' logprobs (vLLM's SampleLogprobs).
    logprobs: list[dict[int, Logprob]] | None = None
    # Prompt tokens the engine did not compute itself (with prefix caching off: tokens that arrived by transfer).
    num_cached_tokens: int = 0
    # First chunk only: when the engine queued, scheduled and produced the request's first token (wall clock, s).
    engine_events: dict[str, float] = field(default_factory=dict)
    # When the engine's step made the chunk's last token, and when its replica passed the chunk on (wall clock, s):
    # with the ingress's and the client's stamps they tell which hop held a stream up (bench/stack_cpu.py).
    made_at: float = 0.0
    sent_at: float = 0.0


@dataclass
class PrefillResult:
    """Prefill's answer: where the prompt's KV now lives (pull), and the first token prefill sampled."""

    kv_transfer_params: dict[str, Any] | None
    first: EngineChunk
