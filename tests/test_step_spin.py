"""How the connector makes engines wait: pauses between steps that only wait for KV, and how long vLLM's step-queue
readers spin."""

import queue
import threading
import time

import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from kv import step_spin
from kv.step_spin import IDLE_PAUSE_MAX_S, IDLE_PAUSE_MIN_S, IdleStepPause, engine_input_queue, limit_step_spin


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


def test_steps_that_only_wait_pause_longer_the_longer_the_wait_and_model_work_ends_it():
    pause = IdleStepPause(wake=None)
    assert pause.after_step(model_work=False) == IDLE_PAUSE_MIN_S
    started = time.monotonic()
    while time.monotonic() - started < 0.3:
        taken = pause.after_step(model_work=False)
    assert taken == IDLE_PAUSE_MAX_S
    assert pause.after_step(model_work=True) == 0
    assert pause.after_step(model_work=False) == IDLE_PAUSE_MIN_S  # a new wait starts short
    while time.monotonic() - started < 0.6:
        pause.after_step(model_work=False)
    pause.transfer_ended()
    assert pause.after_step(model_work=False) == 0  # the step that schedules the request comes at once
    assert pause.after_step(model_work=False) == IDLE_PAUSE_MIN_S


def test_a_request_arriving_ends_the_pause_at_once_and_starts_a_new_wait(monkeypatch):
    monkeypatch.setattr(step_spin, "IDLE_PAUSE_MIN_S", 2.0)
    monkeypatch.setattr(step_spin, "IDLE_PAUSE_MAX_S", 2.0)
    requests = queue.Queue()
    pause = IdleStepPause(wake=requests)
    threading.Timer(0.05, requests.put, ("add request",)).start()
    started = time.monotonic()
    assert pause.after_step(model_work=False) == 2.0
    assert time.monotonic() - started < 1  # woken by the request, not at the pause's end
    assert pause._waiting_since is None  # the next step's wait is the new request's own


def test_the_engines_request_queue_is_found_from_the_code_that_builds_the_scheduler():
    class EngineCoreProc:  # vLLM's builds its scheduler inside its constructor, its input queue already made
        def __init__(self):
            self.input_queue = queue.Queue()
            self.found = engine_input_queue()

    engine = EngineCoreProc()
    assert engine.found is engine.input_queue
    assert engine_input_queue() is None
