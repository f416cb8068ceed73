"""Which requests an ingress replica runs now, which wait, and which it turns away.

It runs at most `slots` requests at once (as many as the decode engines run, app/config.py `ingress_slots`), each
service class at most its share of them, so that batch work never fills the slots interactive requests need. The
rest wait in one queue ordered by class priority, then arrival: an interactive request never waits behind batch
work. When the queue is full, the least urgent request in it makes room for a more urgent newcomer (or the newcomer
is turned away, if nothing waiting is less urgent); either way the one turned away is told to come back later.

A class's share is a ceiling, not a promise: when a request misses its class's latency objectives, every less
urgent class's share is halved, and each request that meets its own lets the cut shares grow back (additive
increase, multiplicative decrease), so batch work runs with what interactive requests leave, as measured by their
latency rather than guessed from slot counts. With no more urgent request running or waiting, a share is whole.
Pure: the ingress (and the simulator) hold the requests, judge their latency and wake them; this decides."""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from app.policy.service_class import ServiceClass

RUNNING, WAITING, SHED, LEFT = "running", "waiting", "shed", "left"


@dataclass(eq=False)
class Ticket:
    """One request's place: running, waiting for a slot, shed (to be answered 429), or left."""

    pd_class: str
    rank: tuple[int, int]  # (class priority, arrival order): the lowest runs first
    cuts_before: int  # how many times the shares had been cut when it arrived
    state: str = WAITING
    judged: bool = False  # whether its latency was already told (`judged`)


class ClassAdmission:
    def __init__(self, slots: int, queue_size: int, classes: Mapping[str, ServiceClass]):
        self.slots, self.queue_size = slots, queue_size
        self.priority = {name: c.priority for name, c in classes.items()}
        # At least one: a class with a share of a slot still gets one.
        self.max_limits = {name: max(1, math.floor(c.max_share * slots)) for name, c in classes.items()}
        self.limits = dict(self.max_limits)  # how many of each class may run now: as cut and grown back
        self._credit: Counter[str] = Counter()  # met requests since a class's limit last grew
        self.cuts = 0
        self.held: Counter[str] = Counter()
        self.waiting: list[Ticket] = []  # by rank
        self._arrivals = itertools.count()

    @property
    def running(self) -> int:
        return sum(self.held.values())

    def arrive(self, pd_class: str) -> tuple[Ticket, list[Ticket]]:
        """A request of `pd_class` arrives: its ticket (running, waiting or shed), and the waiting tickets shed to
        make room for it."""
        ticket = Ticket(pd_class, (self.priority[pd_class], next(self._arrivals)), self.cuts)
        self._restore_unneeded_cuts()
        if self._may_run(pd_class):
            self._run(ticket)
            return ticket, []
        shed = []
        if len(self.waiting) >= self.queue_size:
            if not self.waiting or self.waiting[-1].rank[0] <= ticket.rank[0]:
                ticket.state = SHED  # nothing waiting is less urgent than the newcomer
                return ticket, []
            last = self.waiting.pop()
            last.state = SHED
            shed.append(last)
        bisect.insort(self.waiting, ticket, key=lambda t: t.rank)
        return ticket, shed

    def judged(self, ticket: Ticket, met: bool) -> None:
        """Whether the request met its class's objectives, told once, as soon as known (no first token by the
        TTFT objective is a miss then, waiting or running; the ingress tells this before the request leaves). A
        miss halves every less urgent class's share, unless the shares were cut since it arrived (it waited and
        ran under the old ones, which that cut already answered). A met request lets every cut share grow by one
        slot per as many met requests as the share holds; a grown share lets waiting requests start at the next
        `leave`."""
        if ticket.judged:
            return
        ticket.judged = True
        if met:
            for name, limit in self.limits.items():
                if limit < self.max_limits[name]:
                    self._credit[name] += 1
                    if self._credit[name] >= limit:
                        self.limits[name], self._credit[name] = limit + 1, 0
            return
        if ticket.cuts_before < self.cuts:
            return
        urgency = self.priority[ticket.pd_class]
        cut = [name for name, priority in self.priority.items() if priority > urgency]
        for name in cut:
            self.limits[name], self._credit[name] = max(1, self.limits[name] // 2), 0
        self.cuts += bool(cut)

    def leave(self, ticket: Ticket) -> list[Ticket]:
        """A running request ended or a waiting one gave up (a shed one changes nothing): the waiting tickets that
        run now, in the order they should start."""
        if ticket.state == RUNNING:
            self.held[ticket.pd_class] -= 1
        elif ticket.state == WAITING:
            self.waiting.remove(ticket)
        ticket.state = LEFT
        self._restore_unneeded_cuts()
        started = []
        for waiting in self.waiting:
            if self._may_run(waiting.pd_class):
                self._run(waiting)
                started.append(waiting)
        self.waiting = [t for t in self.waiting if t.state == WAITING]
        return started

    def _restore_unneeded_cuts(self) -> None:
        """A cut protected more urgent requests; with none of them running or waiting, the share is whole again."""
        for name, limit in self.limits.items():
            if limit < self.max_limits[name] and not self._more_urgent_than(name):
                self.limits[name], self._credit[name] = self.max_limits[name], 0

    def _may_run(self, pd_class: str) -> bool:
        return self.running < self.slots and self.held[pd_class] < self.limits[pd_class]

    def _more_urgent_than(self, pd_class: str) -> bool:
        urgency = self.priority[pd_class]
        return (any(held for name, held in self.held.items() if self.priority[name] < urgency)
                or bool(self.waiting) and self.waiting[0].rank[0] < urgency)

    def _run(self, ticket: Ticket) -> None:
        self.held[ticket.pd_class] += 1
        ticket.state = RUNNING
