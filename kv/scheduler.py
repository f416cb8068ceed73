"""Scheduler side of the dual-mode connector: each request's hooks go to vLLM's push or pull logic, by its params.

Built on vLLM 0.32.0's NIXL scheduler classes (pinned exactly). One object inherits both modes over one shared base
(one side-channel listener, one set of lease tables); the per-request hooks dispatch explicitly on the mode the
ingress wrote into `kv_transfer_params`. What this adds on top of vLLM:
- the transfer id travels with push registrations and finished push blocks, so the worker matches them by the id
  the ingress generated, never by request-id similarity;
- each pending decode-side receive is tagged with its mode for the worker (metadata `transfer_modes`);
- a step with no model work pauses, longer the longer the engine has waited (kv/step_spin.py);
- on a CPU engine, a step's transfers start before its forward pass, not after it;
- a pull request reaching decode too late to read its KV is failed (or recomputed, per policy), never read;
- a push request that ends while decode waits for its WRITE withdraws its registration (see kv/push_matching.py);
- the answer of a finished request states the mode that was really used and its transfer id.

vLLM internals relied on: the per-request hooks of both classes, `_push_pending_registrations`, `_reqs_need_recv`,
`NixlConnectorMetadata.reqs_to_recv` / `push_finished_blocks`.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.logger import init_logger

from kv.push_matching import withdrawal_of
from kv.step_spin import IdleStepPause, engine_input_queue, limit_step_spin
from kv.transfer_config import SIDE_CHANNEL_PORT_KEY
from kv.transfer_params import LEASE_EXPIRES_AT_KEY, MODE_KEY, TRANSFER_ID_KEY

logger = init_logger(__name__)


def transfer_mode(params: dict[str, Any] | None) -> str:
    """The mode a request's params ask for; requests from plain vLLM clients are pull, as in vLLM."""
    return (params or {}).get(MODE_KEY) or "pull"


