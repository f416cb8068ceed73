"""Decisions of the dual-mode worker, tested at their narrowest seam: a worker object carrying only the state these
methods read (building a real one needs a running engine). The faults they guard against need TP > 1, a slow
handshake or an abort in a narrow window, which this machine cannot produce on demand; the other paths run for real
in test_dual_mode.py."""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from kv.mode_stats import DualModeStats
from kv.push_matching import PushMatcher, ReceiveDeadlines, withdrawal_of
from kv.worker import RECEIVED_AT_KEY, DualModeWorker


def bare_worker(world_size: int) -> DualModeWorker:
    worker = object.__new__(DualModeWorker)
    worker.world_size = world_size
    worker._pending_completion_notifs = queue.Queue()
    worker._reqs_to_send, worker._reqs_to_process = {}, set()
    worker._recving_metadata, worker._recving_transfers = {}, {}
    worker.consumer_notification_counts_by_req = defaultdict(int)
    worker.transfer_topo = SimpleNamespace()
    worker.xfer_stats = DualModeStats()
    worker._writes_posted = threading.Event()  # what `_drive_writes` waits on
    return worker


def test_pull_blocks_are_freed_only_after_every_reader(monkeypatch):
    """Prefill TP 4, decode TP 8: two decode ranks read each prefill rank's blocks, and each sends `<id>:2`."""
    worker = bare_worker(world_size=4)
    worker._reqs_to_send["prefill-req"] = time.perf_counter() + 30
    worker._reqs_to_process.add("prefill-req")

    worker._pending_completion_notifs.put(b"prefill-req:2")
    assert worker._get_new_notifs() == set()
    assert "prefill-req" in worker._reqs_to_send  # the second reader may still be reading

    worker._pending_completion_notifs.put(b"prefill-req:2")
    assert worker._get_new_notifs() == {"prefill-req"}
    assert "prefill-req" not in worker._reqs_to_send and not worker._reqs_to_process


def test_write_notices_on_the_receiving_side_keep_the_push_rules():
    """Decode side of a push: one notice per producer rank, `<id>:<producer TP>`; TP 4 to TP 4 needs one."""
    worker = bare_worker(world_size=4)
    worker._recving_metadata["decode-req"] = SimpleNamespace(pp_size=1)
    worker._pending_completion_notifs.put(b"decode-req:4")
    assert worker._get_new_notifs() == set()
    assert worker._recving_transfers == {"decode-req": []}  # reported done by the next step


@pytest.mark.parametrize("age_s, written", [(1.0, True), (9.0, False)])
def test_a_write_deferred_past_the_window_is_never_posted(monkeypatch, age_s, written):
    """A WRITE that waited for the handshake with decode is re-checked when it is finally posted."""
    posted = []
    monkeypatch.setattr(NixlPushConnectorWorker, "_do_start_push_kv",
                        lambda self, rid, blocks, registration: posted.append(rid))
    worker = bare_worker(world_size=1)
    worker._push_matcher = PushMatcher(max_wait_s=8.0)
    registration = {"transfer_id": "t1", "decode_engine_id": "decode-1", RECEIVED_AT_KEY: time.monotonic() - age_s}

    worker._do_start_push_kv("prefill-req", [[1, 2]], registration)

    assert posted == (["prefill-req"] if written else [])
    assert worker._writes_posted.is_set() == written  # a posted WRITE is polled until done (`_drive_writes`)
    assert len(worker.xfer_stats.data["late_writes_dropped"]) == (0 if written else 1)


