"""The user's own training code on sparkdl's launch path: ``sparkdl.run`` and ``sparkdl.TorchDistributor``.

``run(fn, num_workers=N)`` runs ``fn`` once per task of one barrier stage, with the
``torch.distributed`` environment ``torchrun`` would set (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``; the Spark-assigned GPU as the
current device), so ``torch.distributed.init_process_group()`` works as under ``torchrun``; and
with :func:`sparkdl.context` for the data partition, reports and PS optimizers.  It returns
every rank's value in rank order.  The path is the estimator's: preflight, one barrier stage,
one ``allGather`` rendezvous, the failing rank's traceback on the driver, retries (a retried
function finds its PS optimizers' state on the driver), Spark Connect.

:class:`TorchDistributor` keeps the signature of ``pyspark.ml.torch.distributor.TorchDistributor``
so a notebook changes one import; it returns rank 0's value, like Spark's.
"""
from __future__ import annotations

import base64
import contextlib
import functools
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from pyspark import RDD, cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from torch import nn

from sparkdl._internal.data.arrow import arrow_chunks
from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.data.checks import DataRules
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.data.schema import validate_columns
from sparkdl._internal.modes.functions.context import WorkerContext, active
from sparkdl._internal.modes.launch import tls_pems
from sparkdl._internal.modes.result import history_frames
from sparkdl._internal.ps.server.function_server import FunctionServer
from sparkdl._internal.ps.server.runlog import RunLog
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl._internal.ps.wire.tls import server_context
from sparkdl._internal.ps.worker.client import PSClient, failure_reported
from sparkdl._internal.spark.backend import SparkBackend, active_connect_session, backend_for
from sparkdl._internal.spark.barrier import BarrierStageRunner, dataframe_barrier_stage, rdd_barrier_stage
from sparkdl._internal.spark.devices import gpu_addresses, select_device
from sparkdl._internal.spark.hadoop_files import checkpoint_files
from sparkdl._internal.spark.preflight import bind_address, check_cluster, ps_host
from sparkdl._internal.spark.rendezvous import (
    environment_set,
    gather_places,
    process_groups_outlive_their_users,
    torch_environment,
)
from sparkdl._internal.spark.task import TaskEnv, open_partition, partition_summary
from sparkdl._internal.training.flat import load_flat_parameters
from sparkdl.config import TrainConfig
from sparkdl.errors import ClusterConfigError


@dataclass(frozen=True)
class FunctionSpec:
    """What every task of a function run receives (the stage runner's spec)."""

    config: TrainConfig
    fn: Callable[..., Any] | str        # a function, or the path of a Python script
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    ps_host: str
    ps_port: int
    secret: bytes
    barrier_attempt: int = 0
    tls_cert_pem: str | None = None
    has_data: bool = False


@dataclass
class SpaceResult:
    """One PS optimizer's key space at the end of the run."""

    weights: torch.Tensor            # the PS's final flat weights
    version: int
    history: Any                     # pandas: one row per update
    gradients: Any                   # pandas: one row per pushed gradient (staleness, accepted)
    summary: dict[str, Any]


class FunctionResult(list):
    """Every rank's return value in rank order, with what the run measured.

    ``metrics``: the ranks' ``ctx.report(...)`` rows (pandas); ``spaces``: each PS optimizer's
    final weights, update history and counters; ``summary``; ``workers``: each task's summary;
    ``attempts``: the barrier-stage attempts.
    """

    def __init__(self, values: list[Any], metrics: Any, spaces: list[SpaceResult], summary: dict[str, Any],
                 workers: list[dict[str, Any]], attempts: list[dict[str, Any]]) -> None:
        super().__init__(values)
        self.metrics = metrics
        self.spaces = spaces
        self.summary = summary
        self.workers = workers
        self.attempts = attempts

    def load_weights(self, model: nn.Module, space: int = 0) -> nn.Module:
        """Copy PS optimizer ``space``'s final weights into ``model`` (built like the function's)."""
        load_flat_parameters(model, self.spaces[space].weights)
        return model


