"""Key-range shards, whole-model snapshots of a consistent cut, and the driver's shard coordinator."""
from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import torch

from sparkdl import TrainConfig
from sparkdl._internal.combinations import shard_refusal
from sparkdl._internal.ps.server.core import PSCore
from sparkdl._internal.ps.server.runlog import TAIL_ROWS, RunLog, UpdateRow, empty_log, extend_log, log_tail, trimmed_log
from sparkdl._internal.ps.shards.coordinator import Report, ShardCoordinator, decode_state, encode_state
from sparkdl._internal.ps.shards.ranges import (
    MIN_SHARD_PARAMS,
    clip_tensor_sizes,
    merge_snapshots,
    shard_count,
    shard_spans,
    split_snapshot,
)
from sparkdl._internal.ps.shards.snapshot_cuts import ConsistentCuts
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl.errors import ParameterServerError, ProtocolError
from tests.unit.conftest import SECRET


@pytest.mark.parametrize("num_params", [1, 7, 1000, 4810, 10_000_019])
@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_every_parameter_belongs_to_exactly_one_shard(num_params, shards):
    if shards > num_params:
        with pytest.raises(ValueError, match="cannot cut"):
            shard_spans(num_params, shards)
        return
    spans = shard_spans(num_params, shards)
    assert len(spans) == shards and spans[0][0] == 0 and spans[-1][1] == num_params
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))           # contiguous, no overlap, no gap
    sizes = [hi - lo for lo, hi in spans]
    assert max(sizes) - min(sizes) <= 1                                   # balanced by bytes


def test_a_small_model_gets_fewer_shards_than_asked():
    assert shard_count(10 * MIN_SHARD_PARAMS, 4) == 4
    assert shard_count(2 * MIN_SHARD_PARAMS + 5, 4) == 2
    assert shard_count(100, 4) == 1


def test_more_shards_than_tensors_cut_through_tensors():
    tensor_sizes = [3000, 10]            # two tensors, four shards
    spans = shard_spans(sum(tensor_sizes), 4)
    pieces = [clip_tensor_sizes(tensor_sizes, span) for span in spans]
    assert [sum(p) for p in pieces] == [hi - lo for lo, hi in spans]
    assert pieces == [[752], [753], [752], [743, 10]]


def _optimizer_state(kind: str, num_params: int) -> PSCore:
    config = TrainConfig(num_workers=1, optimizer=kind, momentum=0.9, learning_rate=0.1)
    core = PSCore(config, torch.randn(num_params))
    for _ in range(3):
        core.optimizer.step(torch.randn(num_params))
    return core


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_shard_snapshots_merge_into_the_whole_snapshot_and_split_back(kind):
    whole = _optimizer_state(kind, 5000).snapshots.take()
    spans = shard_spans(5000, 3)
    parts = split_snapshot(whole, spans)
    assert [p["num_params"] for p in parts] == [hi - lo for lo, hi in spans]
    merged = merge_snapshots(parts)
    assert merged["num_params"] == 5000 and torch.equal(merged["weights"], whole["weights"])
    for key, value in whole["optimizer"]["state"][0].items():
        assert torch.equal(merged["optimizer"]["state"][0][key], value), key
    # a merged cut restores into a whole PS, which continues exactly
    core = PSCore(TrainConfig(num_workers=1, optimizer=kind, momentum=0.9, learning_rate=0.1), torch.zeros(5000))
    core.snapshots.restore(merged)
    assert torch.equal(core.weights(), whole["weights"])


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_optimizers_on_key_ranges_step_exactly_as_one_optimizer_on_the_whole(kind):
    """What makes sharding exact: the optimizers are element-wise."""
    config = TrainConfig(num_workers=1, optimizer=kind, momentum=0.9, learning_rate=0.1, weight_decay=1e-3)
    start = torch.randn(3000)
    whole = PSCore(config, start)
    spans = shard_spans(3000, 3)
    shards = [PSCore(config, start[lo:hi]) for lo, hi in spans]
    for _ in range(4):
        grad = torch.randn(3000)
        whole.optimizer.step(grad.clone())
        for (lo, hi), shard in zip(spans, shards):
            shard.optimizer.step(grad[lo:hi].clone())
    assert torch.equal(torch.cat([s.weights() for s in shards]), whole.weights())


