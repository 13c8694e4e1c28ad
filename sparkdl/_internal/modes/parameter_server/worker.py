"""Executor side of parameter-server training: one replica pushing to and pulling from the PS."""
from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from sparkdl._internal.data.block import Batch
from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.data.partitions import PartitionBatches
from sparkdl._internal.modes.executor_shards.host import ShardHost
from sparkdl._internal.modes.parameter_server.work_units import CARRIED, WorkUnit
from sparkdl._internal.ps.server.policy import takes_full_batches
from sparkdl._internal.ps.shards.ranges import clip_tensor_sizes
from sparkdl._internal.ps.wire.compression import make_codec
from sparkdl._internal.ps.worker.client import PSClient, TableRows, Welcome, failure_reported, report_failure_to
from sparkdl._internal.ps.worker.overlap import overlapped_exchange
from sparkdl._internal.ps.worker.remote_embedding import RemoteEmbedding
from sparkdl._internal.ps.worker.sharded_client import ShardedClient
from sparkdl._internal.ps.worker.table_prefetch import call_tensors
from sparkdl._internal.spark.devices import gpu_addresses, select_device
from sparkdl._internal.spark.task import JobSpec, TaskEnv, build_replica, model_call, open_partition, partition_summary
from sparkdl._internal.training.flat import FlatReplica, flatten_buffers
from sparkdl._internal.training.inputs import POSITIONAL, ModelCall
from sparkdl._internal.training.loop import LoopCounters, LoopPlan, evaluate, holdout_split, run_step_loop, task_summary
from sparkdl._internal.training.losses import metric_sum, resolve_loss
from sparkdl._internal.training.optim import make_optimizer, tensor_layout
from sparkdl._internal.training.precision import MixedPrecision, worker_precision
from sparkdl._internal.training.steps import EpochTotals, TrainStep
from sparkdl.config import TrainConfig
from sparkdl.transforms import resolve_transform


@dataclass
class _Wire:
    """Where the replica's weights arrive and its gradients leave: its own buffers (CPU), pinned host copies
    (a GPU), or the PS's shared-memory segment (the PS's host)."""

    weights: torch.Tensor
    grads: torch.Tensor
    on_cpu: bool
    #: the exchange overlaps compute (overlap_communication, where the connection allows it)
    overlap: bool


def train_replica(worker: int, data: PartitionBatches, spec: JobSpec, device: torch.device,
                  client: PSClient | ShardedClient,
                  task_attempt: int = 0) -> dict[str, Any]:
    """Train one replica on its partition (or its work unit's pass) against the parameter server; its summary."""
    started = time.perf_counter()
    config = spec.config
    # tables pull their rows through this worker's client (each row from the PS shard that holds it)
    replica = build_replica(spec, worker, device, TableRows(client, spec.tables))
    precision = worker_precision(config.precision, device, replica.model.parameters())
    unit = WorkUnit.of(config, worker)
    carried = unit is not None and CARRIED.load_into(spec.secret, replica.model)
    held_out = None
    if config.validation_fraction and data.has_labels:
        train_rows, val_rows = (holdout_split(data.rows, config.validation_fraction, config.seed, worker) if unit is None
                                else unit.held_out(data.rows, config.validation_fraction, config.seed))
        data, held_out = data.subset(train_rows), data.subset(val_rows)
    wire, welcome = _say_hello(client, replica, data.rows, spec, device, task_attempt)
    # A global sample budget: train until the PS says it is spent, drawing from this partition.  A retried
    # task continues where the PS says its gradients stopped; a unit's task trains its epoch's pass only.
    budget = config.sample_budget == "global" and config.policy in ("async", "softsync", "softsync_nodes") and not unit
    plan = LoopPlan(worker, data.rows, welcome.steps_per_epoch,
                    None if budget else config.epochs if unit is None else unit.epoch + 1,
                    config.batch_size, config.local_steps, config.seed, config.shuffle,
                    takes_full_batches(config.policy),
                    start_batch=(0 if unit is None else unit.first_batch(welcome.steps_per_epoch)) + welcome.position)
    call = model_call(spec, replica.model)
    reports = _EpochReports(config, replica, call, held_out, client, spec.report_epochs)
    step = TrainStep(reports.loss_fn, call, resolve_transform(config.train_step, "train_step"))
    if wire.overlap:
        counters = _train_overlapped(replica, step, data, plan, cast(PSClient, client), welcome.version, reports,
                                     call, precision, config)
    else:
        exchange = _PushPull(replica, wire, client, spec, worker, precision, welcome.version, call)
        counters = run_step_loop(replica, step, data, plan, exchange.push_pull,
                                 exchange.local_step if exchange.local_sgd else None, reports.at_epoch_end,
                                 call=call, precision=precision, totals=reports.totals,
                                 lookahead=exchange.look_ahead if exchange.prefetch is not None else None)
    if counters.stopped_in_epoch is not None and counters.stopped_in_epoch < config.epochs and reports.at_epoch_end:
        # the sample budget was spent (or early stopping fired) inside an epoch of the run: this worker's part of
        # it is still that epoch's, whose row waits for its report (the PS drops those after an early stop)
        reports.epoch_end(counters.stopped_in_epoch)
    buffers = flatten_buffers(replica.model) if counters.samples else None
    if unit is not None and buffers is not None:
        CARRIED.keep(spec.secret, buffers)
    client.done(counters.samples, buffers)
    summary = task_summary(plan, counters, task_attempt, started, client.bytes_pushed, client.bytes_pulled, device)
    if unit is not None:
        # the Python worker that ran the unit: a reused one carries its statistics to its next unit
        summary.update(unit.summary(welcome.position, carried), python_worker=os.getpid())
    return {**summary, "round_trips": client.round_trips, "transport": client.transport,
            "transport_note": client.transport_note,
            "shared_tables": isinstance(client, PSClient) and client.shared_rows is not None,
            "overlapped": wire.overlap, "amp_skipped_steps": precision.skipped_steps}


