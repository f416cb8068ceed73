"""The per-request state of push transfers, free of NIXL and vLLM so it can be tested on its own.

Prefill side: a finished push request and a decode registration meet under the transfer id the ingress gave both
legs, in either order. Decode side: a registered receive must see its WRITE by a deadline.

The two sides share one timeout but not one clock: prefill only WRITEs into a registration during a window that
closes well before decode's deadline (`write_window`), so a WRITE never lands in blocks that decode has already
given up on and handed to another request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable


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
            self._waiting[transfer_id] = PendingRegistration(registration, now)
            return None

    def prune(self, now: float) -> None:
        """Drop registrations past the write window: their request was aborted here, or never came."""
        with self._lock:
            for stale in [t for t, p in self._waiting.items() if p.too_old(now, self.max_wait_s)]:
                del self._waiting[stale]

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

    def __len__(self) -> int:
        with self._lock:
            return len(self._transfer_of) + len(self._waiting)


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