def test_snapshots_of_different_versions_are_not_a_cut():
    parts = split_snapshot(_optimizer_state("sgd", 3000).snapshots.take(), shard_spans(3000, 2))
    parts[1] = {**parts[1], "version": parts[1]["version"] + 1}
    with pytest.raises(ValueError, match="consistent cut"):
        merge_snapshots(parts)
    assert merge_snapshots(parts, same_version=False)["num_params"] == 3000
    with pytest.raises(ValueError, match="another model"):
        split_snapshot(_optimizer_state("sgd", 3000).snapshots.take(), shard_spans(2999, 2))


@pytest.mark.parametrize("settings, match", [
    ({"ps_shards": 2}, "ps_hosts='executors'"),
    ({"ps_shards": 3, "ps_hosts": "executors"}, "ps_shards <= 2"),
    ({"ps_shards": 2, "ps_hosts": "executors", "policy": "allreduce"}, "no parameter server"),
    ({"ps_shards": 2, "ps_hosts": "executors", "pipeline_stages": 3}, "set ps_shards=3"),
    ({"ps_shards": 2, "ps_hosts": "executors", "overlap_communication": True}, "overlap_communication"),
    ({"ps_shards": 2, "ps_hosts": "executors", "backup_workers": 1}, "backup_workers"),
])
def test_what_shards_cannot_do_is_refused_with_the_setting_to_change(settings, match):
    assert match in shard_refusal(TrainConfig(num_workers=2, **settings))


def test_defaults_and_executor_shards_are_accepted():
    assert shard_refusal(TrainConfig(num_workers=2)) is None
    assert shard_refusal(TrainConfig(num_workers=2, ps_shards=2, ps_hosts="executors", policy="async")) is None


def test_the_log_travels_as_deltas_and_is_cut_back_to_a_version():
    log = RunLog()
    for version in range(1, 6):
        log.updates.append(UpdateRow(version, 0.1 * version, 0, 1.0, 16, 2, 0.0, 0, 1.0, 0.1))
    first, position = log.export()
    log.updates.append(UpdateRow(6, 0.6, 0, 1.0, 16, 2, 0.0, 0, 1.0, 0.1))
    log.event("lost", 6, worker=1)
    second, _ = log.export(position)
    assert [r[0] for r in second["updates"]] == [6] and len(second["events"]) == 1
    assembled = empty_log()
    extend_log(assembled, first)
    extend_log(assembled, second)
    assert [r[0] for r in assembled["updates"]] == [1, 2, 3, 4, 5, 6]
    # back to a snapshot's rows: the later rows are redone after a restart, the events (the failure) stay
    cut = trimmed_log(assembled, (4, 0, 0))
    assert [r[0] for r in cut["updates"]] == [1, 2, 3, 4] and len(cut["events"]) == 1
    restored = RunLog()
    restored.load(decode_state(encode_state(cut)))
    assert [r.version for r in restored.updates] == [1, 2, 3, 4]
    assert restored.row_counts() == (4, 0, 0, 1)


def test_a_restarted_log_shard_gets_only_the_tail_and_continues_the_runs_row_positions():
    assembled = empty_log()
    rows = [UpdateRow(v, 0.01 * v, 0, 1.0, 16, 2, 0.0, 0, 1.0, 0.1) for v in range(1, 1001)]
    extend_log(assembled, {**empty_log(), "updates": [dataclasses.astuple(r) for r in rows]})
    tail = log_tail(assembled)
    assert len(tail["updates"]) == TAIL_ROWS and len(assembled["updates"]) == 1000   # the driver keeps the rest
    restored = RunLog()
    restored.load(decode_state(encode_state(tail)))
    assert restored.row_counts()[0] == 1000 and restored.updates[-1].version == 1000
    position = restored.row_counts()
    restored.updates.append(UpdateRow(1001, 10.01, 0, 1.0, 16, 2, 0.0, 0, 1.0, 0.1))
    delta, after = restored.export(position)
    assert [r[0] for r in delta["updates"]] == [1001] and after[0] == 1001
    extend_log(assembled, delta)
    assert [r[0] for r in assembled["updates"]] == list(range(1, 1002))
    assert trimmed_log(assembled, after[:3])["updates"] == assembled["updates"]


