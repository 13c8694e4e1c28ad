"""Checks before a barrier stage is launched (free slots, dynamic allocation, executor Python), and
where the parameter server listens.

A classic session asks the JVM (``sc._jsc``) for its free slots and runs the executors' Python
itself (local modes); under Spark Connect the same questions go through ``spark.conf`` and one
tiny probe job on an executor.
"""
from __future__ import annotations

import logging
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pyspark import SparkContext

from sparkdl._internal.spark.backend import ClassicBackend, ConnectBackend, SparkBackend
from sparkdl.errors import ClusterConfigError

log = logging.getLogger(__name__)

_PYTHON_ADVICE = ("set PYSPARK_PYTHON (or 'spark.pyspark.python') to the interpreter that has them, e.g. "
                  "sys.executable, before the {what} starts ({helper} does this for you)")


def task_slots(sc: SparkContext) -> int:
    """Task slots of the default resource profile on the executors alive now (what a barrier stage needs)."""
    jsc = sc._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))


def free_task_slots(sc: SparkContext) -> int:
    """Task slots of the default resource profile not taken by running tasks."""
    total = task_slots(sc)
    tracker = sc.statusTracker()
    running = 0
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id)
        running += info.numActiveTasks if info else 0
    return int(total) - running


def too_few_slots_error(num_tasks: int, slots: int | None, master: str, task_cpus: str,
                        starters: bool = False) -> ClusterConfigError:
    """The error for a cluster that cannot run ``num_tasks`` barrier tasks at once (``slots``: None if unknown);
    ``starters``: the ``min_workers`` tasks an elastic run needs at its start."""
    has = "fewer" if slots is None else str(slots)
    setting, why = ("min_workers", "to start an elastic run") if starters else ("num_workers", "at once")
    return ClusterConfigError(
        f"{setting}={num_tasks} needs {num_tasks} free task slots {why}, "
        f"but the cluster has {has} (master {master}, spark.task.cpus={task_cpus}); lower "
        f"{setting}, or add executors/cores ('spark.executor.instances', 'spark.executor.cores', "
        "local[N]) or lower 'spark.task.cpus'")


def dynamic_allocation(backend: SparkBackend) -> bool:
    """Whether the session adds and removes executors as its stages need them."""
    return (backend.conf("spark.dynamicAllocation.enabled", "false") or "false").lower() == "true"


def check_elastic_cluster(backend: SparkBackend) -> None:
    """Refuse speculative execution for an elastic run: Spark never speculates barrier tasks, but in a plain
    stage a speculative copy of a slow worker's task would take over its parameter-server slot."""
    if (backend.conf("spark.speculation", "false") or "false").lower() == "true":
        raise ClusterConfigError(
            "an elastic run cannot use speculative execution: a speculative copy of a slow worker's task would "
            "take over that worker's parameter-server slot and restart it; set 'spark.speculation=false' (or "
            "elastic=False)")


def check_cluster(backend: SparkBackend, num_tasks: int, wait_s: float = 60.0, elastic: bool = False,
                  starters: bool = False) -> None:
    """Refuse, with a message naming the setting to change, a cluster that cannot run the stage.

    ``elastic``: the plain stage of an elastic run, which may run under dynamic allocation; its slots are
    then not counted here, since Spark asks for executors only for the pending tasks of a submitted stage.
    ``starters``: ``num_tasks`` is ``min_workers``, the tasks the run starts with (the others take their
    slots as they come).
    """
    dynamic = dynamic_allocation(backend)
    if dynamic and not elastic:
        raise ClusterConfigError(
            "training cannot run with dynamic allocation unless it is elastic: a barrier stage needs every "
            "worker's task slot from its start.  Set elastic=True (policy 'async', 'softsync' or "
            "'softsync_nodes'; add min_workers to start before every executor has arrived), or "
            "'spark.dynamicAllocation.enabled=false' and a fixed 'spark.executor.instances'")
    if isinstance(backend, ConnectBackend):
        _check_connect_cluster(backend, 0 if dynamic else num_tasks, starters)
        return
    assert isinstance(backend, ClassicBackend)
    if not dynamic:
        slots = wait_for_slots(backend, num_tasks, wait_s)   # executors may still be registering
        if slots < num_tasks:
            raise too_few_slots_error(num_tasks, slots, backend.master, backend.conf("spark.task.cpus", "1") or "1",
                                      starters)
    check_executor_python(backend.master, backend.sc.pythonExec)


