"""The parameter server over real loopback sockets, with real clients in threads."""
import socket
import threading
import time

import pytest
import torch

from sparkdl._internal.ps.server.core import PSCore
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl.errors import AuthenticationError, ParameterServerError, PSTimeoutError
from tests.unit.conftest import SECRET, connect


def hello_all(server, sizes):
    """Connect and say hello for every worker concurrently (hello is a rendezvous)."""
    clients, weights = {}, {}

    def one(worker):
        client = connect(server, worker)
        weights[worker] = torch.zeros(server.num_params)
        client.hello(sizes[worker], weights[worker])
        clients[worker] = client

    threads = [threading.Thread(target=one, args=(w,)) for w in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return clients, weights


def test_async_push_pull_applies_sgd_and_returns_fresh_weights(make_server):
    server = make_server()
    clients, weights = hello_all(server, [10])
    version, accepted = clients[0].push_pull(torch.ones(4), 0, 8, 1.5, 0, weights[0])
    assert (version, accepted) == (1, True)
    assert torch.allclose(weights[0], torch.full((4,), -0.1))
    version, _ = clients[0].push_pull(torch.tensor([1.0, 2.0, 3.0, 4.0]), 1, 8, 1.0, 0, weights[0])
    assert version == 2
    assert torch.allclose(server.weights(), torch.tensor([-0.2, -0.3, -0.4, -0.5]))
    clients[0].done(16, None)
    assert server.finished and server.stats.applied_gradients == 2
    assert [row.loss for row in server.core.log.updates] == [1.5, 1.0]   # loss per update


def test_sync_round_averages_and_releases_both_workers(make_server):
    server = make_server(num_workers=2, policy="sync")
    clients, weights = hello_all(server, [10, 10])
    grads = {0: torch.full((4,), 1.0), 1: torch.full((4,), 3.0)}
    results = {}

    def push(worker):
        results[worker] = clients[worker].push_pull(grads[worker], 0, 8, 0.0, 0, weights[worker])

    threads = [threading.Thread(target=push, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: (1, True), 1: (1, True)}
    for w in (0, 1):
        assert torch.allclose(weights[w], torch.full((4,), -0.2))   # w - 0.1 * mean(1, 3)


def test_wrong_secret_is_refused_and_changes_nothing(make_server):
    server = make_server()
    with pytest.raises(AuthenticationError):
        connect(server, secret=b"x" * 32)
    assert server.stats.auth_failures == 1
    assert torch.equal(server.weights(), torch.zeros(4))
    clients, weights = hello_all(server, [4])        # an honest client is still served
    assert clients[0].push_pull(torch.ones(4), 0, 4, 0.0, 0, weights[0])[0] == 1


def test_garbage_before_authentication_does_not_crash_the_server(make_server):
    server = make_server()
    raw = socket.create_connection((server.host, server.port))
    raw.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
    raw.close()
    raw = socket.create_connection((server.host, server.port))
    nonce_header = protocol.recv_header(raw, 64)
    protocol.recv_small_payload(raw, nonce_header)
    # skip authentication and try to push straight away
    protocol.send_message(raw, Header(Msg.PUSH, length=16), torch.ones(4).numpy().tobytes())
    try:
        answer = raw.recv(1024)
    except ConnectionResetError:
        answer = b""
    assert answer == b""                   # closed without an answer
    raw.close()
    clients, weights = hello_all(server, [4])
    assert clients[0].push_pull(torch.ones(4), 0, 4, 0.0, 0, weights[0]) == (1, True)
    assert server.stats.auth_failures == 2


def unchecked_push(client, grad, weights_out):
    """A push the worker did not check (as one streamed during backward is): the PS checks it."""
    push = protocol.Push(client.worker, 0, 0, 4, 0.0, 4 * grad.numel())
    return client.stream_push(push, [memoryview(grad.numpy()).cast("B")], weights_out)


def test_non_finite_gradient_is_rejected_and_counted(make_server):
    server = make_server()
    clients, weights = hello_all(server, [4])
    version, accepted = unchecked_push(clients[0], torch.tensor([1.0, float("nan"), 0.0, 0.0]), weights[0])
    assert (version, accepted) == (0, False)
    assert server.stats.rejected_nonfinite == 1
    assert torch.equal(server.weights(), torch.zeros(4))


def test_the_ps_checks_only_the_gradients_their_worker_did_not(make_server, monkeypatch):
    """One finiteness check per gradient: push_pull's caller checked it, so the PS trusts the flag."""
    server = make_server()
    clients, weights = hello_all(server, [8])
    checks = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: checks.append(t.numel()) or isfinite(t))
    assert clients[0].push_pull(torch.ones(4), 0, 4, 0.0, 0, weights[0]) == (1, True)
    assert checks == []
    assert unchecked_push(clients[0], torch.ones(4), weights[0]) == (2, True)
    assert checks
    assert torch.allclose(server.weights(), torch.full((4,), -0.2))


def test_wrong_size_gradient_is_refused_before_touching_weights(make_server):
    server = make_server()
    clients, weights = hello_all(server, [4])
    with pytest.raises(ParameterServerError, match="expected 16"):
        clients[0].push_pull(torch.ones(3), 0, 4, 0.0, 0, weights[0])
    assert torch.equal(server.weights(), torch.zeros(4))
    assert server.stats.protocol_errors == 1


def test_max_staleness_drops_and_counts(make_server):
    server = make_server(num_workers=2, max_staleness=0)
    clients, weights = hello_all(server, [4, 4])
    assert clients[0].push_pull(torch.ones(4), 0, 4, 0.0, 0, weights[0]) == (1, True)
    # worker 1 still computes on version 0: staleness 1 > 0, dropped; it gets version 1 back
    assert clients[1].push_pull(torch.ones(4), 0, 4, 0.0, 0, weights[1]) == (1, False)
    assert server.stats.dropped_stale == 1
    assert torch.allclose(weights[1], torch.full((4,), -0.1))


def test_sync_round_with_a_silent_worker_is_abandoned_within_the_timeout(make_server):
    server = make_server(num_workers=2, policy="sync", timeout_s=1)
    clients, weights = hello_all(server, [4, 4])
    started = time.monotonic()
    with pytest.raises(ParameterServerError, match="sync round 0 was abandoned because a worker was lost"):
        clients[0].push_pull(torch.ones(4), 0, 4, 0.0, 0, weights[0])
    assert time.monotonic() - started < 5
    lost = [e for e in server.events if e["event"] == "lost"]
    assert lost[0]["worker"] == 1 and "sent nothing for 1 s" in lost[0]["reason"]
    assert server.stats.discarded_on_loss == 1
    assert torch.equal(server.weights(), torch.zeros(4))


def test_a_retried_worker_rejoins_with_weights_and_its_position(make_server):
    server = make_server(num_workers=2, policy="sync")
    clients, weights = hello_all(server, [64, 64])
    results = {}

    def push(worker):
        results[worker] = clients[worker].push_pull(torch.ones(4), 0, 8, 0.0, 0, weights[worker])

    threads = [threading.Thread(target=push, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.positions() == [1, 1]
    # worker 0 pushes round 1, then worker 1 dies before its push: the round is abandoned
    waiting = threading.Thread(target=lambda: pytest.raises(ParameterServerError, clients[0].push_pull,
                                                            torch.ones(4), 1, 8, 0.0, 0, weights[0]))
    waiting.start()
    time.sleep(0.3)
    clients[1].close()
    waiting.join(timeout=5)
    assert not waiting.is_alive()
    assert server.positions() == [1, 1] and server.version == 1
    # the retried tasks (attempt 1) get version 1, its weights, and resume after batch 1
    fresh = {w: connect(server, w) for w in (0, 1)}
    for client in fresh.values():
        into = torch.zeros(4)
        welcome = client.hello(64, into, task_attempt=1)
        assert (welcome.version, welcome.position, welcome.has_weights) == (1, 1, True)
        assert torch.allclose(into, torch.full((4,), -0.1))
    assert server.stats.rejoins == 2 and server.failure is None


def test_stale_attempt_cannot_take_over_an_active_worker(make_server):
    server = make_server()
    clients, _ = hello_all(server, [4])      # keep the honest connection open
    intruder = connect(server, 0)
    with pytest.raises(ParameterServerError, match="already connected"):
        intruder.hello(4, torch.zeros(4), task_attempt=0)
    assert server.workers_seen == 1
    assert clients[0].push_pull(torch.zeros(4), 0, 4, 0.0, 0, torch.zeros(4)) == (1, True)


def test_rendezvous_times_out_when_a_worker_never_arrives(make_server):
    server = make_server(num_workers=2, timeout_s=1)
    client = connect(server, 0)
    with pytest.raises(ParameterServerError, match=r"workers \[1\] did not reach"):
        client.hello(4, torch.zeros(4))


def test_client_times_out_when_the_server_stops_answering():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        with pytest.raises(PSTimeoutError, match="waited 1 s"):
            PSClient("127.0.0.1", silent.getsockname()[1], SECRET, 0, timeout_s=1)
    finally:
        silent.close()


def test_client_fails_fast_when_nothing_listens():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(ParameterServerError, match="cannot reach the parameter server"):
        PSClient("127.0.0.1", port, SECRET, 0, timeout_s=5)


def test_worker_failure_report_reaches_the_server(make_server):
    server = make_server(num_workers=2)
    client = connect(server, 1)
    client.report_failure("Traceback ...\nValueError: bad row 7")
    assert "bad row 7" in server.worker_failures[1]
    # not fatal by itself: the launcher decides whether to retry the stage
    assert server.failure is None
    assert server.events[-1]["event"] == "failed" and "bad row 7" in server.events[-1]["reason"]


def test_a_snapshot_made_due_by_the_flush_at_done_is_written(make_server, tmp_path):
    """softsync c=2: worker 1's DONE flushes worker 0's buffered gradient into update 1, whose
    checkpoint is due; no push follows it, so the DONE itself must deliver it."""
    server = make_server(num_workers=2, policy="softsync", softsync_size=2, checkpoint_dir=str(tmp_path),
                         checkpoint_every=1, sample_budget="per_worker")
    clients, weights = hello_all(server, [10, 10])
    assert clients[0].push_pull(torch.ones(4), 0, 8, 1.0, 0, weights[0]) == (0, True)   # buffered
    clients[1].done(0, None)
    assert server.version == 1 and server.checkpoints_written == 1
    clients[0].done(8, None)


def test_ssp_holds_the_reply_of_a_worker_too_far_ahead_until_the_slowest_pushes(make_server):
    """ssp_bound=1: worker 0's second push is two clocks ahead of worker 1; its reply waits for worker 1's push."""
    server = make_server(num_workers=2, ssp_bound=1, sample_budget="per_worker")
    clients, weights = hello_all(server, [10, 10])
    assert clients[0].push_pull(torch.ones(4), 0, 8, 1.0, 0, weights[0]) == (1, True)   # one ahead: within
    replies = []
    ahead = threading.Thread(target=lambda: replies.append(
        clients[0].push_pull(torch.ones(4), 1, 8, 1.0, 0, weights[0])))
    ahead.start()
    ahead.join(1.0)
    assert ahead.is_alive() and not replies        # held: its gradient is in, its weights are not sent
    assert clients[1].push_pull(torch.ones(4), 0, 8, 1.0, 0, weights[1])[1]   # the slowest catches up
    ahead.join(10)
    assert replies == [(3, True)]                   # released with the weights of both updates since
    assert server.version == 3 and torch.equal(weights[0], server.weights())
    for client in clients.values():
        client.done(16 if client is clients[0] else 8, None)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_ps_steps_with_its_own_intra_op_threads_and_gives_the_process_default_back(make_server, monkeypatch,
                                                                                        threads):
    seen = []
    push = PSCore.push

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return push(self, *args, **kwargs)

    monkeypatch.setattr(PSCore, "push", spy)
    before = torch.get_num_threads()
    server = make_server(ps_threads=threads)
    clients, weights = hello_all(server, [4])
    clients[0].push_pull(torch.ones(4), 0, 4, 0.0, 0, weights[0])
    clients[0].done(4, None)
    server.stop()
    assert seen == [threads]
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [before]