def test_a_push_aborted_before_decode_allocated_leaves_nothing_behind(monkeypatch):
    """Its receive comes with no blocks: neither view of the worker may track it (nothing would ever clear it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    seen = {}
    monkeypatch.setattr(NixlPullConnectorWorker, "start_load_kv",
                        lambda self, view: seen.setdefault("pull", dict(view.reqs_to_recv)))
    monkeypatch.setattr(NixlPushConnectorWorker, "start_load_kv",
                        lambda self, view: seen.setdefault("push", dict(view.reqs_to_recv)))
    worker = bare_worker(world_size=1)
    worker._push_matcher = PushMatcher(max_wait_s=8.0)
    worker._push_deadlines = ReceiveDeadlines(timeout_s=10.0)
    metadata = NixlConnectorMetadata()
    metadata.reqs_to_recv = {"aborted": SimpleNamespace(local_block_ids=([],)),
                             "waiting": SimpleNamespace(local_block_ids=([3, 4],))}
    metadata.transfer_modes = {"aborted": "push", "waiting": "push"}

    worker.start_load_kv(metadata)

    assert seen == {"pull": {}, "push": {"waiting": metadata.reqs_to_recv["waiting"]}}
    assert len(worker._push_deadlines) == 1


def test_heartbeats_naming_a_push_transfer_extend_its_prefill_lease():
    worker = bare_worker(world_size=1)
    worker._push_matcher = PushMatcher(max_wait_s=8.0)
    worker._lease_extension = 30
    soon = time.perf_counter() + 1
    worker._reqs_to_send = {"prefill-push": soon, "prefill-pull": soon}
    worker._push_matcher.request_finished("prefill-push", "transfer-1")

    worker._handle_heartbeat("transfer-1,prefill-pull")

    assert all(expiry > soon + 20 for expiry in worker._reqs_to_send.values()), worker._reqs_to_send


# -- withdrawals: a push request that ended while decode waited for its WRITE ----------------------------------------

REGISTRATION = {"transfer_id": "t1", "request_id": "decode-req", "decode_engine_id": "decode-1",
                "decode_host": "127.0.0.1", "decode_port": 5600, "decode_tp_size": 1, "remote_engine_id": "prefill-1",
                "local_block_ids": [[7, 8]]}


def decode_worker(handshaken: bool) -> DualModeWorker:
    worker = bare_worker(world_size=1)
    worker._recving_metadata["decode-req"] = SimpleNamespace(pp_size=1)
    worker._withdrawn_unsent = set()
    worker._failed_recv_reqs = queue.Queue()
    worker._handshake_lock = threading.Lock()
    worker._remote_agents = {"prefill-1": {(0, 0): "prefill-agent"}} if handshaken else {}
    return worker


def test_a_withdrawal_goes_to_prefill_after_the_registration(monkeypatch):
    sent = []
    monkeypatch.setattr(NixlPushConnectorWorker, "_do_send_reg_notif", lambda self, rid, data: sent.append(data))
    worker = decode_worker(handshaken=True)
    worker._send_registration_to_p("decode-req", withdrawal_of(REGISTRATION))
    assert sent == [withdrawal_of(REGISTRATION)] and worker._failed_recv_reqs.empty()  # freed on prefill's answer


def test_a_registration_withdrawn_before_its_handshake_is_never_sent(monkeypatch):
    """The registration waits for the handshake with prefill when the withdrawal comes: it is dropped, and with no
    registration out, no WRITE can come, so decode frees its blocks at once."""
    sent = []
    monkeypatch.setattr(NixlPushConnectorWorker, "_send_registration_to_p",
                        lambda self, rid, data: sent.append(data))
    worker = decode_worker(handshaken=False)
    worker._send_registration_to_p("decode-req", withdrawal_of(REGISTRATION))
    assert worker._failed_recv_reqs.empty()
    worker._send_registration_to_p("decode-req", REGISTRATION)  # back from the handshake
    assert sent == [] and worker._failed_recv_reqs.get_nowait() == "decode-req"
    assert not worker._withdrawn_unsent


def prefill_worker(notices: list) -> DualModeWorker:
    worker = bare_worker(world_size=1)
    worker._push_matcher = PushMatcher(max_wait_s=8.0)
    worker._push_finished_blocks = {}
    worker._handshake_lock = threading.Lock()
    worker._remote_agents = {"decode-1": {(0, 0): "decode-agent"}}  # keyed (PP rank, TP rank)
    worker.use_mla = False
    worker.tp_mappings = {"decode-1": SimpleNamespace(all_source_ranks=[0])}
    worker.transfer_topo = SimpleNamespace(get_engine_info=lambda engine: SimpleNamespace(remote_tp_size=1),
                                           tp_ratio=lambda tp: 1)
    worker._ensure_handshake = lambda *args, **kwargs: None  # decode already reached
    worker.nixl_wrapper = SimpleNamespace(send_notif=lambda agent, notif_msg: notices.append((agent, notif_msg)))
    return worker


def message(data: dict) -> bytes:
    return PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(data)


def test_prefill_answers_a_withdrawal_and_never_writes_for_it(monkeypatch):
    posted, notices = [], []
    monkeypatch.setattr(NixlPushConnectorWorker, "_do_start_push_kv",
                        lambda self, rid, blocks, registration: posted.append(rid))
    worker = prefill_worker(notices)
    worker._handle_push_reg_notif(message(REGISTRATION))
    worker._handle_push_reg_notif(message(withdrawal_of(REGISTRATION)))
    # the notice a completed WRITE would send, so decode's receive ends the same way
    assert notices == [("decode-agent", b"decode-req:1")]
    assert len(worker.xfer_stats.data["push_withdrawn"]) == 1
    # prefill finishes afterwards: its blocks find no registration, and nothing is written
    worker._push_matcher.request_finished("prefill-req", "t1")
    assert worker._pop_matching_registration("prefill-req") is None
    worker._do_start_push_kv("prefill-req", [[1, 2]], {**REGISTRATION, RECEIVED_AT_KEY: time.monotonic()})
    assert posted == []


def test_prefill_does_not_answer_a_withdrawal_once_its_write_is_posted(monkeypatch):
    posted, notices = [], []
    monkeypatch.setattr(NixlPushConnectorWorker, "_do_start_push_kv",
                        lambda self, rid, blocks, registration: posted.append(rid))
    worker = prefill_worker(notices)
    worker._push_matcher.request_finished("prefill-req", "t1")
    worker._push_finished_blocks["prefill-req"] = [[1, 2]]
    worker._handle_push_reg_notif(message(REGISTRATION))  # matched: the WRITE is posted
    worker._handle_push_reg_notif(message(withdrawal_of(REGISTRATION)))
    assert posted == ["prefill-req"] and notices == []  # the WRITE's own notice will end decode's receive
