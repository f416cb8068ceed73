"""The transfer parameters the ingress builds for each leg."""

from __future__ import annotations

import pytest

from kv.transfer_params import new_transfer_id, prefill_params, pull_decode_params, push_decode_params

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
    "transfer_mode": "pull",
    "transfer_id": "t-1",
    "unexpected": "dropped",
}
PREFILL_IDENTITY = {"engine_id": "prefill-1", "side_channel_host": "10.1.2.3", "side_channel_port": 5601,
                    "tp_size": 8, "pp_size": 1}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_prefill_leg_keeps_its_blocks_for_a_remote_decode(mode):
    assert prefill_params(mode, "t-1") == {"do_remote_decode": True, "do_remote_prefill": False,
                                           "transfer_mode": mode, "transfer_id": "t-1"}


def test_pull_decode_leg_reads_from_the_location_prefill_returned():
    params = pull_decode_params(PREFILL_ANSWER)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transfer_mode"] == "pull" and params["transfer_id"] == "t-1"
    assert params["remote_block_ids"] == [[3, 4]] and params["remote_engine_id"] == "prefill-1"
    assert "remote_prefill_cached_tokens" not in params and "unexpected" not in params


@pytest.mark.parametrize("answer", [None, {}, {"remote_block_ids": []}])
def test_a_prefill_answer_without_blocks_is_an_error(answer):
    with pytest.raises(RuntimeError, match="no KV location"):
        pull_decode_params(answer)


def test_push_decode_leg_registers_with_the_chosen_prefill_engine():
    params = push_decode_params("t-9", PREFILL_IDENTITY, num_prompt_tokens=300)
    assert params["transfer_mode"] == "push" and params["transfer_id"] == "t-9"
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == ("prefill-1", "10.1.2.3", 5601)
    assert params["tp_size"] == 8 and params["remote_block_ids"] == ()
    assert params["do_remote_prefill"] is True
    assert params["remote_num_tokens"] == 300  # decode loads what prefill computes, nothing beyond


def test_transfer_ids_are_unique():
    assert len({new_transfer_id() for _ in range(1000)}) == 1000
