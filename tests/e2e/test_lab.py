"""Training across hosts: the multi-host lab (tests/e2e/lab.py), one lab shared by the tests of a run.

Selected with ``-m lab`` (``make test-lab``); skipped with the reason where the lab cannot be built.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from . import lab_run
from .lab import Lab, namespaces

pytestmark = [pytest.mark.lab, pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("lab")]
SCRIPT = Path(__file__).with_name("lab_run.py")


@pytest.fixture(scope="module")
def lab():
    reason = Lab.missing()
    if reason:
        pytest.skip(reason)
    with Lab(workers=2, rate="1gbit") as built:
        yield built


def run_on_lab(lab: Lab, settings: dict, weights: Path) -> tuple[dict, dict[str, dict[str, int]]]:
    """One driver run on the lab: its RESULT and the bytes each worker host's link carried during it."""
    before = {host.name: lab.link_bytes(host) for host in lab.workers}
    done = lab.run_driver([sys.executable, str(SCRIPT), "--master", lab.master_url, "--driver-host",
                           lab.driver.address, "--settings", json.dumps(settings), "--weights", str(weights)])
    assert done.returncode == 0, done.stderr[-5000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    carried = {}
    for host in lab.workers:
        after = lab.link_bytes(host)
        carried[host.name] = {way: after[way] - before[host.name][way] for way in after}
    return json.loads(line[len("RESULT "):]), carried


def test_sync_across_two_hosts_goes_over_tcp_and_equals_the_single_host_run(lab, spark, tmp_path):
    result, carried = run_on_lab(lab, {"policy": "sync"}, tmp_path / "lab.pt")
    # no worker's host sees the PS's /dev/shm: each reports the socket, from the bytes that travelled
    assert [w["transport"] for w in result["workers"]] == ["tcp", "tcp"]
    # each worker ran on a host of its own: its own link carried its gradients out and the weights in
    params = sum(p.numel() for p in lab_run.digits_mlp().parameters())
    for worker in result["workers"]:
        pushed = worker["pushes"] * params * 4
        assert pushed > 0
    assert all(c["sent"] >= w["pushes"] * params * 4 and c["received"] >= w["pushes"] * params * 4
               for c, w in zip(carried.values(), sorted(result["workers"], key=lambda w: w["worker"]))), carried
    # sync is the same computation on one host: the same weights to 1e-5
    reference = lab_run.fit(spark, {"policy": "sync"})
    across = torch.load(tmp_path / "lab.pt")
    assert result["summary"]["updates"] == reference.summary["updates"] and result["attempts"] == 1
    for name, value in reference.state_dict.items():
        assert torch.allclose(across[name], value, atol=1e-5), name


def test_async_across_two_hosts_applies_every_gradient_and_learns(lab, tmp_path):
    result, carried = run_on_lab(lab, {"policy": "async", "epochs": 4}, tmp_path / "lab.pt")
    assert [w["transport"] for w in result["workers"]] == ["tcp", "tcp"]
    summary = result["summary"]
    # every gradient that crossed a link was applied once (a push after the budget ran out is counted apart)
    assert summary["pushes"] == sum(w["pushes"] for w in result["workers"])
    assert summary["applied_gradients"] + summary.get("pushes_past_end", 0) == summary["pushes"]
    assert summary["staleness_max"] >= 0 and summary["updates"] == summary["applied_gradients"]
    assert all(c["sent"] > 0 and c["received"] > 0 for c in carried.values())
    model = lab_run.digits_mlp()
    model.load_state_dict(torch.load(tmp_path / "lab.pt"))
    x, y = zip(*lab_run.digits_rows())
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(np.stack(x))).argmax(1) == torch.tensor(y)).float().mean().item()
    assert accuracy > 0.8, accuracy        # chance is 0.1; measured 0.9+ (training accuracy, 4 epochs)


def test_a_lab_leaves_no_namespace_link_or_process_behind():
    reason = Lab.missing()
    if reason:
        pytest.skip(reason)
    built = Lab(workers=1, rate="100mbit")
    built.start()
    made = [host.namespace for host in built.hosts] + [built.switch]
    started = [process.pid for host in built.hosts for process in host.processes]
    assert set(made) <= set(namespaces()) and started
    built.close()
    assert not set(made) & set(namespaces())
    alive = subprocess.run(["ps", "-o", "pid=", "-p", ",".join(map(str, started))], capture_output=True, text=True)
    assert alive.stdout.strip() == "", alive.stdout
