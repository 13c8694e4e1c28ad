"""What a user function sees inside a sparkdl run: its place, its data, reports and PS optimizers.

Inside a function launched by :func:`sparkdl.run` (or :class:`sparkdl.TorchDistributor`),
``sparkdl.context()`` returns this task's :class:`WorkerContext`:

* ``rank``, ``world_size``, ``local_rank``, ``device`` (the Spark-assigned GPU, else the CPU);
* ``batches(epoch)``: the task's data partition as typed mini-batches (one tensor per input in
  its own dtype, ragged rows padded per batch with their masks; see the typed-inputs guide),
  in the same seeded order the estimator's loop uses;
* ``report(**metrics)``: numbers for the driver's progress line and the result's ``metrics``;
* ``fully_shard(model)``: the model sharded over the workers as ``policy="fsdp"`` shards it (FSDP);
* ``ps_optimizer(model)``: a :class:`PSOptimizer` whose ``step()`` pushes the model's gradient
  to the run's parameter server and loads the weights it answers with, under the run's policy.
"""
from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from sparkdl._internal.data.block import Batch
from sparkdl._internal.data.partitions import PartitionBatches
from sparkdl._internal.ps.server.policy import steps_per_epoch, takes_full_batches
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.compression import make_codec
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl._internal.training.flat import FlatReplica
from sparkdl._internal.training.fully_sharded import shard_model
from sparkdl._internal.training.loop import epoch_order
from sparkdl.config import TrainConfig

_current: WorkerContext | None = None


def context() -> WorkerContext:
    """This task's context; only inside a function run by ``sparkdl.run`` or ``sparkdl.TorchDistributor``."""
    if _current is None:
        raise RuntimeError("sparkdl.context() is only available inside a function launched by sparkdl.run(fn, ...) "
                           "or sparkdl.TorchDistributor(...).run(fn)")
    return _current


@contextlib.contextmanager
def active(ctx: WorkerContext) -> Iterator[WorkerContext]:
    """Make ``ctx`` what :func:`context` returns while the user function runs."""
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


