"""An elastic run gains a worker mid-run: a standalone cluster starts with one executor, a second joins
(under dynamic allocation, which asks for the executors as the stage needs them)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ASYNC_ACCURACY
from .script_results import results
from .standalone import kill_leftovers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = Path(__file__).with_name("join_run.py")
DIGITS_ROWS, EPOCHS, JOIN_AFTER = 1797, 5, 50


def test_a_worker_whose_executor_arrives_mid_run_joins_and_trains_its_partition(tmp_path):
    """min_workers=1 of 2: worker 0 starts alone on the only executor; a second standalone worker is started
    after its 50th mini-batch, Spark launches worker 1's waiting task there, and it joins the running PS."""
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), "--marker-dir", str(tmp_path), "--join-after",
                               str(JOIN_AFTER), "--dynamic-allocation"], capture_output=True, text=True, timeout=600)
    finally:     # the cluster's processes live in sessions of their own: a timed-out script leaves them
        kill_leftovers(tmp_path / "logs")
    assert done.returncode == 0, done.stderr[-5000:]
    result = results(done.stdout)[0]
    summary, workers = result["summary"], {w["worker"]: w for w in result["workers"]}
    # one plain stage, nobody lost: the second task started late, not again
    assert result["attempts"] == 1 and summary["workers_lost"] == 0 and summary["rejoins"] == 0
    assert [w["barrier_stage"] for w in workers.values()] == [False, False]
    # worker 1 joined once training had begun, after worker 0's mini-batches so far (one update each)
    joined = [e for e in result["events"] if e["event"] == "joined"]
    assert summary["late_joins"] == 1 and [(e["worker"], e["version"]) for e in joined] == [(1, JOIN_AFTER)]
    # the budget grew by the joiner's partition: every row's epochs, spent exactly by the two together
    assert summary["sample_budget"] == EPOCHS * DIGITS_ROWS and joined[0]["rows"] == DIGITS_ROWS - DIGITS_ROWS // 2
    assert summary["sample_budget"] <= summary["samples_consumed"] < summary["sample_budget"] + 2 * 16
    assert summary["applied_gradients"] + summary["pushes_past_end"] == summary["pushes"]
    # both trained side by side after the join: worker 0 went on past its wait, worker 1 trained its share
    assert workers[0]["pushes"] > JOIN_AFTER + 1 and workers[1]["pushes"] > 0
    assert result["accuracy"] >= ASYNC_ACCURACY     # training accuracy of an async digits run


def test_with_work_units_a_new_executor_takes_the_next_units_and_trains_beside_the_first(tmp_path):
    """num_workers=1, max_workers=2: the digits in 8 work units, one task per unit and epoch, on a cluster of one
    one-core executor.  A second standalone worker is started as task 4 begins; task 4 holds the only slot until a
    later task has begun, which only the new executor can run, so two workers train at once."""
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), "--marker-dir", str(tmp_path), "--join-after", "4",
                               "--dynamic-allocation", "--work-units"], capture_output=True, text=True, timeout=600)
    finally:
        kill_leftovers(tmp_path / "logs")
    assert done.returncode == 0, done.stderr[-5000:]
    result = results(done.stdout)[0]
    summary, workers = result["summary"], result["workers"]
    assert result["attempts"] == 1 and summary["workers_lost"] == 0 and summary["rejoins"] == 0
    assert summary["work_units"] == 8 and summary["peak_workers"] == 2
    # every unit's every epoch trained once, one pass each, whichever executor took it
    assert sorted((w["unit_epoch"], w["unit"]) for w in workers) == [(e, u) for e in range(EPOCHS) for u in range(8)]
    assert all(w["samples"] == w["partition_rows"] for w in workers)
    assert summary["samples_consumed"] == summary["sample_budget"] == EPOCHS * DIGITS_ROWS
    assert summary["pushes_past_end"] == 0 and summary["late_joins"] == 0
    assert result["accuracy"] >= ASYNC_ACCURACY     # training accuracy of an async digits run
