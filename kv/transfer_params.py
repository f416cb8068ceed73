"""The `kv_transfer_params` the ingress attaches to each leg of a request. Clients never supply these."""

from __future__ import annotations

import uuid
from typing import Any

MODE_KEY = "transfer_mode"
TRANSFER_ID_KEY = "transfer_id"

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
    "lease_expires_at",
)


# Pull: when prefill frees the prompt's KV unless a decode engine has taken the request by then (wall-clock seconds).
LEASE_EXPIRES_AT_KEY = "lease_expires_at"


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def prefill_params(mode: str, transfer_id: str) -> dict[str, Any]:
    """Prefill computes the prompt and keeps its blocks: for a decode engine to READ (pull), or to WRITE into the
    blocks the decode engine registers under `transfer_id` (push)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, MODE_KEY: mode, TRANSFER_ID_KEY: transfer_id}


def pull_decode_params(prefill_answer: dict[str, Any] | None) -> dict[str, Any]:
    """Decode READs the blocks that prefill's answer points at."""
    if not prefill_answer or not prefill_answer.get("remote_block_ids"):
        raise RuntimeError(f"prefill returned no KV location to pull from: {prefill_answer!r}")
    location = {key: prefill_answer[key] for key in _PULL_LOCATION_KEYS if key in prefill_answer}
    return {**location, "do_remote_prefill": True, "do_remote_decode": False, MODE_KEY: "pull",
            TRANSFER_ID_KEY: prefill_answer.get(TRANSFER_ID_KEY)}


def push_decode_params(transfer_id: str, prefill_identity: dict[str, Any], num_prompt_tokens: int) -> dict[str, Any]:
    """Decode allocates the blocks of the `num_prompt_tokens` prefill computes and registers them, under
    `transfer_id`, with the prefill engine described by `prefill_identity`, which WRITEs into them when its
    prefill ends."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        MODE_KEY: "push",
        TRANSFER_ID_KEY: transfer_id,
        "remote_engine_id": prefill_identity["engine_id"],
        "remote_host": prefill_identity["side_channel_host"],
        "remote_port": prefill_identity["side_channel_port"],
        "tp_size": prefill_identity["tp_size"],
        "pp_size": prefill_identity["pp_size"],
        # Decode never learns prefill's internal request id in push; the transfer id stands in for it.
        "remote_request_id": transfer_id,
        "remote_block_ids": (),
        "remote_num_tokens": num_prompt_tokens,
    }