class WorkerContext:
    """One task of a function run: its place, its partition, its connection to the driver."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int, local_rank: int, device: torch.device,
                 server: PSClient, spaces_address: tuple[str, bytes, str | None], task_attempt: int,
                 data: PartitionBatches | None = None, partition_rows: list[int] | None = None,
                 attempt: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.task_attempt = task_attempt
        #: the barrier-stage attempt (0, then 1 ... when a failed run is retried)
        self.attempt = attempt
        self.data = data
        self._server = server
        self._spaces_address = spaces_address   # (PS host, run secret, pinned certificate)
        self._partition_rows = partition_rows or [0] * world_size
        self.optimizers: list[PSOptimizer] = []
        #: the epoch of the batches last handed out (the epoch a push is reported under)
        self.epoch = 0
        self._last_batch_rows = config.batch_size

    @property
    def partition_rows(self) -> int:
        """Rows of this task's data partition (0 without data)."""
        return self.data.rows if self.data is not None else 0

    def steps_per_epoch(self, batch_size: int | None = None) -> int:
        """Mini-batches per epoch: under sync every rank takes as many full batches as the largest
        partition needs (smaller partitions wrap around), so sync rounds always find every rank."""
        rows = dict(enumerate(self._partition_rows))
        return steps_per_epoch(self.config.policy, rows, batch_size or self.config.batch_size)[self.rank]

    def batches(self, epoch: int = 0, batch_size: int | None = None, shuffle: bool | None = None) -> Iterator[Batch]:
        """This partition's mini-batches for ``epoch``: typed inputs, masks, labels and weights on ``device``.

        The order is the estimator's: a permutation seeded by ``config.seed``, the rank and the epoch.
        """
        if self.data is None:
            raise RuntimeError("this function run has no data: pass data=df_or_rdd to sparkdl.run")
        size = batch_size or self.config.batch_size
        steps = self.steps_per_epoch(size)
        full = takes_full_batches(self.config.policy)
        order = epoch_order(self.data.rows, epoch, self.config.seed, self.rank,
                            self.config.shuffle if shuffle is None else shuffle,
                            steps * size if full else self.data.rows)
        indices = [order[k * size:(k + 1) * size] for k in range(steps)]
        self.epoch = epoch
        with contextlib.closing(self.data.batches(indices, epoch)) as batches:
            for batch in batches:
                self._last_batch_rows = len(batch)
                yield batch

    def fully_shard(self, model: nn.Module, blocks: str | None = None) -> nn.Module:
        """``model`` fully sharded over the run's workers, as ``policy="fsdp"`` shards the estimator's models.

        Joins the default process group first if the function has not (``env://``: gloo on CPU, nccl on
        GPU).  ``blocks`` names the classes sharded as one block each (default: the run's ``shard_blocks``,
        else every module held directly in an ``nn.Sequential`` or ``nn.ModuleList``); the run's ``precision``
        ``"bf16-mixed"`` computes in bfloat16 with float32 reduction and master weights.  A model built on the
        meta device is materialised here, each worker allocating only its shards (its modules'
        ``reset_parameters()`` under the run's seed); a model built for real starts from rank 0's values.  Make
        the optimizer from the returned model's parameters.
        """
        import datetime

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=self.config.timeout_s))
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            # every rank's chunks must come from one model: rank 0's, as DDP starts from
            for tensor in itertools.chain(model.parameters(), model.buffers()):
                dist.broadcast(tensor.data, 0)
        sharded = shard_model(model, mesh, self.device, self.config.precision, blocks or self.config.shard_blocks,
                              self.config.seed)
        torch.manual_seed(self.config.seed + self.rank)   # dropout and other randomness differ per rank
        return sharded

    def report(self, **metrics: Any) -> None:
        """Send numbers (loss, accuracy, a step count ...) to the driver: progress and ``result.metrics``."""
        payload = json.dumps({k: _plain(v) for k, v in metrics.items()}).encode("utf-8")
        self._server.request(Header(Msg.REPORT, worker=self.rank, length=len(payload)), payload, reply=Msg.ACK)

    def ps_optimizer(self, model_or_params: nn.Module | Iterable[nn.Parameter]) -> PSOptimizer:
        """A PS-backed optimizer over these parameters: every rank makes the same ones in the same order."""
        params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
        optimizer = PSOptimizer(self, len(self.optimizers), params)
        self.optimizers.append(optimizer)
        return optimizer

    def finish(self) -> None:
        """The function returned: every PS optimizer tells its server this rank is done."""
        for optimizer in self.optimizers:
            optimizer.done()

    def close(self) -> None:
        for optimizer in self.optimizers:
            optimizer.close()

    def last_batch_rows(self) -> int:
        return self._last_batch_rows

    def space_address(self, space: int, flat: torch.Tensor) -> int:
        """The port of key space ``space``'s parameter server (rank 0's ``flat`` weights start it)."""
        payload = flat.numpy().tobytes() if self.rank == 0 else None
        request = protocol.Space(self.rank, space, flat.numel(), len(payload) if payload is not None else 0)
        reply = self._server.request(request.header(), payload, reply=Msg.SPACE_AT)
        assert reply is not None   # a reply was asked for
        return reply[0].count