def _cut_snapshot(version: int, shard: int, after: int = 0) -> dict:
    return {"version": version, "weights": torch.full((4,), float(shard)), "tables": [], "tables_after": after}


def test_a_cut_needs_every_shards_snapshot_of_one_version():
    cuts = ConsistentCuts(shard_spans(3000, 3))
    assert cuts.start_state(0) is None and cuts.version == 0
    assert cuts.offer(0, 5, _cut_snapshot(5, 0)) == []
    assert cuts.offer(2, 5, _cut_snapshot(5, 2)) == []
    assert cuts.offer(1, 10, _cut_snapshot(10, 1, 5)) == []    # another version completes nothing
    assert cuts.cut is None and cuts.newest_pending() == 10
    assert cuts.offer(1, 5, _cut_snapshot(5, 1)) == [5]         # the last shard of version 5
    assert cuts.version == 0                                    # formed by advance only
    cut = cuts.advance()
    assert cut is not None and [s["weights"][0].item() for s in cut] == [0.0, 1.0, 2.0]
    assert cuts.version == 5 and cuts.start_state(2) == cut[2]
    assert cuts.newest_pending() == 10                          # version 10 still waits for two shards
    assert cuts.offer(0, 5, _cut_snapshot(5, 0)) == [] and cuts.advance() is None   # no newer: dropped
    cuts.forget_pending()
    assert cuts.newest_pending() == 0 and cuts.version == 5
    with pytest.raises(ProtocolError, match="labelled 7 of version 6"):
        cuts.offer(0, 7, _cut_snapshot(6, 0))


def _rows_snapshot(version: int, after: int, rows: list[int], value: float) -> dict:
    """A shard's snapshot whose one table changed ``rows`` (local indices) to ``value``."""
    return {"version": version, "weights": torch.zeros(4), "tables_after": after,
            "tables": [{"rows": torch.tensor(rows, dtype=torch.int64), "weight": torch.full((len(rows), 2), value),
                        "state_sum": torch.full((len(rows), 2), -value), "steps": version}]}


def test_a_cut_lays_every_shards_changed_rows_over_the_last_once_each_link_has_arrived():
    initial = torch.arange(12.0).reshape(6, 2)      # shard i holds rows i, i + 2, i + 4
    expected = initial.clone()
    cuts = ConsistentCuts(shard_spans(3000, 2), tables=[initial])
    assert cuts.offer(0, 10, _rows_snapshot(10, 5, [1], 10.0)) == []   # before the snapshot it follows
    assert cuts.offer(1, 10, _rows_snapshot(10, 0, [0], 11.0)) == []   # every shard at 10, a link missing
    assert cuts.cut is None
    assert cuts.offer(0, 5, _rows_snapshot(5, 0, [0, 1], 5.0)) == [10]   # shard 1 has no 5: no cut there
    cut = cuts.advance()
    assert cut is not None and cuts.version == 10
    expected[0], expected[2], expected[1] = 5.0, 10.0, 11.0   # shard 0's rows 0 and 1 (then 1 again), shard 1's 0
    assert torch.equal(initial, expected)                     # laid over the initial rows, in order
    restart = cuts.start_state(0)["tables"][0]
    assert restart["weight"].is_contiguous() and torch.equal(restart["weight"], expected[0::2])
    assert restart["state_sum"][:2].tolist() == [[-5.0, -5.0], [-10.0, -10.0]] and restart["steps"] == 10
    # an authenticated peer's malformed changes are refused before anything is kept
    with pytest.raises(ProtocolError, match="outside the shard's 3 rows"):
        cuts.offer(0, 15, _rows_snapshot(15, 10, [3], 1.0))
    with pytest.raises(ProtocolError, match="start at version 15"):
        cuts.offer(0, 15, _rows_snapshot(15, 15, [0], 1.0))
    assert cuts.newest_pending() == 0 and torch.equal(initial, expected)
    with pytest.raises(ProtocolError, match="update count"):
        cuts.offer(0, 15, {**_rows_snapshot(15, 10, [0], 1.0), "tables": [{**_rows_snapshot(15, 10, [0], 1.0)["tables"][0],
                                                                        "steps": "x"}]})
    # the end: the rows a shard changed since it started, over the newest cut (checked when they arrive)
    with pytest.raises(ProtocolError, match="final state"):
        cuts.check_final(1, _rows_snapshot(14, 10, [3], 7.0))
    assert torch.equal(initial, expected)
    final = cuts.final_snapshot(1, _rows_snapshot(14, 10, [2], 7.0))
    expected[5] = 7.0
    assert torch.equal(initial, expected) and "tables_after" not in final
    assert torch.equal(final["tables"][0]["weight"], expected[1::2])
    rows_only = _rows_snapshot(14, 10, [1], 8.0)          # taken without optimizer state: none is handed on
    del rows_only["tables"][0]["state_sum"]
    final = cuts.final_snapshot(0, rows_only)["tables"][0]
    assert "state_sum" not in final and final["weight"][1].tolist() == [8.0, 8.0]


