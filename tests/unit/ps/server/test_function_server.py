"""The driver's server of a user function's run, over real sockets: key spaces, reports, failures."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from sparkdl._internal.ps.server.function_server import FunctionServer
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError, ProtocolError
from tests.unit.conftest import SECRET


@pytest.fixture
def server():
    made = FunctionServer(TrainConfig(num_workers=2, policy="sync", timeout_s=2), SECRET, "127.0.0.1")
    made.start()
    yield made
    made.stop()


def ask(server: FunctionServer, rank: int, space: int, weights: torch.Tensor | None, size: int) -> int:
    client = PSClient("127.0.0.1", server.port, SECRET, rank, 5)
    try:
        payload = weights.numpy().tobytes() if weights is not None else None
        request = protocol.Space(rank, space, size, len(payload) if payload else 0)
        reply = client.request(request.header(), payload, reply=Msg.SPACE_AT)
        assert reply is not None
        return reply[0].count
    finally:
        client.close()


def test_rank_zeros_weights_start_a_space_the_others_wait_for(server):
    ports: dict[int, int] = {}
    waiting = threading.Thread(target=lambda: ports.__setitem__(1, ask(server, 1, 0, None, 3)))
    waiting.start()   # rank 1 asks first: it waits for rank 0's weights
    deadline = time.monotonic() + 10
    while not server.spaces_awaited() and time.monotonic() < deadline:   # rank 1's request has arrived
        time.sleep(0.01)
    waiting.join(0.3)
    assert server.spaces_awaited() == {0} and waiting.is_alive()        # and it waits, unanswered
    ports[0] = ask(server, 0, 0, torch.tensor([1.0, 2.0, 3.0]), 3)
    waiting.join(5)
    assert ports[0] == ports[1] == server.spaces[0].port
    assert torch.equal(server.spaces[0].weights(), torch.tensor([1.0, 2.0, 3.0]))
    # a second key space is a parameter server of its own
    assert ask(server, 0, 1, torch.zeros(2), 2) not in (ports[0], server.port)
    assert [s.num_params for s in server.spaces.values()] == [3, 2]


def test_a_rank_whose_model_has_another_size_is_refused_with_both_sizes(server):
    ask(server, 0, 0, torch.zeros(3), 3)
    with pytest.raises(ParameterServerError, match="rank 1's PS optimizer 0 has 5 parameters, rank 0's has 3"):
        ask(server, 1, 0, None, 5)


def test_a_space_rank_zero_never_makes_times_out_and_says_why(server):
    with pytest.raises(ParameterServerError, match="every rank must make the same PS optimizers in the same order"):
        ask(server, 1, 0, None, 3)


def test_only_rank_zero_starts_a_space_and_the_payload_must_be_the_weights(server):
    with pytest.raises(ParameterServerError, match="only rank 0's start a key space"):
        ask(server, 1, 0, torch.zeros(3), 3)
    with pytest.raises(ProtocolError, match="expected none or the initial weights"):
        protocol.Space.read(Header(Msg.SPACE, epoch=0, version=3, length=8))


def test_reports_and_failures_reach_the_stage_runners_view(server):
    client = PSClient("127.0.0.1", server.port, SECRET, 1, 5)
    try:
        client.request(Header(Msg.REPORT, flags=protocol.FLAG_STARTED, worker=1), None, reply=Msg.ACK)
        payload = b'{"loss": 0.5, "step": 3}'
        client.request(Header(Msg.REPORT, worker=1, length=len(payload)), payload, reply=Msg.ACK)
        client.report_failure("Traceback ...\nValueError: bad batch")
    finally:
        client.close()
    assert server.workers_seen == 1
    assert [(m.rank, m.metrics) for m in server.metrics] == [(1, {"loss": 0.5, "step": 3})]
    assert server.worker_failures[1].endswith("ValueError: bad batch")


def test_every_key_space_checkpoints_to_a_folder_of_its_own(tmp_path):
    """Several PS optimizers (a GAN's generator and discriminator) checkpoint apart, and each resumes its own."""
    from sparkdl import load_latest_checkpoint

    config = TrainConfig(num_workers=2, policy="sync", timeout_s=2, checkpoint_dir=str(tmp_path))
    server = FunctionServer(config, SECRET, "127.0.0.1")
    server.start()
    try:
        ask(server, 0, 0, torch.zeros(3), 3)
        ask(server, 0, 1, torch.ones(5), 5)
        for space in server.spaces.values():
            space.write_checkpoint(final=True)
    finally:
        server.stop()
    saved = {space: load_latest_checkpoint(tmp_path / f"space-{space}") for space in (0, 1)}
    assert saved[0]["num_params"] == 3 and saved[1]["num_params"] == 5
    assert torch.equal(saved[1]["weights"], torch.ones(5))
