"""Streamed pushes (overlap_communication) against a real parameter server over loopback."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sparkdl.config import TrainConfig
from sparkdl.ps.client import PSClient
from sparkdl.ps.transport import ParameterServer
from sparkdl.runtime.overlap import OverlappedExchange
from sparkdl.training.flat import FlatReplica, flatten_parameters

SECRET = b"o" * 32


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.fixture
def server():
    config = TrainConfig(num_workers=1, policy="async", learning_rate=0.1, timeout_s=10, ps_transport="tcp")
    template = model()
    ps = ParameterServer(config, flatten_parameters(template), SECRET,
                         tensor_sizes=[p.numel() for p in template.parameters()])
    ps.start()
    yield ps
    ps.stop()


def connect(server) -> tuple[PSClient, FlatReplica, int]:
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    replica = FlatReplica(model(), torch.device("cpu"))
    version = client.hello(16, replica.weights).version
    return client, replica, version


def test_a_streamed_gradient_is_applied_as_one(server):
    client, replica, version = connect(server)
    streamed = OverlappedExchange(client, replica, version, pipelined=False, timeout_s=10)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    loss = nn.functional.cross_entropy(replica.model(x), y)
    streamed.before_backward(loss.item(), 16, 0)
    loss.backward()
    expected = flatten_parameters(replica.model) - 0.1 * replica.grads      # SGD on the PS, lr 0.1
    accepted, stop = streamed.exchange(1.0, 16, loss.item(), 0)
    streamed.close()
    assert accepted and not stop and server.version == 1
    torch.testing.assert_close(server.weights(), expected)
    torch.testing.assert_close(replica.weights, expected)      # the reply landed in the replica
    client.done(16, None)


def test_a_step_that_fails_mid_stream_applies_nothing(server):
    """Backward dies after part of the gradient went out: the PS must not complete it with later bytes."""
    client, replica, version = connect(server)
    before = server.weights()
    streamed = OverlappedExchange(client, replica, version, pipelined=True, timeout_s=10)
    streamed.before_backward(1.0, 16, 0)
    replica.grads.fill_(1e3)
    streamed._ready[-1].set()              # the last layer's gradient is final and goes out ...
    time.sleep(0.2)
    streamed.close()                       # ... then the step fails: the stream is cut
    for _ in range(200):
        if any(event["event"] == "lost" for event in server.events):
            break
        time.sleep(0.01)
    assert server.version == 0 and torch.equal(server.weights(), before)
    assert any(event["event"] == "lost" for event in server.events)


def test_frozen_parameters_are_streamed_as_they_are(server):
    client, replica, version = connect(server)
    replica.model[0].weight.requires_grad_(False)
    streamed = OverlappedExchange(client, replica, version, pipelined=False, timeout_s=10)
    loss = replica.model(torch.randn(16, 4)).sum()
    streamed.before_backward(loss.item(), 16, 0)
    loss.backward()
    accepted, _ = streamed.exchange(1.0, 16, loss.item(), 0)
    streamed.close()
    assert accepted and server.version == 1
    client.done(16, None)


def pipelined_run(transport: str, copies: bool = False, steps: int = 6) -> tuple[torch.Tensor, list[int], str]:
    """One pipelined async worker for ``steps`` fixed mini-batches: the PS's final weights, the staleness
    of each applied gradient, and the transport used.  ``copies``: the replica keeps its own buffers
    and copies to and from the segment, as a GPU replica does."""
    config = TrainConfig(num_workers=1, policy="async", learning_rate=0.1, timeout_s=10, ps_transport=transport,
                         overlap_communication=True)
    template = model()
    ps = ParameterServer(config, flatten_parameters(template), SECRET,
                         tensor_sizes=[p.numel() for p in template.parameters()])
    ps.start()
    try:
        client = PSClient(ps.host, ps.port, SECRET, 0, 10)
        replica = FlatReplica(model(), torch.device("cpu"))
        version = client.hello(16 * steps, replica.weights, shared_memory=transport == "auto", double=True).version
        if client.segment is not None and not copies:
            replica.rebind(client.segment.weights, client.segment.gradient)
        exchange = OverlappedExchange(client, replica, version, pipelined=True, timeout_s=10)
        assert exchange._copies == (copies and client.segment is not None)
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(16, 4, generator=generator), torch.randint(0, 3, (16,), generator=generator)
            loss = nn.functional.cross_entropy(replica.model(x), y)
            exchange.before_backward(loss.item(), 16, 0)
            loss.backward()
            assert exchange.exchange(1.0, 16, loss.item(), 0)[0]
        exchange.settle()
        exchange.close()
        client.done(16 * steps, None)
        staleness = [row.staleness for row in ps.core.log.gradients]
        return ps.weights(), staleness, client.transport
    finally:
        ps.stop()


@pytest.mark.parametrize("copies", [False, True], ids=["trains-in-the-segment", "copies-like-a-gpu"])
def test_pipelined_exchanges_through_a_double_buffered_segment_equal_the_socket_path(copies):
    """Same gradients, same staleness (one update behind from the second step on), same weights."""
    tcp_weights, tcp_staleness, tcp = pipelined_run("tcp")
    shm_weights, shm_staleness, shm = pipelined_run("auto", copies)
    assert (tcp, shm) == ("tcp", "shared_memory")
    assert tcp_staleness == shm_staleness == [0] + [1] * 5
    torch.testing.assert_close(shm_weights, tcp_weights, rtol=0, atol=0)


def sync_run(overlapped: bool, steps: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """One sync worker for ``steps`` fixed mini-batches, the reply streamed into the next forward or not:
    (the PS's final weights, the replica's)."""
    config = TrainConfig(num_workers=1, policy="sync", learning_rate=0.1, momentum=0.9, timeout_s=10,
                         ps_transport="tcp", overlap_communication=overlapped)
    template = model()
    ps = ParameterServer(config, flatten_parameters(template), SECRET,
                         tensor_sizes=[p.numel() for p in template.parameters()])
    ps.start()
    try:
        client = PSClient(ps.host, ps.port, SECRET, 0, 10)
        replica = FlatReplica(model(), torch.device("cpu"))
        version = client.hello(16 * steps, replica.weights).version
        exchange = OverlappedExchange(client, replica, version, pipelined=False, timeout_s=10) if overlapped else None
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(16, 4, generator=generator), torch.randint(0, 3, (16,), generator=generator)
            loss = nn.functional.cross_entropy(replica.model(x), y)
            if exchange is None:
                loss.backward()
                version, accepted = client.push_pull(replica.grads, version, 16, loss.item(), 0, replica.weights)
                replica.zero_grads()
            else:
                exchange.before_backward(loss.item(), 16, 0)
                loss.backward()
                accepted = exchange.exchange(1.0, 16, loss.item(), 0)[0]
            assert accepted
        if exchange is not None:
            exchange.settle()
            exchange.close()
        client.done(16 * steps, None)
        return ps.weights(), replica.weights.clone()
    finally:
        ps.stop()


def test_sync_replies_streamed_into_the_next_forward_change_no_weight():
    """Every forward runs on the round's new weights: the run is bit-identical to waiting for the whole reply."""
    plain_ps, plain_replica = sync_run(False)
    streamed_ps, streamed_replica = sync_run(True)
    torch.testing.assert_close(streamed_ps, plain_ps, rtol=0, atol=0)
    torch.testing.assert_close(streamed_replica, plain_replica, rtol=0, atol=0)
    torch.testing.assert_close(streamed_replica, streamed_ps, rtol=0, atol=0)


def test_each_module_waits_for_its_own_new_weights_only(server):
    """With a reply arriving, the first layer runs once its weight and bias are in; the last waits for its own."""
    client, replica, version = connect(server)
    exchange = OverlappedExchange(client, replica, version, pipelined=False, timeout_s=10)
    reached: list[int] = []
    for index, layer in enumerate(replica.model):
        layer.register_forward_hook(lambda module, args, out, index=index: reached.append(index))
    arriving = SimpleNamespace(arrived=[threading.Event() for _ in range(4)], done=threading.Event(), error=None)
    exchange._arriving = arriving
    forward = threading.Thread(target=replica.model, args=(torch.randn(2, 4),))
    forward.start()
    time.sleep(0.2)
    assert reached == []                       # nothing of layer 0 arrived yet
    arriving.arrived[0].set()
    arriving.arrived[1].set()                  # layer 0's weight and bias are in place
    time.sleep(0.2)
    assert reached == [0, 1]                   # layer 0 and the ReLU ran; layer 2 waits for its weights
    arriving.arrived[2].set()
    arriving.arrived[3].set()
    forward.join(5)
    assert reached == [0, 1, 2]
    exchange._arriving = None
    exchange.close()
    client.done(0, None)
