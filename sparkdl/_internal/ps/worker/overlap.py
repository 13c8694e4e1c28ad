"""Communication overlapped with computation (``TrainConfig.overlap_communication``).

Three overlaps, as an accelerator leaves the CPU free while it computes:

- **Gradients streamed during backward.**  A post-accumulate-grad hook on every parameter marks
  its slice of the flat gradient final; a communication thread sends the PUSH header as
  backward starts, then the slices in reverse parameter order (the order backward produces
  them, as DDP's reducer fills its buckets), each as soon as it is final.  The PS receives them
  in that order (``protocol.FLAG_REVERSED``).  The push costs what is left after backward ends.
- **The next step before the reply** (``async``, ``softsync``, ``softsync_nodes``): the worker
  goes on with the weights it has while the reply travels and is applied, and takes the new
  weights at its next exchange.  Every gradient is then computed on weights one update of its
  own older: one more version of staleness, which the PS measures and records like any other
  (``result.gradients``).
- **The reply streamed into the next forward** (``sync``, across hosts): the round's new
  weights arrive in parameter order, and each module's forward waits only for the parameters
  it reads: the pull half of P3 (Jayarajan et al., "Priority-based Parameter Propagation for
  Distributed DNN Training", SysML 2019), which overlaps the pull with the forward pass.  (P3
  also updates each layer as soon as all its gradients are in; here the PS steps the whole
  vector once per round.)  Every forward still runs on the round's new weights, so sync keeps
  its definition.  A module reads its own parameters and those of descendants whose forward
  does not run (seen in the first step); as with ZeRO-3's per-module gathering, a module must
  not read a descendant's weights before that descendant's forward ran.

Two gradient buffers and two weight buffers alternate, so a buffer is never written while the
communication thread reads or fills it.

One class per strategy, on one base that owns the communication thread: :class:`StreamedSync`
(sync across hosts), :class:`StreamedPipelined` (the pipelined policies across hosts) and
:class:`SharedPipelined` (the pipelined policies on the PS's host); :func:`overlapped_exchange`
picks the one a worker's connection calls for.

On the PS's host ``sync`` exchanges through a plain shared-memory segment and streams nothing
(it costs less there than streaming hides); the pipelined policies use a double-buffered
segment (:class:`~sparkdl._internal.ps.wire.shared_memory.SharedSegment` with two regions of each): nothing is
streamed, since nothing travels; a push is a header naming the gradient region, and the PS's
check, step and weight write overlap the next mini-batch.  A CPU replica trains in the regions
themselves; a GPU replica copies its gradient into the host region after backward and the new
weights back at its next exchange, so a GPU on the PS's host (``local[N]`` on an N-GPU
machine) overlaps the PS's work with its own.
"""
from __future__ import annotations

import functools
import itertools
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.worker.client import InOrderReply, PSClient
from sparkdl._internal.training.flat import FlatReplica
from sparkdl.errors import PSTimeoutError


@dataclass
class _Job:
    """One push in flight: its header, its gradient buffer's readiness, where its reply goes."""

    push: protocol.Push
    gradient: torch.Tensor
    ready: list[threading.Event]
    weights_out: torch.Tensor
    done: threading.Event
    #: the reply's header is in (version, accepted); the weights may still be arriving
    answered: threading.Event = field(default_factory=threading.Event)
    #: sync: one event per parameter, set as its new weights land (forward order)
    arrived: list[threading.Event] = field(default_factory=list)
    version: int = 0
    accepted: bool = False
    error: BaseException | None = None


