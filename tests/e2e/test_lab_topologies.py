"""The other topologies and policies across hosts of the multi-host lab: allreduce, executor-hosted PS
shards, pipelines, streamed (overlapped) exchange, softsync and softsync_nodes.

Run by hand (about 3 min; CI runs the short selection of ``test_lab.py``)::

    python -m pytest -q -m lab tests/e2e/test_lab_topologies.py

Each trains digits on two worker hosts over 1 Gbit/s links; those with sync semantics must equal the
same run on one host (``local[2]``) to 1e-5, with their bytes on the worker hosts' links.
"""
from __future__ import annotations

import pytest
import torch

from . import lab_run
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
