"""Executor side of parameter-server training: one replica pushing to and pulling from the PS."""
from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Iterator
from typing import Any, cast

import torch

from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.data.partitions import PartitionBatches
from sparkdl._internal.modes.executor_shards.host import ShardHost
from sparkdl._internal.ps.server.policy import takes_full_batches
from sparkdl._internal.ps.shards.ranges import clip_tensor_sizes
from sparkdl._internal.ps.wire.compression import make_codec
from sparkdl._internal.ps.worker.client import PSClient, TableRows, failure_reported, report_failure_to
from sparkdl._internal.ps.worker.overlap import overlapped_exchange
from sparkdl._internal.ps.worker.remote_embedding import RemoteEmbedding
from sparkdl._internal.ps.worker.sharded_client import ShardedClient
from sparkdl._internal.spark.devices import gpu_addresses, select_device
from sparkdl._internal.spark.task import JobSpec, TaskEnv, build_replica, model_call, open_partition, partition_summary
from sparkdl._internal.training.flat import flatten_buffers, load_flat_buffers
from sparkdl._internal.training.loop import LoopPlan, evaluate, holdout_split, run_step_loop, task_summary
from sparkdl._internal.training.losses import metric_sum, resolve_loss
from sparkdl._internal.training.optim import make_optimizer, tensor_layout
from sparkdl._internal.training.precision import worker_precision
from sparkdl._internal.training.steps import EpochTotals, TrainStep
from sparkdl.transforms import resolve_transform

#: work units: the run (its secret) whose buffers this Python worker's last task ended with, and those buffers
_carried_buffers: dict[bytes, torch.Tensor] = {}


