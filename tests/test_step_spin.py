"""The connector's hold on how long vLLM's step-queue readers spin."""

import time

import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from kv.step_spin import limit_step_spin


def test_readers_of_this_process_stop_spinning_and_writers_are_left_alone():
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    assert reader.busy_loop_s == 1  # vLLM's default
    try:
        assert limit_step_spin(0.05) >= 1
        assert reader.busy_loop_s == 0.05 and writer.busy_loop_s == 0
        time.sleep(0.1)  # past the spin: the reader sleeps on its socket
        writer.notify()
        started = time.monotonic()
        reader.wait(timeout_ms=5000)  # sleeps on the socket and wakes on the notification, not the timeout
        assert time.monotonic() - started < 1
    finally:
        context.destroy(linger=0)
