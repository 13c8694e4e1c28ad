"""The other topologies and policies across hosts of the multi-host lab: allreduce, executor-hosted PS
shards, pipelines, streamed (overlapped) exchange, softsync and softsync_nodes, Spark Connect.

Run by hand (about 3 min; CI runs the short selection of ``test_lab.py``)::

    python -m pytest -q -m lab tests/e2e/test_lab_topologies.py

Each trains digits on two worker hosts over 1 Gbit/s links; those with sync semantics must equal the
same run on one host (``local[2]``) to 1e-5, with their bytes on the worker hosts' links.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from . import lab as lab_module
from . import lab_run
from .script_results import results
from .test_lab import built_lab, run_on_lab

pytestmark = [pytest.mark.lab, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def lab():
    with built_lab(workers=2, rate="1gbit") as fresh:
        yield fresh


def assert_equal_to_one_host(spark, settings: dict, result: dict, weights) -> None:
    reference = lab_run.fit(spark, settings)
    across = torch.load(weights)
    assert result["summary"]["updates"] == reference.summary["updates"] and result["attempts"] == 1
    for name, value in reference.state_dict.items():
        assert torch.allclose(across[name], value, atol=1e-5), name


def test_allreduce_across_two_hosts_equals_the_single_host_run(lab, spark, tmp_path):
    settings = {"policy": "allreduce"}
    result, carried = run_on_lab(lab, settings, tmp_path / "lab.pt")
    # the gradients were averaged between the hosts: each worker host's link carried at least one
    # gradient's worth of bytes per step each way (a ring of two sends a half and receives a half)
    params = sum(p.numel() for p in lab_run.digits_mlp().parameters())
    steps = result["summary"]["updates"]
    assert steps > 0
    assert all(c["sent"] >= steps * params * 4 // 2 and c["received"] >= steps * params * 4 // 2
               for c in carried.values()), (carried, steps)
    # hosts with /dev/shm of their own reduce through the process group; the one-host run below, in shared memory
    assert {w["reduction"] for w in result["workers"]} == {"gloo"}, result["workers"]
    assert_equal_to_one_host(spark, settings, result, tmp_path / "lab.pt")


def test_executor_hosted_shards_across_two_hosts_equal_the_single_host_run(lab, spark, tmp_path):
    settings = {"policy": "sync", "ps_hosts": "executors", "ps_shards": 2}
    result, carried = run_on_lab(lab, settings, tmp_path / "lab.pt")
    # each worker reaches its own host's shard and the other host's: the other one over TCP
    assert all("tcp" in w["transport"].split(",") for w in result["workers"]), result["workers"]
    assert sorted(w["ps_shard"] for w in result["workers"]) == [0, 1]
    # the driver's link carries no gradients: each worker host's link carries the other host's half
    params = sum(p.numel() for p in lab_run.digits_mlp().parameters())
    pushes = max(w["pushes"] for w in result["workers"])
    assert all(c["sent"] >= pushes * params * 4 // 2 // 2 for c in carried.values()), carried
    assert_equal_to_one_host(spark, settings, result, tmp_path / "lab.pt")


def test_two_pipeline_stages_on_two_hosts_equal_the_single_host_run(lab, spark, tmp_path):
    settings = {"policy": "sync", "num_workers": 1, "pipeline_stages": 2, "micro_batches": 2}
    result, _ = run_on_lab(lab, settings, tmp_path / "lab.pt")
    # one stage task per one-core worker host: the activations and their gradients crossed between them
    assert sorted(w["pipeline_stage"] for w in result["workers"]) == [0, 1]
    assert_equal_to_one_host(spark, settings, result, tmp_path / "lab.pt")


def test_streamed_exchange_across_two_hosts_equals_the_single_host_run(lab, spark, tmp_path):
    settings = {"policy": "sync", "overlap_communication": True}
    result, carried = run_on_lab(lab, settings, tmp_path / "lab.pt")
    # each gradient left in pieces while backward ran, over the socket (no host sees the PS's /dev/shm)
    assert [(w["transport"], w["overlapped"]) for w in result["workers"]] == [("tcp", True)] * 2, result["workers"]
    params = sum(p.numel() for p in lab_run.digits_mlp().parameters())
    assert all(c["sent"] >= w["pushes"] * params * 4 for c, w in
               zip(carried.values(), sorted(result["workers"], key=lambda w: w["worker"]))), carried
    assert_equal_to_one_host(spark, settings, result, tmp_path / "lab.pt")


@pytest.mark.parametrize("policy", ["softsync", "softsync_nodes"])
def test_softsync_across_two_hosts_averages_every_gradient_once_and_learns(lab, tmp_path, policy):
    result, _ = run_on_lab(lab, {"policy": policy, "softsync_size": 2, "epochs": 4}, tmp_path / "lab.pt")
    assert [w["transport"] for w in result["workers"]] == ["tcp", "tcp"]
    summary = result["summary"]
    # every gradient that crossed a link went into exactly one update of two (or past the budget's end)
    assert summary["pushes"] == sum(w["pushes"] for w in result["workers"])
    assert summary["applied_gradients"] + summary.get("pushes_past_end", 0) == summary["pushes"]
    assert summary["applied_gradients"] >= 2 * summary["updates"] - 1 and summary["updates"] > 0, summary
    accuracy = lab_run.training_accuracy(torch.load(tmp_path / "lab.pt"))
    assert accuracy > 0.8, accuracy        # chance is 0.1


CONNECT_PORT = 15002


def test_spark_connect_across_hosts_equals_the_classic_single_host_fit(lab, spark, digits, tmp_path):
    """A Connect server on the driver host, its executors on the worker hosts, and the client (with the PS)
    on the driver host: the same weights as the classic fit on one host, the gradients over the links."""
    from tests.integration import connect_reference
    from tests.integration.test_connect import connect_missing

    reason = connect_missing()
    if reason:
        pytest.skip(reason)
    connect_reference.write_digits(spark, digits, tmp_path)
    connect_reference.classic_run(spark, tmp_path)
    address = lab.driver.address
    server = lab.start_driver([str(lab_module.SPARK_HOME / "bin" / "spark-submit"), "--class",
                               "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", lab.master_url,
                               "--conf", f"spark.driver.host={address}", "--conf", f"spark.driver.bindAddress={address}",
                               "--conf", f"spark.connect.grpc.binding.address={address}",
                               "--conf", f"spark.connect.grpc.binding.port={CONNECT_PORT}",
                               "--conf", "spark.executor.cores=1", "--conf", "spark.executor.memory=1g",
                               "--conf", "spark.ui.enabled=false"], lab.logs / "connect-server.log")
    assert lab.wait_for_port(lab.driver, CONNECT_PORT, 120), (lab.logs / "connect-server.log").read_text()[-3000:]
    with lab.carried(lab.workers) as carried:
        done = lab.run_driver([sys.executable, str(Path(__file__).with_name("lab_connect_run.py")), "--remote",
                               f"sc://{address}:{CONNECT_PORT}", "--data", str(tmp_path), "--weights",
                               str(tmp_path / "lab.pt")])
    assert done.returncode == 0, done.stderr[-5000:] + (lab.logs / "connect-server.log").read_text()[-3000:]
    assert server.poll() is None
    result = results(done.stdout)[0]
    summary = result["summary"]
    # the workers on the worker hosts reached the client's PS over their links, each pushing its gradients
    # and pulling the weights (the model's parameters, 4 bytes each, per push)
    assert [w for w in result["warnings"] if "2 of 2 workers exchanged over TCP" in w], result["warnings"]
    params = sum(p.numel() for p in connect_reference.DIGITS_MLP().parameters())
    per_worker = summary["pushes"] // 2 * params * 4
    for host in lab.workers:
        assert all(bytes_ >= per_worker for bytes_ in carried[host.name].values()), (host.name, per_worker)
    reference = json.loads((tmp_path / "reference.json").read_text())
    assert summary["updates"] == reference["updates"]
    across, classic = torch.load(tmp_path / "lab.pt"), torch.load(tmp_path / "weights.pt")
    for name, value in classic.items():
        assert torch.allclose(across[name], value, atol=1e-5), name


def test_two_replicas_of_two_pipeline_stages_on_two_hosts_equal_the_single_host_run(tmp_path):
    """Four stage tasks on two two-core worker hosts against the same run on one host (``local[4]``)."""
    settings = {"policy": "sync", "num_workers": 2, "pipeline_stages": 2, "micro_batches": 2}
    with built_lab(workers=2, rate="1gbit", cores=2) as lab:
        result, carried = run_on_lab(lab, settings, tmp_path / "lab.pt")
        reference, _ = run_on_lab(lab, settings, tmp_path / "one-host.pt", master="local[4]")
    assert sorted((w["pipeline_stage"], w["worker"]) for w in result["workers"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c["sent"] > 0 and c["received"] > 0 for c in carried.values()), carried
    assert result["summary"]["updates"] == reference["summary"]["updates"] > 0
    across, one_host = torch.load(tmp_path / "lab.pt"), torch.load(tmp_path / "one-host.pt")
    for name, value in one_host.items():
        assert torch.allclose(across[name], value, atol=1e-5), name
