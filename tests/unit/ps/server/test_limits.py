"""Driver-memory bounds (the parameter server; task results through the driver's JVM), sessions bound,
checkpoint write failures."""
import socket

import pytest
import torch

from sparkdl._internal.ps.server.limits import check_ps_memory, ps_memory_bytes
from sparkdl._internal.ps.server.server import ParameterServer
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.spark.preflight import check_results_fit_driver
from sparkdl.config import TrainConfig
from sparkdl.errors import ClusterConfigError, ParameterServerError
from tests.unit.conftest import SECRET


def test_memory_estimate_counts_optimizer_state_connections_and_snapshots():
    plain = TrainConfig(num_workers=2)
    assert ps_memory_bytes(plain, 1000) == 4 * 1000 * (2 + 2 * 2)
    assert ps_memory_bytes(plain.replace(momentum=0.9), 1000) == 4 * 1000 * (3 + 2 * 2)
    adam = plain.replace(optimizer="adam", checkpoint_dir="/tmp/x", compression="int8")
    assert ps_memory_bytes(adam, 1000, float_buffer_count=10) == 4 * (1000 * (4 + 3 * 2 + 3) + 10 * 2)
    # a pipelined replica's stage ranges are assembled in one more full-size buffer per replica
    assert ps_memory_bytes(plain.replace(pipeline_stages=2), 1000) == 4 * 1000 * (2 + 3 * 2)
    # shards on the executors: the driver keeps two cuts of snapshots (three with checkpoint files)
    sharded = plain.replace(momentum=0.9, ps_shards=2, ps_hosts="executors")
    assert ps_memory_bytes(sharded, 1000) == 4 * 1000 * 2 * 2
    assert ps_memory_bytes(sharded.replace(checkpoint_dir="/tmp/x"), 1000) == 4 * 1000 * 2 * 3


def test_a_model_over_the_limit_is_refused_naming_the_setting():
    config = TrainConfig(num_workers=8, optimizer="adam", ps_memory_limit_mb=100)
    check_ps_memory(config, 1_000_000)                       # 4 MB x 20 copies = 80 MB: fits
    with pytest.raises(ClusterConfigError, match=r"about 153 MB .* more than ps_memory_limit_mb=100"):
        check_ps_memory(config, 2_000_000)


def test_a_model_larger_than_the_machine_is_refused_by_default():
    with pytest.raises(ClusterConfigError, match="available memory"):
        check_ps_memory(TrainConfig(num_workers=2), 10**13)


def test_authenticated_sessions_are_bounded(make_server):
    server = make_server(timeout_s=30)
    sockets = []
    try:
        for _ in range(server._listener.max_sessions):
            sock = socket.create_connection((server.host, server.port), timeout=5)
            protocol.client_authenticate(sock, SECRET)
            sockets.append(sock)
        extra = socket.create_connection((server.host, server.port), timeout=5)
        sockets.append(extra)
        protocol.client_authenticate(extra, SECRET)
        header = protocol.recv_header(extra, protocol.MAX_TEXT_BYTES)
        assert header.type == protocol.Msg.ERROR
        assert b"too many connections" in protocol.recv_small_payload(extra, header)
        assert server.stats.auth_failures == 1
    finally:
        for sock in sockets:
            sock.close()


def test_a_failed_periodic_checkpoint_is_counted_and_the_final_one_raises(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    config = TrainConfig(num_workers=1, policy="async", checkpoint_dir=str(blocker / "ckpt"))
    server = ParameterServer(config, torch.zeros(4), SECRET)
    server.write_checkpoint()
    assert server.stats.checkpoint_failures == 1 and server.events[-1]["event"] == "checkpoint_failed"
    with pytest.raises(ParameterServerError, match="could not write the final checkpoint"):
        server.write_checkpoint(final=True)


def test_task_results_too_large_for_the_drivers_heap_are_refused_with_the_memory_to_set():
    gib = 1 << 30
    check_results_fit_driver(196_000_000, gib, "weights", "use the PS")      # came through a 1 GiB heap
    check_results_fit_driver(10 ** 12, None, "weights", "use the PS")        # Connect: the heap is not known
    with pytest.raises(ClusterConfigError, match=r"spark.driver.memory of at least 2g.*or use the PS"):
        check_results_fit_driver(274_000_000, gib, "weights", "use the PS")  # ran a 1 GiB heap out of memory
