"""The handshake gate over real loopback sockets: deadlines, bounds, garbage, prompt shutdown."""
import contextlib
import faulthandler
import socket
import threading
import time

import pytest
import torch

from sparkdl._internal.ps.server.server import ParameterServer, ServerSetup
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.handshake import HandshakeGate
from sparkdl._internal.ps.wire.protocol import HEADER
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError
from tests.unit.conftest import SECRET


class Gate:
    """A gate on its own polling thread, recording what it let through and what it refused."""

    def __init__(self, **limits):
        self.authenticated: list[socket.socket] = []
        self.refused: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.gate = HandshakeGate(SECRET, self.authenticated.append, self.refused.append, **limits)
        self.gate.listen(self.listener)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.gate.poll(0.05)
        self.gate.close()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        for sock in self.authenticated:
            sock.close()


@pytest.fixture
def gate():
    gates = []

    def make(**limits):
        gates.append(Gate(**limits))
        return gates[-1]

    yield make
    for g in gates:
        g.close()


def wait_until(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_an_honest_client_is_let_through(gate):
    g = gate()
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as sock:
        protocol.client_authenticate(sock, SECRET)
        assert wait_until(lambda: len(g.authenticated) == 1)
    assert g.refused == [] and g.gate.pending == 0


def test_a_silent_connection_is_dropped_at_its_deadline(gate):
    g = gate(timeout_s=0.5)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as sock:
        assert wait_until(lambda: g.refused, 3)
        assert sock.recv(1024)          # the challenge ...
        assert sock.recv(1024) == b""   # ... then a close
    assert 0.4 < time.monotonic() - started < 10           # dropped at its 0.5 s deadline
    assert "no answer to the challenge" in g.refused[0] and g.authenticated == []


def test_garbage_is_refused_as_soon_as_the_header_is_in(gate):
    g = gate(timeout_s=30)
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        assert wait_until(lambda: g.refused, 3)
    assert "bad magic" in g.refused[0]


def test_at_the_bound_the_oldest_pending_connection_makes_room(gate):
    g = gate(timeout_s=30, max_pending=100, max_pending_per_peer=3)
    idle = []
    for _ in range(3):
        idle.append(socket.create_connection(("127.0.0.1", g.port), timeout=5))
        assert wait_until(lambda: g.gate.pending == len(idle))
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as honest:
        protocol.client_authenticate(honest, SECRET)      # admitted although three were waiting
        assert wait_until(lambda: len(g.authenticated) == 1)
    assert g.gate.pending == 2 and sum("evicted" in r for r in g.refused) == 1
    idle[0].settimeout(5)
    assert idle[0].recv(1024) and idle[0].recv(1024) == b""   # the oldest: challenged, then closed
    for sock in idle:
        sock.close()
    assert wait_until(lambda: g.gate.pending == 0)


def test_an_evicted_worker_is_told_busy_and_connects_again():
    # the gate is driven by hand: the worker's first connection is evicted by a newer one from its address.  The
    # gate reads an answer already there as it sends the challenge, so a worker thread that answers within that
    # admission is authenticated before any eviction: the scenario then starts over with a new worker
    for _ in range(20):
        outcome = _evict_a_worker_once()
        if outcome is not None:
            break
    else:
        pytest.fail("in 20 tries the worker answered its challenge before a newer connection could evict it")
    errors, clients, authenticated, refused = outcome
    assert errors == [] and len(clients) == 1 and len(authenticated) == 1
    assert sum("evicted" in r for r in refused) == 1


def _evict_a_worker_once() -> tuple[list, list, list, list] | None:
    """A worker's pending connection evicted, and its next one authenticated: (errors, clients, authenticated,
    refused); None when the worker was authenticated at its first admission (nothing left to evict)."""
    listener = socket.create_server(("127.0.0.1", 0))
    authenticated: list = []
    refused: list[str] = []
    gate = HandshakeGate(SECRET, authenticated.append, refused.append, timeout_s=30, max_pending_per_peer=1)
    clients: list = []
    errors: list = []

    def connect():
        try:
            clients.append(PSClient("127.0.0.1", listener.getsockname()[1], SECRET, 0, 30))
        except Exception as exc:   # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    listener.settimeout(10)
    intruder = None
    try:
        first, _ = listener.accept()
        gate.admit(first, "worker-host")                       # challenged
        if authenticated:                                      # answered within the admission: no eviction
            worker.join(timeout=10)
            return None
        intruder = socket.create_connection(listener.getsockname(), timeout=5)
        gate.admit(listener.accept()[0], "worker-host")        # makes room: the worker's connection is evicted
        try:
            again, _ = listener.accept()                       # the worker came back
        except TimeoutError:
            with contextlib.suppress(OSError):                # no file descriptor behind stderr: no dump
                faulthandler.dump_traceback(all_threads=True)  # where the worker's thread waits, for the report
            raise AssertionError((errors, clients, refused, authenticated)) from None
        gate.admit(again, "another-host")
        deadline = time.monotonic() + 10
        while not authenticated and time.monotonic() < deadline:
            gate.poll(0.05)
        worker.join(timeout=10)
        return errors, clients, list(authenticated), refused
    finally:
        for sock in [intruder, listener, *authenticated]:
            if sock is not None:
                sock.close()
        for client in clients:
            client.close()
        gate.close()


def test_close_drops_pending_connections_without_waiting(gate):
    g = gate(timeout_s=60)
    idle = [socket.create_connection(("127.0.0.1", g.port), timeout=5) for _ in range(5)]
    assert wait_until(lambda: g.gate.pending == 5)
    started = time.monotonic()
    g.close()
    assert time.monotonic() - started < 10                  # far below the 60 s deadline of those connections
    for sock in idle:
        sock.settimeout(5)
        data = sock.recv(HEADER.size + 64)
        assert data == b"" or sock.recv(1024) == b""   # closed (possibly after the challenge)
        sock.close()


def test_a_flooded_server_still_serves_its_worker_and_stops_promptly():
    config = TrainConfig(num_workers=1, policy="async", learning_rate=0.1, timeout_s=60)
    server = ParameterServer(config, torch.zeros(4), SECRET, ServerSetup(handshake_timeout_s=1.0))
    server.start()
    # more idle connections from the worker's own address than the gate keeps pending
    idle = [socket.create_connection((server.host, server.port), timeout=5) for _ in range(80)]
    try:
        started = time.monotonic()
        client = PSClient(server.host, server.port, SECRET, 0, 30)
        weights = torch.zeros(4)
        client.hello(8, weights)
        assert client.push_pull(torch.ones(4), 0, 8, 0.0, 0, weights) == (1, True)
        assert time.monotonic() - started < 10            # not held up by the idle connections
        stopping = time.monotonic()
        server.stop()
        assert time.monotonic() - stopping < 10     # no handler waits out timeout_s (60 s)
        with pytest.raises(ParameterServerError):
            client.push_pull(torch.ones(4), 1, 8, 0.0, 0, weights)
    finally:
        server.stop()
        for sock in idle:
            sock.close()