def run(fn: Callable[..., Any] | str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
        num_workers: int | None = None, config: TrainConfig | None = None, data: DataFrame | RDD | None = None,
        input_cols: Sequence[str] | None = None, label_col: str | None = "label", weight_col: str | None = None,
        input_args: Sequence[str] = (), use_gpu: bool | None = None, spark: SparkSession | None = None
        ) -> FunctionResult:
    """Run ``fn(*args, **kwargs)`` on ``num_workers`` barrier tasks; every rank's value, in rank order.

    ``fn`` may be the path of a Python script instead (run with ``args`` as its command line,
    in the same environment; its value is None).  ``config`` supplies the PS optimizers' update
    rule (policy, optimizer, learning rate ...), ``batch_size``, ``seed`` and ``timeout_s``;
    ``num_workers`` overrides its count.  ``data`` (a DataFrame or an RDD of the rows
    ``sparkdl.train`` takes) is split into one partition per rank, read by ``ctx.batches(epoch)``;
    a DataFrame's ``input_cols`` (default: every column but the label and weight) reach the model
    as typed inputs.  ``use_gpu``: True needs a GPU per task (Spark's ``spark.task.resource.gpu.amount``),
    False trains on the CPU, None follows ``config.device``.
    """
    if not (callable(fn) or isinstance(fn, str)):
        raise TypeError(f"sparkdl.run takes a function or the path of a Python script, got {type(fn).__name__}")
    if isinstance(fn, str) and kwargs:
        raise ValueError("a script takes command-line arguments (args), not kwargs")
    config = config or TrainConfig()
    if config.elastic:
        raise ValueError("TrainConfig.elastic cannot be used with sparkdl.run: the ranks of a function form one "
                         "process group (one allGather rendezvous), which needs a barrier stage; set elastic=False")
    device = config.device if use_gpu is None else ("cuda" if use_gpu else "cpu")
    # the user's loop decides when training ends: no PS-side sample budget
    config = config.replace(num_workers=num_workers or config.num_workers, device=device, sample_budget="per_worker")
    backend, stage, read_chunks = _stage(config, data, spark, input_cols, label_col, weight_col, tuple(input_args))
    check_cluster(backend, config.num_workers, wait_s=min(config.timeout_s, 60.0))
    if device == "cuda":
        _require_gpus(backend)
    started = time.perf_counter()
    secret = secrets.token_bytes(32)
    advertised = ps_host(backend, config.ps_host)
    cert_pem, key_pem = tls_pems(config)
    server = FunctionServer(config, secret, bind_address(advertised), tls=server_context(cert_pem, key_pem),
                            checkpoint_files=checkpoint_files(backend, config.checkpoint_dir, config.resume_from))
    _, port = server.start()
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", "function")
    runner = BarrierStageRunner(backend, stage, read_chunks, function_worker, f"{name} x{config.num_workers}",
                                config.max_attempts, config.timeout_s, server, num_tasks=config.num_workers)

    def spec_for(barrier_attempt: int) -> FunctionSpec:
        server.begin_attempt()
        return FunctionSpec(config, fn, tuple(args), dict(kwargs or {}), advertised, port, secret, barrier_attempt,
                            cert_pem, has_data=data is not None)

    progress = MetricsProgress(server, f"sparkdl {name} x{config.num_workers}") if config.verbose else None
    try:
        with progress or contextlib.nullcontext():
            workers = runner.run(spec_for)
    finally:
        server.stop()
    if server.failure is not None:
        raise server.failure
    return _result(server, workers, runner, started)


