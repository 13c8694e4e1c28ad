"""Checks before a barrier stage is launched: free slots, dynamic allocation, executor Python."""
from __future__ import annotations

import subprocess
import time

from pyspark import SparkContext

from ..errors import ClusterConfigError


def free_task_slots(sc: SparkContext) -> int:
    """Task slots of the default resource profile not taken by running tasks."""
    jsc = sc._jsc.sc()
    total = jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile())
    tracker = sc.statusTracker()
    running = 0
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id)
        running += info.numActiveTasks if info else 0
    return int(total) - running


def check_cluster(sc: SparkContext, num_tasks: int, wait_s: float = 60.0) -> None:
    """Refuse, with a message naming the setting to change, a cluster that cannot run the stage."""
    conf = sc.getConf()
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        raise ClusterConfigError(
            "barrier-mode training cannot run with dynamic allocation: set "
            "'spark.dynamicAllocation.enabled=false' and a fixed 'spark.executor.instances'")
    if sc.master.startswith("local["):
        wait_s = 0.0   # local mode has all its slots from the start
    deadline = time.monotonic() + wait_s
    slots = free_task_slots(sc)
    while slots < num_tasks and time.monotonic() < deadline:   # executors may still be registering
        time.sleep(0.5)
        slots = free_task_slots(sc)
    if slots < num_tasks:
        task_cpus = conf.get("spark.task.cpus", "1")
        raise ClusterConfigError(
            f"num_workers={num_tasks} needs {num_tasks} free task slots at once (a barrier stage), "
            f"but the cluster has {slots} (master {sc.master}, spark.task.cpus={task_cpus}); lower "
            "num_workers, or add executors/cores ('spark.executor.instances', 'spark.executor.cores', "
            "local[N]) or lower 'spark.task.cpus'")
    check_executor_python(sc.master, sc.pythonExec)


def check_executor_python(master: str, python: str) -> None:
    """On this machine's executors (local modes), the Python Spark starts must have sparkdl."""
    if not master.startswith("local"):
        return
    probe = ("import importlib.util, sys; "
             "sys.exit(0 if importlib.util.find_spec('sparkdl') and importlib.util.find_spec('torch') else 3)")
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise ClusterConfigError(
            f"executors run the Python interpreter {python!r}, which cannot import sparkdl and torch; set "
            "PYSPARK_PYTHON (or 'spark.pyspark.python') to the interpreter that has them, e.g. sys.executable, "
            "before the SparkContext starts (sparkdl.spark_session() does this for you)")


def ps_host(sc: SparkContext, configured: str | None = None) -> str:
    """The address the parameter server listens on and the executors connect to."""
    if configured:
        return configured
    # In local modes every executor is on this machine: keep the PS on loopback.
    if sc.master.startswith("local"):
        return "127.0.0.1"
    return sc.getConf().get("spark.driver.host", "127.0.0.1")