class OverlappedExchange:
    """A worker's exchanges with the PS on a communication thread: the part every strategy shares.

    The training loop calls :meth:`before_backward` (a streamed push starts), :meth:`exchange` (after
    backward), :meth:`settle` (before validating and at the end) and :meth:`close`.
    """

    #: whether the replica trains outside the exchanged buffers and copies to and from them (a GPU one)
    _copies = False

    def __init__(self, client: PSClient, replica: FlatReplica, version: int, timeout_s: float) -> None:
        self.client = client
        self.replica = replica
        self.version = version
        self.timeout_s = timeout_s
        params = replica.parameters
        sizes = [p.numel() for p in params]
        self._bounds = list(zip(itertools.accumulate([0, *sizes[:-1]]), sizes, strict=True))
        self._index = {id(p): i for i, p in enumerate(params)}
        self._gradients: list[torch.Tensor] = []
        self._weights: list[torch.Tensor] = []
        self._step = 0
        self._in_flight: _Job | None = None
        self._pending: _Job | None = None
        self.accepted = 0
        #: set when the connection can no longer carry a push (an error mid-stream, or close() mid-push)
        self._aborted = threading.Event()
        self._broken: BaseException | None = None
        self._hooks: list[Any] = []
        #: sync: seconds the forward passes waited for arriving weights, and how many times
        self.weights_wait_seconds = 0.0
        self.weights_waits = 0
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sparkdl-exchange", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called by the training loop
    def before_backward(self, loss: float, samples: int, epoch: int, weight: float | None = None) -> None:
        """Start this step's push, where the strategy streams it."""

    def exchange(self, divisor: float, samples: int, loss: float, epoch: int,
                 weight: float | None = None) -> tuple[bool, bool]:
        raise NotImplementedError

    def settle(self) -> None:
        """Wait for the push in flight, if any, and take its weights (before validating, and at the end)."""
        job, self._in_flight = self._in_flight, None
        if job is not None:
            self._finish(job)
            self._adopt(job)

    def close(self) -> None:
        """Stop the communication thread; a push still open (the loop failed mid-step) breaks the connection.

        A half-sent gradient must never be completed by later bytes on the socket: the PS sees the
        connection end in the middle of the payload and applies nothing.
        """
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        open_jobs = [job for job in (self._pending, self._in_flight) if job is not None and not job.done.is_set()]
        self._close_open(open_jobs)
        self._jobs.put(None)
        self._thread.join(timeout=self.timeout_s)

    # ------------------------------------------------------------------ what a strategy supplies
    def _send(self, job: _Job) -> tuple[int, bool]:
        """Send ``job``'s push and take its reply (on the communication thread): (version, accepted)."""
        raise NotImplementedError

    def _close_open(self, open_jobs: list[_Job]) -> None:
        """At close: what becomes of pushes not yet answered (by default the connection is cut)."""
        if open_jobs:
            self._abort()

    def _adopt(self, job: _Job) -> None:
        """Train on the newest weights (the finished job's reply) and an empty gradient buffer that is free."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the pipelined policies' exchange
    def _rotate(self, job: _Job) -> tuple[bool, bool]:
        """``job`` goes in flight; the one before it is waited for and its weights taken."""
        previous, self._in_flight = self._in_flight, job
        if previous is None:
            self._first_push_sent()
            return True, False
        self._finish(previous)
        self._adopt(previous)
        return previous.accepted, self.client.stop_requested

    def _first_push_sent(self) -> None:
        """The first push is in flight and no reply to adopt yet."""

    # ------------------------------------------------------------------ internals
    def _abort(self) -> None:
        self._aborted.set()
        for job in (self._pending, self._in_flight):
            if job is not None:
                for event in job.ready:
                    event.set()      # wakes the stream, which sees the abort and stops sending
        try:
            self.client.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _finish(self, job: _Job) -> None:
        self._answer(job)
        self._landed(job)

    def _answer(self, job: _Job) -> None:
        """Wait for the reply's header: the new version, whether the gradient counted."""
        if not job.answered.wait(self.timeout_s):
            raise PSTimeoutError(f"worker {self.client.worker}: a push was not answered within {self.timeout_s:.0f} s")
        if job.error is not None:
            raise job.error
        self.version = job.version
        self.accepted += job.accepted

    def _landed(self, job: _Job) -> None:
        """Wait until the whole reply is in place."""
        if not job.done.wait(self.timeout_s):
            raise PSTimeoutError(f"worker {self.client.worker}: the new weights did not arrive within "
                                 f"{self.timeout_s:.0f} s")
        if job.error is not None:
            raise job.error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._broken is not None:     # never write after a broken stream: fail without the socket
                job.error = self._broken
                self._wake(job)
                continue
            try:
                job.version, job.accepted = self._send(job)
            except BaseException as exc:   # handed to the training thread at its next exchange
                job.error = self._broken = exc
                try:   # a partly sent payload: end the connection so the PS applies nothing of it
                    self.client.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._wake(job)

    @staticmethod
    def _wake(job: _Job) -> None:
        """The job is over: wake whoever waits on it (after an error, a waiting forward raises it)."""
        job.answered.set()
        for event in job.arrived:
            event.set()
        job.done.set()


