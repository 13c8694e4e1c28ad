"""A pipelined worker's pushes assembled from its stage tasks' key ranges, over real loopback sockets."""
import threading

import pytest
import torch

from sparkdl._internal.ps.server.core import PushMeta
from sparkdl._internal.ps.server.parts import PartAssembly, PartRanges, check_part_ranges
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl.errors import ParameterServerError, ProtocolError
from tests.unit.conftest import SECRET

SPANS = [PartRanges((0, 3), (0, 0)), PartRanges((3, 5), (0, 2))]   # parameters 0-2 and 3-4; buffers on part 1


@pytest.fixture
def server(make_server):
    return make_server(torch.arange(5, dtype=torch.float32), num_workers=2, policy="sync", learning_rate=0.5,
                       server_args={"float_buffer_count": 2, "parts": SPANS})


def run_all(*calls):
    """Run every call in a thread of its own (hellos and sync pushes block until their peers arrive)."""
    results, errors = [None] * len(calls), []

    def one(i, call):
        try:
            results[i] = call()
        except Exception as exc:   # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    if errors:
        raise errors[0]
    return results


def connect_parts(ps, attempt=0):
    """Both replicas' two stage tasks: clients and their weight buffers, keyed (worker, part)."""
    clients = {(w, p): PSClient(ps.host, ps.port, SECRET, w, 10) for w in range(2) for p in range(2)}
    weights = {key: torch.zeros(SPANS[key[1]].num_params) for key in clients}
    run_all(*[lambda key=key: clients[key].hello(6 if key[1] == 0 else 0, weights[key], attempt, part=(key[1], 2))
              for key in clients])
    return clients, weights


def test_parts_get_their_ranges_and_one_update_covers_the_whole_model(server):
    clients, weights = connect_parts(server)
    # every stage task starts from its range of the PS's weights
    assert torch.equal(weights[0, 0], torch.tensor([0.0, 1.0, 2.0])) and torch.equal(weights[1, 1], torch.tensor([3.0, 4.0]))
    grads = {(0, 0): torch.full((3,), 1.0), (0, 1): torch.full((2,), 2.0),
             (1, 0): torch.full((3,), 3.0), (1, 1): torch.full((2,), 4.0)}
    loss = {0: 0.0, 1: 0.7}   # the last stage computes the loss
    replies = run_all(*[lambda key=key: clients[key].push_pull(grads[key], 0, 4, loss[key[1]], 0, weights[key])
                        for key in clients])
    assert {r[0] for r in replies} == {1} and all(r[1] for r in replies)
    # one sync round: the mean of the two replicas' assembled gradients, stepped once
    expected = torch.arange(5, dtype=torch.float32) - 0.5 * torch.tensor([2.0, 2.0, 2.0, 3.0, 3.0])
    assert torch.allclose(server.weights(), expected)
    assert torch.allclose(weights[0, 0], expected[:3]) and torch.allclose(weights[1, 1], expected[3:])
    assert server.stats.updates == 1 and server.stats.pushes == 2
    assert server.core.log.updates[0].loss == pytest.approx(0.7)
    # DONE from every part: the buffers of part 1 come back at their range of the whole model's
    run_all(*[lambda key=key: clients[key].done(4, torch.full((2,), 5.0) if key[1] == 1 else None)
              for key in clients])
    assert server.finished
    assert [b.tolist() for b, _ in server.core.members.reported_float_buffers()] == [[5.0, 5.0], [5.0, 5.0]]


def test_a_lost_part_loses_its_replica_and_its_partner_is_told(server):
    clients, weights = connect_parts(server)
    result = {}

    def partner():
        try:
            clients[0, 0].push_pull(torch.ones(3), 0, 4, 0.0, 0, weights[0, 0])
        except ParameterServerError as exc:
            result["error"] = str(exc)

    thread = threading.Thread(target=partner)
    thread.start()
    clients[0, 1].sock.close()      # the last stage of replica 0 dies before it pushes
    thread.join(timeout=15)
    assert "error" in result and not thread.is_alive()
    assert server.stats.workers_lost == 1 and [e["worker"] for e in server.events if e["event"] == "lost"] == [0]
    assert server.stats.updates == 0      # nothing half-applied


def test_a_part_of_a_stale_attempt_cannot_join(server):
    clients, weights = connect_parts(server, attempt=1)
    late = PSClient(server.host, server.port, SECRET, 0, 10)
    with pytest.raises(ParameterServerError, match="no session of its attempt"):
        late.hello(0, torch.zeros(2), 0, part=(1, 2))


def test_a_whole_model_worker_is_refused_by_a_parts_server(server):
    client = PSClient(server.host, server.port, SECRET, 0, 10)
    with pytest.raises(ParameterServerError, match="expects 2"):
        client.hello(6, torch.zeros(5), 0)


def test_assembly_refuses_a_double_push_and_disagreeing_parts():
    assembly = PartAssembly(SPANS, 5, 2)
    assembly.reset(token=1)
    assert not assembly.arrive(0, PushMeta(3, 8, 0.0, 0), True)
    with pytest.raises(ProtocolError, match="twice"):
        assembly.arrive(0, PushMeta(3, 8, 0.0, 0), True)
    assert assembly.arrive(1, PushMeta(2, 8, 1.0, 0), True)
    with pytest.raises(ProtocolError, match="disagree"):
        assembly.assembled()


def test_spans_must_tile_the_model():
    check_part_ranges(SPANS, 5, 2)
    with pytest.raises(ValueError, match="do not tile"):
        check_part_ranges([PartRanges((0, 2), (0, 0)), PartRanges((3, 5), (0, 2))], 5, 2)
    with pytest.raises(ValueError, match="do not tile"):
        check_part_ranges(SPANS, 6, 2)


def test_a_stage_that_fails_before_hello_loses_its_replica_unless_its_attempt_is_stale(server):
    clients, _ = connect_parts(server, attempt=1)
    stale = PSClient(server.host, server.port, SECRET, 0, 10)
    stale.report_failure("Traceback ...\nRuntimeError: an old attempt", part_attempt=0)
    assert server.stats.workers_lost == 0          # attempt 0 is gone; attempt 1 holds the slot
    failing = PSClient(server.host, server.port, SECRET, 1, 10)
    failing.report_failure("Traceback ...\nValueError: stage 1 could not build", part_attempt=1)
    assert server.stats.workers_lost == 1
    assert "stage 1 could not build" in server.worker_failures[1]
