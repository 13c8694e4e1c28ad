"""Executor side of pipeline training: one stage of one model replica, in one barrier task.

Task ``t`` of the barrier stage is stage ``t % P`` of replica ``t // P``.  Only stage 0
reads data; it sends each mini-batch's labels to the last stage, which computes the loss.
Activations go forward and activation gradients backward between neighbouring stages
point to point (``torch.distributed``: gloo on CPU, nccl on GPU), scheduled by
``torch.distributed.pipelining`` (GPipe or 1F1B).  Each stage task then pushes its key
range of the replica's gradient to the parameter server and pulls its range of the new
weights (:mod:`sparkdl._internal.ps.server.parts`): no task ever holds the whole model.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Generator, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from sparkdl._internal.data.block import Batch
from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.data.partitions import PartitionBatches
from sparkdl._internal.memory import REPLICA_BUILD_BYTES_PER_PARAMETER, require_address_space
from sparkdl._internal.modes.executor_shards.host import ShardHost
from sparkdl._internal.ps.worker.client import PSClient, failure_reported, report_failure_to
from sparkdl._internal.spark.devices import gpu_addresses, select_device
from sparkdl._internal.spark.rendezvous import process_group
from sparkdl._internal.spark.task import TaskEnv, model_call, open_partition, partition_summary
from sparkdl._internal.training.flat import FlatReplica, flatten_buffers, load_flat_buffers
from sparkdl._internal.training.loop import LoopCounters, epoch_order, summary_fields
from sparkdl._internal.training.losses import resolve_loss
from sparkdl._internal.training.pipeline_cuts import build_stage
from sparkdl.config import TrainConfig
from sparkdl.errors import DataError

#: label dtypes that travel from stage 0 to the last stage, by code
_LABEL_DTYPES = (torch.int64, torch.float32, torch.float64, torch.int32)
_LABEL_META = 8   # dtype code, number of dimensions, up to 6 sizes


def ideal_bubble(stages: int, micro_batches: int) -> float:
    """The idle fraction of a synchronous pipeline step, (P - 1) / (m + P - 1) (GPipe, Huang et al. 2019)."""
    return (stages - 1) / (micro_batches + stages - 1)


class StageTimer:
    """Busy time of a stage's forward and backward chunks, and its pipeline steps' wall time.

    On a GPU each timed call ends with a device synchronisation, so the time is the kernels'
    and not only their launch.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.busy_seconds = 0.0
        self.step_seconds = 0.0
        #: micro-batches whose forward ran and whose backward has not: GPipe holds all m of them at
        #: once, 1F1B at most P - stage (Narayanan et al., PipeDream-Flush); the most seen in a step
        self.live_micro_batches = 0
        self.peak_live_micro_batches = 0
        self.forward_bytes = 0       # activations this stage sent forward in its last step
        self._step_bytes = 0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def wrap(self, stage: PipelineStage, sends_forward: bool) -> None:
        """Time the stage's compute calls (their communication is the schedule's, outside them)."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            started = self._now()
            output = forward(*args, **kwargs)
            self.busy_seconds += self._now() - started
            self.live_micro_batches += 1
            self.peak_live_micro_batches = max(self.peak_live_micro_batches, self.live_micro_batches)
            if sends_forward:
                tensors = output if isinstance(output, (tuple, list)) else (output,)
                self._step_bytes += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            return output

        def timed_backward(*args: Any, **kwargs: Any) -> Any:
            started = self._now()
            result = backward(*args, **kwargs)
            self.busy_seconds += self._now() - started
            self.live_micro_batches -= 1
            return result

        stage.forward_one_chunk = timed_forward  # type: ignore[method-assign]  # timing wrappers on this one stage
        stage.backward_one_chunk = timed_backward  # type: ignore[method-assign]  # timing wrappers on this one stage

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._step_bytes = 0
        started = self._now()
        yield
        self.step_seconds += self._now() - started
        self.forward_bytes = self._step_bytes

    @property
    def bubble(self) -> float:
        """The measured idle fraction of the steps: 1 - busy / wall (waiting on neighbours and the wire)."""
        return max(0.0, 1.0 - self.busy_seconds / self.step_seconds) if self.step_seconds else 0.0


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
        return base(output, target, None) * (len(target) / batch_size)

    kind = ScheduleGPipe if config.pipeline_schedule == "gpipe" else Schedule1F1B
    return kind(stage, n_microbatches=config.micro_batches, loss_fn=micro_batch_loss, scale_grads=False)


def _planned_batches(data: PartitionBatches | None, config: TrainConfig, replica: int, steps: int, start: int
                     ) -> Generator[tuple[int, Batch | None], None, None]:
    """(epoch, batch) of every remaining mini-batch of the plan; the batch only on the first stage
    (``data`` given), which reads the partition."""
    if not steps:
        return
    for epoch in range(start // steps, config.epochs):
        first_step = start - epoch * steps if epoch == start // steps else 0
        if data is None:
            for _ in range(first_step, steps):
                yield epoch, None
            continue
        order = epoch_order(data.rows, epoch, config.seed, replica, config.shuffle, steps * config.batch_size)
        indices = [order[k * config.batch_size:(k + 1) * config.batch_size] for k in range(first_step, steps)]
        with contextlib.closing(data.batches(indices, epoch, first_step)) as batches:
            for batch in batches:
                yield epoch, batch


class StageTask:
    """One stage of one replica in this task: its layers, its key range on the PS, its schedule."""

    def __init__(self, env: TaskEnv, device: torch.device, client: PSClient, group: dist.ProcessGroup | None) -> None:
        spec = env.spec
        assert spec.pipeline is not None   # a pipeline run's spec carries its stage layout
        self.spec = spec
        self.config, layout = spec.config, spec.pipeline.layout
        self.stages = layout.num_stages
        self.replica_id, self.index = divmod(env.rank, self.stages)
        self.first_rank, self.last_rank = self.replica_id * self.stages, (self.replica_id + 1) * self.stages - 1
        self.is_first, self.is_last = self.index == 0, self.index == self.stages - 1
        self.device, self.client = device, client
        require_address_space(REPLICA_BUILD_BYTES_PER_PARAMETER * layout.parameter_count(self.index),
                              f"pipeline stage {self.index} ({layout.parameter_count(self.index):,} parameters)",
                              "Cut the model into more stages (pipeline_stages), or give the Python workers more "
                              "memory")
        torch.manual_seed(self.config.seed + env.rank)   # dropout and other randomness differ per task
        self.module = build_stage(spec.model_fn, layout, self.index, device)
        lo, hi = layout.buffer_spans[self.index]
        if hi > lo:
            load_flat_buffers(self.module, torch.from_numpy(spec.pipeline.float_buffers[lo:hi].copy()))
        self.replica = FlatReplica(self.module, device)
        on_cpu = device.type == "cpu"
        # On a GPU the wire needs pinned host buffers; on CPU the replica's own buffers go on the wire.
        size = self.replica.weights.numel()
        self.wire_weights = self.replica.weights if on_cpu else torch.empty(size, pin_memory=True)
        self.wire_grads = self.replica.grads if on_cpu else torch.empty(size, pin_memory=True)
        self.stage = PipelineStage(self.module, self.index, self.stages, device, group=group)
        self.schedule = make_schedule(self.stage, self.config)
        self.timer = StageTimer(device)
        self.timer.wrap(self.stage, sends_forward=not self.is_last)
        self.call = model_call(spec, self.module)
        self.version = 0

    def hello(self, partition_rows: int, barrier_attempt: int) -> tuple[int, int]:
        """Join the replica's PS session (or say hello to this stage's PS shard as the replica's worker);
        returns (steps per epoch, mini-batches already consumed)."""
        part = None if self.spec.ps_shards else (self.index, self.stages)
        welcome = self.client.hello(partition_rows, self.wire_weights, barrier_attempt, part=part)
        if self.wire_weights is not self.replica.weights:
            self.replica.weights.copy_(self.wire_weights)
        self.version = welcome.version
        return welcome.steps_per_epoch, welcome.position

    def step(self, batch: Batch | None) -> float:
        """Run one mini-batch through the schedule; this stage's gradient accumulates in ``replica.grads``.

        Returns the mini-batch's mean loss on the last stage, 0 elsewhere.
        """
        losses: list[torch.Tensor] = []
        if self.is_first:
            assert batch is not None and batch.labels is not None   # the first stage reads labelled training rows
            if batch.weights is not None:
                raise DataError("pipeline stages weigh every row alike: train rows of (features, label), without "
                                "a weight, with pipeline_stages > 1")
            if self.config.sequence_length is None and any(mask is not None for mask in batch.masks):
                raise DataError("pipeline stages fix their activation shapes at the first step, so ragged inputs "
                                "(sequences of varying length) need one length: set sequence_length")
            if self.stages > 1:
                _send_labels(batch.labels, self.last_rank)
            args, kwargs = self.call.arguments(batch.inputs, batch.masks)
            self.schedule.step(*args, **kwargs, return_outputs=False)
        elif self.is_last:
            self.schedule.step(target=_receive_labels(self.first_rank, self.device), losses=losses,
                               return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        return float(sum(value.item() for value in losses))

    def warm_up(self, batch: Batch | None) -> None:
        """Let the schedule infer the shapes between stages on a step whose effects are undone.

        ``torch.distributed.pipelining`` infers them at its first step by running each stage's
        forward once more, on the first micro-batch (stage 0) or on uninitialised tensors of the
        right shape (the others).  In training mode that extra forward would update BatchNorm
        statistics and draw dropout randomness; so it runs in eval mode, and the step's
        gradient, buffer changes and timings are discarded.
        """
        buffers = [b.detach().clone() for b in self.module.buffers()]
        self.module.eval()
        self.step(batch)
        self.module.train()
        self.replica.zero_grads()
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), buffers, strict=True):
                buffer.copy_(saved)
        self.timer.reset()

    def exchange(self, loss: float, epoch: int) -> bool:
        """Push this stage's gradient range, pull its new weights; returns whether the push was used."""
        if self.wire_grads is not self.replica.grads:
            self.wire_grads.copy_(self.replica.grads)
        samples = self.config.batch_size   # every mini-batch is full (sync plans)
        if bool(torch.isfinite(self.wire_grads.sum())):
            self.version, used = self.client.push_pull(self.wire_grads, self.version, samples, loss, epoch,
                                                       self.wire_weights)
        else:
            self.version, used = self.client.push_nonfinite(self.version, samples, loss, epoch, self.wire_weights)
        if self.wire_weights is not self.replica.weights:
            self.replica.weights.copy_(self.wire_weights)
        self.replica.zero_grads()
        return used


