"""The per-request state of push transfers, free of NIXL and vLLM so it can be tested on its own.

Prefill side: a finished push request and a decode registration meet under the transfer id the ingress gave both
legs, in either order. Decode side: a registered receive must see its WRITE by a deadline.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class PendingRegistration:
    registration: dict[str, Any]
    received_at: float


@dataclass
class PushMatcher:
    """Prefill side. Registrations that find no finished request are kept until `max_wait_s` (decode gives up on
    them by then), so that a registration for a request this engine never finishes cannot stay forever.
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
        """The finished request's blocks are here: its registration and how long it waited, if decode sent it."""
        with self._lock:
            transfer_id = self._transfer_of.get(request_id)
            pending = self._waiting.pop(transfer_id, None) if transfer_id is not None else None
        return None if pending is None else (pending.registration, now - pending.received_at)

    def registration_arrived(self, registration: dict[str, Any], transfer_id: str, now: float) -> str | None:
        """A decode registration arrived: the prefill request it belongs to, if that one finished already (the
        caller then WRITEs, or calls `keep_waiting` if the blocks are not in hand yet). Otherwise it waits here."""
        with self._lock:
            request_id = self._request_of.get(transfer_id)
            if request_id is not None:
                return request_id
            for stale in [t for t, p in self._waiting.items() if now - p.received_at > self.max_wait_s]:
                del self._waiting[stale]
            self._waiting[transfer_id] = PendingRegistration(registration, now)
            return None

    def keep_waiting(self, registration: dict[str, Any], transfer_id: str, now: float) -> None:
        """The request has finished but its blocks have not reached the matcher's caller yet: hold the
        registration for them."""
        with self._lock:
            self._waiting[transfer_id] = PendingRegistration(registration, now)

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