def wait_for_slots(backend: ClassicBackend, num_tasks: int, wait_s: float,
                        count: Callable[[SparkContext], int] = free_task_slots) -> int:
    """The slots ``count`` sees (free ones by default) once there are ``num_tasks``, or after ``wait_s``
    (local mode: at once).

    Spark itself, short of slots for a barrier stage, retries its check for minutes: waiting here
    turns that into a bounded wait and a clear error.
    """
    sc = backend.sc
    deadline = time.monotonic() + (0.0 if sc.master.startswith("local[") else wait_s)
    slots = count(sc)
    while slots < num_tasks and time.monotonic() < deadline:
        time.sleep(0.5)
        slots = count(sc)
    return slots


#: interpreters already found to import sparkdl and torch (the check starts a process: once per fit adds up)
_PYTHONS_WITH_SPARKDL: set[str] = set()


def check_executor_python(master: str, python: str) -> None:
    """On this machine's executors (local modes), the Python Spark starts must have sparkdl."""
    if not master.startswith("local") or python in _PYTHONS_WITH_SPARKDL:
        return
    probe = ("import importlib.util, sys; "
             "sys.exit(0 if importlib.util.find_spec('sparkdl') and importlib.util.find_spec('torch') else 3)")
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise _python_error(python, connect=False)
    _PYTHONS_WITH_SPARKDL.add(python)    # a found install stays; a missing one is looked for again


def _python_error(python: str, connect: bool) -> ClusterConfigError:
    advice = _PYTHON_ADVICE.format(
        what="Spark Connect server" if connect else "SparkContext",
        helper="sparkdl.spark_session(remote='local[N]')" if connect else "sparkdl.spark_session()")
    return ClusterConfigError(
        f"executors run the Python interpreter {python!r}, which cannot import sparkdl and torch; {advice}")


# ---------------------------------------------------------------------------------- Spark Connect
# The probe is compiled into a module of its own that executors cannot import, so cloudpickle
# ships it by value: it runs (and names the interpreter) even where sparkdl is missing.
_PROBE_SOURCE = '''
def probe(batches):
    import importlib.util, os, sys
    import pyarrow as pa
    for _ in batches:   # read to the end (sparkdl._internal.spark.task.read_to_the_end, which this code cannot import)
        pass
    missing = [name for name in ("sparkdl", "torch") if importlib.util.find_spec(name) is None]
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    yield pa.RecordBatch.from_pydict({"python": [sys.executable], "missing": [",".join(missing)],
                                      "cpus": [cpus]})
'''


@dataclass(frozen=True)
class ExecutorProbe:
    """What one executor's Python worker reported."""

    python: str
    missing: tuple[str, ...]   # of sparkdl, torch
    cpus: int


def executor_probe_function() -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The probe's mapInArrow body, in a module of its own that executors cannot import."""
    namespace: dict[str, Any] = {"__name__": "sparkdl_executor_probe"}
    exec(compile(_PROBE_SOURCE, "<sparkdl executor probe>", "exec"), namespace)
    return namespace["probe"]


def probe_executor(spark: Any) -> ExecutorProbe:
    """Run one tiny task on an executor: its Python interpreter, whether it has sparkdl and torch, its cores."""
    try:
        row = (spark.range(0, 1, 1, 1)
               .mapInArrow(executor_probe_function(), "python string, missing string, cpus long").collect()[0])
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [repr(exc)])[0]
        raise ClusterConfigError(
            f"a one-row probe task on the executors failed ({first}); if the executors cannot start Python, "
            + _PYTHON_ADVICE.format(what="Spark Connect server", helper="sparkdl.spark_session(remote='local[N]')")
        ) from exc
    return ExecutorProbe(row.python, tuple(filter(None, row.missing.split(","))), int(row.cpus))


def connect_slots(backend: SparkBackend, executor_cpus: int | None = None) -> int | None:
    """Task slots the master's settings promise (None when the settings do not say)."""
    master = backend.master.strip()
    task_cpus = max(1, int(backend.conf("spark.task.cpus", "1") or "1"))
    local = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\s*\d+)?\])?", master)
    cluster = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if local:
        cores = local.group(1)
        if cores is None:
            total: int | None = 1
        elif cores == "*":
            total = executor_cpus   # local[*]: the server machine's cores, as its Python worker sees them
        else:
            total = int(cores)
    elif cluster:
        total = int(cluster.group(1)) * int(cluster.group(2))
    else:
        instances, cores = backend.conf("spark.executor.instances"), backend.conf("spark.executor.cores")
        total = int(instances) * int(cores) if instances and cores else None
    return None if total is None else total // task_cpus