class PSOptimizer:
    """An optimizer whose state lives on the parameter server: ``step()`` pushes, the PS updates.

    The parameters are rebound to views of one flat buffer (as the estimator's replicas are); at
    creation they take the PS's weights (rank 0's initial ones, or a retried run's current ones).
    ``step()`` pushes the accumulated gradient (tagged with the weight version it was computed
    on, so staleness rules apply), loads the answered weights and zeroes the gradient: it has
    been pushed.  ``zero_grad()`` clears it as usual.  The update rule (optimizer, learning rate,
    policy, staleness, compression) is the run's ``TrainConfig``.
    """

    def __init__(self, ctx: WorkerContext, space: int, params: list[nn.Parameter]) -> None:
        if not params:
            raise ValueError("ps_optimizer needs parameters to optimize")
        self.ctx = ctx
        self.space = space
        self.params = params
        self._holder = nn.ParameterList(params)
        device = params[0].device
        self.replica = FlatReplica(self._holder, device)
        config = ctx.config
        host, secret, cert = ctx._spaces_address
        port = ctx.space_address(space, self.replica.weights.detach().cpu())
        self.client = PSClient(host, port, secret, ctx.rank, config.timeout_s, cert)
        self.on_cpu = device.type == "cpu"
        self.wire_weights = self.replica.weights if self.on_cpu else torch.empty_like(self.replica.weights, device="cpu")
        self.wire_grads = self.replica.grads if self.on_cpu else torch.empty_like(self.replica.grads, device="cpu")
        welcome = self.client.hello(max(ctx.partition_rows, 1), self.wire_weights, ctx.task_attempt,
                                    shared_memory=config.ps_transport == "auto")
        if self.client.segment is not None and self.on_cpu:   # same host: train in the shared segment itself
            self.replica.rebind(self.client.segment.weights, self.client.segment.gradient)
            self.wire_weights, self.wire_grads = self.replica.weights, self.replica.grads
        if not self.on_cpu:
            self.replica.weights.copy_(self.wire_weights)
        self.version = welcome.version
        #: pushes of this rank the PS counted before this attempt (a retried function may skip them)
        self.position = welcome.position
        self.codec = make_codec(config.compression, self.replica.grads.numel(), config.topk_ratio,
                                [self.replica.grads.numel()], seed=config.seed * 7919 + ctx.rank * 131 + space)
        self.pushes = 0
        self.accepted = 0
        self.samples = 0
        self._done = False

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clear the gradient (the flat buffer stays bound: ``set_to_none`` is accepted and ignored)."""
        self.replica.zero_grads()

    def step(self, closure: Any = None, *, samples: int | None = None, loss: float | None = None) -> Any:
        """Push this rank's gradient, take the PS's answer: the new weights of the run.

        ``samples``: rows behind the gradient (default: the last batch of ``ctx.batches``); under
        sync the PS averages the ranks' gradients weighted by them.  ``loss`` is logged with the push.
        """
        value = None
        if closure is not None:
            with torch.enable_grad():
                value = closure()
        self.replica.ensure_grad_views()   # a zero_grad(set_to_none=True) by the user's loop lets autograd allocate
        rows = samples if samples is not None else self.ctx.last_batch_rows()
        reported = float(loss if loss is not None else (value if value is not None else float("nan")))
        if not self.on_cpu:
            self.wire_grads.copy_(self.replica.grads)
        if bool(torch.isfinite(self.wire_grads.sum())):
            self.version, accepted = self.client.push_pull(self.codec.encode(self.wire_grads), self.version, rows,
                                                           reported, self.ctx.epoch, self.wire_weights)
        else:
            self.version, accepted = self.client.push_nonfinite(self.version, rows, reported, self.ctx.epoch,
                                                                self.wire_weights)
        if not self.on_cpu:
            self.replica.weights.copy_(self.wire_weights)
        self.replica.zero_grads()
        self.pushes += 1
        self.accepted += accepted
        self.samples += rows
        return value

    def state_dict(self) -> dict[str, Any]:
        """Where this optimizer stands (its state itself is on the PS: checkpoints hold it)."""
        return {"space": self.space, "version": self.version, "pushes": self.pushes}

    def done(self) -> None:
        if not self._done:
            self._done = True
            self.client.done(self.samples, None)

    def close(self) -> None:
        self.client.close()

    def summary(self) -> dict[str, Any]:
        return {"space": self.space, "pushes": self.pushes, "accepted": self.accepted, "samples": self.samples,
                "bytes_pushed": self.client.bytes_pushed, "bytes_pulled": self.client.bytes_pulled,
                "transport": self.client.transport, "transport_note": self.client.transport_note}


def _plain(value: Any) -> Any:
    """A metric as JSON takes it (tensors and numpy numbers become Python numbers)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