def _stage(config: TrainConfig, data: DataFrame | RDD | None, spark: SparkSession | None,
           input_cols: Sequence[str] | None, label_col: str | None, weight_col: str | None,
           input_args: tuple[str, ...]) -> tuple[SparkBackend, Any, ChunksFn]:
    """The backend, the barrier stage over ``num_workers`` partitions, and how a task reads its rows."""
    count = config.num_workers
    if isinstance(data, RDD):
        partitions = data if data.getNumPartitions() == count else data.repartition(count)
        return (backend_for(data.context), rdd_barrier_stage(partitions),
                functools.partial(row_chunks, rules=DataRules(max_length=config.sequence_length)))
    if data is not None and hasattr(data, "sparkSession"):   # a classic or a Spark Connect DataFrame
        frame = data
        names = frame.columns
        label = label_col if label_col in names else None
        inputs = tuple(input_cols) if input_cols else tuple(c for c in names if c not in (label, weight_col))
        columns = ColumnSpec(features_col=None, input_cols=inputs, label_col=label, weight_col=weight_col,
                             input_args=input_args)
        validate_columns(frame, columns)
        selected = frame.select(*[F.col(f"`{c}`") for c in columns.columns]).repartition(count)
        return (backend_for(frame.sparkSession), dataframe_barrier_stage(selected),
                functools.partial(arrow_chunks, spec=columns, rules=DataRules(max_length=config.sequence_length)))
    if data is not None:
        raise TypeError(f"data must be a DataFrame or an RDD, got {type(data).__name__}")
    session = spark or active_connect_session() or SparkSession.getActiveSession()
    if session is None:
        from sparkdl._internal.spark.session import spark_session

        session = spark_session()
    # one row per task: the stage's partitions carry no data, only the tasks' places
    return backend_for(session), dataframe_barrier_stage(session.range(0, count, 1, count)), no_rows


def no_rows(batches: Iterator[Any]) -> Iterator[Any]:
    """A function run without data reads nothing from its placeholder partition."""
    return iter(())


def _require_gpus(backend: SparkBackend) -> None:
    """``use_gpu=True`` needs Spark to give every task a GPU: refuse before launch otherwise."""
    amount = backend.conf("spark.task.resource.gpu.amount")
    if not amount or float(amount) <= 0:
        raise ClusterConfigError("use_gpu=True, but Spark assigns no GPU to tasks: set "
                                 "'spark.task.resource.gpu.amount' (and the executors' GPU discovery script), or "
                                 "run with use_gpu=False")


def _result(server: FunctionServer, workers: list[dict[str, Any]], runner: BarrierStageRunner,
            started: float) -> FunctionResult:
    import pandas as pd

    workers = sorted(workers, key=lambda w: w["worker"])
    values = [cloudpickle.loads(base64.b64decode(w.pop("value"))) for w in workers]
    spaces = []
    for index in sorted(server.spaces):
        space = server.spaces[index]
        space.write_checkpoint(final=True)   # the final state, when checkpoints are on
        run_log: RunLog = space.core.log
        history, _, gradients = history_frames(run_log.updates, run_log.gradients)
        stats = space.stats
        spaces.append(SpaceResult(space.final_weights(), space.version, history, gradients,
                                  {"parameters": space.num_params, "updates": stats.updates, "pushes": stats.pushes,
                                   "applied_gradients": stats.applied_gradients,
                                   "dropped_stale": stats.dropped_stale, "workers_lost": stats.workers_lost,
                                   "checkpoints_written": space.checkpoints_written,
                                   "staleness_max": int(gradients["staleness"].max()) if len(gradients) else 0}))
    metrics = pd.DataFrame([{"rank": m.rank, "seconds": m.seconds, **m.metrics} for m in server.metrics])
    summary = {"num_workers": len(workers), "attempts": len(runner.attempts), "ps_optimizers": len(spaces),
               "reports": len(server.metrics), "wall_seconds": time.perf_counter() - started,
               "refused_connections": server.refused_connections}
    return FunctionResult(values, metrics, spaces, summary, workers, runner.attempts)


