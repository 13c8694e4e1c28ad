"""The parameter server's transport: listening socket, handshake gate, one thread per worker.

New connections are authenticated by a :class:`~sparkdl._internal.ps.wire.handshake.HandshakeGate` on the
accept thread (a selector, short deadlines, bounded numbers): an unauthenticated peer costs
no thread and cannot delay the run.  Each authenticated connection gets a handler thread
that decodes frames and calls :class:`~sparkdl._internal.ps.server.core.PSCore` under one condition
variable; the hot path under the lock is the core's few whole-buffer tensor operations.
Sockets are read and written outside the lock.  A sync pusher's reply waits on the
condition until the core says its round is settled.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch

from sparkdl._internal.ps.server.checkpoint import LOCAL, CheckpointFiles, write_run_checkpoint
from sparkdl._internal.ps.server.core import PSCore, PushedRows, PushMeta, RoundAbandoned
from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.server.parts import PartRanges, PipelineParts
from sparkdl._internal.ps.server.policy import PushDecision
from sparkdl._internal.ps.server.run_progress import run_progress
from sparkdl._internal.ps.server.runlog import EpochRow
from sparkdl._internal.ps.wire import protocol, shared_memory
from sparkdl._internal.ps.wire.compression import Codec, make_codec
from sparkdl._internal.ps.wire.handshake import HANDSHAKE_TIMEOUT_S
from sparkdl._internal.ps.wire.listener import Listener, send_error
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl._internal.ps.wire.shared_memory import SharedMaster, SharedSegment, host_identity, master_name, segment_name
from sparkdl._internal.ps.wire.shared_tables import SharedTable, table_file_name
from sparkdl._internal.training.optim import TensorLayout
from sparkdl.config import TrainConfig
from sparkdl.errors import ProtocolError, PSTimeoutError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ServerSetup:
    """What one parameter server needs beyond the run's settings; every field has a default for a whole-model
    PS on loopback."""

    #: where it listens, and how peers are admitted (TLS, the handshake's deadline)
    host: str = "127.0.0.1"
    tls: ssl.SSLContext | None = None
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    #: the model in this server's key range: its float buffers (BatchNorm statistics ...), parameter sizes in
    #: flat order (per-tensor quantisation scales, streamed pushes), parameter tensors (AdamW's decay rule),
    #: embedding tables (held as rows) and, for pipelines, the key range each stage task pushes
    float_buffer_count: int = 0
    tensor_sizes: Sequence[int] | None = None
    tensor_layout: TensorLayout | None = None
    tables: Sequence[EmbeddingTable] = ()
    parts: Sequence[PartRanges] | None = None
    #: which key-range shard of the run's PS this server is (0 for a whole-model PS)
    shard: int = 0
    #: every hello is answered with the weights, also at version 0 (pipeline stages start from none)
    welcome_weights: bool = False
    #: where due snapshots go (an executor-hosted shard sends them to the driver); None: checkpoint files
    snapshot_sink: Callable[[dict], None] | None = None
    #: where checkpoints are written (a local directory, or a Hadoop file system)
    checkpoint_files: CheckpointFiles = LOCAL
    #: called outside the lock with every completed epoch (the driver's callbacks); True stops training
    epoch_listener: Callable[[EpochRow], bool] | None = None


class ParameterServer:
    """Serves one training run's workers over TCP (optionally TLS); started and stopped by the launcher.

    With ``parts`` (pipelines), each worker is a model replica whose stage tasks connect one
    per part and push and pull only their key range; see :mod:`sparkdl._internal.ps.server.parts`.
    """

    def __init__(self, config: TrainConfig, initial_weights: torch.Tensor, secret: bytes,
                 setup: ServerSetup = ServerSetup()) -> None:
        #: sync on this host: the master lives in shared memory the workers here compute on (no reply copies)
        self._master = (SharedMaster.create(initial_weights.numel()) if master_in_place(config, setup) else None)
        #: shared_tables on this host: the tables live in shared memory the workers here step in place
        self._shared_tables = _share_tables(config, setup)
        try:
            self.core = PSCore(config, initial_weights, setup.float_buffer_count, setup.tensor_layout, setup.tables,
                               None if self._master is None else self._master.weights)
        except BaseException:
            self._remove_shared_files()     # a table's file holds the whole table: never left behind
            raise
        self.shard = setup.shard
        self.snapshot_sink = setup.snapshot_sink
        self.welcome_weights = setup.welcome_weights
        self.epoch_listener = setup.epoch_listener
        self.checkpoint_files = setup.checkpoint_files
        #: a pipelined PS's parts (the key range each stage task pushes) and its workers' assemblies
        self.parts = (PipelineParts(list(setup.parts), config.num_workers, self.core.num_params,
                                    setup.float_buffer_count) if setup.parts else None)
        self.config = config
        self.secret = secret
        self.host = setup.host
        self.port = config.ps_port
        self.tls = setup.tls
        self.num_params = self.core.num_params
        self.tensor_sizes = list(setup.tensor_sizes or [self.num_params])
        #: (byte offset, byte length) of every parameter tensor in the flat gradient: streamed pushes
        offsets = [0, *itertools.accumulate(self.tensor_sizes)]
        self._tensor_spans = [(4 * offset, 4 * size) for offset, size in zip(offsets, self.tensor_sizes, strict=False)]
        self._cond = threading.Condition()
        self._listener = Listener(secret, self._serve, self._refused, setup.tls, setup.handshake_timeout_s,
                                  # work units: every unit's task may be waiting for its turn at once
                                  connections=config.worker_slots * (len(setup.parts) if setup.parts else 1),
                                  name="parameter server")
        self._stopping = self._listener.stopping
        self._checkpoint_lock = threading.Lock()
        self.checkpoints_written = 0
        #: the intra-op threads new threads get in this process, put back at stop (setting a handler thread's
        #: count also changes the default later threads start with)
        self._threads_before = torch.get_num_threads()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> tuple[str, int]:
        """Bind, listen and start accepting; returns the (host, port) workers connect to."""
        self.port = self._listener.start(self.host, self.port, "set 'spark.driver.host' to an address of this "
                                         "machine or change ps_port")
        if self._master is not None:    # named by the port: the workers know it, and no other PS here has it
            self._master.publish(master_name(self.secret, self.port))
        for index, table in enumerate(self._shared_tables):
            table.publish(table_file_name(self.secret, self.port, index))
        return self.host, self.port

    def stop(self) -> None:
        """Close every socket this server owns and return promptly (handshakes are not waited for)."""
        self._stopping.set()   # a handler that sees its socket close now does not count its worker as lost
        with self._cond:
            self._cond.notify_all()
        self._listener.stop()
        torch.set_num_threads(self._threads_before)
        self._remove_shared_files()

    def _remove_shared_files(self) -> None:
        """Remove the names of the shared master and tables (their memory goes with the last mapping)."""
        if self._master is not None:
            self._master.remove()
        for table in self._shared_tables:
            table.remove()

    def fail(self, error: BaseException) -> None:
        """Mark the run failed; every waiting or later request gets an ERROR reply."""
        with self._cond:
            self.core.fail(error)
            self._cond.notify_all()

    # ----------------------------------------------------------------- views for the launcher
    def read(self, view: Callable[[PSCore], T]) -> T:
        """``view(core)`` under the server's lock: the one way to read the core, a consistent reading of
        several fields at once.  The properties below are the readings the barrier-stage runner, the
        progress bar and the launcher share with the executor-shard coordinator."""
        with self._cond:
            return view(self.core)

    failure = property(lambda self: self.read(lambda core: core.failure))
    worker_failures = property(lambda self: self.read(lambda core: core.worker_failures))
    stats = property(lambda self: self.core.stats)   # counters: the object itself, updated in place
    events = property(lambda self: self.read(lambda core: core.log.events))
    version = property(lambda self: self.read(lambda core: core.version))
    finished = property(lambda self: self.read(lambda core: core.members.finished))
    workers_seen = property(lambda self: self.read(lambda core: core.members.seen))

    def progress(self) -> dict:
        return self.read(run_progress)

    def positions(self) -> list[int]:
        return self.read(lambda core: core.members.positions())

    def weights(self) -> torch.Tensor:
        """A consistent copy of the current master weights."""
        return self.read(PSCore.weights)

    def final_weights(self) -> torch.Tensor:
        """The run's result (the best validation epoch's weights when configured so)."""
        return self.read(PSCore.final_weights)

    def wait_finished(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for every worker to be done or the run to fail; True if one happened."""
        with self._cond:
            return self._cond.wait_for(lambda: self.core.members.finished or self.core.failure is not None, timeout_s)

    def restore(self, checkpoint: dict) -> None:
        with self._cond:
            self.core.snapshots.restore(checkpoint)

    def write_checkpoint(self, snapshot: dict | None = None, final: bool = False) -> None:
        """Write a snapshot (default: the current state) to ``config.checkpoint_dir``.

        A periodic write that fails is logged and counted and the run goes on; the final one raises.
        """
        if not self.config.checkpoint_dir:
            return
        if snapshot is None:
            with self._cond:
                snapshot = self.core.snapshots.take()
        with self._checkpoint_lock:
            failed = write_run_checkpoint(self.config.checkpoint_dir, snapshot, self.config.checkpoint_keep, final,
                                          "parameter server", self.checkpoint_files)
            if failed is None:
                self.checkpoints_written += 1
                return
        with self._cond:
            self.core.stats.checkpoint_failures += 1
            self.core.log.event("checkpoint_failed", self.core.version, reason=str(failed))

    # ----------------------------------------------------------------- connections
    def _refused(self, reason: str) -> None:
        with self._cond:
            self.core.stats.auth_failures += 1
        log.warning("parameter server: %s", reason)

    def _serve(self, conn: socket.socket) -> None:
        worker: int | None = None
        token = -1
        segment: SharedSegment | None = None
        conn.settimeout(self.config.timeout_s)
        # The step and the aggregation are memory-bound passes: on a host the workers share, a second
        # OpenMP thread gains little and its spin-wait after every pass takes a worker's core.
        torch.set_num_threads(self.config.ps_threads)
        cpu_started = time.thread_time()
        peer = _peer_host(conn)
        try:
            session = self._hello(conn)
            if session is not None:
                worker, token, segment, part, in_master = session
                self._session(conn, worker, token, segment, part, in_master)
        except TimeoutError:
            if worker is not None:
                # a host whose link is down looks like this: name it (Spark notices it only later)
                self._lost(worker, token, f"sent nothing for {self.config.timeout_s:.0f} s (its task on {peer})")
        except ProtocolError as exc:
            with self._cond:
                self.core.stats.protocol_errors += 1
            log.warning("parameter server: protocol error from %s: %s",
                        "an unregistered connection" if worker is None else f"worker {worker}", exc)
            send_error(conn, str(exc))
            if worker is not None:
                self._lost(worker, token, f"broke the protocol: {exc}")
        except RoundAbandoned as exc:
            # this attempt's task fails on the error; its slot is free for the retried task
            send_error(conn, str(exc))
            if worker is not None:
                self._lost(worker, token, "its sync round was abandoned")
        except (ConnectionError, OSError) as exc:
            if worker is not None:
                self._lost(worker, token, f"disconnected ({exc})")
        finally:
            if segment is not None:
                segment.remove()
            with self._cond:
                self.core.stats.handler_cpu_seconds += time.thread_time() - cpu_started

    def _lost(self, worker: int, token: int, reason: str) -> None:
        if self._stopping.is_set():   # connections closing at shutdown are not losses
            return
        with self._worker_event():
            self.core.lost(worker, token, reason)

    def _shared_segment(self, hello: protocol.Hello) -> SharedSegment | None:
        """A shared-memory segment for a worker on this host (uncompressed gradients), or None: TCP."""
        if (not hello.host_identity or self.config.ps_transport != "auto" or self.config.compression != "none"
                or hello.host_identity != host_identity()):
            return None
        return SharedSegment.create(segment_name(self.secret, hello.worker, hello.task_attempt, self.shard),
                                    self.num_params, regions=2 if hello.double else 1)

    def _check_part(self, hello: protocol.Hello) -> int | None:
        """The part a pipelined worker's connection pushes (None: the whole model)."""
        if self.parts is None:
            if hello.parts:
                raise ProtocolError(f"worker {hello.worker} pushes its model in {hello.parts} part(s); this "
                                    "parameter server expects 1")
            return None
        return self.parts.check_hello(hello.worker, hello.parts, hello.part)

    def _join(self, hello: protocol.Hello, part: int | None) -> int:
        """Open (the whole model, or a pipeline's part 0) or join (the other parts) the worker's session."""
        token: int | None
        if part is None or part == 0:
            token = self.core.hello(hello.worker, hello.task_attempt, hello.partition_rows)
            if part == 0:
                assert self.parts is not None   # a part number comes only with parts (_check_part)
                self.parts.assemblies[hello.worker].reset(token)
            return token
        # the other stages of the replica join the session its first stage opened for the same attempt
        token = self.core.members.session_of(hello.worker, hello.task_attempt)   # also checks the worker id
        if token is None:
            self._cond.wait_for(lambda: self.core.failure is not None
                                or self.core.members.slots[hello.worker].task_attempt >= hello.task_attempt,
                                timeout=self.config.timeout_s)
            token = self.core.members.session_of(hello.worker, hello.task_attempt)
        if token is None and self.core.failure is None:
            raise ProtocolError(f"part {part} of worker {hello.worker} (attempt {hello.task_attempt}) found no "
                                "session of its attempt opened by part 0")
        return -1 if token is None else token

    def _hello(self, conn: socket.socket) -> tuple[int, int, SharedSegment | None, int | None, bool] | None:
        """Register a worker (first attempt or a retry) and welcome it; None when it only reported a failure.

        Returns (worker, session token, its shared-memory segment, its pipeline part, whether its pushes are
        answered in the shared master)."""
        header = protocol.recv_header(conn, protocol.MAX_TEXT_BYTES)
        if header.type == Msg.FAIL:   # a worker that failed before it could say hello
            text = protocol.recv_small_payload(conn, header)
            with self._worker_event():   # a pipeline stage task's FAIL says which stage attempt it was
                self.core.failed_before_hello(header.worker, text,
                                              header.version if self.parts and header.version >= 0 else None)
            protocol.send_message(conn, Header(Msg.ACK))
            return None
        hello = protocol.Hello.read(header, protocol.recv_small_payload(conn, header, protocol.MAX_HOST_IDENTITY_BYTES)
                                    if header.length else b"")
        part = self._check_part(hello)
        with self._cond:
            # work units: a task beyond max_workers waits for a running one to end (a silent one is declared
            # lost after timeout_s, so this wait ends)
            while not self.core.may_start(hello.worker):
                if self._stopping.is_set():
                    return None
                self._cond.wait(timeout=1.0)
            token = self._join(hello, part)
            self._cond.notify_all()
            replaced_due = self.core.snapshots.take_due()   # an older attempt replaced as lost may flush
            ready = self._cond.wait_for(lambda: self.core.members.steps_known or self.core.failure is not None,
                                        timeout=self.config.timeout_s)
            if self.core.failure is None and not ready:
                self.core.rendezvous_timed_out()
                self._cond.notify_all()
            if self.core.failure is not None:
                send_error(conn, self.core.failure_text())
                return None
            # a stage task starts from its range of the PS's weights: no task holds the whole model
            # a part number comes only with parts (_check_part)
            span = cast(PipelineParts, self.parts).ranges[part].params if part is not None else (
                (0, self.num_params) if self.welcome_weights else None)
            welcome = self.core.welcome(hello.worker, span)
            weights = welcome.weights
        self._deliver(replaced_due)
        segment = None if part is not None else self._shared_segment(hello)
        in_master = segment is not None and segment.regions == 1 and hello.master and self._master is not None
        in_tables = segment is not None and hello.tables and bool(self._shared_tables)
        try:
            protocol.send_message(conn, protocol.Welcome(hello.worker, welcome.version, welcome.steps_per_epoch,
                                                         welcome.position, 0 if weights is None else weights.numel() * 4,
                                                         shared_memory=segment is not None, master=in_master,
                                                         tables=in_tables, table_rate=self._table_rate()).header(),
                                  None if weights is None else
                                  memoryview(weights.numpy()))  # type: ignore[arg-type]  # numpy#26783: no __buffer__ <3.12
        except BaseException:
            if segment is not None:
                segment.remove()
            raise
        return hello.worker, token, segment, part, in_master

    def _session(self, conn: socket.socket, worker: int, token: int, segment: SharedSegment | None,
                 part: int | None, in_master: bool = False) -> None:
        """Serve one registered worker's (or worker part's) messages until it is done or fails."""
        span = None if part is None else cast(PipelineParts, self.parts).ranges[part]   # parts: see _hello
        num_params = self.num_params if span is None else span.num_params
        codec = make_codec(self.config.compression, num_params, self.config.topk_ratio, self.tensor_sizes)
        if span is not None and (codec.lossy or self.config.overlap_communication):
            raise ProtocolError("pipeline parts push uncompressed, unstreamed gradients")
        # a table's ROWS or PULL_ROWS names each of its rows at most once (a PULL_TABLES each table at most once)
        largest_rows = sum(16 + t.spec.rows * (8 + 4 * t.spec.dim) for t in self.core.tables)
        session = _Session(conn, worker, token, segment, part, num_params, codec,
                           max(num_params * 4, self.core.float_buffer_count * 4, protocol.MAX_TEXT_BYTES,
                               largest_rows), in_master)
        handlers = {Msg.PUSH: self._on_push, Msg.VALIDATION: self._on_validation, Msg.EPOCH: self._on_epoch,
                    Msg.DONE: self._on_done,
                    Msg.FAIL: self._on_fail, Msg.ROWS: self._on_rows, Msg.PULL_ROWS: self._on_pull_rows,
                    Msg.PULL_TABLES: self._on_pull_tables}
        while not self._stopping.is_set():
            header = protocol.recv_header(conn, session.max_length)
            if header.worker != worker:
                raise ProtocolError(f"connection of worker {worker} sent a message as worker {header.worker}")
            handler = handlers.get(header.type)
            if handler is None:
                raise ProtocolError(f"unexpected {header.type.name} from worker {worker}")
            if not handler(session, header):
                return

    def _on_push(self, session: _Session, header: Header) -> bool:
        """A gradient: received (socket, or the worker's shared-memory segment), decided, answered with weights.

        A push flagged shared has its gradient in the worker's segment and gets its weights there, or, where
        the worker computes on the shared master, gets no weights at all (its round's step wrote them there).
        A part's gradient lands straight in its range of the worker's assembly buffer.
        """
        conn, worker, segment = session.conn, session.worker, session.segment
        push = protocol.Push.read(header)
        if push.shared:
            if segment is None or header.length or push.region >= segment.regions:
                raise ProtocolError("a PUSH flagged shared without a shared-memory segment (or that region "
                                    "of it), or with a payload")
            grad = segment.gradients[push.region]
            reply = None if session.in_master else segment.reply_region(push.region)
        else:
            grad, reply = self._receive_gradient(session, header, push)
        rows, session.rows = session.rows, []
        outcome = self._push(worker, session.token, push, grad, reply, session.part, rows)
        if outcome is None:
            send_error(conn, self.core.failure_text() if self.core.failure else "this connection "
                                 "was replaced by a newer attempt of the same worker")
            return False
        accepted, version, stop = outcome
        if push.shared:
            assert segment is not None   # a shared push without a segment was refused above
            if segment.regions == 2:
                # a double-buffered region goes back empty: the worker's next backward into it
                # accumulates from zero, and clearing it here keeps that off the worker's step
                segment.gradients[push.region].zero_()
            protocol.send_message(conn, protocol.Weights(worker, version, accepted, 0, stop, shared=True,
                                                         master=session.in_master,
                                                         table_rate=self._table_rate()).header())
        else:
            protocol.send_message(conn, protocol.Weights(worker, version, accepted, len(session.reply_view),
                                                         stop, table_rate=self._table_rate()).header(),
                                  session.reply_view)
        return True

    def _table_rate(self) -> float:
        """The tables' learning rate for the next update, for the workers that step shared tables (else 0)."""
        if not self._shared_tables:
            return 0.0
        with self._cond:
            return self.core.table_rate()

    def _receive_gradient(self, session: _Session, header: Header,
                          push: protocol.Push) -> tuple[torch.Tensor, torch.Tensor]:
        """A socket push's gradient, into the session's buffers (made at its first one): whole, streamed,
        or encoded; none for a push flagged non-finite.  Returns (gradient, reply buffer)."""
        conn, codec = session.conn, session.codec
        if session.grad is None:
            session.grad, session.reply = torch.empty(session.num_params), torch.empty(session.num_params)
            encoded = session.grad if not codec.lossy else torch.empty(codec.encoded_bytes(), dtype=torch.uint8)
            session.encoded = encoded
            session.grad_view = memoryview(encoded.numpy()).cast("B")  # type: ignore[arg-type]  # numpy#26783: no __buffer__ <3.12
            session.reply_view = memoryview(session.reply.numpy()).cast("B")  # type: ignore[arg-type]  # numpy#26783
        grad, reply = session.grad, cast(torch.Tensor, session.reply)
        if push.nonfinite:
            if header.length:
                raise ProtocolError("a PUSH flagged non-finite carries a payload")
        elif push.reversed:
            if codec.lossy:
                raise ProtocolError("a streamed PUSH must carry the uncompressed gradient")
            protocol.recv_payload_reversed(conn, header, session.grad_view, self._tensor_spans)
        elif codec.lossy:
            protocol.recv_payload_into(conn, header, session.grad_view)
            try:
                codec.decode_into(cast(torch.Tensor, session.encoded), grad)
            except ValueError as exc:
                raise ProtocolError(f"undecodable {codec.name} gradient: {exc}") from None
        else:
            protocol.recv_payload_into(conn, header, session.grad_view)
        return grad, reply

    def _table(self, header: Header) -> EmbeddingTable:
        return self._table_at(header.epoch, header.type.name)

    def _table_at(self, index: int, message: str) -> EmbeddingTable:
        if not 0 <= index < len(self.core.tables):
            raise ProtocolError(f"{message} for table {index}, and the run has {len(self.core.tables)} tables")
        return self.core.tables[index]

    def _pull(self, session: _Session, wanted: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, int] | None:
        """The current values of ``wanted``'s rows ((table, row indices) each), read under one hold of the lock
        (so all from one version), flat and in order, with that version; None once the run has failed (the
        worker is told why)."""
        with self._cond:
            if self.core.failure is not None:
                send_error(session.conn, self.core.failure_text())
                return None
            pulled = [self.core.pull_rows(table, index)[0].reshape(-1) for table, index in wanted]
            version = self.core.version
        return (pulled[0] if len(pulled) == 1 else torch.cat(pulled)), version

    def _receive_ids(self, session: _Session, count: int, table: EmbeddingTable) -> torch.Tensor:
        """The next ``count`` int64 row ids of a ROWS, PULL_ROWS or PULL_TABLES payload, as this shard's row indices.

        The one check of a message's ids: in the table and on this shard, and in increasing order, each once
        (as a worker's ``torch.unique`` gives them), so one worker's rows step without being sorted again.
        """
        ids = torch.empty(count, dtype=torch.int64)
        protocol.recv_tensor(session.conn, ids)
        values = ids.numpy()     # a few hundred ids: numpy's comparisons cost far less than torch's dispatch
        if count > 1 and not bool((values[1:] > values[:-1]).all()):
            raise ProtocolError(f"table {table.spec.name!r}: a ROWS or PULL_ROWS message names its row ids in "
                                "increasing order, each once")
        try:
            return table.local_index(ids, increasing=True)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None

    def _on_rows(self, session: _Session, header: Header) -> bool:
        """A table's touched rows and their gradients: kept for the worker's next PUSH."""
        table = self._table(header)
        protocol.Rows.read(header, with_ids=True, dim=table.spec.dim)
        index = self._receive_ids(session, header.count, table)
        values = torch.empty((header.count, table.spec.dim), dtype=torch.float32)
        protocol.recv_tensor(session.conn, values)
        session.rows.append((header.epoch, index, values))
        return True

    def _on_pull_rows(self, session: _Session, header: Header) -> bool:
        """Rows a worker's batch needs: answered with their current values."""
        table = self._table(header)
        protocol.Rows.read(header, with_ids=True, dim=0)
        pulled = self._pull(session, [(header.epoch, self._receive_ids(session, header.count, table))])
        if pulled is None:
            return False
        values, version = pulled
        protocol.send_message(session.conn, protocol.Rows(Msg.ROWS, session.worker, header.epoch, header.count,
                                                          values.numel() * 4, version).header(),
                              memoryview(values.numpy()).cast("B"))  # type: ignore[arg-type]
        return True

    def _on_pull_tables(self, session: _Session, header: Header) -> bool:
        """The rows of several tables a worker's step needs, in one request: answered by one ROWS with every
        table's values, read under one hold of the lock (so all from the same version)."""
        pull = protocol.TablePull.read(header, len(self.core.tables))
        layout = torch.empty(2 * pull.tables, dtype=torch.int64)
        protocol.recv_tensor(session.conn, layout)
        tables, counts = layout[:pull.tables].tolist(), layout[pull.tables:].tolist()
        if len(set(tables)) != len(tables) or min(counts) < 0 or 16 * pull.tables + 8 * sum(counts) != header.length:
            raise ProtocolError(f"PULL_TABLES names tables {tables} with {counts} rows in {header.length} bytes: each "
                                "table once, followed by its ids")
        pulled = self._pull(session, [(table, self._receive_ids(session, count, self._table_at(table, "PULL_TABLES")))
                                      for table, count in zip(tables, counts, strict=True)])
        if pulled is None:
            return False
        values, version = pulled
        protocol.send_message(session.conn, protocol.Rows(Msg.ROWS, session.worker, protocol.ALL_TABLES, sum(counts),
                                                          values.numel() * 4, version).header(),
                              memoryview(values.numpy()).cast("B"))  # type: ignore[arg-type]
        return True

    def _on_validation(self, session: _Session, header: Header) -> bool:
        report = protocol.Validation.read(header, protocol.recv_small_payload(session.conn, header, 64))
        with self._cond:
            stop = self.core.validation(session.worker, session.token, report.epoch, report.samples,
                                        report.loss_sum, report.metric_sum)
            self._cond.notify_all()
        protocol.send_message(session.conn, Header(Msg.ACK, flags=protocol.FLAG_STOP if stop else 0,
                                                   worker=session.worker))
        return True

    def _on_epoch(self, session: _Session, header: Header) -> bool:
        report = protocol.EpochReport.read(header, protocol.recv_small_payload(session.conn, header))
        with self._worker_event():
            self.core.epoch_end(session.worker, session.token, report.epoch, report.rows, report.sums)
        stop = self.read(lambda core: core.training_over)   # after the callbacks of the epochs it completed
        protocol.send_message(session.conn, Header(Msg.ACK, flags=protocol.FLAG_STOP if stop else 0,
                                                   worker=session.worker))
        return True

    def _on_done(self, session: _Session, header: Header) -> bool:
        self._done(session.conn, session.worker, session.token, protocol.Done.read(header), header, session.part)
        protocol.send_message(session.conn, Header(Msg.ACK, worker=session.worker))
        return False

    def _on_fail(self, session: _Session, header: Header) -> bool:
        text = protocol.recv_small_payload(session.conn, header)
        with self._worker_event():
            self.core.worker_failed(session.worker, text, session.token)
        protocol.send_message(session.conn, Header(Msg.ACK, worker=session.worker))
        return False

    def _decide_part(self, worker: int, token: int, part: int, meta: PushMeta, grad: torch.Tensor,
                     finite: bool) -> PushDecision | None:
        """A part's push (under the lock): the parts decide when it completes the worker's push; the
        other parts wait for that decision."""
        parts = cast(PipelineParts, self.parts)   # only a pipelined PS has parts that push
        decision, target = parts.offer(self.core, worker, token, part, meta, grad, finite)
        if target < 0:
            self._cond.notify_all()   # the parts waiting for this push, or for a run it failed
            return decision
        settled = self._cond.wait_for(
            lambda: (self._stopping.is_set() or parts.settled(worker, target) or self.core.failure is not None
                     or not self.core.members.is_active(worker, token)), timeout=2 * self.config.timeout_s)
        if not settled:
            self.core.fail(PSTimeoutError(
                f"worker {worker}'s pipeline stages did not all push within {2 * self.config.timeout_s:.0f} s: "
                "a stage task is gone or far slower (raise timeout_s)"))
            self._cond.notify_all()
        if self._stopping.is_set() or not parts.settled(worker, target) or not self.core.members.is_active(worker, token):
            return None
        return parts.decision_for(worker)

    def _push(self, worker: int, token: int, push: protocol.Push, grad: torch.Tensor,
              reply: torch.Tensor | None, part: int | None = None,
              rows: Sequence[PushedRows] = ()) -> tuple[bool, int, bool] | None:
        """Hand one gradient (or a pipeline part of one), with its tables' ``rows``, to the core, wait out its
        round or SSP bound, fill ``reply`` (None: the worker reads the shared master).

        Returns (accepted, version, stop), or None when no weights may be sent.
        """
        # One check per gradient: the worker's, when it checked before sending; else (a push streamed during
        # backward) one vectorised pass here: NaN/Inf propagate into the sum (so does a float32 overflow, which
        # is refused too); torch.isfinite(grad).all() costs ~40x more on large gradients.
        finite = not push.nonfinite and (push.checked or (
            bool(torch.isfinite(grad.sum())) and all(bool(torch.isfinite(values.sum())) for _, _, values in rows)))
        meta = PushMeta(push.computed_on, push.samples, push.loss, push.epoch, push.weight)
        span = None if part is None else cast(PipelineParts, self.parts).ranges[part].params   # parts: see _hello
        with self._cond:
            if part is None:
                decision = self.core.push(worker, token, meta, grad, finite, rows)
                self._cond.notify_all()
            else:
                decision = self._decide_part(worker, token, part, meta, grad, finite)
            if decision is None:
                return None
            if decision.wait_for_version is not None:
                target, generation = decision.wait_for_version, self.core.round_generation
                # A silent worker is caught first by its own connection's timeout_s (it is then lost
                # and the round abandoned); this longer bound is the backstop that keeps the wait finite.
                settled = self._cond.wait_for(
                    lambda: self._stopping.is_set() or self.core.round_settled(worker, token, target, generation),
                    timeout=2 * self.config.timeout_s)
                if self._stopping.is_set():
                    return None
                self.core.after_round_wait(worker, token, target, generation, timed_out=not settled)
                self._cond.notify_all()
            if not self.core.ssp_released(worker, token):
                # SSP: this worker is too far ahead; it gets its weights once the slowest catches up
                released = self._cond.wait_for(lambda: self._stopping.is_set() or self.core.ssp_released(worker, token),
                                               timeout=2 * self.config.timeout_s)
                if self._stopping.is_set():
                    return None
                if not released:
                    self.core.fail(PSTimeoutError(
                        f"worker {worker} waited {2 * self.config.timeout_s:.0f} s for the slowest worker to come "
                        f"within ssp_bound={self.config.ssp_bound}; a worker is gone or far slower (raise timeout_s "
                        "or ssp_bound)"))
                    self._cond.notify_all()
            version = self.core.reply_weights(worker, token, reply, span)
            stop = self.core.training_over
            due = self.core.snapshots.take_due()
        self._deliver(due)
        return None if version is None else (decision.accepted, version, stop)

    @contextlib.contextmanager
    def _worker_event(self) -> Iterator[None]:
        """A worker done, failed or lost, under the lock: then the waiters are woken, and a snapshot that
        a buffer flushed by the event made due is delivered (no push may come to deliver it)."""
        with self._cond:
            yield
            self._cond.notify_all()
            due = self.core.snapshots.take_due()
            epochs = self.core.epochs.take_completed()
        self._deliver(due)
        self._call_back(epochs)

    def _call_back(self, epochs: list[EpochRow]) -> None:
        """Hand completed epochs to the driver's callbacks, outside the lock; one returning True stops training."""
        if self.epoch_listener is None:
            return
        for row in epochs:
            if self.epoch_listener(row):
                with self._cond:
                    self.core.epochs.stop_by_callback(row.epoch, "on_epoch_end")
                    self._cond.notify_all()

    def _deliver(self, due: dict | None) -> None:
        """Send or write a snapshot an update made due, outside the lock (other workers keep training)."""
        if due is None:
            return
        if self.snapshot_sink is not None:
            self.snapshot_sink(due)
        else:
            self.write_checkpoint(due)

    def _done(self, conn: socket.socket, worker: int, token: int, done: protocol.Done, header: Header,
              part: int | None) -> None:
        if part is not None:
            self._part_done(conn, worker, token, done, header, part)
            return
        float_buffers = None
        if done.float_buffer_bytes:
            float_buffers = torch.empty(self.core.float_buffer_count, dtype=torch.float32)
            protocol.recv_payload_into(conn, header, memoryview(
                float_buffers.numpy()).cast("B"))  # type: ignore[arg-type]  # numpy#26783: no __buffer__ <3.12
        with self._worker_event():
            self.core.done(worker, token, float_buffers if done.samples > 0 else None, done.samples)

    def _part_done(self, conn: socket.socket, worker: int, token: int, done: protocol.Done, header: Header,
                   part: int) -> None:
        """A stage finished: its buffers go to their range; the worker is done when every stage is."""
        parts = cast(PipelineParts, self.parts)   # only a pipelined PS has parts that report
        lo, hi = parts.ranges[part].buffers
        float_buffers = torch.empty(hi - lo)
        if done.float_buffer_bytes:
            protocol.recv_payload_into(conn, header, memoryview(
                float_buffers.numpy()).cast("B"))  # type: ignore[arg-type]  # numpy#26783: no __buffer__ <3.12
        with self._worker_event():
            parts.done(self.core, worker, token, part, done.samples, float_buffers if done.float_buffer_bytes else None)


