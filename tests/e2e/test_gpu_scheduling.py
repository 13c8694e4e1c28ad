"""Spark's GPU scheduling with fake GPUs: every task sees its own address and maps it correctly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparkdl._internal.spark.devices import cuda_index, select_device

from .script_results import results

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_fake_gpus_are_assigned_one_per_task_and_mapped(tmp_path):
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_tasks.py")), str(tmp_path / "gpus.sh")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    result = results(done.stdout)[0]
    tasks = sorted(result["tasks"], key=lambda t: t["partition"])
    assert [len(t["addresses"]) for t in tasks] == [1, 1]
    assert sorted(t["addresses"][0] for t in tasks) == ["0", "1"]          # distinct per task
    for task in tasks:
        address = task["addresses"][0]
        assert task["ordinal"] == int(address)
        assert task["ordinal_with_visible_devices"] == ["7", "1", "0"].index(address)
    # the training tasks do try the assigned GPU: on this CPU-only torch that is a clear error
    assert "assigned GPU(s)" in result["train_error"] and "torch sees no CUDA device" in result["train_error"]


@pytest.mark.parametrize("address, visible, expected", [
    ("0", None, 0), ("3", None, 3), ("3", "2,3", 1), ("5", "5", 0), ("1", "GPU-a, 1", 1),
])
def test_address_to_ordinal(address, visible, expected):
    assert cuda_index(address, visible) == expected


def test_hidden_address_is_an_error():
    with pytest.raises(ValueError, match="hides it"):
        cuda_index("4", "0,1")


def test_cpu_when_nothing_is_assigned():
    assert select_device("auto", []).type == "cpu"
    assert select_device("cpu", ["0"]).type == "cpu"