class _Streamed(OverlappedExchange):
    """Over the socket: the gradient streamed during backward, slice by slice as autograd finalizes them."""

    def __init__(self, client: PSClient, replica: FlatReplica, version: int, timeout_s: float, buffers: int) -> None:
        super().__init__(client, replica, version, timeout_s)
        self._gradients = [replica.grads] + [torch.zeros_like(replica.grads) for _ in range(buffers - 1)]
        self._weights = [replica.weights] + [replica.weights.clone() for _ in range(buffers - 1)]
        self._ready: list[threading.Event] = []
        params = replica.parameters
        # frozen parameters get no gradient: their (zero) slices are final from the start
        self._frozen = [i for i, p in enumerate(params) if not p.requires_grad]
        self._hooks += [p.register_post_accumulate_grad_hook(self._gradient_final) for p in params if p.requires_grad]

    def before_backward(self, loss: float, samples: int, epoch: int, weight: float | None = None) -> None:
        """Start this step's push: header now, slices as backward finalizes them."""
        slot = self._step % len(self._gradients)
        gradient = self._gradients[slot]
        if gradient.data_ptr() != self.replica.grads.data_ptr():
            self.replica.use_grads(gradient)
        self._ready = [threading.Event() for _ in self._bounds]
        for index in self._frozen:
            self._ready[index].set()
        reply_slot = (self._step + 1) % len(self._weights)
        job = _Job(protocol.Push(self.client.worker, epoch, self.version, samples, loss, gradient.numel() * 4,
                                 reversed=True, weight=weight), gradient, self._ready, self._weights[reply_slot],
                   threading.Event())
        self._jobs.put(self._prepared(job))
        self._pending = job

    def _prepared(self, job: _Job) -> _Job:
        return job

    def _take_pending(self) -> _Job:
        """After backward: every slice is final (those backward did not reach too); this step's job."""
        for event in self._ready:      # parameters backward did not reach (unused in this forward)
            event.set()
        job, self._pending = self._pending, None
        assert job is not None   # before_backward made this step's job
        self._step += 1
        return job

    def _send(self, job: _Job) -> tuple[int, bool]:
        return self.client.stream_push(job.push, self._spans(job), job.weights_out, None)

    def _gradient_final(self, param: torch.Tensor) -> None:
        """Autograd hook: this parameter's gradient is accumulated; its slice may go on the wire."""
        index = self._index.get(id(param))
        if index is None or not self._ready:
            return
        self.replica.adopt_grad(param)      # autograd may have allocated instead of accumulating in place
        self._ready[index].set()

    def _spans(self, job: _Job) -> Iterator[memoryview]:
        raw = memoryview(job.gradient.numpy()).cast("B")  # type: ignore[arg-type]  # numpy#26783: no __buffer__ <3.12
        for index in reversed(range(len(self._bounds))):
            if not job.ready[index].wait(self.timeout_s):
                raise PSTimeoutError(f"worker {self.client.worker}: backward did not produce gradient "
                                     f"{index} within {self.timeout_s:.0f} s")
            if self._aborted.is_set():
                raise ConnectionAbortedError("the training step failed while its gradient was being sent")
            start, size = self._bounds[index]
            yield raw[4 * start:4 * (start + size)]


