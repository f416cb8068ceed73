"""An engine's KV side channel: the port its replica picks is still free when the engine binds it minutes later,
and an engine whose port was taken anyway fails its start instead of hanging it."""

from __future__ import annotations

import socket
import threading

import zmq

from kv.engine_identity import LISTEN_PORTS_FROM, ephemeral_ports, free_port
from kv.scheduler import DualModeScheduler

HOST = "127.0.0.1"


def test_ports_are_drawn_where_outgoing_connections_never_land():
    ports = {free_port(HOST) for _ in range(20)}
    assert all(LISTEN_PORTS_FROM <= port < ephemeral_ports().start for port in ports)
    assert len(ports) > 1  # drawn at random: two replicas starting together do not pick the same one


def listening_scheduler(port: int) -> DualModeScheduler:
    """A scheduler carrying only what starting its side-channel listener reads (building a real one needs an
    engine)."""
    scheduler = object.__new__(DualModeScheduler)
    scheduler._nixl_handshake_listener_t = None
    scheduler._stop_event = threading.Event()
    scheduler.side_channel_host, scheduler.side_channel_port = HOST, port
    return scheduler


def test_a_taken_port_fails_the_listeners_start():
    with socket.socket() as taken:
        taken.bind((HOST, free_port(HOST)))
        taken.listen()
        scheduler = listening_scheduler(taken.getsockname()[1])
        outcome: list[BaseException | None] = []

        def start():
            try:
                scheduler.set_xfer_handshake_metadata({})
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 -- the outcome is what the test reads
                outcome.append(e)

        starter = threading.Thread(target=start, daemon=True)
        starter.start()
        starter.join(timeout=30)  # vLLM's own listener thread died here and left the start waiting forever
        assert outcome, "the listener's start hung on a taken port"
        assert isinstance(outcome[0], RuntimeError) and str(taken.getsockname()[1]) in str(outcome[0])
        assert isinstance(outcome[0].__cause__, zmq.ZMQError)


def test_a_free_port_is_listened_on_until_shutdown():
    scheduler = listening_scheduler(free_port(HOST))
    scheduler.set_xfer_handshake_metadata({})
    with socket.create_connection((HOST, scheduler.side_channel_port), timeout=5):
        pass
    scheduler._stop_event.set()
    scheduler._nixl_handshake_listener_t.join(timeout=10)
    assert not scheduler._nixl_handshake_listener_t.is_alive()
