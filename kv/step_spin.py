"""How an engine's processes wait: between steps that only wait for KV, and for the next step or its result.

An engine whose requests only wait for KV -- a decode receive waiting for prefill's WRITE or its own READ, a prefill
holding blocks for a reader -- still steps, with no model work, so that its connector can notice the transfer end.
vLLM steps again at once; each such step wakes the engine-core process and the worker. `IdleStepPause` paces them:
the pause after a step with no model work grows with how long the engine has waited so far (a share of it, between
a floor and a cap), so a long wait costs a few hundred steps a second at most instead of a thousand; a request that
arrives meanwhile ends the pause at once, and a step that saw a transfer end is followed by none (its request is
scheduled by the next step), so noticing the KV costs at most one pause.

vLLM's engine core and its worker process pass every step through shared-memory queues. A reader of such a queue
spins (sched_yield) for a second after its last read before it sleeps on the queue's notification socket, so each
engine keeps its worker's core busy for a second after every step, and its engine-core process (bound to no core)
busy during every step. On a machine with fewer cores than engine processes, that spinning takes the CPU from the
other engine: a decode engine waiting for a push slowed the very prefill it waited for.

A reader that sleeps sooner pays the socket's wake-up per step, and must not sleep at once: with no spin at all,
requests here stalled for 5-15 s now and then (a notification missed, caught only by the reader's periodic
re-check). A short spin (tens of milliseconds) covers the steps of a running request and frees the core soon after.

vLLM exposes no setting for either; the connector, which runs in both processes, sets them.
"""

from __future__ import annotations

import gc
import queue
import sys
import time

from vllm.distributed.device_communicators.shm_broadcast import SpinCondition


def limit_step_spin(seconds: float) -> int:
    """Let every step-queue reader in this process spin at most `seconds` after its last read. Returns how many
    readers it found (none where vLLM runs the model in the engine-core process itself)."""
    readers = [obj for obj in gc.get_objects() if type(obj) is SpinCondition and obj.is_reader]
    for reader in readers:
        reader.busy_loop_s = seconds
    return len(readers)


# The pause after a step with no model work: this share of the time waited so far, within these bounds.
IDLE_PAUSE_SHARE = 0.1
IDLE_PAUSE_MIN_S = 0.001
IDLE_PAUSE_MAX_S = 0.005


def engine_input_queue() -> queue.Queue | None:
    """The queue by which requests reach this engine-core process (vLLM's `EngineCoreProc.input_queue`), found on the
    call stack while the engine builds its scheduler; None where no such process is building it."""
    frame = sys._getframe(1)
    while frame is not None:
        found = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(found, queue.Queue):
            return found
        frame = frame.f_back
    return None


class IdleStepPause:
    """Paces an engine's steps with no model work (see the module's docstring)."""

    def __init__(self, wake: queue.Queue | None):
        self.wake = wake  # a request put here ends a pause
        self._waiting_since: float | None = None
        self._skip_next = False

    def transfer_ended(self) -> None:
        """A step saw a transfer end: the next step has a request to schedule, so no pause before it."""
        self._skip_next = True

    def after_step(self, model_work: bool) -> float:
        """Called after each step is scheduled; returns the pause taken."""
        now = time.monotonic()
        if model_work or self._skip_next:
            self._waiting_since, self._skip_next = None, False
            return 0.0
        if self._waiting_since is None:
            self._waiting_since = now
        pause = min(IDLE_PAUSE_MAX_S, max(IDLE_PAUSE_MIN_S, IDLE_PAUSE_SHARE * (now - self._waiting_since)))
        if self.wake is None:
            time.sleep(pause)
            return pause
        with self.wake.not_empty:  # the queue's own lock: a put notifies this condition
            woken = bool(self.wake.queue) or self.wake.not_empty.wait(pause)
        if woken:  # a request arrived: what it waits for starts now
            self._waiting_since = None
        return pause
