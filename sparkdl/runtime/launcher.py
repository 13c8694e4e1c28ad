"""Driver side of a training run: checks, parameter server, broadcast, barrier stage, errors."""
from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import re
import secrets
import ssl
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from pyspark import RDD, SparkContext
from pyspark import cloudpickle
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from torch import nn

from ..config import TrainConfig
from ..errors import ClusterConfigError, ParameterServerError, SparkDLError, WorkerError
from ..ps.checkpoint import load_latest_checkpoint
from ..ps.flat import flatten_buffers, flatten_parameters, load_flat_buffers, load_flat_parameters
from ..ps.server import GRADIENT_COLUMNS, UPDATE_COLUMNS, ParameterServer
from .allreduce import make_allreduce_task
from .columns import ColumnSpec, arrow_to_arrays
from .data import rows_to_arrays
from .progress import TrainingProgress
from .result import TrainResult, history_frames
from .worker import JobSpec, arrow_output, make_barrier_task

log = logging.getLogger(__name__)


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


def check_cluster(sc: SparkContext, num_workers: int, wait_s: float = 60.0) -> None:
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
    while slots < num_workers and time.monotonic() < deadline:   # executors may still be registering
        time.sleep(0.5)
        slots = free_task_slots(sc)
    if slots < num_workers:
        task_cpus = conf.get("spark.task.cpus", "1")
        raise ClusterConfigError(
            f"num_workers={num_workers} needs {num_workers} free task slots at once (a barrier stage), "
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


def _ps_host(sc: SparkContext) -> str:
    # In local modes every executor is on this machine: keep the PS on loopback.
    if sc.master.startswith("local"):
        return "127.0.0.1"
    return sc.getConf().get("spark.driver.host", "127.0.0.1")


def _worker_traceback(text: str) -> str:
    """The Python traceback inside a Py4J/Spark error message, if there is one."""
    start = text.find("Traceback (most recent call last)")
    if start < 0:
        return ""
    end = min((i for i in (text.find("\n\tat ", start), text.find(" SQLSTATE", start)) if i > 0),
              default=len(text))
    return text[start:end].strip()


def _stage_failure(exc: BaseException, ps: ParameterServer | None) -> SparkDLError:
    """Turn a failed barrier stage into the most informative sparkdl error."""
    if ps is not None and ps.worker_failures:
        worker, trace = sorted(ps.worker_failures.items())[0]
        last = trace.strip().splitlines()[-1] if trace.strip() else "unknown error"
        return WorkerError(f"training worker {worker} failed: {last}", worker, trace)
    if ps is not None and isinstance(ps.failure, SparkDLError):
        return ps.failure
    text = str(exc)
    if re.search(r"No module named '(sparkdl|torch)'", text):
        return ClusterConfigError(
            "executors cannot import sparkdl or torch: ship the environment to the cluster "
            "(spark-submit --archives venv.tar.gz#env with PYSPARK_PYTHON=./env/bin/python) or install it "
            "on every node, and point PYSPARK_PYTHON at it")
    trace = _worker_traceback(text)
    if trace:
        return WorkerError(f"the training stage failed: {trace.splitlines()[-1]}", None, trace)
    java = re.search(r"^: ([\w.$]+): (.*)$", text, re.MULTILINE)   # the JVM-side cause
    cause = f"{java.group(1).rsplit('.', 1)[-1]}: {java.group(2)}" if java else (text.strip() or repr(exc))
    return SparkDLError(f"the training stage failed: {cause}")


def _order_preserving_shuffle(data: RDD) -> RDD:
    """The same partitions (rows and order) behind a shuffle boundary.

    Barrier stages refuse lineages such as ``union`` or ``coalesce`` whose ancestors have other
    partition counts; a shuffle that sends partition i to partition i cuts the lineage without
    moving a row to another worker.
    """
    count = data.getNumPartitions()
    keyed = data.mapPartitionsWithIndex(lambda index, rows: ((index, row) for row in rows))
    return keyed.partitionBy(count, lambda index: index).values()


def _run_barrier_stage(shards: RDD, task: Callable) -> list[dict[str, Any]]:
    try:
        return shards.barrier().mapPartitions(task).collect()
    except Exception as exc:
        if "BarrierJobUnsupportedRDDChainException" not in str(exc):
            raise
    log.info("sparkdl: the input lineage cannot run in a barrier stage as is; adding a shuffle boundary")
    return _order_preserving_shuffle(shards).barrier().mapPartitions(task).collect()


def _watch(ps: ParameterServer, sc: SparkContext, group: str, timeout_s: float, stop: threading.Event) -> None:
    """Cancel the stage when the PS fails or no worker shows up, so the driver never waits forever."""
    started = time.monotonic()
    while not stop.wait(0.2):
        if ps.failure is None and not ps.workers_seen and time.monotonic() - started > timeout_s:
            ps.fail(ParameterServerError(
                f"no training task reached the parameter server within {timeout_s:.0f} s; the barrier stage "
                "could not start (not enough free slots?) or executors cannot connect to the driver"))
        if ps.failure is not None:
            sc.cancelJobGroup(group)
            return


def _run_attempts(sc: SparkContext, ps: ParameterServer, config: TrainConfig, group: str,
                  run_stage: Callable, to_arrays: Callable, attempts: list[dict[str, Any]],
                  make_spec: Callable[[int], JobSpec]) -> list[dict[str, Any]]:
    """Run the barrier stage until it succeeds or ``max_attempts`` are used; retries resume."""
    for attempt in range(config.max_attempts):
        outcome = _run_attempt(sc, ps, make_spec(attempt), group, run_stage, to_arrays)
        attempts.append({"attempt": attempt, "version_at_end": ps.version,
                         "error": None if isinstance(outcome, list) else str(outcome).splitlines()[0]})
        if isinstance(outcome, list):
            return outcome
        if ps.failure is not None or attempt + 1 == config.max_attempts:
            raise _after_attempts(outcome, attempt + 1)
        log.warning("sparkdl: training stage attempt %d failed (%s); retrying from PS version %d",
                    attempt + 1, str(outcome).splitlines()[0], ps.version)
    raise AssertionError("unreachable: max_attempts >= 1")


def _after_attempts(error: SparkDLError, attempts: int) -> SparkDLError:
    """The same error, its message saying how many stage attempts were made."""
    if attempts == 1:
        return error
    message = f"{error.args[0]} (failed in all {attempts} stage attempts)"
    if isinstance(error, WorkerError):
        return WorkerError(message, error.worker_id, error.worker_traceback)
    return type(error)(message)


def _server_tls(config: TrainConfig) -> ssl.SSLContext | None:
    if not config.tls_cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


def _run_attempt(sc: SparkContext, ps: ParameterServer, spec: JobSpec, group: str,
                 run_stage: Callable[[Callable], list[dict[str, Any]]],
                 to_arrays: Callable) -> list[dict[str, Any]] | SparkDLError:
    """One barrier stage; its worker summaries, or the error that ended it."""
    broadcast = sc.broadcast(cloudpickle.dumps(spec))
    ps.worker_failures.clear()   # tracebacks of an earlier attempt stay in ps.events
    sc.setJobGroup(group, f"sparkdl train: policy={spec.config.policy}, workers={spec.config.num_workers}"
                   + (f" (attempt {spec.attempt + 1})" if spec.attempt else ""), interruptOnCancel=True)
    stop_watch = threading.Event()
    watcher = threading.Thread(target=_watch, args=(ps, sc, group, spec.config.timeout_s, stop_watch),
                               name="sparkdl-watchdog", daemon=True)
    watcher.start()
    try:
        return run_stage(make_barrier_task(broadcast, to_arrays))
    except Exception as exc:
        return _stage_failure(exc, ps)
    finally:
        stop_watch.set()
        watcher.join()
        broadcast.destroy()


def train(data: RDD, model_fn: Callable[[], nn.Module], config: TrainConfig | None = None,
          **overrides: Any) -> TrainResult:
    """Train ``model_fn()`` on an RDD of ``(features, label)`` pairs with a parameter server.

    The RDD is split into ``num_workers`` partitions (kept as is when it already has that
    many); each partition is one worker's shard in a barrier stage.  Keyword arguments
    override fields of ``config``.
    """
    config = _resolve_config(config, overrides)
    shards = data if data.getNumPartitions() == config.num_workers else data.repartition(config.num_workers)

    def run_stage(task: Callable) -> list[dict[str, Any]]:
        return _run_barrier_stage(shards, task)

    return _train(data.context, model_fn, config, run_stage, rows_to_arrays)


def train_dataframe(df: DataFrame, model_fn: Callable[[], nn.Module], config: TrainConfig,
                    columns: ColumnSpec) -> TrainResult:
    """Train on a DataFrame: Arrow batches feed the workers through ``mapInArrow(barrier=True)``.

    Only the feature and label columns are shuffled into ``num_workers`` partitions.
    Validate the columns first (``columns.validate_dataframe``).
    """
    shards = df.select(*[F.col(f"`{c}`") for c in columns.columns]).repartition(config.num_workers)

    def run_stage(task: Callable) -> list[dict[str, Any]]:
        out = shards.mapInArrow(arrow_output(task), "summary string", barrier=True)
        return [json.loads(row.summary) for row in out.collect()]

    return _train(df.sparkSession.sparkContext, model_fn, config, run_stage,
                  functools.partial(arrow_to_arrays, spec=columns))


def _train_allreduce(sc: SparkContext, model_fn: Callable[[], nn.Module], config: TrainConfig,
                     run_stage: Callable, to_arrays: Callable, template: nn.Module, initial: torch.Tensor,
                     started: float) -> TrainResult:
    """``policy="allreduce"``: no parameter server; workers average gradients with torch.distributed.

    A failed attempt restarts from the initial weights (there is no PS state to resume from).
    """
    group = f"sparkdl-train-{uuid.uuid4().hex[:8]}"
    attempts: list[dict[str, Any]] = []
    stage_started = time.perf_counter()
    for attempt in range(config.max_attempts):
        spec = JobSpec(config, model_fn, initial.numpy(), "", 0, b"", attempt)
        broadcast = sc.broadcast(cloudpickle.dumps(spec))
        sc.setJobGroup(group, f"sparkdl train: policy=allreduce, workers={config.num_workers}", interruptOnCancel=True)
        try:
            workers = run_stage(make_allreduce_task(broadcast, to_arrays))
            attempts.append({"attempt": attempt, "error": None})
            break
        except Exception as exc:
            error = _stage_failure(exc, None)
            attempts.append({"attempt": attempt, "error": str(error).splitlines()[0]})
            if attempt + 1 == config.max_attempts:
                raise _after_attempts(error, attempt + 1) from None
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
            sc.setLocalProperty("spark.job.description", None)
            broadcast.destroy()
    stage_seconds = time.perf_counter() - stage_started
    workers = sorted(workers, key=lambda w: w["worker"])
    lead = workers[0]
    weights = np.frombuffer(base64.b64decode(lead.pop("weights")), dtype=np.float32)
    load_flat_parameters(template, torch.from_numpy(weights.copy()))
    buffers = np.frombuffer(base64.b64decode(lead.pop("buffers")), dtype=np.float32)
    if buffers.size:
        load_flat_buffers(template, torch.from_numpy(buffers.copy()))
    rows = [tuple(r) for r in lead.pop("history_rows")]
    history, epochs, gradients = history_frames(rows, UPDATE_COLUMNS, [], GRADIENT_COLUMNS)
    summary = _run_summary(config, workers, history, gradients, attempts, started, stage_seconds,
                           updates=len(rows), version=len(rows), pushes=sum(w["pushes"] for w in workers),
                           applied_gradients=len(rows) * config.num_workers, dropped_stale=0,
                           rejected_nonfinite=0, checkpoints_written=0, workers_lost=0, rejoins=0,
                           resumed_from_version=None)
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    return TrainResult(state, history, epochs, gradients, workers, summary, attempts=attempts)


def _run_summary(config: TrainConfig, workers: list[dict[str, Any]], history: Any, gradients: Any,
                 attempts: list[dict[str, Any]], started: float, stage_seconds: float,
                 **counts: Any) -> dict[str, Any]:
    """The headline figures of a run: those every mode has, plus its own ``counts``."""
    samples = sum(w["samples"] for w in workers)
    loop_seconds = max((w["compute_seconds"] + w["communication_seconds"] for w in workers), default=0.0)
    return {
        "policy": config.policy, "num_workers": config.num_workers, "epochs": config.epochs,
        "batch_size": config.batch_size, **counts,
        "samples": samples, "train_seconds": time.perf_counter() - started, "stage_seconds": stage_seconds,
        "loop_seconds": loop_seconds, "samples_per_second": samples / loop_seconds if loop_seconds else 0.0,
        "staleness_mean": float(gradients["staleness"].mean()) if len(gradients) else 0.0,
        "staleness_max": int(gradients["staleness"].max()) if len(gradients) else 0,
        "bytes_pushed": sum(w["bytes_pushed"] for w in workers),
        "bytes_pulled": sum(w["bytes_pulled"] for w in workers),
        "attempts": len(attempts),
        "final_loss": float(history["loss"].iloc[-1]) if len(history) else float("nan"),
    }


def _resolve_config(config: TrainConfig | None, overrides: dict[str, Any]) -> TrainConfig:
    config = config or TrainConfig()
    return config.replace(**overrides) if overrides else config


def _train(sc: SparkContext, model_fn: Callable[[], nn.Module], config: TrainConfig,
           run_stage: Callable[[Callable], list[dict[str, Any]]], to_arrays: Callable) -> TrainResult:
    """Everything around the barrier stage: checks, PS, broadcast, failures, the result."""
    if not callable(model_fn):
        raise ValueError("model_fn must be a zero-argument callable returning a torch.nn.Module")
    started = time.perf_counter()
    check_cluster(sc, config.num_workers, wait_s=min(config.timeout_s, 60.0))

    torch.manual_seed(config.seed)
    template = model_fn()
    if not isinstance(template, nn.Module):
        raise ValueError(f"model_fn must return a torch.nn.Module, got {type(template).__name__}")
    initial = flatten_parameters(template)
    buffer_count = flatten_buffers(template).numel()
    if config.policy == "allreduce":
        return _train_allreduce(sc, model_fn, config, run_stage, to_arrays, template, initial, started)

    secret = secrets.token_bytes(32)
    ps = ParameterServer(config, initial, secret, host=_ps_host(sc), port=config.ps_port,
                         buffer_count=buffer_count, tls=_server_tls(config))
    if config.resume_from:
        checkpoint = load_latest_checkpoint(config.resume_from)
        if checkpoint is None:
            raise SparkDLError(f"resume_from={config.resume_from!r} holds no complete checkpoint (ckpt-*.pt)")
        ps.restore(checkpoint)
    host, port = ps.start()
    tls_pem = Path(config.tls_cert).read_text() if config.tls_cert else None
    group = f"sparkdl-train-{uuid.uuid4().hex[:8]}"
    stage_started = time.perf_counter()
    attempts: list[dict[str, Any]] = []
    progress = (TrainingProgress(ps, f"sparkdl {config.policy} x{config.num_workers}") if config.verbose
                else contextlib.nullcontext())
    try:
        with progress:
            workers = _run_attempts(sc, ps, config, group, run_stage, to_arrays, attempts,
                                    lambda attempt: JobSpec(config, model_fn, initial.numpy(), host, port, secret,
                                                            attempt, tls_pem))
    finally:
        ps.stop()
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    if ps.failure is not None:
        raise ps.failure
    ps.write_checkpoint()   # the final state, when checkpoints are on
    stage_seconds = time.perf_counter() - stage_started
    load_flat_parameters(template, ps.weights())
    buffers = ps.averaged_buffers()
    if buffers is not None:
        load_flat_buffers(template, buffers)
    history, epochs, gradients = history_frames(ps.update_rows, UPDATE_COLUMNS, ps.gradient_rows, GRADIENT_COLUMNS)
    workers = sorted(workers, key=lambda w: w["worker"])
    stats = ps.stats
    summary = _run_summary(
        config, workers, history, gradients, attempts, started, stage_seconds,
        updates=stats.updates, version=ps.version, pushes=stats.pushes, applied_gradients=stats.applied_gradients,
        dropped_stale=stats.dropped_stale, rejected_nonfinite=stats.rejected_nonfinite,
        ps_aggregate_seconds=stats.aggregate_seconds, ps_optimizer_seconds=stats.optimizer_seconds,
        ps_handler_cpu_seconds=stats.handler_cpu_seconds, checkpoints_written=ps.checkpoints_written,
        workers_lost=stats.workers_lost, rejoins=stats.rejoins,
        resumed_from_version=next((e["version"] for e in ps.events if e["event"] == "resumed"), None))
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    return TrainResult(state, history, epochs, gradients, workers, summary, events=ps.events, attempts=attempts)
