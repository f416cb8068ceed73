"""Worker side of the dual-mode connector: one NIXL agent that READs for pull requests and WRITEs for push requests.

Built on vLLM 0.32.0's NIXL worker classes (pinned exactly): vLLM's push worker brings the background writer thread
(registration sends and matching, WRITE posting, completion notices), vLLM's pull worker the READ path; both share
one agent, one set of registered KV regions and one handshake table. What this class changes:
- Per request, the decode side routes a receive to the READ path or to the wait-for-WRITE path by its mode.
- Push registrations are matched to finished prefill blocks by the ingress's transfer id, on the writer thread.
- A push receive whose WRITE does not arrive by its deadline fails; vLLM's `kv_load_failure_policy` then fails the
  request or recomputes the prompt locally.
- The engine keeps the CPU cores it was given (vLLM's worker re-pins the engine thread to the last core), and the
  agent runs without NIXL's busy-polling progress thread unless configured: the engines' own steps and the writer
  thread drive transfers, so an idle engine burns no CPU. (Steps with no model work are paced by the scheduler.)
- Handshakes are always full (descriptors included): a peer reached first for a push may later be read from.

vLLM internals relied on: `_ensure_handshake`, `_handle_push_reg_notif`, `_pop_matching_registration`,
`_push_finished_blocks`, `_pending_d_registrations`, `_recving_metadata`, `_failed_recv_reqs`, `_sending_transfers`,
`_recving_transfers`, `xfer_stats` and the push/pull `start_load_kv` split of `NixlConnectorMetadata`.
"""

from __future__ import annotations

import copy
import os
import queue
import sys
import time
import uuid

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX, NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
from vllm.logger import init_logger

from kv.mode_stats import DualModeStats
from kv.push_matching import PushMatcher, ReceiveDeadlines, write_window
from kv.step_spin import limit_step_spin
from kv.transfer_params import TRANSFER_ID_KEY

logger = init_logger(__name__)

DEFAULT_PUSH_TIMEOUT_S = 20.0
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

    def get_transfer_results(self):
        waiting = lambda rid: rid in self._recving_metadata and rid not in self._recving_transfers  # noqa: E731
        for rid in self._push_deadlines.expired(time.monotonic(), waiting):
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
        super()._do_start_push_kv(request_id, local_block_ids, registration_data)

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        """A decode engine registered its blocks: WRITE now if prefill has finished, else keep it until then."""
        try:
            registration = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])
            transfer_id = registration[TRANSFER_ID_KEY]
        except Exception:  # noqa: BLE001 -- a malformed peer message must not stop the writer thread
            logger.exception("dropping a malformed push registration")
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
