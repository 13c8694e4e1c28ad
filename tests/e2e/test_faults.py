"""A worker's Python process (or executor JVM) is SIGKILLed mid-training on local-cluster: the run goes on."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ASYNC_ACCURACY
from .script_results import results_by_run, succeeded

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = Path(__file__).with_name("fault_run.py")
# each test's run: its flags for fault_run.py (the executor kills last: a killed executor is replaced after it)
# (an undisturbed run first only where a test compares with one: sync's exact reruns)
RUNS = {"async-auto": "--policy async --data-cache auto --faulty-only", "sync-disk": "--policy sync --data-cache disk",
        "shards": "--policy sync --ps-shards 2",
        "elastic": "--policy async --elastic --kill executor --shuffled --table --faulty-only",
        "units": "--policy async --elastic --kill executor --work-units --table --faulty-only"}


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory) -> dict[str, dict]:
    """Every run of this module, one after another in one process and one cluster (a start-up each
    would take longer than most runs); by name, each its result or the error it raised."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--marker-dir", str(tmp_path_factory.mktemp("faults")),
                           *RUNS.values()], capture_output=True, text=True, timeout=900)
    by_flags = results_by_run(done, list(RUNS.values()))
    return {name: by_flags[flags] for name, flags in RUNS.items()}


# sync on disk and async in memory: each policy once, each cache once (the kill and retry are the same)
@pytest.mark.parametrize("policy, data_cache", [("async", "auto"), ("sync", "disk")])
def test_killed_worker_is_retried_and_the_run_continues(fault_runs, policy, data_cache):
    result = succeeded(fault_runs[f"{policy}-{data_cache}"])
    faulty, kill = result["faulty"], result["kill"]
    assert kill["killed_after_batches"] >= 150            # killed mid-training, not at the start
    lost = [e for e in result["events"] if e["event"] == "lost"]
    rejoined = [e for e in result["events"] if e["event"] == "rejoined"]
    assert lost and lost[0]["worker"] == 1 and lost[0]["version"] > 0
    # the retried tasks continue from the PS's version at the kill, not from 0
    assert rejoined and min(e["version"] for e in rejoined) >= lost[0]["version"] > 0
    assert faulty["attempts"] >= 2 or faulty["rejoins"] >= 1
    # the retried task rebuilt its shard (on disk when asked) and resumed after the batches already applied
    retried = [w for w in result["workers"] if w["worker"] == 1]
    assert retried and retried[0]["resumed_at_batch"] >= kill["killed_after_batches"] - 20
    if data_cache == "disk":
        assert {w["data_cache"] for w in result["workers"]} == {"disk"}
    if policy == "sync":   # exactly once: every mini-batch's gradient is applied once across the retry
        clean = result["clean"]
        assert faulty["updates"] == clean["updates"]
        assert faulty["applied_gradients"] == clean["applied_gradients"]
    else:   # the global sample budget is spent exactly, across the retry, and every accepted push applied once
        assert faulty["sample_budget"] <= faulty["samples_consumed"] < faulty["sample_budget"] + 16
        assert faulty["applied_gradients"] == faulty["updates"]
        assert faulty["applied_gradients"] + faulty["pushes_past_end"] + faulty["rejected_nonfinite"] == faulty["pushes"]
    # async accuracy moves by about 1.5 points either way with how the workers interleave, and a retry changes
    # the interleaving (clean 0.975 against faulty 0.944 in one run of three): async is held to the bound of the
    # undisturbed async runs (ASYNC_ACCURACY), sync to its clean run
    assert faulty["accuracy"] >= (result["clean"]["accuracy"] - 0.02 if policy == "sync" else ASYNC_ACCURACY)
    assert 0 < result["seconds_kill_to_rejoin"] < 60


def test_killed_task_hosting_a_ps_shard_resumes_every_shard_from_the_newest_cut(fault_runs):
    """Sync, so exact: async restarts are measured by hand (fault_run.py --marker-dir D "--policy async --ps-shards 2")."""
    result = succeeded(fault_runs["shards"])
    clean, faulty, kill = result["clean"], result["faulty"], result["kill"]
    assert kill["killed_after_batches"] >= 150
    assert clean["ps_hosts"] == faulty["ps_hosts"] == "executors" and faulty["ps_shards"] == 2
    assert any(w.get("ps_shard") == 1 and w["worker"] == 1 for w in result["workers"])
    # the stage was retried from a consistent cut past the start (snapshots every 20 updates)
    assert faulty["attempts"] >= 2 and clean["attempts"] == 1
    restarts = faulty["restarted_from_versions"]
    assert restarts and restarts[0] > 0 and restarts[0] % 20 == 0
    assert faulty["shard_versions"][0] == faulty["version"]
    # the retried workers were told the cut's data positions by the restored shards (one batch per update)
    assert [w["resumed_at_batch"] for w in result["workers"]] == [restarts[-1]] * 2
    # exact: the same updates, and the same weights as the undisturbed run
    assert faulty["updates"] == clean["updates"] and faulty["shard_versions"] == clean["shard_versions"]
    for (sum_a, norm_a), (sum_b, norm_b) in zip(result["weights"]["clean"], result["weights"]["faulty"]):
        assert abs(sum_a - sum_b) < 1e-3 and abs(norm_a - norm_b) < 1e-4
    assert faulty["accuracy"] == pytest.approx(clean["accuracy"], abs=0.005)


