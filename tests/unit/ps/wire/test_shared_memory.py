"""The same-host shared-memory transport against a real parameter server over loopback."""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

from sparkdl._internal.ps.wire import protocol, shared_memory
from sparkdl._internal.ps.wire.compression import make_codec
from sparkdl._internal.ps.wire.protocol import Msg
from sparkdl._internal.ps.wire.shared_memory import SharedMaster, SharedSegment, segment_name
from sparkdl._internal.ps.worker.client import PSClient
from tests.unit.conftest import SECRET

pytestmark = pytest.mark.skipif(not shared_memory.available(), reason="needs /dev/shm and a boot id (Linux)")


@pytest.fixture
def make_server(make_server):
    """The shared PS fixture over ``arange(num_params)`` weights at learning rate 0.5."""
    def make(num_params=6, **settings):
        return make_server(torch.arange(num_params, dtype=torch.float32), **{"learning_rate": 0.5, **settings})

    return make


def sync_run(server, shared: bool, steps: int = 3, master: bool = False) -> list[torch.Tensor]:
    """Two workers push fixed gradients for ``steps`` sync rounds; every worker's final weights (``master``:
    read from the PS's shared master, where the replies leave them)."""
    finals = {}

    def worker(rank: int) -> None:
        client = PSClient(server.host, server.port, SECRET, rank, 10)
        weights = torch.zeros(server.num_params)
        version = client.hello(64, weights, task_attempt=rank, shared_memory=shared, master=master).version
        assert (client.segment is not None) == shared and (client.master is not None) == master
        for step in range(steps):
            grad = torch.linspace(-1, 1, server.num_params) * (rank + 1) * (step + 1)
            version, accepted = client.push_pull(grad, version, 32, 0.5, 0, weights)
            assert accepted
        assert torch.equal(weights, torch.zeros(server.num_params)) or not master   # nothing copied to it
        finals[rank] = (client.master.weights if master else weights).clone()
        client.done(64, None)
        client.close()

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [finals[0], finals[1]]


def test_shared_memory_pushes_give_the_same_weights_as_tcp(make_server):
    settings = dict(num_workers=2, policy="sync", momentum=0.9)
    over_tcp = sync_run(make_server(**settings), shared=False)
    through_memory = sync_run(make_server(**settings), shared=True)
    for tcp, shared in zip(over_tcp, through_memory):
        assert torch.equal(tcp, shared)
    assert not torch.equal(over_tcp[0], torch.arange(6, dtype=torch.float32))


def test_sync_workers_on_the_ps_host_compute_on_its_master_with_no_weights_copied(make_server):
    settings = dict(num_workers=2, policy="sync", momentum=0.9)
    over_tcp = sync_run(make_server(**settings), shared=False)
    server = make_server(**settings)
    in_master = sync_run(server, shared=True, master=True)
    for tcp, shared in zip(over_tcp, in_master):
        assert torch.equal(tcp, shared)
    assert torch.equal(in_master[0], server.weights())
    server.stop()
    assert not os.path.exists(server._master.path)      # the name goes with the PS


@pytest.mark.parametrize("settings", [dict(policy="async"), dict(policy="sync", backup_workers=1, num_workers=2),
                                      dict(policy="sync", local_update="sgd"), dict(policy="sync", ps_transport="tcp")])
def test_no_master_is_shared_where_a_step_may_run_while_a_worker_computes(make_server, settings):
    assert make_server(**settings)._master is None


def test_a_worker_that_asks_for_the_master_of_an_async_ps_gets_its_weights_copied(make_server):
    server = make_server(policy="async")
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    client.hello(10, torch.zeros(6), shared_memory=True, master=True)
    assert client.segment is not None and client.master is None
    weights = torch.zeros(6)
    assert client.push_pull(torch.ones(6), 0, 10, 0.0, 0, weights) == (1, True)
    assert torch.equal(weights, torch.arange(6, dtype=torch.float32) - 0.5)