def test_a_resumed_run_starts_every_shard_from_its_part_of_the_checkpoint():
    whole = _optimizer_state("sgd", 3000).snapshots.take()
    cuts = ConsistentCuts(shard_spans(3000, 2), resume=whole)
    assert cuts.resumed_from == cuts.version == whole["version"]
    assert torch.equal(torch.cat([cuts.start_state(i)["weights"] for i in range(2)]), whole["weights"])
    assert all(cuts.start_state(i)["log_rows"] == [0, 0, 0] for i in range(2))


# ----------------------------------------------------------------- the coordinator over real sockets
def _host(coordinator: ShardCoordinator, shard: int, attempt: int = 0, task_attempt: int = 0
          ) -> tuple[PSClient, Header, bytes]:
    link = PSClient(coordinator.host, coordinator.port, SECRET, shard, timeout_s=10)
    header, payload = link.request(Header(Msg.SHARD_HELLO, worker=shard, version=attempt, count=task_attempt),
                                   reply=Msg.SHARD_STATE, max_length=1 << 24)
    return link, header, payload


def _report(link: PSClient, kind: Report, payload: bytes, version: int = 0) -> None:
    link.request(Header(Msg.SHARD_REPORT, flags=kind, worker=link.worker, version=version, length=len(payload)),
                 payload, reply=Msg.ACK if kind is Report.FINAL else None)


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def coordinator():
    whole = _optimizer_state("sgd", 3000).snapshots.take()
    config = TrainConfig(num_workers=2, ps_shards=2, ps_hosts="executors", timeout_s=10)
    server = ShardCoordinator(config, SECRET, shard_spans(3000, 2), "127.0.0.1")
    server.start()
    server.whole = whole
    yield server
    server.stop()


def test_a_cut_forms_when_every_shard_reached_a_version_and_a_retry_starts_from_it(coordinator):
    parts = [{**part, "version": 5, "tables_after": 0} for part in split_snapshot(coordinator.whole, coordinator.spans)]
    links = []
    for shard in range(2):
        link, header, payload = _host(coordinator, shard)
        assert header.version == -1 and payload == b""       # a fresh run starts from the broadcast weights
        links.append(link)
    version = parts[0]["version"]
    log, _ = RunLog().export()
    _report(links[0], Report.SNAPSHOT, encode_state({**parts[0], "log": log}), version)
    time.sleep(0.2)
    assert coordinator.version == 0                          # one shard is not a cut
    _report(links[1], Report.SNAPSHOT, encode_state(parts[1]), version)
    _wait(lambda: coordinator.version == version)
    for link in links:
        link.close()
    coordinator.begin_attempt(1)
    for shard in range(2):
        link, header, payload = _host(coordinator, shard, attempt=1)
        assert header.version == version
        assert torch.equal(decode_state(payload)["weights"], parts[shard]["weights"])
        link.close()
    with pytest.raises(ParameterServerError, match="attempt 0 is over"):
        _host(coordinator, 0, attempt=0)
    assert coordinator.driver_bytes > 4 * 3000


