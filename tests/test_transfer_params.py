"""The transfer parameters the ingress builds for each leg."""

from __future__ import annotations

import pytest

from kv.transfer_params import pull_decode_params, pull_prefill_params


PREFILL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[3, 4]],
    "remote_engine_id": "prefill-1",
    "remote_request_id": "cmpl-1-abcd1234",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_prefill_cached_tokens": 0,
    "unexpected": "dropped",
}


def test_prefill_leg_keeps_its_blocks_for_a_remote_decode():
    assert pull_prefill_params() == {"do_remote_decode": True, "do_remote_prefill": False}


def test_decode_leg_reads_from_the_location_prefill_returned():
    params = pull_decode_params(PREFILL_ANSWER)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[3, 4]] and params["remote_engine_id"] == "prefill-1"
    assert "remote_prefill_cached_tokens" not in params and "unexpected" not in params


@pytest.mark.parametrize("answer", [None, {}, {"remote_block_ids": []}])
def test_a_prefill_answer_without_blocks_is_an_error(answer):
    with pytest.raises(RuntimeError, match="no KV location"):
        pull_decode_params(answer)
