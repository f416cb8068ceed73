"""The virtual clock: events in time order (ties in the order they were scheduled), no sleeping."""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable


class Clock:
    def __init__(self):
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._scheduled = 0

    def at(self, when: float, action: Callable[..., Any], *args: Any) -> None:
        if when < self.now:
            raise ValueError(f"an event at {when} is in the past (now {self.now})")
        heapq.heappush(self._events, (when, self._scheduled, action, args))
        self._scheduled += 1

    def after(self, delay: float, action: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, action, *args)

    def run(self, until: float = math.inf) -> None:
        """Carry out every event up to `until`, those they schedule included."""
        while self._events and self._events[0][0] <= until:
            when, _, action, args = heapq.heappop(self._events)
            self.now = when
            action(*args)
        if until != math.inf:
            self.now = max(self.now, until)

    @property
    def pending(self) -> int:
        return len(self._events)