class StreamedSync(_Streamed):
    """``sync`` across hosts: the gradient streamed during backward, the reply streamed into the next forward.

    The weights arrive in parameter order; a forward pre-hook on each module waits only for the
    parameters it reads (P3's pull overlap, see the module's docstring).
    """

    def __init__(self, client: PSClient, replica: FlatReplica, version: int, timeout_s: float) -> None:
        super().__init__(client, replica, version, timeout_s, buffers=1)
        self._byte_spans = [(4 * start, 4 * size) for start, size in self._bounds]
        #: the reply whose weights are still arriving while the next forward runs
        self._arriving: _Job | None = None
        # the first step runs on the whole weights of the hello: it shows which modules' forward runs
        self._ran: set[int] = set()
        self._discovery = [module.register_forward_pre_hook(lambda module, args: self._ran.add(id(module)))
                           for module in replica.model.modules()]

    def _prepared(self, job: _Job) -> _Job:
        job.arrived = [threading.Event() for _ in self._bounds]
        return job

    def exchange(self, divisor: float, samples: int, loss: float, epoch: int,
                 weight: float | None = None) -> tuple[bool, bool]:
        """After backward: the whole push is in (its buffer is free); wait for the reply's header only.

        The weights stream in while the next forward waits for each module's own.
        """
        job = self._take_pending()
        if self._discovery:
            self._gate_forwards()
        self._arriving = job    # tracked before its answer: close() ends a connection that never answers
        self._answer(job)
        self.replica.zero_grads()
        return job.accepted, self.client.stop_requested

    def settle(self) -> None:
        arriving, self._arriving = self._arriving, None
        if arriving is not None:
            self._landed(arriving)

    def close(self) -> None:
        for hook in self._discovery:
            hook.remove()
        self._discovery = []
        super().close()

    def _close_open(self, open_jobs: list[_Job]) -> None:
        if self._arriving is not None and not open_jobs:
            # a reply still arriving is whole bytes from the PS: take it in, so the connection stays
            # usable (the failure is reported on it); a reply that does not come ends the connection
            if not self._arriving.done.wait(self.timeout_s):
                self._abort()
        super()._close_open(open_jobs)

    def _send(self, job: _Job) -> tuple[int, bool]:
        return self.client.stream_push(job.push, self._spans(job), job.weights_out, self._in_order(job))

    def _in_order(self, job: _Job) -> InOrderReply:
        def answered(version: int, accepted: bool) -> None:
            job.version, job.accepted = version, accepted
            job.answered.set()
        return InOrderReply(self._byte_spans, answered, lambda index: job.arrived[index].set())

    def _gate_forwards(self) -> None:
        """After the first step: a forward pre-hook on every module that ran, waiting for its weights.

        A module waits for its own parameters and for those of descendants whose forward did not
        run, which it reads itself (``nn.MultiheadAttention``'s ``out_proj``, a ``ParameterList``).
        The hooks go first, before the model's own pre-hooks (weight norm computes its weight in one).
        """
        for hook in self._discovery:
            hook.remove()
        self._discovery = []
        model = self.replica.model
        last_read: dict[torch.nn.Module, int] = {}   # modules hash by identity

        def assign(module: torch.nn.Module, reader: torch.nn.Module) -> None:
            reader = module if id(module) in self._ran else reader
            for param in module.parameters(recurse=False):
                if id(param) in self._index:
                    last_read[reader] = max(self._index[id(param)], last_read.get(reader, -1))
            for child in module.children():
                assign(child, reader)

        assign(model, model)      # the root's forward always runs
        # the weights arrive in order: the last one a module reads is the one to wait for
        self._hooks += [module.register_forward_pre_hook(functools.partial(self._await_weights, last), prepend=True)
                        for module, last in last_read.items()]

    def _await_weights(self, index: int, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: this module's weights of the newest round are in place."""
        job = self._arriving
        if job is None or (job.done.is_set() and job.error is None):
            return
        if not job.arrived[index].is_set():
            started = time.perf_counter()
            arrived = job.arrived[index].wait(self.timeout_s)
            self.weights_wait_seconds += time.perf_counter() - started
            self.weights_waits += 1
            if not arrived:
                raise PSTimeoutError(f"worker {self.client.worker}: the new weights of {type(module).__name__} "
                                     f"did not arrive within {self.timeout_s:.0f} s")
        if job.error is not None:
            raise job.error


class StreamedPipelined(_Streamed):
    """``async``/``softsync``/``softsync_nodes`` across hosts: the gradient streamed during backward, and the
    next step before the reply (it trains on the weights it has; the reply is taken at its next exchange)."""

    def __init__(self, client: PSClient, replica: FlatReplica, version: int, timeout_s: float) -> None:
        # gradient k leaves from one buffer while backward k+1 fills the other, and reply k lands
        # in the weight buffer that step k+1 does not read
        super().__init__(client, replica, version, timeout_s, buffers=2)

    def exchange(self, divisor: float, samples: int, loss: float, epoch: int,
                 weight: float | None = None) -> tuple[bool, bool]:
        return self._rotate(self._take_pending())

    def _adopt(self, job: _Job) -> None:
        self.replica.use_weights(job.weights_out)        # the old buffer is free for the next reply
        self.replica.use_grads(self._gradients[self._step % len(self._gradients)])
        self.replica.zero_grads()


class SharedPipelined(OverlappedExchange):
    """The pipelined policies on the PS's host: a double-buffered shared-memory segment, nothing streamed.

    A push is a header naming the gradient region; the PS's check, step and weight write overlap
    the next mini-batch.  A CPU replica trains in the regions themselves; a GPU replica copies its
    gradient into the host region after backward and the new weights back at its next exchange.
    """

    def __init__(self, client: PSClient, replica: FlatReplica, version: int, timeout_s: float) -> None:
        super().__init__(client, replica, version, timeout_s)
        segment = client.segment
        assert segment is not None and segment.regions == 2   # overlapped_exchange checked it
        self._gradients, self._weights = list(segment.gradients), list(segment.weight_regions)
        self._copies = replica.weights.data_ptr() != self._weights[0].data_ptr()

    def exchange(self, divisor: float, samples: int, loss: float, epoch: int,
                 weight: float | None = None) -> tuple[bool, bool]:
        """This step's push through the segment: the gradient is in region ``step % 2`` (copied there from
        a GPU), so sending the header now commits it."""
        region = self._step % 2
        if self._copies:
            self._gradients[region].copy_(self.replica.grads)
        push = protocol.Push(self.client.worker, epoch, self.version, samples, loss, 0, shared=True, region=region,
                             weight=weight)
        job = _Job(push, self._gradients[region], [], self._weights[1 - region], threading.Event())
        self._jobs.put(job)
        self._step += 1
        return self._rotate(job)

    def _first_push_sent(self) -> None:
        if self._copies:    # a GPU replica's own buffer, copied out: free again
            self.replica.zero_grads()
        else:               # step 1 fills the other region, zero as the PS made it (or left it)
            self.replica.use_grads(self._gradients[self._step % 2])

    def _adopt(self, job: _Job) -> None:
        if self._copies:
            self.replica.weights.copy_(job.weights_out)      # host region -> the GPU
            self.replica.zero_grads()
        else:   # a segment's gradient region comes back zeroed by the PS
            self.replica.use_weights(job.weights_out)
            self.replica.use_grads(self._gradients[self._step % 2])

    def _send(self, job: _Job) -> tuple[int, bool]:
        return self.client.push_shared(job.push)

    def _close_open(self, open_jobs: list[_Job]) -> None:
        # a header-only push is never half sent: let it be answered, so the connection stays usable
        # (the failure is reported on it)
        for job in open_jobs:
            job.done.wait(self.timeout_s)


def overlapped_exchange(client: PSClient, replica: FlatReplica, version: int, pipelined: bool,
                        timeout_s: float) -> OverlappedExchange:
    """The strategy this connection calls for: a double-buffered segment (pipelined policies on the PS's
    host), else streaming over the socket (sync, or the pipelined policies)."""
    segment = client.segment
    if segment is not None and segment.regions == 2:
        if not pipelined:
            raise ValueError("a double-buffered segment serves pipelined exchanges only")
        return SharedPipelined(client, replica, version, timeout_s)
    return (StreamedPipelined if pipelined else StreamedSync)(client, replica, version, timeout_s)
