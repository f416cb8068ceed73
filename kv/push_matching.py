"""The per-request state of push transfers, free of NIXL and vLLM so it can be tested on its own.

Prefill side: a finished push request and a decode registration meet under the transfer id the ingress gave both
legs, in either order. Decode side: a registered receive must see its WRITE by a deadline.

The two sides share one timeout but not one clock: prefill only WRITEs into a registration during a window that
closes well before decode's deadline (`write_window`), so a WRITE never lands in blocks that decode has already
given up on and handed to another request.

A decode request that ends while it waits (its client went away) withdraws its registration. Prefill answers that
no WRITE will come, unless one was posted already; from then on it never WRITEs for that transfer id. Decode can
then free its blocks at once instead of at its deadline.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from kv.transfer_params import TRANSFER_ID_KEY

# Marks a registration message (decode -> prefill) that withdraws an earlier registration.
WITHDRAW_KEY = "withdraw"
# What a withdrawal carries over from the registration it withdraws: enough for prefill to find the transfer and
# to reach the decode engine with its answer.
WITHDRAWAL_FIELDS = (TRANSFER_ID_KEY, "request_id", "decode_engine_id", "decode_host", "decode_port", "decode_tp_size",
                     "remote_engine_id")


def withdrawal_of(registration: dict[str, Any]) -> dict[str, Any]:
    return {**{key: registration[key] for key in WITHDRAWAL_FIELDS}, WITHDRAW_KEY: True}


@dataclass
class PendingRegistration:
    registration: dict[str, Any]
    received_at: float

    def too_old(self, now: float, max_wait_s: float) -> bool:
        return now - self.received_at > max_wait_s


# Share of decode's push timeout during which prefill may still start a WRITE: the rest is the margin for the
# registration's trip to prefill and for the WRITE itself (milliseconds, against a timeout of seconds).
WRITE_WINDOW_SHARE = 0.8


def write_window(push_timeout_s: float) -> float:
    """How long after a registration arrives prefill may still WRITE into it, for decode's `push_timeout_s`."""
    return push_timeout_s * WRITE_WINDOW_SHARE


@dataclass
class PushMatcher:
    """Prefill side. A registration is usable for `max_wait_s` after it arrives (see `write_window`); older ones are
    dropped, never written, so that a registration for a request this engine never finishes cannot stay forever
    and a late prefill cannot WRITE into blocks decode has released.
    Thread-safe: the transfer writer thread matches while the engine thread records and forgets."""

    max_wait_s: float
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _transfer_of: dict[str, str] = field(default_factory=dict)  # prefill request id -> transfer id
    _request_of: dict[str, str] = field(default_factory=dict)  # transfer id -> prefill request id
    _waiting: dict[str, PendingRegistration] = field(default_factory=dict)  # transfer id -> registration
    _written: set[str] = field(default_factory=set)  # transfer ids whose WRITE was posted
    _withdrawn: dict[str, float] = field(default_factory=dict)  # transfer id -> when decode withdrew it

    def request_finished(self, request_id: str, transfer_id: str) -> None:
        """Prefill finished a push request; its blocks are about to be offered for matching."""
        with self._lock:
            self._transfer_of[request_id] = transfer_id
            self._request_of[transfer_id] = request_id

    def take_registration(self, request_id: str, now: float) -> tuple[dict[str, Any], float] | None:
        """The finished request's blocks are here: its registration and how long it waited, if decode sent it
        and is still waiting for it."""
        with self._lock:
            transfer_id = self._transfer_of.get(request_id)
            pending = self._waiting.pop(transfer_id, None) if transfer_id is not None else None
        if pending is None or pending.too_old(now, self.max_wait_s):
            return None
        return pending.registration, now - pending.received_at

    def registration_arrived(self, registration: dict[str, Any], transfer_id: str, now: float) -> str | None:
        """A decode registration arrived: the prefill request it belongs to, if that one finished already (the
        caller then WRITEs, or calls `keep_waiting` if the blocks are not in hand yet). Otherwise it waits here."""
        with self._lock:
            request_id = self._request_of.get(transfer_id)
            if request_id is not None:
                return request_id
            if transfer_id not in self._withdrawn:  # a withdrawal that overtook its registration
                self._waiting[transfer_id] = PendingRegistration(registration, now)
            return None

    def withdraw(self, transfer_id: str, now: float) -> bool:
        """Decode withdrew its registration. True if no WRITE was posted for it: none ever will be (`claim_write`
        refuses from now on), so decode may free its blocks. False if a WRITE is on its way; its completion notices
        end decode's receive."""
        with self._lock:
            if transfer_id in self._written:
                return False
            self._withdrawn[transfer_id] = now
            self._waiting.pop(transfer_id, None)
            return True

    def claim_write(self, transfer_id: str) -> bool:
        """About to post the WRITE for `transfer_id`: False if decode withdrew it (then it must not be posted)."""
        with self._lock:
            if transfer_id in self._withdrawn:
                return False
            self._written.add(transfer_id)
            return True

    def prune(self, now: float) -> None:
        """Drop registrations past the write window (their request was aborted here, or never came), and
        withdrawals as old: a registration they could still stop is past its window by then too."""
        with self._lock:
            for stale in [t for t, p in self._waiting.items() if p.too_old(now, self.max_wait_s)]:
                del self._waiting[stale]
            for stale in [t for t, at in self._withdrawn.items() if now - at > self.max_wait_s]:
                del self._withdrawn[stale]

    def keep_waiting(self, registration: dict[str, Any], transfer_id: str, now: float) -> None:
        """The request has finished but its blocks have not reached the matcher's caller yet: hold the
        registration for them."""
        with self._lock:
            self._waiting[transfer_id] = PendingRegistration(registration, now)

    def request_of(self, transfer_id: str) -> str | None:
        """The finished prefill request that carries `transfer_id`, if any."""
        with self._lock:
            return self._request_of.get(transfer_id)

    def forget(self, request_id: str) -> None:
        """The request's blocks are released (WRITE done, lease expired or aborted)."""
        with self._lock:
            transfer_id = self._transfer_of.pop(request_id, None)
            if transfer_id is not None:
                self._request_of.pop(transfer_id, None)
                self._waiting.pop(transfer_id, None)
                self._written.discard(transfer_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._transfer_of) + len(self._waiting) + len(self._written) + len(self._withdrawn)


@dataclass
class ReceiveDeadlines:
    """Decode side: each registered push receive must complete by its deadline. Used by the engine thread only."""

    timeout_s: float
    _deadline_of: dict[str, float] = field(default_factory=dict)

    def arm(self, request_id: str, now: float) -> None:
        self._deadline_of[request_id] = now + self.timeout_s

    def expired(self, now: float, still_waiting: Callable[[str], bool]) -> list[str]:
        """Receives past their deadline that are still waiting; finished ones are dropped along the way."""
        late = []
        for request_id, deadline in list(self._deadline_of.items()):
            if not still_waiting(request_id):
                del self._deadline_of[request_id]
            elif now > deadline:
                del self._deadline_of[request_id]
                late.append(request_id)
        return late

    def __len__(self) -> int:
        return len(self._deadline_of)