def train_stage(env: TaskEnv, task: StageTask, data: PartitionBatches | None, attempt: int,
                partition_rows: int | None = None) -> dict[str, Any]:
    """Train this task's stage for the whole plan; return its summary.

    ``attempt`` is shared by every task of this barrier-stage attempt and grows with every retry
    (sparkdl's or Spark's own re-run of the stage): the session all stages of the replica join.
    ``partition_rows``: the replica's rows, said in the hello (default: this task's own, if it has data).
    """
    started = time.perf_counter()
    config = task.config
    if partition_rows is None:
        partition_rows = data.rows if data is not None else 0
    steps, position = task.hello(partition_rows, attempt)
    start = min(position, steps * config.epochs)
    task.module.train()
    counters = LoopCounters()
    # closing: leaving early (an error) also stops the loader's thread
    with contextlib.closing(_planned_batches(data, config, task.replica_id, steps, start)) as planned:
        for step, (epoch, batch) in enumerate(planned):
            if step == 0:
                task.warm_up(batch)
            t0 = time.perf_counter()
            with task.timer.step():
                loss = task.step(batch)
            t1 = time.perf_counter()
            counters.accepted += task.exchange(loss, epoch)
            counters.exchanges += 1
            counters.compute_seconds += t1 - t0
            counters.communication_seconds += time.perf_counter() - t1
    counters.batches = pushes = counters.exchanges
    samples = pushes * config.batch_size
    counters.samples = samples if task.is_first else 0   # the replica's samples are counted once, by its first stage
    buffers = flatten_buffers(task.replica.model)
    task.client.done(samples, buffers if samples and buffers.numel() else None)
    return {**summary_fields(task.replica_id, env.task_attempt, data.rows if data is not None else 0, steps, start,
                             counters, started, task.client.bytes_pushed, task.client.bytes_pulled, task.device),
            "pipeline_stage": task.index, "transport": "tcp",
            "parameter_bytes": task.replica.weights.numel() * 4, "bubble": task.timer.bubble if pushes else None,
            "ideal_bubble": ideal_bubble(task.stages, config.micro_batches),
            "peak_live_micro_batches": task.timer.peak_live_micro_batches,
            "forward_bytes_per_step": task.timer.forward_bytes}