def _check_connect_cluster(backend: ConnectBackend, num_tasks: int, starters: bool = False) -> None:
    """Slots from the settings, the executors' Python from a probe task.

    Where the settings do not tell the slots (a cluster master without a fixed executor count),
    Spark's own barrier check stands: its error, and the watchdog's timeout, become a
    :class:`ClusterConfigError` in the stage runner.
    """
    probe = probe_executor(backend.spark)
    if probe.missing:
        raise _python_error(probe.python, connect=True)
    slots = connect_slots(backend, probe.cpus)
    if slots is not None and slots < num_tasks:
        raise too_few_slots_error(num_tasks, slots, backend.master, backend.conf("spark.task.cpus", "1") or "1",
                                  starters)


# ------------------------------------------------------------------------- parameter server address
def ps_host(backend: SparkBackend, configured: str | None = None) -> str:
    """The address the executors connect to for the parameter server.

    ``configured`` (``ps_host``) wins.  Classic: 127.0.0.1 under a local master, else
    ``spark.driver.host``.  Spark Connect (the PS runs in the client, not in Spark's driver):
    127.0.0.1 when the master is local and the Connect server runs on this machine; the
    server's ``spark.driver.host`` when the server runs on this machine and drives a cluster;
    otherwise this machine's address on the route to the Connect server.
    """
    if configured:
        return configured
    master = backend.master
    if not isinstance(backend, ConnectBackend):
        # In local modes every executor is on this machine: keep the PS on loopback.
        if master.startswith("local"):
            return "127.0.0.1"
        return backend.conf("spark.driver.host", "127.0.0.1") or "127.0.0.1"
    server = connect_server_host(backend.spark)
    if is_this_machine(server):
        if master.startswith("local"):
            return "127.0.0.1"
        return backend.conf("spark.driver.host") or outward_address(server)
    return outward_address(server)


def connect_server_host(spark: Any) -> str:
    """The host name of the Spark Connect server a session talks to."""
    host = str(spark.client.host or "localhost")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_this_machine(host: str) -> bool:
    """True when ``host`` names this machine (loopback, or an address of one of its interfaces)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return any(_bindable(family, address) for family, _, _, _, address in infos)


def outward_address(peer: str) -> str:
    """This machine's address on the route to ``peer`` (a UDP socket is 'connected'; nothing is sent)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as exc:
        raise ClusterConfigError(
            f"cannot find this machine's address towards the Spark Connect server {peer!r} ({exc}); set "
            "ps_host (Param psHost) to an address of this machine that the executors can reach") from exc


