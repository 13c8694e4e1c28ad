"""Executor side of pipeline training: one stage of one model replica, in one barrier task.

Task ``t`` of the barrier stage is stage ``t % P`` of replica ``t // P``.  Only stage 0
reads data; it sends each mini-batch's labels to the last stage, which computes the loss.
Activations go forward and activation gradients backward between neighbouring stages
point to point (``torch.distributed``: gloo on CPU, nccl on GPU), scheduled by
``torch.distributed.pipelining`` (GPipe or 1F1B).  Each stage task then pushes its key
range of the replica's gradient to the parameter server and pulls its range of the new
weights (:mod:`sparkdl.ps.parts`): no task ever holds the whole model.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ..config import TrainConfig
from ..errors import ParameterServerError
from ..ps.client import PSClient
from ..training.batches import ShardBatches
from ..training.flat import FlatReplica, flatten_buffers, load_flat_buffers
from ..training.losses import resolve_loss
from ..training.loop import epoch_order
from ..runtime.data_cache import ChunksFn
from ..runtime.devices import gpu_addresses, select_device
from ..runtime.memory import REPLICA_BUILD_BYTES_PER_PARAMETER, require_address_space
from ..runtime.task import TaskEnv, open_shard, shard_summary
from .partition import build_stage

#: label dtypes that travel from stage 0 to the last stage, by code
_LABEL_DTYPES = (torch.int64, torch.float32, torch.float64, torch.int32)
_LABEL_META = 8   # dtype code, number of dimensions, up to 6 sizes


def ideal_bubble(stages: int, micro_batches: int) -> float:
    """The idle fraction of a synchronous pipeline step, (P - 1) / (m + P - 1) (GPipe, Huang et al. 2019)."""
    return (stages - 1) / (micro_batches + stages - 1)


@dataclass
class StageTimer:
    """Busy time of a stage's forward and backward chunks, and its pipeline steps' wall time."""

    busy_seconds: float = 0.0
    step_seconds: float = 0.0
    forward_bytes: int = 0       # activations this stage sent forward in its last step
    _step_bytes: int = field(default=0, repr=False)

    def wrap(self, stage: PipelineStage, sends_forward: bool) -> None:
        """Time the stage's compute calls (their communication is the schedule's, outside them)."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            output = forward(*args, **kwargs)
            self.busy_seconds += time.perf_counter() - started
            if sends_forward:
                tensors = output if isinstance(output, (tuple, list)) else (output,)
                self._step_bytes += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            return output

        def timed_backward(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = backward(*args, **kwargs)
            self.busy_seconds += time.perf_counter() - started
            return result

        stage.forward_one_chunk = timed_forward
        stage.backward_one_chunk = timed_backward

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._step_bytes = 0
        started = time.perf_counter()
        yield
        self.step_seconds += time.perf_counter() - started
        self.forward_bytes = self._step_bytes

    @property
    def bubble(self) -> float:
        """The measured idle fraction of the steps: 1 - busy / wall (waiting on neighbours and the wire)."""
        return max(0.0, 1.0 - self.busy_seconds / self.step_seconds) if self.step_seconds else 0.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def pipeline_groups(env: TaskEnv, stages: int, device: torch.device, timeout_s: float
                    ) -> Iterator[dist.ProcessGroup | None]:
    """Join the run's process group (one Spark-level rendezvous) and return this replica's pipeline group."""
    context, rank = env.context, env.rank
    infos = context.getTaskInfos()
    world = len(infos)
    port = _free_port() if rank == 0 else 0
    gathered = [json.loads(m) for m in context.allGather(json.dumps({"port": port}))]
    host = infos[0].address.rsplit(":", 1)[0]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://{host}:{gathered[0]['port']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        replicas = world // stages
        mine = None
        if replicas > 1:   # every rank creates every group, in the same order
            for replica in range(replicas):
                group = dist.new_group(list(range(replica * stages, (replica + 1) * stages)))
                if replica == rank // stages:
                    mine = group
        yield mine
    finally:
        dist.destroy_process_group()


def _send_labels(labels: torch.Tensor, last_rank: int) -> None:
    if labels.dtype not in _LABEL_DTYPES or labels.dim() > _LABEL_META - 2:
        raise ValueError(f"pipelines carry labels of dtype {_LABEL_DTYPES} and at most {_LABEL_META - 2} "
                         f"dimensions, got {labels.dtype} {tuple(labels.shape)}")
    meta = torch.zeros(_LABEL_META, dtype=torch.int64, device=labels.device)
    meta[0], meta[1] = _LABEL_DTYPES.index(labels.dtype), labels.dim()
    meta[2:2 + labels.dim()] = torch.tensor(labels.shape, dtype=torch.int64)
    dist.send(meta, last_rank)
    dist.send(labels.contiguous(), last_rank)


def _receive_labels(first_rank: int, device: torch.device) -> torch.Tensor:
    meta = torch.empty(_LABEL_META, dtype=torch.int64, device=device)
    dist.recv(meta, first_rank)
    dtype, ndim = _LABEL_DTYPES[int(meta[0])], int(meta[1])
    labels = torch.empty([int(s) for s in meta[2:2 + ndim]], dtype=dtype, device=device)
    dist.recv(labels, first_rank)
    return labels


def make_schedule(stage: PipelineStage, config: TrainConfig) -> ScheduleGPipe | Schedule1F1B:
    """The configured schedule over ``stage``; its loss is each micro-batch's share of the batch's mean loss.

    So the summed micro-batch gradients equal the unsplit mini-batch's gradient (no further
    scaling by the schedule).
    """
    base = resolve_loss(config.loss)
    batch_size = config.batch_size

    def micro_batch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return base(output, target) * (len(target) / batch_size)

    kind = ScheduleGPipe if config.pipeline_schedule == "gpipe" else Schedule1F1B
    return kind(stage, n_microbatches=config.micro_batches, loss_fn=micro_batch_loss, scale_grads=False)


def _planned_batches(data: ShardBatches | None, config: TrainConfig, replica: int, steps: int, start: int
                     ) -> Iterator[tuple[int, torch.Tensor | None, torch.Tensor | None]]:
    """(epoch, features, labels) of every remaining mini-batch of the plan; the features and labels
    only on the first stage (``data`` given), which reads the shard."""
    if not steps:
        return
    for epoch in range(start // steps, config.epochs):
        first_step = start - epoch * steps if epoch == start // steps else 0
        if data is None:
            for _ in range(first_step, steps):
                yield epoch, None, None
            continue
        order = epoch_order(data.rows, epoch, config.seed, replica, config.shuffle, steps * config.batch_size)
        indices = [order[k * config.batch_size:(k + 1) * config.batch_size] for k in range(first_step, steps)]
        with contextlib.closing(data.batches(indices, epoch, first_step)) as batches:
            for x, y in batches:
                yield epoch, x, y


def train_stage(env: TaskEnv, data: ShardBatches | None, device: torch.device, client: PSClient,
                group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Train this task's stage for the whole plan; return its summary."""
    started = time.perf_counter()
    spec = env.spec
    config, plan = spec.config, spec.pipeline.plan
    stages = plan.num_stages
    replica_id, index = divmod(env.rank, stages)
    first_rank, last_rank = replica_id * stages, (replica_id + 1) * stages - 1
    is_first, is_last = index == 0, index == stages - 1
    require_address_space(REPLICA_BUILD_BYTES_PER_PARAMETER * plan.parameter_count(index),
                          f"pipeline stage {index} ({plan.parameter_count(index):,} parameters)",
                          "Cut the model into more stages (pipeline_stages), or give the Python workers more memory")
    module = build_stage(spec.model_fn, plan, index, device)
    lo, hi = plan.buffer_spans[index]
    if hi > lo:
        load_flat_buffers(module, torch.from_numpy(spec.pipeline.float_buffers[lo:hi].copy()))
    replica = FlatReplica(module, device)
    on_cpu = device.type == "cpu"
    wire_weights = replica.weights if on_cpu else torch.empty_like(replica.weights, device="cpu").pin_memory()
    wire_grads = replica.grads if on_cpu else torch.empty_like(replica.grads, device="cpu").pin_memory()
    welcome = client.hello(data.rows if data is not None else 0, wire_weights, spec.stage_attempt,
                           part=(index, stages))
    if not on_cpu:
        replica.weights.copy_(wire_weights)
    version, steps = welcome.version, welcome.steps_per_epoch
    total = steps * config.epochs
    start = min(welcome.position, total)
    stage = PipelineStage(module, index, stages, device, group=group)
    schedule = make_schedule(stage, config)
    timer = StageTimer()
    timer.wrap(stage, sends_forward=not is_last)
    module.train()
    def pipeline_step(x: torch.Tensor | None, y: torch.Tensor | None) -> float:
        """Run one mini-batch through the schedule; this stage's gradient accumulates in ``replica.grads``."""
        losses: list[torch.Tensor] = []
        if is_first:
            if stages > 1:
                _send_labels(y, last_rank)
            schedule.step(x, return_outputs=False)
        elif is_last:
            schedule.step(target=_receive_labels(first_rank, device), losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        return float(sum(value.item() for value in losses))

    def warm_up(x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        """Let the schedule infer the shapes between stages on a step whose effects are undone.

        ``torch.distributed.pipelining`` infers them at its first step by running each stage's
        forward once more, on the first micro-batch (stage 0) or on uninitialised tensors of the
        right shape (the others).  In training mode that extra forward would update BatchNorm
        statistics and draw dropout randomness; so it runs in eval mode, and the step's
        gradient and any buffer change are discarded.
        """
        buffers = [b.detach().clone() for b in module.buffers()]
        module.eval()
        pipeline_step(x, y)
        module.train()
        replica.zero_grads()
        with torch.no_grad():
            for buffer, saved in zip(module.buffers(), buffers):
                buffer.copy_(saved)

    pushes = accepted = samples = 0
    compute_seconds = communication_seconds = 0.0
    # closing: leaving early (an error) also stops the loader's thread
    with contextlib.closing(_planned_batches(data, config, replica_id, steps, start)) as planned:
        for step, (epoch, x, y) in enumerate(planned):
            if step == 0:
                warm_up(x, y)
            t0 = time.perf_counter()
            with timer.step():
                loss = pipeline_step(x, y)
            t1 = time.perf_counter()
            compute_seconds += t1 - t0
            if not on_cpu:
                wire_grads.copy_(replica.grads)
            if bool(torch.isfinite(wire_grads.sum())):
                version, used = client.push_pull(wire_grads, version, config.batch_size, loss, epoch, wire_weights)
            else:
                version, used = client.push_nonfinite(version, config.batch_size, loss, epoch, wire_weights)
            if not on_cpu:
                replica.weights.copy_(wire_weights)
            replica.zero_grads()
            pushes += 1
            accepted += used
            samples += config.batch_size
            communication_seconds += time.perf_counter() - t1
    trained = samples if is_first else 0   # the replica's samples are counted once, by its first stage
    buffers = flatten_buffers(replica.model)
    client.done(samples, buffers if samples and buffers.numel() else None)
    return {"worker": replica_id, "pipeline_stage": index, "task_attempt": env.task_attempt,
            "shard_size": data.rows if data is not None else 0, "steps_per_epoch": steps, "resumed_at_batch": start,
            "batches": pushes, "pushes": pushes, "accepted": accepted, "samples": trained,
            "compute_seconds": compute_seconds, "communication_seconds": communication_seconds,
            "wall_seconds": time.perf_counter() - started, "bytes_pushed": int(client.bytes_pushed),
            "bytes_pulled": int(client.bytes_pulled), "device": str(device), "transport": "tcp",
            "parameter_bytes": replica.weights.numel() * 4, "bubble": timer.bubble,
            "ideal_bubble": ideal_bubble(stages, config.micro_batches),
            "forward_bytes_per_step": timer.forward_bytes}


def pipeline_worker(env: TaskEnv, rows: Iterator[Any], read_chunks: ChunksFn) -> dict[str, Any]:
    """The barrier task body of pipeline training: a failure's traceback is handed to the driver via the PS."""
    spec = env.spec
    stages = spec.pipeline.plan.num_stages
    replica_id, index = divmod(env.rank, stages)
    client = PSClient(spec.ps_host, spec.ps_port, spec.secret, replica_id, spec.config.timeout_s, spec.tls_cert_pem)
    try:
        device = select_device(spec.config.device, gpu_addresses(env.context.resources()))
        with pipeline_groups(env, stages, device, spec.config.timeout_s) as group:
            if index > 0:   # only the first stage of a replica reads data
                return train_stage(env, None, device, client, group)
            with open_shard(env, rows, read_chunks, device) as (data, cached):
                summary = train_stage(env, data, device, client, group)
            return {**summary, **shard_summary(cached)}
    except ParameterServerError:
        raise   # the PS already knows: it reported this failure to us
    except BaseException:
        client.report_failure(traceback.format_exc())
        raise
    finally:
        client.close()