class MetricsProgress:
    """A line every few seconds with each rank's newest report (``config.verbose``), and one at the end."""

    def __init__(self, server: FunctionServer, description: str, interval_s: float = 5.0) -> None:
        self._server = server
        self._description = description
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-function-progress", daemon=True)
        self._shown = 0
        self._started = time.monotonic()

    def __enter__(self) -> MetricsProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.refresh()

    def refresh(self) -> None:
        rows = list(self._server.metrics)
        if len(rows) == self._shown:
            return
        self._shown = len(rows)
        newest = {row.rank: row.metrics for row in rows}
        figures = " | ".join(f"rank {rank}: " + " ".join(f"{k}={_figure(v)}" for k, v in metrics.items())
                             for rank, metrics in sorted(newest.items()))
        sys.stderr.write(f"{self._description}: {figures} elapsed={time.monotonic() - self._started:.0f}s\n")
        sys.stderr.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.refresh()


def _figure(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------- the task side
def function_worker(env: TaskEnv, rows: Iterator[Any], read_chunks: ChunksFn) -> dict[str, Any]:
    """The barrier task body of a function run: rendezvous, the environment, the function, its value."""
    spec = cast(FunctionSpec, env.spec)
    config = spec.config
    started = time.perf_counter()
    server = PSClient(spec.ps_host, spec.ps_port, spec.secret, env.rank, config.timeout_s, spec.tls_cert_pem)
    try:
        with failure_reported(server.report_failure):
            server.request(Header(Msg.REPORT, flags=protocol.FLAG_STARTED, worker=env.rank), None, reply=Msg.ACK)
            device = select_device(config.device, gpu_addresses(env.context.resources()))
            with contextlib.ExitStack() as stack:
                data, cached = (stack.enter_context(open_partition(env, rows, read_chunks, device))
                                if spec.has_data else (None, None))
                gathered = gather_places(env, device, rows=data.rows if data is not None else 0)
                variables = torch_environment(env.rank, gathered)
                ctx = WorkerContext(config, env.rank, len(gathered), int(variables["LOCAL_RANK"]), device, server,
                                    (spec.ps_host, spec.secret, spec.tls_cert_pem), env.task_attempt, data,
                                    [g["rows"] for g in gathered], spec.barrier_attempt)
                try:
                    with environment_set(variables), active(ctx), process_groups_outlive_their_users():
                        value = _call(spec, gathered, env.rank)
                    ctx.finish()
                finally:
                    ctx.close()
            summary = {"worker": env.rank, "task_attempt": env.task_attempt, "device": str(device),
                       "wall_seconds": time.perf_counter() - started,
                       "ps_optimizers": [o.summary() for o in ctx.optimizers],
                       "value": base64.b64encode(cloudpickle.dumps(value)).decode("ascii")}
            if cached is not None:
                summary.update(partition_summary(cached))
            return summary
    finally:
        server.close()


def _call(spec: FunctionSpec, gathered: list[dict[str, Any]], rank: int) -> Any:
    """The user's function, or its script in a child process with the same environment."""
    if callable(spec.fn):
        return spec.fn(*spec.args, **spec.kwargs)
    command = [sys.executable, spec.fn, *map(str, spec.args)]
    done = subprocess.run(command, env=dict(os.environ), capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"rank {rank}: {' '.join(command)} exited with status {done.returncode}:\n{tail}")
    return None


class TorchDistributor:
    """``pyspark.ml.torch.distributor.TorchDistributor``'s API on sparkdl's launch path.

    ``TorchDistributor(num_processes, local_mode, use_gpu).run(train_object, *args, **kwargs)``
    runs ``num_processes`` ranks as barrier tasks and returns rank 0's value (None for a script),
    as Spark's does.  Differences: ``local_mode=True`` also runs the ranks as Spark tasks (on a
    local master they are on the driver's machine anyway) instead of ``torchrun`` on the driver;
    no ``torchrun`` process is started inside a task, the function runs in the task's Python worker.
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 _ssl_conf: str = "pytorch.spark.distributor.ignoreSsl") -> None:
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.ssl_conf = _ssl_conf

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any | None:
        """Run ``train_object`` on every rank; rank 0's value (None when it is a script)."""
        result = run(train_object, args, kwargs, num_workers=self.num_processes,
                     config=TrainConfig(num_workers=self.num_processes, verbose=False), use_gpu=self.use_gpu)
        return result[0]