def _say_hello(client: PSClient | ShardedClient, replica: FlatReplica, rows: int, spec: JobSpec,
               device: torch.device, task_attempt: int) -> tuple[_Wire, Welcome]:
    """Say hello (waiting for a work unit's turn), take the PS's weights, and choose the wire buffers."""
    config = spec.config
    on_cpu = device.type == "cpu"
    # On a GPU the wire needs host buffers; on CPU the replica's own buffers go on the wire.
    weights = replica.weights if on_cpu else torch.empty_like(replica.weights, device="cpu").pin_memory()
    grads = replica.grads if on_cpu else torch.empty_like(replica.grads, device="cpu").pin_memory()
    # Overlapped, a pipelined policy asks for a double-buffered segment (the PS's host).  Sync asks
    # for a plain one: there its exchange costs less than streaming hides (docs/design/overlap.md#on-the-ps-host).
    # Without a segment (another host) a CPU replica streams: the gradient during backward, and
    # under sync the reply into the next forward.
    pipelined = config.overlap_communication and config.policy != "sync"
    # the replica may compute on the PS's master in place (sync on its host) unless it steps its own weights
    welcome = client.hello(rows, weights, task_attempt, shared_memory=config.ps_transport == "auto",
                           double=pipelined, wait_for_turn=bool(config.work_units),
                           master=config.local_update != "sgd",
                           # on the PS's host the tables may be stepped in place (shared_tables)
                           tables=spec.tables if config.shared_tables else (), table_slots=config.worker_slots + 1)
    if welcome.has_weights and not on_cpu:
        replica.weights.copy_(weights)
    segment = client.segment
    if segment is not None:
        # same host as the PS: gradients and weights move through shared memory; on CPU the replica
        # trains in the segment itself, so nothing is copied at all
        if on_cpu:
            replica.rebind(segment.weights, segment.gradient)
            weights, grads = replica.weights, replica.grads
        else:
            weights, grads = segment.weights, segment.gradient
    overlap = config.overlap_communication and (segment.regions == 2 if segment is not None else on_cpu)
    return _Wire(weights, grads, on_cpu, overlap), welcome


