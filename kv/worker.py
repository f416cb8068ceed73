"""Worker side of the dual-mode connector: one NIXL agent that READs for pull requests and WRITEs for push requests.

Built on vLLM 0.32.0's NIXL worker classes (pinned exactly): vLLM's push worker brings the background writer thread
(registration sends and matching, WRITE posting, completion notices), vLLM's pull worker the READ path; both share
one agent, one set of registered KV regions and one handshake table. What this class changes:
- Per request, the decode side routes a receive to the READ path or to the wait-for-WRITE path by its mode.
- Push registrations are matched to finished prefill blocks by the ingress's transfer id, on the writer thread.
- A push receive whose WRITE does not arrive by its deadline fails; vLLM's `kv_load_failure_policy` then fails the
  request or recomputes the prompt locally.
- A push request that ends while decode waits for its WRITE (client gone) withdraws its registration: prefill
  answers that no WRITE will come, and decode frees the blocks then rather than at the deadline.
- The engine keeps the CPU cores it was given (vLLM's worker re-pins the engine thread to the last core), and the
  agent runs without NIXL's busy-polling progress thread unless configured: the engines' own steps and the writer
  thread drive transfers, and a prefill engine polls its WRITEs in flight every millisecond until they are done
  (`_drive_writes`), so an idle engine burns next to no CPU: its writer thread checks for notices every
  `NOTICE_POLL_S`. (Steps with no model work are paced by the scheduler.)
- Handshakes are always full (descriptors included): a peer reached first for a push may later be read from.

vLLM internals relied on: `_ensure_handshake`, `_handle_push_reg_notif`, `_pop_matching_registration`,
`_push_finished_blocks`, `_pending_d_registrations`, `_recving_metadata`, `_failed_recv_reqs`, `_sending_transfers`,
`_recving_transfers`, `_send_registration_to_p`, `_do_send_reg_notif`, `_reg_send_inbox`, `_remote_agents`,
`tp_mappings`, `xfer_stats`, the push/pull `start_load_kv` split of `NixlConnectorMetadata`, and the format of a
WRITE's completion notice (`<decode request id>:<prefill TP size>`).
"""

from __future__ import annotations

import copy
import os
import queue
import sys
import threading
import time
import uuid

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX, NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
from vllm.logger import init_logger

from kv.mode_stats import DualModeStats
from kv.push_matching import WITHDRAW_KEY, PushMatcher, ReceiveDeadlines, write_window
from kv.step_spin import limit_step_spin
from kv.transfer_params import TRANSFER_ID_KEY

logger = init_logger(__name__)

DEFAULT_PUSH_TIMEOUT_S = 20.0
# vLLM's writer thread reads NIXL notices when an engine step wakes it, so an idle engine (say, a prefill whose
# request was just aborted) would not read a decode engine's withdrawal until its next request. Waking it this
# often bounds that; each wake only checks for notices.
NOTICE_POLL_S = 0.05
# How often a prefill engine drives its WRITEs in flight (see `_drive_writes`).
WRITE_PROGRESS_S = 0.001
# Stamped into each push registration as it arrives at prefill (monotonic seconds); never sent anywhere.
RECEIVED_AT_KEY = "_received_at"

