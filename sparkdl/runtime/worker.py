"""Executor side: the barrier task function and one replica's training loop."""
from __future__ import annotations

import pickle
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..config import TrainConfig
from ..errors import ParameterServerError
from ..ps.client import PSClient
from ..ps.compression import make_codec
from ..ps.flat import FlatReplica, flatten_buffers
from ..ps.policy import LocalSteps
from .data import epoch_order, labels_for_loss, rows_to_arrays
from .devices import gpu_addresses, select_device


@dataclass(frozen=True)
class JobSpec:
    """What every task of one run receives through the broadcast variable."""

    config: TrainConfig
    model_fn: Callable[[], nn.Module]
    initial_weights: np.ndarray      # flat float32, parameters in model.parameters() order
    ps_host: str
    ps_port: int
    secret: bytes
    attempt: int = 0                 # the launcher's stage attempt (retries continue the run)
    tls_cert_pem: str | None = None  # the PS certificate, pinned by the workers


def resolve_loss(loss: str | Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss function named in the config (or the user's callable)."""
    if callable(loss):
        return loss
    if loss == "cross_entropy":
        return F.cross_entropy

    def squeezed(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        # A regression/binary head of shape [B, 1] against labels of shape [B].
        def apply(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            if output.dim() == 2 and output.shape[1] == 1 and target.dim() == 1:
                output = output.squeeze(1)
            return fn(output, target)
        return apply

    return squeezed(F.mse_loss if loss == "mse" else F.binary_cross_entropy_with_logits)


def build_replica(spec: JobSpec, rank: int, device: torch.device) -> FlatReplica:
    """This worker's model copy on ``device``, holding the broadcast initial weights."""
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
    return x, torch.from_numpy(np.require(labels_for_loss(labels, loss), requirements=["W"])).to(device)


def backward_step(replica: FlatReplica, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
                  index: torch.Tensor) -> float:
    """Forward and backward on one mini-batch; its gradient adds into ``replica.grads``."""
    loss = loss_fn(replica.model(x[index]), y[index])
    loss.backward()
    replica.ensure_grad_views()
    return loss.item()


def train_replica(worker: int, features: np.ndarray, labels: np.ndarray, spec: JobSpec,
                  device: torch.device, client: PSClient, attempt: int = 0) -> dict[str, Any]:
    """Train one replica on its shard against the parameter server; return its summary."""
    started = time.perf_counter()
    config = spec.config
    replica = build_replica(spec, worker, device)
    model = replica.model
    loss_fn = resolve_loss(config.loss)
    on_cpu = device.type == "cpu"
    # On a GPU the wire needs host buffers; on CPU the replica's own buffers go on the wire.
    wire_weights = replica.weights if on_cpu else torch.empty_like(replica.weights, device="cpu").pin_memory()
    wire_grads = replica.grads if on_cpu else torch.empty_like(replica.grads, device="cpu").pin_memory()

    n = len(features)
    x, y = shard_tensors(features, labels, config.loss, device)
    welcome = client.hello(n, wire_weights, attempt)
    if welcome.has_weights and not on_cpu:
        replica.weights.copy_(wire_weights)
    version, steps = welcome.version, welcome.steps_per_epoch
    codec = make_codec(config.compression, replica.grads.numel(), config.topk_ratio)
    total_batches = steps * config.epochs
    # A retried task continues where the PS says its gradients stopped, not from epoch 0.
    resumed_at = min(welcome.position, total_batches)
    first_epoch, first_step = divmod(resumed_at, steps) if steps else (0, 0)
    local = LocalSteps(config.local_steps)
    batch_size = config.batch_size
    pushes = accepted = samples_trained = pending_samples = 0
    batches = resumed_at
    pending_loss = 0.0
    compute_s = comm_s = 0.0
    model.train()
    for epoch in range(first_epoch, config.epochs if steps else 0):
        length = steps * batch_size if config.policy == "sync" else n
        order = epoch_order(n, epoch, config.seed, worker, config.shuffle, length).to(device)
        for k in range(first_step if epoch == first_epoch else 0, steps):
            t0 = time.perf_counter()
            index = order[k * batch_size:(k + 1) * batch_size]
            pending_loss += backward_step(replica, loss_fn, x, y, index)
            pending_samples += len(index)
            batches += 1
            count = local.after_batch(last=batches == total_batches)
            t1 = time.perf_counter()
            compute_s += t1 - t0
            if not count:
                continue
            if count > 1:
                replica.grads.div_(count)
            if not on_cpu:
                wire_grads.copy_(replica.grads)
            version, ok = client.push_pull(codec.encode(wire_grads), version, pending_samples,
                                           pending_loss / count, epoch, wire_weights)
            if not on_cpu:
                replica.weights.copy_(wire_weights)
            replica.zero_grads()
            pushes += 1
            accepted += ok
            samples_trained += pending_samples
            pending_samples, pending_loss = 0, 0.0
            comm_s += time.perf_counter() - t1
    client.done(samples_trained, flatten_buffers(model) if samples_trained else None)
    return {"worker": worker, "attempt": attempt, "shard_size": n, "steps_per_epoch": steps,
            "resumed_at_batch": resumed_at, "batches": batches - resumed_at,
            "pushes": pushes, "accepted": accepted, "samples": samples_trained,
            "compute_seconds": compute_s, "communication_seconds": comm_s,
            "wall_seconds": time.perf_counter() - started,
            "bytes_pushed": client.bytes_pushed, "bytes_pulled": client.bytes_pulled,
            "device": str(device)}


ToArrays = Callable[[Iterator[Any]], "tuple[np.ndarray, np.ndarray]"]


def make_barrier_task(spec_broadcast: Any, to_arrays: ToArrays = rows_to_arrays
                      ) -> Callable[[Iterator[Any]], Iterator[dict[str, Any]]]:
    """The function run by each task of the barrier stage (one task = one worker).

    ``to_arrays`` turns the partition's input (RDD rows or Arrow batches) into
    (features, labels) arrays.
    """

    def run_task(rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        worker = context.partitionId()
        spec: JobSpec = pickle.loads(spec_broadcast.value)
        # Torch threads follow the cores Spark gave this task, so replicas don't oversubscribe.
        torch.set_num_threads(max(1, context.cpus()))
        attempt = context.taskAttemptId()   # grows with every retry, so a retried task can take over its id
        client = PSClient(spec.ps_host, spec.ps_port, spec.secret, worker, spec.config.timeout_s, spec.tls_cert_pem)
        try:
            device = select_device(spec.config.device, gpu_addresses(context.resources()))
            features, labels = to_arrays(rows)
            summary = train_replica(worker, features, labels, spec, device, client, attempt)
        except ParameterServerError:
            raise   # the PS already knows: it reported this failure to us
        except BaseException:
            client.report_failure(traceback.format_exc())
            raise
        finally:
            client.close()
        yield summary

    return run_task


def arrow_output(task: Callable[[Iterator[Any]], Iterator[dict[str, Any]]]) -> Callable:
    """Adapt a barrier task to ``mapInArrow``: its summary leaves as one JSON string column."""
    import json

    import pyarrow as pa

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        for summary in task(batches):
            yield pa.RecordBatch.from_pydict({"summary": [json.dumps(summary)]})

    return run
