"""How long an engine's processes spin, rather than sleep, while they wait for the next step or its result.

vLLM's engine core and its worker process pass every step through shared-memory queues. A reader of such a queue
spins (sched_yield) for a second after its last read before it sleeps on the queue's notification socket, so each
engine keeps its worker's core busy for a second after every step, and its engine-core process (bound to no core)
busy during every step. On a machine with fewer cores than engine processes, that spinning takes the CPU from the
other engine: a decode engine waiting for a push slowed the very prefill it waited for.

A reader that sleeps sooner pays the socket's wake-up per step, and must not sleep at once: with no spin at all,
requests here stalled for 5-15 s now and then (a notification missed, caught only by the reader's periodic
re-check). A short spin (tens of milliseconds) covers the steps of a running request and frees the core soon after.

vLLM exposes no setting for it; the connector, which runs in both processes, sets it on the readers it finds.
"""

from __future__ import annotations

import gc

from vllm.distributed.device_communicators.shm_broadcast import SpinCondition


def limit_step_spin(seconds: float) -> int:
    """Let every step-queue reader in this process spin at most `seconds` after its last read. Returns how many
    readers it found (none where vLLM runs the model in the engine-core process itself)."""
    readers = [obj for obj in gc.get_objects() if type(obj) is SpinCondition and obj.is_reader]
    for reader in readers:
        reader.busy_loop_s = seconds
    return len(readers)