class DualModeWorker(NixlPushConnectorWorker, NixlPullConnectorWorker):
    # Part of the NIXL compatibility hash: dual-mode engines pair only with dual-mode engines.
    _TRANSFER_MODE = "dual"

    def __init__(self, vllm_config, engine_id: str, kv_cache_config):
        cores = os.sched_getaffinity(0)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        os.sched_setaffinity(0, cores)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        # The base class built an agent with NIXL's progress thread, which polls without pause; replace it before
        # anything is registered with it. Without that thread, the threads that call into the agent (engine,
        # writer, handshakes) drive its progress themselves, so the agent must serialize them (STRICT).
        nixl_api = sys.modules[NixlWrapper.__module__]
        self.nixl_wrapper = NixlWrapper(str(uuid.uuid4()), nixl_agent_config(
            enable_prog_thread=bool(extra.get("progress_thread", False)),
            backends=list(self.nixl_backends),
            num_threads=int(extra.get("num_threads", 4)),
            capture_telemetry=True,
            sync_mode=nixl_api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        ))
        self.xfer_stats = DualModeStats()
        if extra.get("step_spin_s") is not None:  # the worker process waits for each next step here
            limit_step_spin(float(extra["step_spin_s"]))
        push_timeout_s = float(extra.get("push_registration_timeout", DEFAULT_PUSH_TIMEOUT_S))
        # Prefill side: read and written by the writer thread, plus `request_finished` from the main thread
        # (always before the request's blocks reach the writer).
        self._push_matcher = PushMatcher(max_wait_s=write_window(push_timeout_s))
        # Decode side, main thread only.
        self._push_deadlines = ReceiveDeadlines(timeout_s=push_timeout_s)
        # Decode side, writer thread only: receives withdrawn while their registration waited for a handshake.
        self._withdrawn_unsent: set[str] = set()
        threading.Thread(target=self._wake_writer_periodically, daemon=True, name="nixl-notice-poll").start()
        # Prefill side: set when a WRITE is posted, cleared by `_drive_writes` once none is in flight.
        self._writes_posted = threading.Event()
        threading.Thread(target=self._drive_writes, daemon=True, name="nixl-write-progress").start()

    def _wake_writer_periodically(self) -> None:
        while not self._push_writer_stop.wait(NOTICE_POLL_S):
            self._push_writer_wake.set()

    def _drive_writes(self) -> None:
        """Without NIXL's progress thread, a posted WRITE completes -- and its notice reaches decode -- only when
        someone polls its state, which vLLM does once per engine step. A busy prefill engine steps every 0.5-1 s
        here, so push requests waited a step or two for their KV after prefill had answered (their second token
        1-2 s after the first at 16 streams). This thread polls every WRITE in flight each `WRITE_PROGRESS_S`
        until none is; the engine's step still collects them and frees their blocks."""
        settled: set[tuple[str, object]] = set()  # (request, handle): polled to its end, left for the step to collect
        while self._writes_posted.wait():
            with self._sending_transfers_lock:  # the engine's step releases handles under the same lock
                in_flight = {(rid, h) for rid, hs in self._sending_transfers.items() for h in hs}
                settled &= in_flight
                try:
                    for write in in_flight - settled:
                        if self.nixl_wrapper.check_xfer_state(write[1]) != "PROC":
                            settled.add(write)
                except Exception:  # noqa: BLE001 -- a failed WRITE is the engine step's to report
                    logger.exception("polling a WRITE in flight failed")
                    settled |= in_flight
                if in_flight <= settled:
                    self._writes_posted.clear()  # a WRITE posted from now on sets it again
                    continue
            time.sleep(WRITE_PROGRESS_S)

    def _ensure_handshake(self, engine_id, host, port, tp_size, dcp_size=1, pp_size=1, notif_agents_only=False):
        return super()._ensure_handshake(engine_id, host, port, tp_size, dcp_size, pp_size, notif_agents_only=False)

    def pending_counts(self) -> dict[str, int]:
        """Sizes of the per-request transfer state; all zero on an idle engine, or something leaked."""
        return {
            "receiving": len(self._recving_metadata),
            "receive_handles": len(self._recving_transfers),
            "send_handles": len(self._sending_transfers),
            "leased_sends": len(self._reqs_to_send),
            "sends_in_batch": len(self._reqs_to_process),
            "read_notices_pending": len(self.consumer_notification_counts_by_req),
            "push_blocks_awaiting_registration": len(self._push_finished_blocks),
            "push_matcher_entries": len(self._push_matcher),
            "push_deadlines": len(self._push_deadlines),
            "push_withdrawn_unsent": len(self._withdrawn_unsent),
        }

    # -- engine main thread ------------------------------------------------------------------------------------

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        modes = getattr(metadata, "transfer_modes", {})
        push = {rid for rid in metadata.reqs_to_recv if modes.get(rid) == "push"}
        # A push request aborted before decode allocated its blocks leaves an empty receive. Pull's empty receive
        # tells prefill to let go; push's has no one to tell (prefill WRITEs only into a registration, and none was
        # sent) and nothing to wait for, so it goes nowhere: tracked, it would never be cleared.
        push_recvs = {rid: m for rid, m in metadata.reqs_to_recv.items() if rid in push and any(m.local_block_ids)}
        for rid, transfer_id in getattr(metadata, "push_transfer_ids", {}).items():
            if transfer_id is not None:
                self._push_matcher.request_finished(rid, transfer_id)
        now = time.monotonic()
        for rid in push_recvs:
            self._push_deadlines.arm(rid, now)

        expired = getattr(metadata, "expired_pulls", set())
        for rid in expired:  # their KV may be gone: fail the receive, never READ (see DualModeScheduler)
            self._recving_metadata[rid] = metadata.reqs_to_recv[rid]
            self.xfer_stats.record_pull_lease_expired()
            self._failed_recv_reqs.put(rid)  # vLLM then fails the request or recomputes, per kv_load_failure_policy

        # Pull view: READs, leases, batch tracking and heartbeats (vLLM's pull worker does all of these).
        pull_view = copy.copy(metadata)
        pull_view.reqs_to_recv = {rid: m for rid, m in metadata.reqs_to_recv.items()
                                  if rid not in push and rid not in expired}
        pull_view.push_registrations, pull_view.push_finished_blocks = {}, {}
        NixlPullConnectorWorker.start_load_kv(self, pull_view)

        # Push view: only what is push-specific, so that the shared lease and heartbeat work is not done twice.
        push_view = copy.copy(metadata)
        push_view.reqs_to_recv = push_recvs
        push_view.reqs_in_batch, push_view.reqs_not_processed = set(), set()
        push_view.reqs_to_send, push_view.heartbeat_by_engine = {}, {}
        NixlPushConnectorWorker.start_load_kv(self, push_view)

        # After this step's registrations: the writer thread sends messages in the order they are queued.
        for rid, withdrawal in getattr(metadata, "push_withdrawals", {}).items():
            if self._waits_for_write(rid):
                self._reg_send_inbox.put((rid, withdrawal))
                self._push_writer_wake.set()

    def _waits_for_write(self, request_id: str) -> bool:
        return request_id in self._recving_metadata and request_id not in self._recving_transfers

    def get_transfer_results(self):
        for rid in self._push_deadlines.expired(time.monotonic(), self._waits_for_write):
            logger.warning("push receive %s got no WRITE within %.1f s", rid, self._push_deadlines.timeout_s)
            self.xfer_stats.record_push_timeout()
            self._failed_recv_reqs.put(rid)  # vLLM then fails the request or recomputes, per kv_load_failure_policy
        results = super().get_transfer_results()
        for rid in results.finished_sending:
            self._push_matcher.forget(rid)
        self._push_matcher.prune(time.monotonic())  # every step; an idle engine prunes at its next one
        return results

    def _get_new_notifs(self) -> set[str]:
        """Notices to this engine about a request it is sending are pull READ notices, `<request id>:<readers>`:
        free the blocks once that many readers are done. vLLM's push worker, which owns this method here, would read
        the number as the readers' TP size, and with decode TP larger than prefill TP (4 and 8: 2 readers) free the
        blocks after the first reader, while the second still reads them. Heartbeats and the notices of WRITEs this
        engine receives (decode side) follow the push worker's rules."""
        freed: set[str] = set()
        others = []
        while True:
            try:
                notif = self._pending_completion_notifs.get_nowait()
            except queue.Empty:
                break
            request_id, _, readers = notif.decode("utf-8").rpartition(":")
            if notif.startswith(b"HB:") or not readers.isdigit() or not self._is_sending(request_id):
                others.append(notif)
                continue
            self.consumer_notification_counts_by_req[request_id] += 1
            if self.consumer_notification_counts_by_req[request_id] >= int(readers):
                del self.consumer_notification_counts_by_req[request_id]
                self._reqs_to_process.discard(request_id)
                self._reqs_to_send.pop(request_id, None)
                freed.add(request_id)
        for notif in others:
            self._pending_completion_notifs.put(notif)
        return freed | super()._get_new_notifs()

    def _handle_heartbeat(self, payload: str) -> None:
        """Decode's heartbeats name a push request by its transfer id (decode never learns prefill's request id):
        extend the lease of the prefill request carrying it, so that a push request queued at a busy decode keeps
        its KV. Pull heartbeats name prefill's request id and pass as they are."""
        names = [self._push_matcher.request_of(name) or name for name in payload.split(",")]
        super()._handle_heartbeat(",".join(names))

    def _is_sending(self, request_id: str) -> bool:
        return request_id in self._reqs_to_send or request_id in self._reqs_to_process

    def _pop_done_transfers(self, transfers):
        # Prefill's WRITE handles are push transfers; decode's READ handles are pull transfers.
        mode = "push" if transfers is self._sending_transfers else "pull"
        with self.xfer_stats.mode(mode):
            return super()._pop_done_transfers(transfers)

    # -- writer thread -----------------------------------------------------------------------------------------

    def _send_registration_to_p(self, req_id: str, reg_data: dict) -> None:
        """Decode side: send a registration, or a withdrawal of one (a request that ended while it waited)."""
        self._withdrawn_unsent = {rid for rid in self._withdrawn_unsent if rid in self._recving_metadata}
        if reg_data.get(WITHDRAW_KEY):
            with self._handshake_lock:
                reached = bool(self._remote_agents.get(reg_data["remote_engine_id"]))
            if reached:  # the registration went out before this: prefill answers (kv/push_matching.py)
                self._do_send_reg_notif(req_id, reg_data)
            else:  # the registration still waits for its handshake: it will not be sent
                self._withdrawn_unsent.add(req_id)
            return
        if req_id in self._withdrawn_unsent:  # no registration went out, so no WRITE can come: free at once
            self._withdrawn_unsent.discard(req_id)
            self._failed_recv_reqs.put(req_id)
            return
        super()._send_registration_to_p(req_id, reg_data)

    def _answer_withdrawal(self, withdrawal: dict) -> None:
        """Prefill side: decode withdrew a registration. Unless its WRITE was posted already, promise that none
        will be, and tell each decode rank this engine would have written, with the notice that completes a
        WRITE: decode counts it the same way, and its request has ended, so nothing reads those blocks."""
        if not self._push_matcher.withdraw(withdrawal[TRANSFER_ID_KEY], time.monotonic()):
            return  # the WRITE's own notices end decode's receive
        self.xfer_stats.record_push_withdrawn()
        decode_engine_id = withdrawal["decode_engine_id"]

        def notify(handshake=None) -> None:
            if handshake is not None and handshake.exception() is not None:
                return  # decode unreachable: its deadline frees the blocks
            notice = f"{withdrawal['request_id']}:{self.world_size}".encode()
            with self._handshake_lock:
                agents = dict(self._remote_agents.get(decode_engine_id) or {})
            for rank in self._decode_ranks_written(decode_engine_id):
                self.nixl_wrapper.send_notif(agents[(0, rank)], notif_msg=notice)  # keyed (PP rank, TP rank)

        handshake = self._ensure_handshake(decode_engine_id, withdrawal["decode_host"], withdrawal["decode_port"],
                                           withdrawal["decode_tp_size"])
        if handshake is None:
            notify()
        else:
            handshake.add_done_callback(notify)

    def _decode_ranks_written(self, decode_engine_id: str) -> list[int]:
        """The decode ranks this engine's WRITEs go to, as vLLM's push worker picks them (`_xfer_blocks_for_req`):
        MLA models replicate their latent KV to every decode rank, other models follow the TP mapping."""
        remote_tp = self.transfer_topo.get_engine_info(decode_engine_id).remote_tp_size
        if self.use_mla and self.transfer_topo.tp_ratio(remote_tp) < 0 and not self._has_mamba:
            return sorted(self.dst_xfer_side_handles[decode_engine_id])
        return list(self.tp_mappings[decode_engine_id].all_source_ranks)

    def _pop_matching_registration(self, request_id: str):
        """Finished prefill blocks arrived: the registration with the same transfer id, if decode sent it already."""
        match = self._push_matcher.take_registration(request_id, time.monotonic())
        if match is None:
            return None
        registration, waited_s = match
        self.xfer_stats.record_registration_wait(waited_s)
        return registration

    def _do_start_push_kv(self, request_id: str, local_block_ids, registration_data: dict) -> None:
        """Post the WRITE, if decode is still waiting for it. Also reached later, for a WRITE that waited for the
        handshake with decode: the write window must still be open then, or the WRITE could land in blocks that
        decode gave up on and gave to another request. A dropped WRITE leaves decode to its deadline and prefill's
        blocks to their lease."""
        age_s = time.monotonic() - registration_data[RECEIVED_AT_KEY]
        if age_s > self._push_matcher.max_wait_s:
            logger.warning("not writing push %s: its registration is %.1f s old, past the write window of %.1f s",
                           request_id, age_s, self._push_matcher.max_wait_s)
            self.xfer_stats.record_write_window_missed()
            return
        if not self._push_matcher.claim_write(registration_data[TRANSFER_ID_KEY]):
            return  # decode withdrew it and was told no WRITE would come
        super()._do_start_push_kv(request_id, local_block_ids, registration_data)
        self._writes_posted.set()

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        """A decode engine registered its blocks: WRITE now if prefill has finished, else keep it until then."""
        try:
            registration = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])
            transfer_id = registration[TRANSFER_ID_KEY]
        except Exception:  # noqa: BLE001 -- a malformed peer message must not stop the writer thread
            logger.exception("dropping a malformed push registration")
            return
        if registration.get(WITHDRAW_KEY):
            self._answer_withdrawal(registration)
            return
        now = time.monotonic()
        registration[RECEIVED_AT_KEY] = now  # local only: when this engine learned of it
        rid = self._push_matcher.registration_arrived(registration, transfer_id, now)
        blocks = self._push_finished_blocks.pop(rid, None) if rid is not None else None
        if blocks is not None:
            self.xfer_stats.record_registration_wait(0.0)
            self._do_start_push_kv(rid, blocks, registration)
            return
        self.xfer_stats.record_registration_first()
        if rid is not None:  # finished, but its blocks are still on their way to this thread
            self._push_matcher.keep_waiting(registration, transfer_id, now)