@dataclass
class _Session:
    """One registered connection's state: who it is, and its receive buffers (made at the first socket push)."""

    conn: socket.socket
    worker: int
    token: int
    segment: SharedSegment | None
    part: int | None
    num_params: int
    codec: Codec
    max_length: int
    #: the worker computes on the shared master: its pushes are answered without weights
    in_master: bool = False
    grad: torch.Tensor | None = None
    reply: torch.Tensor | None = None
    encoded: torch.Tensor | None = None
    grad_view: memoryview = field(default_factory=lambda: memoryview(b""))
    reply_view: memoryview = field(default_factory=lambda: memoryview(b""))
    #: the tables' rows sent since the last PUSH: they go to the core with it
    rows: list[PushedRows] = field(default_factory=list)


def master_in_place(config: TrainConfig, setup: ServerSetup) -> bool:
    """Whether workers on this host may compute on the master itself: only where no step can run while one of
    them computes.  Under sync without backup workers a round steps once all its workers have pushed and wait;
    backup workers, the other policies and pipeline parts step while some worker computes, and local SGD's
    workers write their weights."""
    return (config.policy == "sync" and config.backup_workers == 0 and config.local_update != "sgd"
            and not setup.parts and config.ps_transport == "auto" and config.compression == "none"
            and shared_memory.available())


def _share_tables(config: TrainConfig, setup: ServerSetup) -> list[SharedTable]:
    """With ``shared_tables``, move every table of ``setup`` into a shared-memory file (one PS on this host);
    none when this host cannot make them all (every worker's rows then travel as messages)."""
    if not (config.shared_tables and setup.tables and not setup.parts and config.ps_transport == "auto"
            and shared_memory.available()):
        return []
    made = [SharedTable.create(table.spec, config.worker_slots + 1) for table in setup.tables]
    if any(table is None for table in made):
        for table in made:
            if table is not None:
                table.remove()
        log.warning("parameter server: /dev/shm cannot hold the embedding tables; their rows travel as messages")
        return []
    shared = [table for table in made if table is not None]
    for held, table in zip(setup.tables, shared, strict=True):
        held.share(table)
    return shared


def _peer_host(conn: socket.socket) -> str:
    """The address a connection comes from ("an unknown host" once it is gone)."""
    try:
        return str(conn.getpeername()[0])
    except OSError:
        return "an unknown host"