class DualModeScheduler(NixlPushConnectorScheduler, NixlPullConnectorScheduler):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        # The engine's own port (kv/engine_identity.py says why it is not read from the environment); the listener
        # that binds it starts later, once the workers' handshake metadata is known.
        self.side_channel_port = extra[SIDE_CHANNEL_PORT_KEY] + vllm_config.parallel_config.data_parallel_index
        self._idle_pause = IdleStepPause(engine_input_queue())
        # vLLM starts a step's transfers after launching its forward pass, which on a GPU returns at once; a CPU
        # forward pass returns when it is done, so a transfer waited a whole step to start: a finished push
        # request's WRITE, a pull request's READ, a push request's registration -- a step each (0.5-1 s for a
        # busy prefill engine). On CPU, a step with transfers to start starts them first.
        self._transfers_before_forward = vllm_config.device_config.device_type == "cpu"
        spin_s = extra.get("step_spin_s")
        if spin_s is not None:  # the engine-core process waits for each step's result here
            limit_step_spin(spin_s)
        # Decode side: mode of each request whose receive has not yet been handed to the worker.
        self._recv_modes: dict[str, str] = {}
        # Prefill side: transfer id of each finished push request whose blocks the worker has not yet been given.
        self._finished_push_ids: dict[str, str] = {}
        # Decode side: pull requests that arrived too close to their lease's end to read (see `on_new_request`).
        self._expired_pulls: set[str] = set()
        # Decode side: the registration of each unfinished push request, and withdrawals for the worker to send.
        self._registration_of: dict[str, dict[str, Any]] = {}
        self._withdrawals: dict[str, dict[str, Any]] = {}
        # Once decode has a pull request, its heartbeats extend prefill's lease; the first one goes out within a
        # heartbeat interval. A request arriving later than this before the lease ends may find its blocks freed.
        self._lease_margin_s = self._heartbeat_interval + 1.0

    def _nixl_handshake_listener(self, encoded_data, ready_event, *args) -> None:
        """vLLM's listener, on the instance: if its socket cannot bind (the port was taken after the replica chose
        it), vLLM's thread dies before saying it is ready and the engine's start waits for it forever."""
        try:
            super()._nixl_handshake_listener(encoded_data, ready_event, *args)
        except Exception as e:
            if ready_event.is_set():
                raise
            self._listener_failure = e  # raised by the start, below
            ready_event.set()

    def set_xfer_handshake_metadata(self, metadata) -> None:
        """Starts the side-channel listener; a listener that could not start fails the engine's start (Serve then
        starts the replica afresh, with a port of its own) instead of hanging it."""
        self._listener_failure = None
        super().set_xfer_handshake_metadata(metadata)
        if self._listener_failure is not None:
            raise RuntimeError(f"the KV side channel cannot listen on {self.side_channel_host}:"
                               f"{self.side_channel_port}: {self._listener_failure}") from self._listener_failure

    def on_new_request(self, request) -> None:
        """Decode side: a pull request whose prefill lease is over (or nearly) must not READ: prefill may have
        freed those blocks and given them to another request, and a READ would return someone else's KV without
        error. It is failed instead; vLLM's `kv_load_failure_policy` then fails it or recomputes the prompt.
        (Wall clocks: across nodes this assumes clocks agree to well within the margin, as NTP gives.)"""
        expires_at = (request.kv_transfer_params or {}).get(LEASE_EXPIRES_AT_KEY)
        if expires_at is not None and time.time() > expires_at - self._lease_margin_s:
            logger.warning("pull request %s arrived %.1f s before its KV lease ends (margin %.1f s): not reading",
                           request.request_id, expires_at - time.time(), self._lease_margin_s)
            self._expired_pulls.add(request.request_id)
            return  # and no heartbeats for it
        super().on_new_request(request)

    @staticmethod
    def _mode_class(request) -> type:
        return NixlPushConnectorScheduler if transfer_mode(request.kv_transfer_params) == "push" \
            else NixlPullConnectorScheduler

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        count, load_async = self._mode_class(request).get_num_new_matched_tokens(self, request, num_computed_tokens)
        # A decode prompt may run past what prefill computed: with the first token seeded by prefill, decode's
        # prompt ends with that token, whose KV no one has. Load only prefill's tokens (so both sides hold the same
        # blocks); decode computes the rest itself.
        computed_by_prefill = (request.kv_transfer_params or {}).get("remote_num_tokens")
        if load_async and computed_by_prefill:
            count = min(count, computed_by_prefill - num_computed_tokens)
        return count, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._mode_class(request).update_state_after_alloc(self, request, blocks, num_external_tokens)
        self._note_new_receive(request)
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is not None:
            registration[TRANSFER_ID_KEY] = request.kv_transfer_params.get(TRANSFER_ID_KEY)
            self._registration_of[request.request_id] = registration

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        delay_free, answer = self._mode_class(request).request_finished(self, request, block_ids)
        self._note_new_receive(request)  # an abort before allocation still queues a receive that releases prefill
        if request.request_id in self._newly_finished_push_blocks:
            self._finished_push_ids[request.request_id] = params.get(TRANSFER_ID_KEY)
        self._expired_pulls.discard(request.request_id)
        registration = self._registration_of.pop(request.request_id, None)
        if registration is not None:  # the worker sends it only if the receive is still waiting for its WRITE
            self._withdrawals[request.request_id] = withdrawal_of(registration)
        if answer is not None:
            answer[MODE_KEY] = transfer_mode(params)
            if delay_free and transfer_mode(params) == "pull":  # prefill holds the blocks for a reader, for a lease
                answer[LEASE_EXPIRES_AT_KEY] = time.time() + self._kv_lease_duration
            if params.get(TRANSFER_ID_KEY):
                answer[TRANSFER_ID_KEY] = params[TRANSFER_ID_KEY]
        return delay_free, answer

    def update_connector_output(self, connector_output) -> None:
        super().update_connector_output(connector_output)
        if connector_output.finished_recving or connector_output.finished_sending:
            self._idle_pause.transfer_ended()

    def _note_new_receive(self, request) -> None:
        if request.request_id in self._reqs_need_recv:
            self._recv_modes[request.request_id] = transfer_mode(request.kv_transfer_params)

    def build_connector_meta(self, scheduler_output) -> NixlConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        meta.transfer_modes = {rid: self._recv_modes.pop(rid, "pull") for rid in meta.reqs_to_recv}
        meta.push_transfer_ids = {rid: self._finished_push_ids.pop(rid) for rid in meta.push_finished_blocks}
        meta.expired_pulls = {rid for rid in meta.reqs_to_recv if rid in self._expired_pulls}
        meta.push_withdrawals, self._withdrawals = self._withdrawals, {}
        self._expired_pulls -= meta.expired_pulls
        if self._transfers_before_forward and (meta.reqs_to_recv or meta.push_finished_blocks or meta.push_withdrawals):
            scheduler_output.has_sync_kv_loads = True
        self._idle_pause.after_step(model_work=scheduler_output.total_num_scheduled_tokens > 0)
        return meta