class _PushPull:
    """The exchange after every ``local_steps`` mini-batches: push the gradient (or local SGD's model delta) with
    the touched table rows, pull the new weights; and local SGD's own optimizer step."""

    def __init__(self, replica: FlatReplica, wire: _Wire, client: PSClient | ShardedClient, spec: JobSpec,
                 worker: int, precision: MixedPrecision, version: int, call: ModelCall = POSITIONAL) -> None:
        config = spec.config
        self.replica, self.wire, self.client, self.precision, self.version = replica, wire, client, precision, version
        self.call = call
        self.tables = TableRows(client, spec.tables)    # by name: each table's index in the run and row width
        self.remote_tables = [(self.tables.index[m.name][0], m) for m in replica.model.modules()
                              if isinstance(m, RemoteEmbedding)]
        # under sync the next call's table rows come with each push (one round trip a step), where a push is one
        # message (one PS: a sharded client's goes to every shard); under the asynchronous policies the pull
        # stays before the forward, where the PS serves it while this worker reads and plans its batch (with
        # the pull behind the push, async MovieLens ran 13-26 % slower on 2 cores; docs/benchmarks.md)
        self.prefetch = next((m.prefetch for _, m in self.remote_tables if m.prefetch is not None), None) \
            if isinstance(client, PSClient) and config.policy == "sync" else None
        # a sharded client compresses range by range itself
        self.codec = make_codec("none" if isinstance(client, ShardedClient) else config.compression,
                                replica.grads.numel(), config.topk_ratio,
                                [p.numel() for p in replica.model.parameters()], seed=config.seed * 7919 + worker)
        # local SGD: the worker's own optimizer steps every mini-batch; the push is the model delta
        # since the weights it last received (its "anchor")
        self.local_sgd = config.local_update == "sgd"
        self.anchor = replica.weights.clone() if self.local_sgd else None
        self.local_optimizer = (make_optimizer(config, replica.weights, tensor_layout(replica.model.parameters()))
                                if self.local_sgd else None)

    def look_ahead(self, batch: Batch) -> None:
        """The next mini-batch, known before this step's push: its tables' rows are pulled right behind the push."""
        assert self.prefetch is not None and isinstance(self.client, PSClient)   # the loop looks ahead only then
        args, kwargs = self.call.arguments(batch.inputs, batch.masks)
        requests = self.prefetch.plan_ahead(call_tensors(args, kwargs))
        self.client.pull_after_push([(self.tables.index[name][0], ids, self.tables.index[name][1])
                                     for name, ids in requests])

    def local_step(self) -> None:
        assert self.local_optimizer is not None   # local_step runs for local SGD only
        if self.precision.unscale():   # a float16 step whose gradient overflowed is skipped
            self.local_optimizer.step(self.replica.grads)
        self.replica.release_grads()

    def push_pull(self, divisor: float, samples: int, loss: float, epoch: int, weight: float | None) -> tuple[bool, bool]:
        replica, wire, client = self.replica, self.wire, self.client
        if self.anchor is not None:
            torch.sub(self.anchor, replica.weights, out=replica.grads)
        elif divisor != 1.0 and divisor > 0:   # gradient accumulation: the weighted mean of the mini-batches
            replica.grads.div_(divisor)
        if not self.local_sgd and not self.precision.unscale():
            # the loss scaler skips this step: push a zero gradient of weight 0, which the PS averages in as
            # nothing (a sync round still completes) and never counts as non-finite
            replica.grads.zero_()
            weight = 0.0
        rows = [(index, touched) for index, table in self.remote_tables
                if (touched := table.take_touched()) is not None and touched.ids.numel()]
        # NaN/Inf are caught before encoding (a lossy codec's residual must never absorb them), in the rows too:
        # every PS shard then refuses the step alike.  The one check of this gradient (the PS trusts it) runs
        # where the gradient is: on the replica's device.
        finite = bool(torch.isfinite(replica.grads.sum())) and all(bool(torch.isfinite(t.grads.sum())) for _, t in rows)
        if finite:
            if not wire.on_cpu:
                wire.grads.copy_(replica.grads)
            # the rows the step touched go right before its push; rows stepped here in shared memory are left alone
            # by a push that weighs nothing (a loss-scaler skip, zero row weights), which the PS would not apply
            stepped_here = isinstance(client, PSClient) and client.shared_rows is not None
            for index, touched in rows if weight != 0.0 or not stepped_here else ():
                client.push_rows(index, touched.ids,
                                 touched.grads / divisor if divisor != 1.0 and divisor > 0 else touched.grads)
            self.version, accepted = client.push_pull(self.codec.encode(wire.grads), self.version, samples, loss,
                                                      epoch, wire.weights, weight)
        else:
            self.version, accepted = client.push_nonfinite(self.version, samples, loss, epoch, wire.weights, weight)
        if self.prefetch is not None:    # the next call's rows, if the loop looked ahead
            self.prefetch.receive_ahead(cast(PSClient, client).rows_after_push)
        master = client.master if isinstance(client, PSClient) else None
        if master is not None:
            # sync on the PS's host: the round's step wrote the weights into the shared master, which the replica
            # computes on from its first reply on (a round steps only once every worker in it waits)
            if not wire.on_cpu:
                replica.weights.copy_(master.weights)
            elif replica.weights.data_ptr() != master.weights.data_ptr():
                replica.use_weights(master.weights)
                wire.weights = master.weights
        elif not wire.on_cpu:
            replica.weights.copy_(wire.weights)
        if self.anchor is not None:
            self.anchor.copy_(replica.weights)
        replica.release_grads()
        return accepted, client.stop_requested