def bind_address(advertised: str) -> str:
    """The local address the parameter server listens on, for workers that connect to ``advertised``.

    An address of this machine is bound as it is.  Any other (a NAT or port-forwarding address,
    a load balancer, or a mistake) is reached through every interface: the PS listens on the
    wildcard address, still behind its per-run HMAC handshake.
    """
    try:
        infos = socket.getaddrinfo(advertised, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        infos = []
    if any(_bindable(family, address) for family, _, _, _, address in infos):
        return advertised
    wildcard = "::" if infos and all(family == socket.AF_INET6 for family, *_ in infos) else "0.0.0.0"
    log.info("sparkdl: ps_host %r is not an address of this machine; the parameter server listens on %s and "
             "the executors connect to %r", advertised, wildcard, advertised)
    return wildcard


def _bindable(family: int, address: tuple) -> bool:
    """True when this machine owns ``address`` (only such an address can be bound)."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address[0], 0))
            return True
        except OSError:
            return False


def _size_bytes(text: str) -> int:
    """A Spark size such as ``512m`` or ``2g`` (a bare number is MiB, as Spark reads these settings) in bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", text.lower())
    if not match:
        raise ClusterConfigError(f"cannot read the memory size {text!r}")
    return int(match.group(1)) << {"k": 10, "": 20, "m": 20, "g": 30, "t": 40}[match.group(2)]


def task_memory_limit(backend: SparkBackend) -> int | None:
    """Bytes one task's Python worker may use under ``spark.executor.pyspark.memory`` (None: not set).

    Spark gives each Python worker an equal part of the executor's setting: it divides by
    ``spark.executor.cores`` (1 unless set), whatever ``spark.task.cpus`` is.
    """
    setting = backend.conf("spark.executor.pyspark.memory", None)
    if not setting:
        return None
    cores = int(backend.conf("spark.executor.cores", "1") or "1")
    return _size_bytes(setting) // max(1, cores)


#: bytes per trained parameter in a task: its weights and its gradient (float32)
TASK_BYTES_PER_PARAMETER = 8


def check_task_memory(pipeline_stage_parameters: list[int], limit_bytes: int | None, pipeline_stages: int) -> None:
    """Refuse a run whose largest pipeline stage (or whole model) cannot fit a task's Python memory limit.

    The limit is ``spark.executor.pyspark.memory`` over the executor's task slots.  A task holds
    its weights and gradient (8 bytes per parameter) plus activations; the parameter server, not
    the task, holds the optimizer state.
    """
    if limit_bytes is None:
        return
    needed = TASK_BYTES_PER_PARAMETER * max(pipeline_stage_parameters)
    if needed > limit_bytes:
        total, largest = sum(pipeline_stage_parameters), max(pipeline_stage_parameters)
        fits = -(-TASK_BYTES_PER_PARAMETER * total // limit_bytes)
        raise ClusterConfigError(
            f"the largest {'pipeline stage' if pipeline_stages > 1 else 'model'} has {largest:,} parameters: "
            f"its weights and gradient alone take {needed / 2**20:.0f} MiB in a task, more than the "
            f"{limit_bytes / 2**20:.0f} MiB each task's Python worker may use (spark.executor.pyspark.memory "
            f"over the executor's task slots). Cut the model into more stages (pipeline_stages >= {fits + 1}, "
            "Param pipelineStages), shard it over the workers (policy='fsdp'), or give the Python workers more memory")


#: bytes per parameter of a block a fully sharded worker gathers: its float32 weights and gradient, and the
#: next block's weights, which FSDP prefetches while this one computes
GATHERED_BYTES_PER_PARAMETER = 12


def check_fsdp_task_memory(parameters: int, largest_block: int, workers: int, optimizer_state_bytes: int,
                              limit_bytes: int | None) -> None:
    """Refuse an fsdp run whose workers cannot hold their shards and the blocks they gather.

    A worker holds 1/N of the weights, gradient and optimizer state (``8 + optimizer_state_bytes`` per
    parameter) and, while a block computes, :data:`GATHERED_BYTES_PER_PARAMETER` per parameter of the largest
    block.  Activations are not counted.
    """
    if limit_bytes is None:
        return
    per_parameter = TASK_BYTES_PER_PARAMETER + optimizer_state_bytes
    share = -(-parameters // workers)
    held, gathered = per_parameter * share, GATHERED_BYTES_PER_PARAMETER * largest_block
    if held + gathered <= limit_bytes:
        return
    room = limit_bytes - gathered
    remedies = [f"train on more workers (num_workers >= {-(-per_parameter * parameters // room)})"] if room > 0 else []
    remedies += ["shard the model in smaller blocks (shard_blocks, Param shardBlocks)",
                 "give the Python workers more memory"]
    advice = ", ".join(remedies[:-1]) + ", or " + remedies[-1]
    raise ClusterConfigError(
        f"each of the {workers} fsdp workers needs {(held + gathered) / 2**20:.1f} MiB before activations: its "
        f"{share:,} parameters' weights, gradient and optimizer state ({held / 2**20:.1f} MiB) and the largest "
        f"block's {largest_block:,} parameters gathered in full ({gathered / 2**20:.1f} MiB), more than the "
        f"{limit_bytes / 2**20:.1f} MiB each task's Python worker may use (spark.executor.pyspark.memory over the "
        f"executor's task slots). {advice[0].upper()}{advice[1:]}")


#: the task results a driver's JVM heap held, at most, as a share of it: with a 1 GiB heap, results of
#: 196 MB (a 37M-parameter allreduce) came through, 274 MB (51M) ran it out of memory, after which
#: Spark's job never ends (the result-getter thread dies)
RESULTS_SHARE_OF_DRIVER_HEAP = 1 / 5


def check_results_fit_driver(result_bytes: int, heap_bytes: int | None, what: str, instead: str) -> None:
    """Refuse a run whose tasks' results (``result_bytes``, through the driver's JVM) its heap cannot hold."""
    if heap_bytes is None or result_bytes <= heap_bytes * RESULTS_SHARE_OF_DRIVER_HEAP:
        return
    needed = -(-int(result_bytes / RESULTS_SHARE_OF_DRIVER_HEAP) // 2**30)
    raise ClusterConfigError(
        f"{what} come back as task results, {result_bytes / 1e6:.0f} MB through the driver's JVM, whose heap "
        f"({heap_bytes / 2**30:.1f} GiB) cannot hold them with Spark's copies: the run would end in an "
        f"OutOfMemoryError on the driver and never finish. Start the application with spark.driver.memory "
        f"of at least {needed}g (set before the driver starts: spark-submit --driver-memory, or the session "
        f"builder's config in a new process), or {instead}")