def test_the_replica_trains_in_the_segment_itself(make_server):
    server = make_server()
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    client.hello(10, torch.zeros(6), shared_memory=True)
    segment = client.segment
    segment.gradient.fill_(1.0)
    version, _ = client.push_pull(segment.gradient, 0, 10, 0.0, 0, segment.weights)
    # SGD, lr 0.5: the PS wrote w - 0.5 * g straight into the worker's weights region
    assert version == 1 and torch.equal(segment.weights, torch.arange(6, dtype=torch.float32) - 0.5)
    assert client.bytes_pushed >= 6 * 4 and client.bytes_pulled >= 6 * 4
    # what travelled: the gradient and the weights through the segment, only headers on the socket
    assert client.shared_payload_bytes == 2 * 6 * 4 and client.socket_payload_bytes == 0
    assert client.transport == "shared_memory"
    client.done(10, None)


def test_the_transport_reported_is_the_path_the_bytes_took(make_server):
    """A client holding a segment that pushes over the socket does not report shared memory alone."""
    server = make_server()
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    client.hello(10, torch.zeros(6), shared_memory=True)
    assert client.transport == "shared_memory"            # before any exchange: the path set up
    segment, client.segment = client.segment, None        # one push over the socket, the segment still held
    weights = torch.zeros(6)
    assert client.push_pull(torch.ones(6), 0, 10, 0.0, 0, weights) == (1, True)
    client.segment = segment
    assert client.socket_payload_bytes == 2 * 6 * 4 and client.shared_payload_bytes == 0
    assert client.transport == "tcp"
    client.push_pull(segment.gradient, 1, 10, 0.0, 0, segment.weights)
    assert client.transport == "shared_memory+tcp"
    client.done(10, None)


def test_a_worker_that_cannot_see_the_segment_goes_over_tcp_and_says_why(make_server, monkeypatch, caplog):
    """The PS runs on this kernel and made a segment, but the worker's /dev/shm is another one (a
    container, a network namespace with a tmpfs of its own): it pushes over the socket and says why."""
    server = make_server()
    attach = SharedSegment.attach

    def in_another_dev_shm(name, num_params, regions=1):
        os.unlink(os.path.join(shared_memory.SHM_DIR, name))   # what another /dev/shm shows: no such file
        return attach(name, num_params, regions)

    monkeypatch.setattr(SharedSegment, "attach", staticmethod(in_another_dev_shm))
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    with caplog.at_level(logging.WARNING, logger="sparkdl._internal.ps.worker.client"):
        client.hello(10, torch.zeros(6), shared_memory=True)
    assert client.segment is None
    assert "worker 0" in client.transport_note and "cannot see it in /dev/shm" in client.transport_note
    assert client.transport_note in caplog.text
    weights = torch.zeros(6)
    assert client.push_pull(torch.ones(6), 0, 10, 0.0, 0, weights) == (1, True)
    assert client.transport == "tcp" and client.socket_payload_bytes == 2 * 6 * 4
    client.done(10, None)


def test_a_worker_on_the_segment_or_on_tcp_by_choice_has_nothing_to_say(make_server):
    for shared in (True, False):
        server = make_server()
        client = PSClient(server.host, server.port, SECRET, 0, 10)
        client.hello(10, torch.zeros(6), shared_memory=shared)
        assert (client.segment is not None) == shared and client.transport_note is None
        client.done(10, None)


def test_the_segment_is_owner_only_and_gone_from_the_file_system_once_mapped(make_server, monkeypatch):
    server = make_server()
    seen = {}
    attach = SharedSegment.attach

    def spy(name, num_params, regions=1):
        path = os.path.join(shared_memory.SHM_DIR, name)
        seen["mode"] = stat.S_IMODE(os.stat(path).st_mode)
        segment = attach(name, num_params, regions)
        seen["exists_after"] = os.path.exists(path)
        return segment

    monkeypatch.setattr(SharedSegment, "attach", staticmethod(spy))
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    client.hello(10, torch.zeros(6), task_attempt=7, shared_memory=True)
    assert client.segment is not None
    assert seen == {"mode": 0o600, "exists_after": False}
    assert segment_name(SECRET, 0, 7) != segment_name(b"x" * 32, 0, 7)   # unguessable without the secret
    client.done(10, None)


