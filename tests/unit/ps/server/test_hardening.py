"""A live parameter server under hostile and heavy traffic: fuzzing, TLS, many concurrent clients."""
from __future__ import annotations

import random
import resource
import socket
import subprocess
import tempfile
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkdl._internal.ps.server.server import ParameterServer, ServerSetup
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.protocol import HEADER, MAGIC, Header, Msg
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError
from tests.unit.conftest import SECRET

NUM_PARAMS = 16


@pytest.fixture(scope="module")
def fuzz_target():
    """One worker slot, held by an honest client that pushes zero gradients (weights must not move)."""
    config = TrainConfig(num_workers=1, policy="async", learning_rate=0.5, timeout_s=5, sample_budget="per_worker")
    server = ParameterServer(config, torch.arange(NUM_PARAMS, dtype=torch.float32), SECRET)
    server.start()
    honest = PSClient(server.host, server.port, SECRET, 0, 10)
    weights = torch.zeros(NUM_PARAMS)
    honest.hello(100, weights)
    yield server, honest
    server.stop()


def valid_frames() -> list[bytes]:
    grad = torch.ones(NUM_PARAMS).numpy().tobytes()
    return [protocol.pack_header(Header(Msg.PUSH, worker=0, version=0, count=4, length=len(grad))) + grad,
            protocol.pack_header(Header(Msg.WEIGHTS, worker=0)),
            protocol.pack_header(Header(Msg.DONE, worker=0)),
            protocol.pack_header(Header(Msg.FAIL, worker=0, length=4)) + b"oops"]


def mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.5 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.7:
            del data[rng.randrange(len(data) + 1):]
        elif choice < 0.85:
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        else:   # a header field set to an extreme value
            offset = rng.choice([4, 5, 6, 8, 12, 20, 28, 36])
            size = {4: 1, 5: 1, 6: 2, 8: 4, 12: 8, 20: 8, 28: 8, 36: 8}[offset]
            data[offset:offset + size] = rng.choice([b"\xff" * size, b"\x00" * size, b"\x7f" + b"\xff" * (size - 1)])
    return bytes(data)


def is_hello(frame: bytes) -> bool:
    return len(frame) > 4 and frame[:4] == MAGIC and frame[4] == Msg.HELLO


def send_frames(server: ParameterServer, frames: list[bytes], authenticate: bool) -> None:
    """Deliver frames on one connection until the server closes it.

    An authenticated peer may legitimately take over a worker slot with a HELLO of a newer
    attempt (that is how retried tasks rejoin), so authenticated fuzz traffic sends no HELLO;
    everything else it sends must be refused.
    """
    if authenticate:
        frames = [f for f in frames if not is_hello(f)]
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        try:
            if authenticate:
                protocol.client_authenticate(sock, SECRET)
            for frame in frames:
                sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except (OSError, ParameterServerError):
            pass


frames_strategy = st.lists(
    st.one_of(st.binary(min_size=0, max_size=120),
              st.builds(lambda i, seed: mutate(valid_frames()[i], random.Random(seed)),
                        st.integers(0, 3), st.integers(0, 2**32)),
              st.builds(lambda kind, worker, length: HEADER.pack(MAGIC, kind, 0, worker, 0, 0, 0, length, 0.0, 0.0),
                        st.integers(0, 255), st.integers(0, 65535), st.integers(0, 2**64 - 1))),
    min_size=1, max_size=16)


@settings(max_examples=1800, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(frames=frames_strategy, authenticate=st.booleans())
def test_fuzzed_frames_never_crash_or_change_the_server(fuzz_target, frames, authenticate):
    server, honest = fuzz_target
    before = server.weights()
    send_frames(server, frames, authenticate)
    fuzz_target_counter[0] += len(frames)
    # the honest client is served throughout, and nothing moved the weights
    weights = torch.empty(NUM_PARAMS)
    version, accepted = honest.push_pull(torch.zeros(NUM_PARAMS), server.version, 1, 0.0, 0, weights)
    assert accepted and torch.equal(weights, before) and torch.equal(server.weights(), before)
    assert server.failure is None


fuzz_target_counter = [0]


def test_fuzz_volume(fuzz_target):
    """Runs after the property test: at least 10,000 frames went to the live server."""
    server, _ = fuzz_target
    assert fuzz_target_counter[0] >= 10_000, fuzz_target_counter[0]
    assert server.stats.auth_failures > 0 and server.stats.protocol_errors > 0
    assert torch.equal(server.weights(), torch.arange(NUM_PARAMS, dtype=torch.float32))


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    for name in ("ps", "other"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-subj", f"/CN=sparkdl-{name}", "-keyout", str(folder / f"{name}.key"),
                        "-out", str(folder / f"{name}.pem")], check=True, capture_output=True, timeout=120)
    return folder


