"""The one barrier-task wrapper every training mode runs, and the job spec it receives."""
from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ..config import TrainConfig
from ..training.flat import FlatReplica
from ..training.losses import targets_for_loss


@dataclass(frozen=True)
class JobSpec:
    """What every task of one run receives (a broadcast, or inside the task function under Spark Connect)."""

    config: TrainConfig
    model_fn: Callable[[], nn.Module]
    initial_weights: np.ndarray      # flat float32, parameters in model.parameters() order
    ps_host: str = ""                # empty without a parameter server (allreduce)
    ps_port: int = 0
    secret: bytes = b""
    stage_attempt: int = 0           # the launcher's barrier-stage attempt (retries continue the run)
    tls_cert_pem: str | None = None  # the PS certificate, pinned by the workers


@dataclass(frozen=True)
class TaskEnv:
    """One barrier task's place in the run."""

    spec: JobSpec
    rank: int            # the partition index = the worker id
    task_attempt: int    # Spark's task attempt id: grows with every retry of the task
    context: Any         # the BarrierTaskContext


ArraysFn = Callable[[Iterator[Any]], "tuple[np.ndarray, np.ndarray]"]
#: body(env, partition input, input -> (features, labels)) -> the task's summary
TaskBody = Callable[[TaskEnv, Iterator[Any], ArraysFn], dict]


def make_barrier_task(body: TaskBody, spec: Any, to_arrays: ArraysFn
                      ) -> Callable[[Iterator[Any]], Iterator[dict[str, Any]]]:
    """The function each task of the barrier stage runs (module-level parts: pickled by reference).

    ``spec`` is the pickled :class:`JobSpec` as ``SparkBackend.share`` made it: a broadcast
    variable in classic PySpark, the bytes themselves (inside this function) under Spark Connect.
    """
    return functools.partial(_run_barrier_task, body, spec, to_arrays)


def _run_barrier_task(body: TaskBody, shared_spec: Any, to_arrays: ArraysFn,
                      rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
    from pyspark import BarrierTaskContext

    from .backend import shared_bytes

    context = BarrierTaskContext.get()
    # unpickled here, not by Spark: a model factory that cannot load fails with this task's traceback
    spec: JobSpec = pickle.loads(shared_bytes(shared_spec))
    # Torch threads follow the cores Spark gave this task, so replicas don't oversubscribe.
    torch.set_num_threads(max(1, context.cpus()))
    yield body(TaskEnv(spec, context.partitionId(), context.taskAttemptId(), context), rows, to_arrays)


def arrow_output(task: Callable[[Iterator[Any]], Iterator[dict[str, Any]]]) -> Callable:
    """Adapt a barrier task to ``mapInArrow``: its summary leaves as one JSON string column."""
    import json

    import pyarrow as pa

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        for summary in task(batches):
            yield pa.RecordBatch.from_pydict({"summary": [json.dumps(summary)]})

    return run


def build_replica(spec: JobSpec, rank: int, device: torch.device) -> FlatReplica:
    """This worker's model copy on ``device``, holding the initial weights of the spec."""
    torch.manual_seed(spec.config.seed + rank)   # dropout and other randomness differ per replica
    replica = FlatReplica(spec.model_fn(), device)
    replica.weights.copy_(torch.from_numpy(spec.initial_weights))
    return replica


def shard_tensors(features: np.ndarray, labels: np.ndarray, loss: Any,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shard as tensors on ``device``, made once and reused every epoch."""
    # Arrow-backed arrays are read-only; torch wants writable memory (one copy, once per run)
    x = torch.from_numpy(np.require(features, requirements=["W"])).to(device)
    if not len(features):
        return x, None
    return x, torch.from_numpy(np.require(targets_for_loss(labels, loss), requirements=["W"])).to(device)