def test_a_snapshot_that_completes_two_cuts_writes_the_due_ones_checkpoint_from_its_own_rows(tmp_path):
    from sparkdl._internal.ps.server.checkpoint import checkpoint_path, state_from_bytes
    from sparkdl._internal.ps.tables import TableSpec

    whole = _optimizer_state("sgd", 3000).snapshots.take()
    initial = torch.arange(12.0).reshape(6, 2)      # shard i holds rows i, i + 2, i + 4
    config = TrainConfig(num_workers=2, ps_shards=2, ps_hosts="executors", timeout_s=10,
                         checkpoint_dir=str(tmp_path), checkpoint_every=3)
    server = ShardCoordinator(config, SECRET, shard_spans(3000, 2), "127.0.0.1", tables=[initial],
                              table_specs=[TableSpec("table", 6, 2)])
    server.start()
    try:
        parts = split_snapshot(whole, server.spans)
        links = [_host(server, shard)[0] for shard in range(2)]
        log, _ = RunLog().export()

        def snapshot(shard: int, version: int, after: int) -> None:
            # each version's weights, and its change of the shard's first row, tell it apart
            state = {**parts[shard], **_rows_snapshot(version, after, [0], float(version)),
                     "weights": parts[shard]["weights"] + version}
            _report(links[shard], Report.SNAPSHOT, encode_state({**state, "log": log} if shard == 0 else state),
                    version)

        # shard 1's snapshots arrive out of order, after shard 0's: its 3 completes the cuts at 3 and 5
        for received, (shard, version, after) in enumerate(((0, 3, 0), (0, 5, 3), (1, 5, 3), (1, 3, 0)), 1):
            snapshot(shard, version, after)
            # handled in this order (the cuts advance just after the report is counted)
            expected = 5 if received == 4 else 0
            _wait(lambda received=received, expected=expected: server.snapshots_received == received
                  and server.version == expected)
        _wait(lambda: server.version == 5 and server.checkpoints_written == 1)
        written = state_from_bytes(checkpoint_path(tmp_path, 3).read_bytes())   # due at 3, merged before 5 formed
        assert torch.equal(written["weights"], whole["weights"] + 3)
        assert written["tables"][0]["weight"][:2].tolist() == [[3.0, 3.0], [3.0, 3.0]]
        assert torch.equal(written["tables"][0]["weight"][2:], torch.arange(4.0, 12.0).reshape(4, 2))
        assert initial[:2].tolist() == [[5.0, 5.0], [5.0, 5.0]]    # the cut at 5, laid over it after
        for link in links:
            link.close()
    finally:
        server.stop()


def test_an_unauthenticated_or_malformed_peer_changes_nothing(coordinator):
    stranger = socket.create_connection((coordinator.host, coordinator.port), timeout=5)
    with pytest.raises(Exception):  # noqa: B017 (refused either way: an AuthenticationError or a closed socket)
        protocol.client_authenticate(stranger, b"x" * 32)
    stranger.close()
    _wait(lambda: coordinator.refused_connections == 1)
    link, _, _ = _host(coordinator, 0)
    _report(link, Report.SNAPSHOT, b"not a torch file", 3)     # authenticated, but not a snapshot
    header = protocol.recv_header(link.sock, protocol.MAX_TEXT_BYTES)
    assert header.type == Msg.ERROR
    assert b"undecodable" in protocol.recv_small_payload(link.sock, header)
    link.close()
    assert coordinator.failure is None and coordinator.version == 0
    with pytest.raises(ParameterServerError, match="outside"):
        _host(coordinator, 7)


def test_a_shard_failure_fails_the_run_and_a_worker_report_is_kept(coordinator):
    link, _, _ = _host(coordinator, 1)
    for attempt, text in ((0, "Traceback ...\nValueError: boom"), (-1, "a leftover of another attempt")):
        reporter = PSClient(coordinator.host, coordinator.port, SECRET, attempt + 1, timeout_s=5)
        reporter.report_failure(text, attempt)
        reporter.close()
    assert "boom" in coordinator.worker_failures[1] and 0 not in coordinator.worker_failures
    _report(link, Report.FAILURE, b"sync round 3 waited 20 s for workers [1]")
    _wait(lambda: coordinator.failure is not None)
    assert "PS shard 1: sync round 3" in str(coordinator.failure)
    link.close()


def test_a_final_report_without_a_state_is_refused_and_not_kept(coordinator):
    link, _, _ = _host(coordinator, 1)
    with pytest.raises(ParameterServerError, match="FINAL report must hold a mapping"):
        _report(link, Report.FINAL, encode_state(None))
    link.close()
    assert 1 not in coordinator.finals and coordinator.failure is None