def _pipeline_group(env: TaskEnv, stages: int) -> dist.ProcessGroup | None:
    """This replica's pipeline group (None: the whole world is one replica); every rank creates
    every group, in the same order."""
    replicas = dist.get_world_size() // stages
    mine = None
    for replica in range(replicas if replicas > 1 else 0):
        group = dist.new_group(list(range(replica * stages, (replica + 1) * stages)))
        if replica == env.rank // stages:
            mine = group
    return mine


def pipeline_worker(env: TaskEnv, rows: Iterator[Any], read_chunks: ChunksFn) -> dict[str, Any]:
    """The barrier task body of pipeline training: a failure's traceback is handed to the driver via the PS."""
    if env.spec.ps_shards:
        return _stage_with_shards(env, rows, read_chunks)
    spec = env.spec
    assert spec.pipeline is not None   # a pipeline run's spec carries its stage layout
    stages = spec.pipeline.layout.num_stages
    replica_id, index = divmod(env.rank, stages)
    client = PSClient(spec.ps_host, spec.ps_port, spec.secret, replica_id, spec.config.timeout_s, spec.tls_cert_pem)
    # Spark's task attempt ids grow with every retry: a later attempt's tasks all have larger ids
    # than any earlier attempt's, so the PS can tell a stale stage task's report
    report = functools.partial(client.report_failure, part_attempt=env.task_attempt)
    try:
        with failure_reported(report):
            device = select_device(spec.config.device, gpu_addresses(env.context.resources()))
            with (process_group(env, device, spec.config.timeout_s, task_attempt=env.task_attempt) as gathered,
                  failure_reported(report)):   # reported before the group's teardown fails the partners
                attempt = min(g["task_attempt"] for g in gathered)
                task = StageTask(env, device, client, _pipeline_group(env, stages))
                if index > 0:   # only the first stage of a replica reads data
                    env.context.barrier()   # say hello once the first stages hold their partitions (they may be slow)
                    return train_stage(env, task, None, attempt)
                with open_partition(env, rows, read_chunks, device) as (data, cached):
                    env.context.barrier()
                    summary = train_stage(env, task, data, attempt)
                return {**summary, **partition_summary(cached)}
    finally:
        client.close()