def train_replica(worker: int, data: PartitionBatches, spec: JobSpec, device: torch.device,
                  client: PSClient | ShardedClient,
                  task_attempt: int = 0) -> dict[str, Any]:
    """Train one replica on its partition against the parameter server; return its summary."""
    started = time.perf_counter()
    config = spec.config
    # tables pull their rows through this worker's client (each row from the PS shard that holds it)
    replica = build_replica(spec, worker, device, TableRows(client, spec.tables))
    table_index = {table.name: i for i, table in enumerate(spec.tables)}
    remote_tables = [(table_index[m.name], m) for m in replica.model.modules() if isinstance(m, RemoteEmbedding)]
    precision = worker_precision(config.precision, device, replica.model.parameters())
    on_cpu = device.type == "cpu"
    # On a GPU the wire needs host buffers; on CPU the replica's own buffers go on the wire.
    wire_weights = replica.weights if on_cpu else torch.empty_like(replica.weights, device="cpu").pin_memory()
    wire_grads = replica.grads if on_cpu else torch.empty_like(replica.grads, device="cpu").pin_memory()
    # work units: this task trains one epoch of one unit (and holds out the same rows of it in every epoch)
    unit_epoch, unit = divmod(worker, config.work_units) if config.work_units else (None, worker)
    carried = _carried_buffers.get(spec.secret) if unit_epoch is not None else None
    if carried is not None:
        # BatchNorm statistics ... go on from this Python worker's previous unit of the run: begun from the
        # initial ones, a pass of a few mini-batches would leave them near those
        load_flat_buffers(replica.model, carried)
    held_out = None
    if config.validation_fraction and data.has_labels:
        train_rows, val_rows = holdout_split(data.rows, config.validation_fraction, config.seed, unit)
        data, held_out = data.subset(train_rows), data.subset(val_rows)
    # Overlapped, a pipelined policy asks for a double-buffered segment (the PS's host).  Sync asks
    # for a plain one: there its exchange costs less than streaming hides (docs/design/overlap.md#on-the-ps-host).
    # Without a segment (another host) a CPU replica streams: the gradient during backward, and
    # under sync the reply into the next forward.
    pipelined = config.overlap_communication and config.policy != "sync"
    welcome = client.hello(data.rows, wire_weights, task_attempt, shared_memory=config.ps_transport == "auto",
                           double=pipelined, wait_for_turn=bool(config.work_units))
    if welcome.has_weights and not on_cpu:
        replica.weights.copy_(wire_weights)
    if client.segment is not None:
        # same host as the PS: gradients and weights move through shared memory; on CPU the replica
        # trains in the segment itself, so nothing is copied at all
        if on_cpu:
            replica.rebind(client.segment.weights, client.segment.gradient)
            wire_weights, wire_grads = replica.weights, replica.grads
        else:
            wire_weights, wire_grads = client.segment.weights, client.segment.gradient
    version = welcome.version
    overlap = config.overlap_communication and (
        client.segment.regions == 2 if client.segment is not None else on_cpu)
    # a sharded client compresses range by range itself
    codec = make_codec("none" if isinstance(client, ShardedClient) else config.compression,
                       replica.grads.numel(), config.topk_ratio,
                       [p.numel() for p in replica.model.parameters()], seed=config.seed * 7919 + worker)
    local_sgd = config.local_update == "sgd"
    # local SGD: the worker's own optimizer steps every mini-batch; the push is the model delta
    # since the weights it last received (its "anchor")
    anchor = replica.weights.clone() if local_sgd else None
    local_optimizer = (make_optimizer(config, replica.weights, tensor_layout(replica.model.parameters()))
                       if local_sgd else None)   # steps the replica

    def local_step() -> None:
        assert local_optimizer is not None   # local_step runs for local SGD only
        if precision.unscale():   # a float16 step whose gradient overflowed is skipped
            local_optimizer.step(replica.grads)
        replica.zero_grads()

    def push_pull(divisor: float, samples: int, loss: float, epoch: int, weight: float | None) -> tuple[bool, bool]:
        nonlocal version
        if local_sgd:
            assert anchor is not None   # made for local SGD
            torch.sub(anchor, replica.weights, out=replica.grads)
        elif divisor != 1.0 and divisor > 0:   # gradient accumulation: the weighted mean of the mini-batches
            replica.grads.div_(divisor)
        if not local_sgd and not precision.unscale():
            # the loss scaler skips this step: push a zero gradient of weight 0, which the PS averages in as
            # nothing (a sync round still completes) and never counts as non-finite
            replica.grads.zero_()
            weight = 0.0
        if not on_cpu:
            wire_grads.copy_(replica.grads)
        rows = [(index, touched) for index, table in remote_tables
                if (touched := table.take_touched()) is not None and touched.ids.numel()]
        # NaN/Inf are caught before encoding (a lossy codec's residual must never absorb them), in the rows too:
        # every PS shard then refuses the step alike
        if bool(torch.isfinite(wire_grads.sum())) and all(bool(torch.isfinite(t.grads.sum())) for _, t in rows):
            for index, touched in rows:     # the rows the step touched go right before its push
                client.push_rows(index, touched.ids,
                                 touched.grads / divisor if divisor != 1.0 and divisor > 0 else touched.grads)
            version, accepted = client.push_pull(codec.encode(wire_grads), version, samples, loss, epoch,
                                                 wire_weights, weight)
        else:
            version, accepted = client.push_nonfinite(version, samples, loss, epoch, wire_weights, weight)
        if not on_cpu:
            replica.weights.copy_(wire_weights)
        if local_sgd:
            assert anchor is not None
            anchor.copy_(replica.weights)
        replica.zero_grads()
        return accepted, client.stop_requested

    # A global sample budget: train until the PS says it is spent, drawing from this partition.
    budget = (config.sample_budget == "global" and config.policy in ("async", "softsync", "softsync_nodes")
              and unit_epoch is None)
    # A retried task continues where the PS says its gradients stopped, not from epoch 0; a unit's task
    # trains its epoch's pass only (the PS counts the position within it).
    first = 0 if unit_epoch is None else unit_epoch * welcome.steps_per_epoch
    plan = LoopPlan(worker, data.rows, welcome.steps_per_epoch,
                    None if budget else config.epochs if unit_epoch is None else unit_epoch + 1,
                    config.batch_size, config.local_steps, config.seed, config.shuffle,
                    takes_full_batches(config.policy), start_batch=first + welcome.position)
    loss_fn = resolve_loss(config.loss)
    call = model_call(spec, replica.model)

    step = TrainStep(loss_fn, call, resolve_transform(config.train_step, "train_step"))
    totals = EpochTotals()

    def validate(epoch: int) -> bool:
        if held_out is None or ((epoch + 1) % config.validation_every and epoch + 1 != config.epochs):
            return False
        loss_sum, metric_total = evaluate(replica, loss_fn, functools.partial(metric_sum, config.loss), held_out,
                                          call=call)
        return client.validation(epoch, held_out.rows, loss_sum, metric_total)

    # executor-hosted shards keep no per-epoch metrics (callbacks need the driver's PS); without a trainStep
    # or callbacks nothing is sent, and an overlapped exchange is not settled at every epoch's end
    reporter = client if spec.report_epochs and isinstance(client, PSClient) else None

    def epoch_end(epoch: int) -> bool:
        """Validation, then the epoch's loss and trainStep metrics to the driver (its callbacks may stop)."""
        stop = validate(epoch)
        rows, sums = totals.take()
        if reporter is not None:
            stop = reporter.epoch_end(epoch, rows, sums) or stop
        return stop

    at_epoch_end = epoch_end if reporter is not None or held_out is not None else None

    if overlap:
        # a sharded PS refuses overlap_communication before launch (sparkdl._internal.combinations.shard_refusal)
        overlapped = overlapped_exchange(cast(PSClient, client), replica, version, pipelined=config.policy != "sync",
                                        timeout_s=config.timeout_s)

        def epoch_end_settled(epoch: int) -> bool:
            overlapped.settle()     # the socket is free and the newest weights are in place
            return epoch_end(epoch)

        try:
            # (float16 loss scaling is refused with overlap: sparkdl._internal.combinations.overlap_refusal)
            counters = run_step_loop(replica, step, data, plan, overlapped.exchange, None,
                                     epoch_end_settled if at_epoch_end is not None else None,
                                     overlapped.before_backward, call, precision, totals)
            overlapped.settle()
        finally:
            overlapped.close()
        # the forward's waits for arriving weights are communication, not compute
        counters.compute_seconds -= overlapped.weights_wait_seconds
        counters.communication_seconds += overlapped.weights_wait_seconds
    else:
        counters = run_step_loop(replica, step, data, plan, push_pull, local_step if local_sgd else None,
                                 at_epoch_end, call=call, precision=precision, totals=totals)
    if counters.stopped_in_epoch is not None and counters.stopped_in_epoch < config.epochs and at_epoch_end:
        # the sample budget was spent (or early stopping fired) inside an epoch of the run: this worker's part of
        # it is still that epoch's, whose row waits for its report (the PS drops those after an early stop)
        epoch_end(counters.stopped_in_epoch)
    buffers = flatten_buffers(replica.model) if counters.samples else None
    if unit_epoch is not None and buffers is not None and buffers.numel():
        _carried_buffers.clear()    # one run's at a time
        _carried_buffers[spec.secret] = buffers
    client.done(counters.samples, buffers)
    summary = task_summary(plan, counters, task_attempt, started, client.bytes_pushed, client.bytes_pulled, device)
    if unit_epoch is not None:
        summary.update(unit=unit, unit_epoch=unit_epoch, resumed_at_batch=welcome.position,
                       buffers_carried=carried is not None)
    return {**summary, "transport": client.transport, "transport_note": client.transport_note,
            "overlapped": overlap, "amp_skipped_steps": precision.skipped_steps}