class _EpochReports:
    """At each epoch's end: validation on the held-out rows, then the epoch's loss and trainStep metrics to the
    driver (whose callbacks may stop training)."""

    def __init__(self, config: TrainConfig, replica: FlatReplica, call: ModelCall,
                 held_out: PartitionBatches | None, client: PSClient | ShardedClient, report_epochs: bool) -> None:
        self.config, self.replica, self.call, self.held_out, self.client = config, replica, call, held_out, client
        self.loss_fn = resolve_loss(config.loss)
        self.totals = EpochTotals()
        # executor-hosted shards keep no per-epoch metrics (callbacks need the driver's PS); without a trainStep
        # or callbacks nothing is sent, and an overlapped exchange is not settled at every epoch's end
        self.reporter = client if report_epochs and isinstance(client, PSClient) else None

    @property
    def at_epoch_end(self) -> Callable[[int], bool] | None:
        """What the step loop calls after every epoch (None: nothing to do)."""
        return self.epoch_end if self.reporter is not None or self.held_out is not None else None

    def validate(self, epoch: int) -> bool:
        config, held_out = self.config, self.held_out
        if held_out is None or ((epoch + 1) % config.validation_every and epoch + 1 != config.epochs):
            return False
        loss_sum, metric_total = evaluate(self.replica, self.loss_fn, functools.partial(metric_sum, config.loss),
                                          held_out, call=self.call)
        return self.client.validation(epoch, held_out.rows, loss_sum, metric_total)

    def epoch_end(self, epoch: int) -> bool:
        stop = self.validate(epoch)
        rows, sums = self.totals.take()
        if self.reporter is not None:
            stop = self.reporter.epoch_end(epoch, rows, sums) or stop
        return stop


def _train_overlapped(replica: FlatReplica, step: TrainStep, data: PartitionBatches, plan: LoopPlan,
                      client: PSClient, version: int, reports: _EpochReports, call: ModelCall,
                      precision: MixedPrecision, config: TrainConfig) -> LoopCounters:
    """The step loop with the exchange overlapped with compute (a sharded PS refuses overlap_communication before
    launch: sparkdl._internal.combinations.shard_refusal; float16 loss scaling too: overlap_refusal)."""
    overlapped = overlapped_exchange(client, replica, version, pipelined=config.policy != "sync",
                                     timeout_s=config.timeout_s)

    def epoch_end_settled(epoch: int) -> bool:
        overlapped.settle()     # the socket is free and the newest weights are in place
        return reports.epoch_end(epoch)

    try:
        counters = run_step_loop(replica, step, data, plan, overlapped.exchange, None,
                                 epoch_end_settled if reports.at_epoch_end is not None else None,
                                 overlapped.before_backward, call, precision, reports.totals)
        overlapped.settle()
    finally:
        overlapped.close()
    # the forward's waits for arriving weights are communication, not compute
    counters.compute_seconds -= overlapped.weights_wait_seconds
    counters.communication_seconds += overlapped.weights_wait_seconds
    return counters


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