def test_tls_with_a_pinned_certificate(certificate, tmp_path, monkeypatch):
    from sparkdl._internal.ps.wire.tls import server_context

    config = TrainConfig(num_workers=1, policy="async", learning_rate=0.1, timeout_s=5,
                         tls_cert=str(certificate / "ps.pem"), tls_key=str(certificate / "ps.key"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))     # where server_context writes the key to load it
    context = server_context((certificate / "ps.pem").read_text(), (certificate / "ps.key").read_text())
    assert list(tmp_path.iterdir()) == []           # the key's copy is gone once loaded
    server = ParameterServer(config, torch.zeros(4), SECRET, ServerSetup(tls=context))
    server.start()
    try:
        with pytest.raises(ParameterServerError, match="TLS handshake"):
            PSClient(server.host, server.port, SECRET, 0, 5, (certificate / "other.pem").read_text())
        with pytest.raises(ParameterServerError):
            PSClient(server.host, server.port, SECRET, 0, 2)     # plain TCP to a TLS server
        client = PSClient(server.host, server.port, SECRET, 0, 5, (certificate / "ps.pem").read_text())
        weights = torch.zeros(4)
        client.hello(8, weights)
        assert client.push_pull(torch.ones(4), 0, 8, 0.0, 0, weights) == (1, True)
        assert torch.allclose(weights, torch.full((4,), -0.1))
        assert server.stats.auth_failures == 2
    finally:
        server.stop()


@pytest.mark.slow
def test_many_concurrent_clients_apply_every_gradient_exactly_once():
    """8 clients push 10M-parameter gradients for 10 s: applied == acknowledged, memory bounded."""
    num_params, clients, duration = 10_000_000, 8, 10.0
    config = TrainConfig(num_workers=clients, policy="softsync", softsync_size=3, learning_rate=1e-6,
                         timeout_s=60)
    server = ParameterServer(config, torch.zeros(num_params), SECRET)
    server.start()
    acknowledged = [0] * clients
    errors: list[BaseException] = []
    pushed = [0] * clients
    # peak RSS once every client and its connection hold their buffers (a client starved by a busy machine
    # may push its first gradient seconds late), and the pushes made by then
    settled: tuple[int, int] | None = None
    rss_samples: list[int] = []

    def run(worker: int) -> None:
        try:
            client = PSClient(server.host, server.port, SECRET, worker, 60)
            weights = torch.zeros(num_params)
            grad = torch.full((num_params,), 1e-3)
            # shards large enough that the run's sample budget outlasts the 10 s on any machine
            version = client.hello(10**7, weights).version
            stop_at = time.monotonic() + duration
            while time.monotonic() < stop_at:
                version, accepted = client.push_pull(grad, version, 32, 0.5, 0, weights)
                acknowledged[worker] += accepted
                pushed[worker] += 1
            client.done(acknowledged[worker] * 32, None)
        except BaseException as exc:   # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        rss_samples.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        if settled is None and min(pushed) >= 2:
            settled = (rss_samples[-1], sum(pushed))
        time.sleep(1)
    server.stop()
    assert not errors, errors
    assert sum(acknowledged) > clients   # real traffic
    assert server.stats.applied_gradients == sum(acknowledged) == server.stats.pushes
    assert -(-sum(acknowledged) // 3) <= server.stats.updates <= sum(acknowledged)   # c=3 per update
    assert server.finished
    # peak memory stops growing once every client has pushed (preallocated buffers, no per-push garbage),
    # over at least one more push per client
    assert settled is not None and sum(pushed) - settled[1] >= clients, (settled, pushed)
    assert rss_samples[-1] - settled[0] < 200 * 1024, (settled, rss_samples[-1])   # KiB
