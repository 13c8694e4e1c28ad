"""Streamed pushes (overlap_communication) against a real parameter server over loopback."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from sparkdl._internal.ps.server.server import ParameterServer, ServerSetup
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.worker.client import InOrderReply, PSClient
from sparkdl._internal.ps.worker.overlap import OverlappedExchange, StreamedSync, overlapped_exchange
from sparkdl._internal.training.flat import FlatReplica, flatten_parameters
from sparkdl.config import TrainConfig
from tests.unit.conftest import SECRET


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def started_server(config: TrainConfig, make_model=model) -> ParameterServer:
    """A running PS over ``make_model()``'s initial weights."""
    template = make_model()
    ps = ParameterServer(config, flatten_parameters(template), SECRET,
                         ServerSetup(tensor_sizes=[p.numel() for p in template.parameters()]))
    ps.start()
    return ps


@pytest.fixture
def server(make_server):
    template = model()
    return make_server(flatten_parameters(template), ps_transport="tcp",
                       server_args={"tensor_sizes": [p.numel() for p in template.parameters()]})


def connect(server) -> tuple[PSClient, FlatReplica, int]:
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    replica = FlatReplica(model(), torch.device("cpu"))
    version = client.hello(16, replica.weights).version
    return client, replica, version


def test_a_streamed_gradient_is_applied_as_one(server):
    client, replica, version = connect(server)
    streamed = overlapped_exchange(client, replica, version, pipelined=False, timeout_s=10)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    loss = nn.functional.cross_entropy(replica.model(x), y)
    # read before the push starts: the reply streams into the replica's weights as soon as it comes,
    # which may be before backward returns here
    weights_before = flatten_parameters(replica.model).clone()
    streamed.before_backward(loss.item(), 16, 0)
    loss.backward()
    expected = weights_before - 0.1 * replica.grads      # SGD on the PS, lr 0.1
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
    streamed = overlapped_exchange(client, replica, version, pipelined=True, timeout_s=10)
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
    streamed = overlapped_exchange(client, replica, version, pipelined=False, timeout_s=10)
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
    ps = started_server(config)
    try:
        client = PSClient(ps.host, ps.port, SECRET, 0, 10)
        replica = FlatReplica(model(), torch.device("cpu"))
        version = client.hello(16 * steps, replica.weights, shared_memory=transport == "auto", double=True).version
        if client.segment is not None and not copies:
            replica.rebind(client.segment.weights, client.segment.gradient)
        exchange = overlapped_exchange(client, replica, version, pipelined=True, timeout_s=10)
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


def sync_run(overlapped: bool, make_model=model, width: int = 4, steps: int = 5
             ) -> tuple[torch.Tensor, torch.Tensor, OverlappedExchange | None]:
    """One sync worker for ``steps`` fixed mini-batches, the reply streamed into the next forward or not:
    (the PS's final weights, the replica's, the overlapped exchange)."""
    config = TrainConfig(num_workers=1, policy="sync", learning_rate=0.1, momentum=0.9, timeout_s=10,
                         ps_transport="tcp", overlap_communication=overlapped)
    ps = started_server(config, make_model)
    try:
        client = PSClient(ps.host, ps.port, SECRET, 0, 10)
        replica = FlatReplica(make_model(), torch.device("cpu"))
        version = client.hello(16 * steps, replica.weights).version
        exchange = overlapped_exchange(client, replica, version, pipelined=False, timeout_s=10) if overlapped else None
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(16, width, generator=generator), torch.randint(0, 3, (16,), generator=generator)
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
        return ps.weights(), replica.weights.clone(), exchange
    finally:
        ps.stop()


def wide_model() -> nn.Module:
    """4M parameters in the first layer: its 16 MB of new weights take a while to arrive."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1000, 4000), nn.ReLU(), nn.Linear(4000, 3))


def test_sync_replies_stream_into_the_next_forward_and_change_no_weight(monkeypatch):
    """The forward starts before the whole reply is in, and still runs on the round's new weights only:
    the run is bit-identical to waiting for the whole reply.  The last layer's weights are held back 0.2 s
    on arrival, so the next forward always reaches that layer first (without it, whether 16 MB arrive before
    the forward does depends on the scheduling)."""
    plain_ps, plain_replica, _ = sync_run(False, wide_model, 1000, steps=3)
    in_order = StreamedSync._in_order

    def last_layer_late(self: StreamedSync, job: Any) -> InOrderReply:
        reply = in_order(self, job)
        last = len(reply.byte_spans) - 1

        def received(index: int) -> None:
            if index == last:
                time.sleep(0.2)
            reply.received(index)
        return InOrderReply(reply.byte_spans, reply.answered, received)

    monkeypatch.setattr(StreamedSync, "_in_order", last_layer_late)
    streamed_ps, streamed_replica, exchange = sync_run(True, wide_model, 1000, steps=3)
    assert exchange.weights_waits >= 1 and exchange.weights_wait_seconds > 0
    torch.testing.assert_close(streamed_ps, plain_ps, rtol=0, atol=0)
    torch.testing.assert_close(streamed_replica, plain_replica, rtol=0, atol=0)
    torch.testing.assert_close(streamed_replica, streamed_ps, rtol=0, atol=0)


class ReadsItsChild(nn.Module):
    """Reads ``proj``'s parameters without calling ``proj`` (as nn.MultiheadAttention does its out_proj)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 8)
        self.proj = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.relu(self.inner(x)), self.proj.weight, self.proj.bias)