def _stage_with_shards(env: TaskEnv, rows: Iterator[Any], read_chunks: ChunksFn) -> dict[str, Any]:
    """A stage task when the PS is sharded by stage over the executors (``ps_hosts="executors"``).

    Task p (stage p of replica 0) hosts PS shard p, which holds stage p's key range; the
    stage-p task of every replica pushes to it as that replica's worker, so each shard runs
    its own sync rounds over the replicas and no gradient is assembled anywhere.  The
    rendezvous's one ``allGather`` carries the shards' addresses and each replica's partition
    size, so first stages open their partitions before it.
    """
    spec, config = env.spec, env.spec.config
    assert spec.pipeline is not None   # a pipeline run's spec carries its stage layout
    layout = spec.pipeline.layout
    stages = layout.num_stages
    replica_id, index = divmod(env.rank, stages)
    host = client = None
    report = functools.partial(report_failure_to, (spec.ps_host, spec.ps_port), spec.secret, replica_id,
                               config.timeout_s, spec.tls_cert_pem, attempt=spec.barrier_attempt)
    try:
        with failure_reported(report):
            device = select_device(config.device, gpu_addresses(env.context.resources()))
            if env.rank < stages:
                lo, hi = layout.buffer_spans[index]
                host = ShardHost(env, index, list(spec.tensor_sizes), hi - lo)
            address = host.start() if host is not None else ""
            with contextlib.ExitStack() as stack:
                data, cached = (stack.enter_context(open_partition(env, rows, read_chunks, device)) if index == 0
                                else (None, None))
                with (process_group(env, device, config.timeout_s, shard=address,
                                    rows=data.rows if data is not None else 0) as gathered,
                      failure_reported(report)):   # reported before the group's teardown fails the partners
                    shard_host, port = gathered[index]["shard"].rsplit(":", 1)
                    client = PSClient(shard_host, int(port), spec.secret, replica_id, config.timeout_s,
                                      spec.tls_cert_pem, shard=index)
                    task = StageTask(env, device, client, _pipeline_group(env, stages))
                    # the plan is the replica's: its first stage's partition size
                    partition_rows = gathered[replica_id * stages]["rows"]
                    summary = train_stage(env, task, data, env.task_attempt, partition_rows)
                if host is not None:
                    host.finish()
                return {**summary, **(partition_summary(cached) if cached is not None else {}),
                        **({"ps_shard": host.shard} if host is not None else {})}
    finally:
        if client is not None:
            client.close()
        if host is not None:
            host.close()