def test_a_worker_killed_while_writing_its_gradient_changes_nothing(make_server):
    """No PUSH header, no update: a half-written gradient in the segment is never applied."""
    server = make_server(max_attempts=1)
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    client.hello(10, torch.zeros(6), shared_memory=True)
    client.segment.gradient[:3] = 1e30          # torn: half written, then the process dies
    client.sock.close()
    for _ in range(200):
        if server.events and server.events[-1]["event"] == "lost":
            break
        threading.Event().wait(0.01)
    assert server.version == 0
    assert torch.equal(server.weights(), torch.arange(6, dtype=torch.float32))


@pytest.mark.parametrize("settings, identity", [({"compression": "int8"}, None), ({"ps_transport": "tcp"}, None),
                                                ({}, b"another-host-boot-id")])
def test_the_socket_is_used_when_shared_memory_does_not_apply(make_server, monkeypatch, settings, identity):
    server = make_server(**settings)
    if identity is not None:
        monkeypatch.setattr("sparkdl._internal.ps.worker.client.host_identity", lambda: identity)
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    client.hello(10, torch.zeros(6), shared_memory=True)
    assert client.segment is None
    weights = torch.zeros(6)
    codec = make_codec(server.config.compression, 6, 0.01, [6])
    version, accepted = client.push_pull(codec.encode(torch.ones(6)), 0, 10, 0.0, 0, weights)
    assert accepted and version == 1
    assert client.transport == "tcp" and client.shared_payload_bytes == 0 and client.socket_payload_bytes > 0
    client.done(10, None)


def test_a_shared_push_without_a_segment_is_a_protocol_error(make_server):
    server = make_server()
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    client.hello(10, torch.zeros(6))
    protocol.send_message(client.sock, protocol.Push(0, 0, 0, 10, 0.0, 0, shared=True).header())
    header = protocol.recv_header(client.sock, protocol.MAX_TEXT_BYTES)
    assert header.type == Msg.ERROR
    assert b"shared" in protocol.recv_small_payload(client.sock, header)
    assert server.stats.protocol_errors == 1


def test_files_of_a_process_that_died_are_removed_and_files_in_use_or_just_made_are_kept(tmp_path):
    # a PS killed before its stop (an executor hosting a PS shard) leaves its master in /dev/shm; the next
    # shared file made on the host removes it, once no process maps it and it is old enough
    made = tmp_path / "made.txt"
    code = ("import sys\nfrom sparkdl._internal.ps.wire.shared_memory import SharedMaster\n"
            "for _ in range(2):\n    master = SharedMaster.create(16)\n    print(master.path, flush=True)\n"
            "import os; os._exit(0)\n")     # dies without removing them
    subprocess.run([sys.executable, "-c", code], check=True, stdout=open(made, "w"))
    dead_old, dead_young = made.read_text().split()
    live = SharedMaster.create(16)                   # mapped by this process
    assert live is not None
    other = os.path.join(shared_memory.SHM_DIR, "sparkdl-tests-not-a-shared-file")    # not a name this module gives
    open(other, "w").close()
    try:
        long_ago = time.time() - 2 * shared_memory.ORPHAN_AGE_S
        for path in (dead_old, live.path, other):
            os.utime(path, (long_ago, long_ago))
        again = SharedMaster.create(16)              # the next file made on this host
        assert again is not None
        again.remove()
        assert not os.path.exists(dead_old)                                   # nobody maps it, old: removed
        assert os.path.exists(live.path) and os.path.exists(dead_young)       # in use; or maybe still being made
        assert os.path.exists(other) and torch.equal(live.weights, torch.zeros(16))
    finally:
        live.remove()
        for path in (dead_old, dead_young, other):
            shared_memory.remove_name(path)