def test_elastic_async_reruns_only_the_task_of_a_killed_executor_jvm(fault_runs):
    """elastic=True: a plain stage, so Spark re-runs the lost task alone; the other worker never stops.
    The input sits behind a shuffle (three partitions into two), as a DataFrame's does: the re-run task
    may fail once fetching the map output the killed executor held, Spark recomputes it and runs the task
    again, and the surviving worker's task is still untouched.  The model also looks up an embedding table
    held by the PS as rows: every update stepped its rows exactly once across the kill."""
    result = succeeded(fault_runs["elastic"])
    faulty, kill, events = result["faulty"], result["kill"], result["events"]
    assert kill["killed_after_batches"] >= 150            # the executor JVM was killed mid-training
    # one stage attempt: no sparkdl retry of the stage (a barrier stage takes two, worker 0 lost and rejoined too)
    assert faulty["stage_attempts"] == 1, events
    assert {e["worker"] for e in events if e["event"] in ("lost", "rejoined")} == {1}, events
    # worker 0's task ran once, from its first batch to its last
    survivor = next(w for w in result["workers"] if w["worker"] == 0)
    assert survivor["resumed_at_batch"] == 0 and survivor["pushes"] == survivor["batches"] > 0
    # the re-run task re-read its partition and resumed at the PS's position for it, not at the start
    retried = next(w for w in result["workers"] if w["worker"] == 1)
    assert retried["resumed_at_batch"] >= kill["killed_after_batches"] - 20
    # the global sample budget is spent exactly, and every accepted push applied once
    assert faulty["sample_budget"] <= faulty["samples_consumed"] < faulty["sample_budget"] + 16
    assert faulty["applied_gradients"] + faulty["pushes_past_end"] + faulty["rejected_nonfinite"] == faulty["pushes"]
    # the table: one row update per accepted push (the killed worker's last rows and the pushes past the end
    # applied none), rows actually trained, and the final checkpoint holds the run's result
    table = faulty["table"]
    assert table["row_updates"] == table["checkpoint_updates"] == faulty["updates"] == faulty["applied_gradients"]
    assert table["rows_moved"] > 50 and table["equals_result"], table
    assert faulty["accuracy"] >= ASYNC_ACCURACY      # the bound of undisturbed async runs


def test_work_units_rerun_only_the_pass_of_a_killed_executor_jvm(fault_runs):
    """max_workers=2: the input in 8 work units, one task per unit and epoch.  The executor of epoch 3's unit 5
    is killed 5 mini-batches into its pass: Spark re-runs that task alone, which resumes at the PS's position
    for it, while every other unit's pass runs once; the budget is spent exactly, with no push past it."""
    result = succeeded(fault_runs["units"])
    faulty, kill, events = result["faulty"], result["kill"], result["events"]
    units, epochs, victim = 8, 10, 3 * 8 + 5
    assert faulty["work_units"] == units and faulty["stage_attempts"] == 1, events
    assert [(e["event"], e["worker"]) for e in events if e["event"] in ("lost", "rejoined")] == [
        ("lost", victim), ("rejoined", victim)]
    # one summary per unit and epoch: the killed task's attempt returned none, its re-run did
    assert sorted(w["worker"] for w in result["workers"]) == list(range(epochs * units))
    assert all(w["samples"] == w["partition_rows"] for w in result["workers"] if w["worker"] != victim)
    retried = next(w for w in result["workers"] if w["worker"] == victim)
    assert (retried["unit_epoch"], retried["unit"]) == (3, 5)
    assert kill["killed_after_batches"] - 1 <= retried["resumed_at_batch"] < retried["steps_per_epoch"]
    assert retried["resumed_at_batch"] + retried["batches"] == retried["steps_per_epoch"]
    # each unit's pass is finite: the budget (every epoch of every unit) is spent exactly, nothing past it
    assert faulty["samples_consumed"] == faulty["sample_budget"] == epochs * sum(
        w["partition_rows"] for w in result["workers"] if w["unit_epoch"] == 0)
    assert faulty["pushes_past_end"] == 0 and faulty["applied_gradients"] == faulty["pushes"]
    table = faulty["table"]
    assert table["row_updates"] == table["checkpoint_updates"] == faulty["updates"] == faulty["applied_gradients"]
    assert table["equals_result"], table
    assert faulty["accuracy"] >= ASYNC_ACCURACY      # the bound of undisturbed async runs


def test_a_work_unit_reads_its_rows_in_one_order_in_every_epoch(fault_runs):
    """A shuffle's output arrives in another order at each read (remote blocks as they come); each unit's rows are
    numbered before it and sorted after it, so a re-run task resumes on the rows it left and every epoch holds
    out the same rows for validation.  Without the sort, 19 of 40 later DataFrame reads of a 6-epoch run came in
    another order."""
    reads = succeeded(fault_runs["units"])["unit_reads"]
    for kind in ("rdd", "dataframe"):
        assert reads[kind]["same_rows"] == reads[kind]["same_order"] == reads[kind]["of"] == 9 * 8, (kind, reads)
