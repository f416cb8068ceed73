"""Which requests an ingress replica runs now, which wait, and which it turns away.

It runs at most `slots` requests at once (as many as the decode engines run, app/config.py `ingress_slots`), each
service class at most its share of them, so that batch work never fills the slots interactive requests need. The
rest wait in one queue ordered by class priority, then arrival: an interactive request never waits behind batch
work. When the queue is full, the least urgent request in it makes room for a more urgent newcomer (or the newcomer
is turned away, if nothing waiting is less urgent); either way the one turned away is told to come back later.
Pure: the ingress (and the simulator) hold the requests and wake them; this decides."""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from app.service_class import ServiceClass

RUNNING, WAITING, SHED, LEFT = "running", "waiting", "shed", "left"


@dataclass(eq=False)
class Ticket:
    """One request's place: running, waiting for a slot, shed (to be answered 429), or left."""

    pd_class: str
    rank: tuple[int, int]  # (class priority, arrival order): the lowest runs first
    state: str = WAITING


class ClassAdmission:
    def __init__(self, slots: int, queue_size: int, classes: Mapping[str, ServiceClass]):
        self.slots, self.queue_size = slots, queue_size
        self.priority = {name: c.priority for name, c in classes.items()}
        # At least one: a class with a share of a slot still gets one.
        self.limits = {name: max(1, math.floor(c.max_share * slots)) for name, c in classes.items()}
        self.held: Counter[str] = Counter()
        self.waiting: list[Ticket] = []  # by rank
        self._arrivals = itertools.count()

    @property
    def running(self) -> int:
        return sum(self.held.values())

    def arrive(self, pd_class: str) -> tuple[Ticket, list[Ticket]]:
        """A request of `pd_class` arrives: its ticket (running, waiting or shed), and the waiting tickets shed to
        make room for it."""
        ticket = Ticket(pd_class, (self.priority[pd_class], next(self._arrivals)))
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

    def leave(self, ticket: Ticket) -> list[Ticket]:
        """A running request ended or a waiting one gave up (a shed one changes nothing): the waiting tickets that
        run now, in the order they should start."""
        if ticket.state == RUNNING:
            self.held[ticket.pd_class] -= 1
        elif ticket.state == WAITING:
            self.waiting.remove(ticket)
        ticket.state = LEFT
        started = []
        for waiting in self.waiting:
            if self._may_run(waiting.pd_class):
                self._run(waiting)
                started.append(waiting)
        self.waiting = [t for t in self.waiting if t.state == WAITING]
        return started

    def _may_run(self, pd_class: str) -> bool:
        return self.running < self.slots and self.held[pd_class] < self.limits[pd_class]

    def _run(self, ticket: Ticket) -> None:
        self.held[ticket.pd_class] += 1
        ticket.state = RUNNING
