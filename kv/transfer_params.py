"""The `kv_transfer_params` the ingress attaches to each leg of a request. Clients never supply these."""

from __future__ import annotations

from typing import Any

# Keys of prefill's answer that describe where its KV lives and how to reach it; everything else is dropped.
# (`remote_prefill_cached_tokens` in particular would overwrite decode's own count of cached prompt tokens,
# which is how the app proves per request that the prompt arrived by transfer.)
_PULL_LOCATION_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
)


def pull_prefill_params() -> dict[str, Any]:
    """Prefill computes the prompt and keeps its blocks for a decode engine to READ."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def pull_decode_params(prefill_answer: dict[str, Any] | None) -> dict[str, Any]:
    """Decode READs the blocks that prefill's answer points at."""
    if not prefill_answer or not prefill_answer.get("remote_block_ids"):
        raise RuntimeError(f"prefill returned no KV location to pull from: {prefill_answer!r}")
    location = {key: prefill_answer[key] for key in _PULL_LOCATION_KEYS if key in prefill_answer}
    return {**location, "do_remote_prefill": True, "do_remote_decode": False}