def ps_worker(env: TaskEnv, rows: Iterator[Any], read_chunks: ChunksFn) -> dict[str, Any]:
    """The barrier task body of PS training: a failure's traceback is handed to the driver via the PS.

    With executor-hosted shards, task i first starts PS shard i; the tasks swap the shards'
    addresses in one ``allGather`` and every worker connects to every shard.
    """
    spec = env.spec
    host = None
    client: PSClient | ShardedClient
    try:
        if spec.ps_shards:
            host, client = _connect_shards(env)
        else:
            client = PSClient(spec.ps_host, spec.ps_port, spec.secret, env.rank, spec.config.timeout_s,
                              spec.tls_cert_pem)
        try:
            with failure_reported(client.report_failure):
                device = select_device(spec.config.device, gpu_addresses(env.context.resources()))
                with open_partition(env, rows, read_chunks, device) as (data, cached):
                    summary = train_replica(env.rank, data, spec, device, client, env.task_attempt)
                if host is not None:
                    host.finish()
                return {**summary, **partition_summary(cached), **({"ps_shard": host.shard} if host else {})}
        finally:
            client.close()
    finally:
        if host is not None:
            host.close()


def _connect_shards(env: TaskEnv) -> tuple[ShardHost | None, ShardedClient]:
    """Start this task's PS shard (tasks below the shard count), learn every shard's address, connect."""
    spec, config = env.spec, env.spec.config
    tensor_sizes = list(spec.tensor_sizes)
    # shard 0 pools the BatchNorm statistics ...
    host = (ShardHost(env, env.rank, tensor_sizes, spec.float_buffer_count if env.rank == 0 else 0)
            if env.rank < len(spec.ps_shards) else None)
    clients: list[PSClient] = []
    try:
        address = host.start() if host is not None else ""
        addresses = env.context.allGather(address)[:len(spec.ps_shards)]
        for shard, where in enumerate(addresses):
            shard_host, port = where.rsplit(":", 1)
            clients.append(PSClient(shard_host, int(port), spec.secret, env.rank, config.timeout_s, spec.tls_cert_pem,
                                    shard=shard))
    except BaseException:
        for client in clients:
            client.close()
        if host is not None:
            host.close()
        report_failure_to((spec.ps_host, spec.ps_port), spec.secret, env.rank, config.timeout_s, spec.tls_cert_pem,
                          traceback.format_exc(), spec.barrier_attempt)
        raise
    codecs = [make_codec(config.compression, hi - lo, config.topk_ratio, clip_tensor_sizes(tensor_sizes, (lo, hi)),
                         seed=config.seed * 7919 + env.rank * 131 + shard)
              for shard, (lo, hi) in enumerate(spec.ps_shards)]
    return host, ShardedClient(clients, list(spec.ps_shards), codecs, (spec.ps_host, spec.ps_port), spec.secret,
                               config.timeout_s, spec.tls_cert_pem, spec.barrier_attempt)