def reads_its_child() -> nn.Module:
    torch.manual_seed(0)
    return ReadsItsChild()


def gated_forward(make_model, server_config: TrainConfig) -> tuple[OverlappedExchange, nn.Module, list[str], Any]:
    """A streamed sync exchange after one real step, with a reply made to arrive by hand; a forward in a
    thread records the modules that ran."""
    ps = started_server(server_config, make_model)
    client = PSClient(ps.host, ps.port, SECRET, 0, 10)
    replica = FlatReplica(make_model(), torch.device("cpu"))
    exchange = overlapped_exchange(client, replica, client.hello(64, replica.weights).version, pipelined=False,
                                  timeout_s=10)
    loss = replica.model(torch.randn(2, 4)).sum()       # the first step: its forward shows which modules run
    exchange.before_backward(loss.item(), 2, 0)
    loss.backward()
    exchange.exchange(1.0, 2, loss.item(), 0)
    exchange.settle()
    reached: list[str] = []
    for name, module in replica.model.named_modules():
        module.register_forward_hook(lambda module, args, out, name=name: reached.append(name))
    count = len(list(replica.model.parameters()))
    exchange._arriving = SimpleNamespace(arrived=[threading.Event() for _ in range(count)], done=threading.Event(),
                                         error=None)
    forward = threading.Thread(target=replica.model, args=(torch.randn(2, 4),), daemon=True)
    forward.start()

    def finish() -> None:
        forward.join(5)
        exchange._arriving = None
        exchange.close()
        client.done(2, None)
        ps.stop()
    return exchange, replica.model, reached, finish


def wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


SYNC = TrainConfig(num_workers=1, policy="sync", learning_rate=0.1, timeout_s=10, ps_transport="tcp")


def test_each_module_waits_for_its_own_new_weights_only():
    """With a reply arriving, the first layer runs once its weight and bias are in; the last waits for its own."""
    exchange, _, reached, finish = gated_forward(model, SYNC)
    arrived = exchange._arriving.arrived
    try:
        time.sleep(0.2)
        assert reached == []                       # nothing of layer 0 arrived yet
        arrived[0].set()
        arrived[1].set()                           # layer 0's weight and bias are in place
        assert wait_for(lambda: reached == ["0", "1"])     # layer 0 and the ReLU ran
        time.sleep(0.2)
        assert reached == ["0", "1"]               # layer 2 waits for its weights
        arrived[2].set()
        arrived[3].set()
        assert wait_for(lambda: reached == ["0", "1", "2", ""])
    finally:
        for event in arrived:                      # a failed check must not leave the forward waiting
            event.set()
        finish()


def test_a_module_reading_a_childs_parameters_waits_for_them():
    """A module that reads a child's weights without calling the child waits for those too."""
    exchange, _, reached, finish = gated_forward(reads_its_child, SYNC)
    arrived = exchange._arriving.arrived
    try:
        for index in range(3):                     # inner's weight and bias, proj's weight: not proj's bias
            arrived[index].set()
        time.sleep(0.3)
        assert reached == []
        arrived[3].set()
        assert wait_for(lambda: reached == ["inner", ""])
    finally:
        for event in arrived:                      # a failed check must not leave the forward waiting
            event.set()
        finish()


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``seconds``: the layers before it get their gradients that much later."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class _SlowBackwardLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x, 0.5)


class _RecordingSocket:
    """The client's socket, counting the bytes it sends."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.sent = 0

    def sendall(self, data) -> None:
        self._sock.sendall(data)
        self.sent += memoryview(data).nbytes

    def sendmsg(self, buffers) -> int:
        sent = self._sock.sendmsg(buffers)
        self.sent += sent
        return sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_the_last_layers_gradient_leaves_while_backward_is_still_running(make_server):
    """The push side of the overlap: by the time backward reaches the first layer (0.5 s after the last
    one's gradient is final), the header and the last layer's slices have crossed the socket."""
    def slow_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), _SlowBackwardLayer(), nn.ReLU(), nn.Linear(8, 3))

    template = slow_model()
    server = make_server(flatten_parameters(template), ps_transport="tcp",
                         server_args={"tensor_sizes": [p.numel() for p in template.parameters()]})
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    replica = FlatReplica(slow_model(), torch.device("cpu"))
    streamed = overlapped_exchange(client, replica, client.hello(16, replica.weights).version, pipelined=False,
                                   timeout_s=10)
    recording = client.sock = _RecordingSocket(client.sock)
    sent_when_first_layer_final: list[int] = []
    replica.model[0].weight.register_post_accumulate_grad_hook(
        lambda p: sent_when_first_layer_final.append(recording.sent))
    loss = nn.functional.cross_entropy(replica.model(torch.randn(16, 4)), torch.randint(0, 3, (16,)))
    streamed.before_backward(loss.item(), 16, 0)
    loss.backward()
    accepted, _ = streamed.exchange(1.0, 16, loss.item(), 0)
    streamed.close()
    last_layer_bytes = 4 * (8 * 3 + 3)
    assert accepted and sent_when_first_layer_final[0] >= protocol.HEADER.size + last_layer_bytes
    assert recording.sent == protocol.HEADER.size + 4 * replica.weights.numel()   # the whole push, once
    client.done(16, None)
