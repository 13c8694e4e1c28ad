"""Worker-side connection to the parameter server: hello, push_pull, done."""
from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sparkdl._internal.ps.tables import TableSpec
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl._internal.ps.wire.shared_memory import (
    SHM_DIR,
    SharedMaster,
    SharedSegment,
    available,
    host_identity,
    master_name,
    segment_name,
)
from sparkdl._internal.ps.worker.shared_rows import SharedRows
from sparkdl.errors import ParameterServerError, ProtocolError, PSTimeoutError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Welcome:
    """What the PS answered to this worker's hello."""

    version: int
    steps_per_epoch: int
    position: int        # mini-batches of this worker already consumed by the PS (resume point)
    has_weights: bool    # the weights buffer was filled (past version 0)


@dataclass(frozen=True)
class InOrderReply:
    """How to take a WEIGHTS reply piece by piece: its byte spans in order, and whom to tell."""

    byte_spans: list[tuple[int, int]]
    #: answered(version, accepted): the reply's header is in (the payload follows)
    answered: Callable[[int, bool], None]
    #: received(i): span i of the weights is in place
    received: Callable[[int], None]


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("wire buffers must be contiguous CPU tensors")
    # flat first: a view of a tensor with no rows (a table's empty part) cannot be cast in its own shape
    return memoryview(tensor.numpy().reshape(-1)).cast("B")  # type: ignore[arg-type]  # numpy#26783: no __buffer__ <3.12


class RowsClient(Protocol):
    """A worker's connection to the tables: :class:`PSClient`, or ``ShardedClient`` across PS shards."""

    def pull_rows(self, table: int, ids: torch.Tensor, dim: int) -> torch.Tensor: ...

    def pull_tables(self, requests: Sequence[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]: ...

    def push_rows(self, table: int, ids: torch.Tensor, grads: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class _TablesRequest:
    """A PULL_TABLES: its header, its payload (the tables, their row counts, then their ids) and the buffer its
    ROWS answer fills, with each table's [rows, width]."""

    header: Header
    asked: torch.Tensor
    values: torch.Tensor
    shapes: list[tuple[int, int]]

    @classmethod
    def of(cls, worker: int, requests: Sequence[tuple[int, torch.Tensor, int]]) -> _TablesRequest:
        ids = [table_ids.to(torch.int64) for _, table_ids, _ in requests]
        layout = torch.tensor([table for table, _, _ in requests] + [i.numel() for i in ids], dtype=torch.int64)
        asked = torch.cat([layout, *ids])
        shapes = [(i.numel(), dim) for i, (_, _, dim) in zip(ids, requests, strict=True)]
        values = torch.empty(sum(rows * dim for rows, dim in shapes), dtype=torch.float32)
        return cls(protocol.TablePull(worker, len(requests), 8 * asked.numel()).header(), asked, values, shapes)


class TableRows:
    """A worker's source of embedding-table rows (``ps.remote_embedding.RowSource``): the PS, by table name."""

    def __init__(self, client: RowsClient, tables: Sequence[TableSpec]) -> None:
        self.client = client
        #: name -> (the table's index in the run's list, its row width)
        self.index = {table.name: (i, table.dim) for i, table in enumerate(tables)}

    def pull_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        index, dim = self.index[table]
        return self.client.pull_rows(index, ids, dim)

    def pull_tables(self, requests: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The rows of several tables (by name) in one round trip; see :meth:`PSClient.pull_tables`."""
        return self.client.pull_tables([(self.index[table][0], ids, self.index[table][1]) for table, ids in requests])


class PSClient:
    """One authenticated connection of one worker; not thread-safe (one per worker)."""

    def __init__(self, host: str, port: int, secret: bytes, worker: int, timeout_s: float,
                 tls_cert_pem: str | None = None, shard: int = 0) -> None:
        self.worker = worker
        self.shard = shard   # which PS shard this connection serves (names its shared-memory segment)
        self.timeout_s = timeout_s
        self.address = (host, port)
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        #: gradient and weight bytes of the exchanges by the path they took: payloads that crossed the
        #: socket, and those that went through the shared-memory segment (headers are not counted)
        self.socket_payload_bytes = 0
        self.shared_payload_bytes = 0
        #: the last reply said the run's sample budget is spent
        self.stop_requested = False
        #: the round trips a training step waits on: a push answered by its weights, a pull of table rows
        self.round_trips = 0
        #: the same-host shared-memory segment, when the PS made one for this worker (see hello)
        self.segment: SharedSegment | None = None
        #: the PS's master weights, when it keeps them in shared memory for this worker (see hello): then every
        #: push's reply leaves the new weights there, not in the caller's buffer
        self.master: SharedMaster | None = None
        #: the embedding tables, when the PS keeps them in shared memory for this worker (see hello): then rows are
        #: gathered and stepped here, with no message
        self.shared_rows: SharedRows | None = None
        #: the tables' learning rate for the next update, from the PS's last reply (shared rows step at it)
        self.table_rate = 0.0
        #: why this worker uses TCP although the PS offered shared memory (None: nothing to say)
        self.transport_note: str | None = None
        self._secret = secret
        #: table rows sent with the next message (the step's PUSH), in one system call with it; their tensors,
        #: kept alive until then
        self._outbox: list[memoryview | bytes] = []
        self._outbox_tensors: list[torch.Tensor] = []
        #: a pull of table rows to send right after the next push, in the same write (see pull_after_push), and
        #: the one sent, whose ROWS follow the push's reply
        self._pull_after_push: _TablesRequest | None = None
        self._pull_in_flight: _TablesRequest | None = None
        #: the rows the last push's pull brought (per table of the request, in its order); None if it had none
        self.rows_after_push: list[torch.Tensor] | None = None
        self.sock = self._connect(secret, tls_cert_pem)

    def _connect(self, secret: bytes, tls_cert_pem: str | None) -> socket.socket:
        """An authenticated connection; connects again (backing off, within ``timeout_s``) while the server
        answers BUSY: a flood from this address made it close the pending connection to make room."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.01
        while True:
            sock = self._open(tls_cert_pem)
            try:
                self._call(lambda conn=sock: protocol.client_authenticate(conn, secret))
                return sock
            except protocol.HandshakeEvicted:
                sock.close()
                if time.monotonic() + pause > deadline:
                    raise PSTimeoutError(
                        f"worker {self.worker} could not authenticate with the parameter server at "
                        f"{self.address[0]}:{self.address[1]} within {self.timeout_s:.0f} s: it kept closing the "
                        "connection to make room for a flood of others from this address") from None
                time.sleep(pause)
                pause = min(2 * pause, 0.5)
            except BaseException:
                sock.close()
                raise

    def _open(self, tls_cert_pem: str | None) -> socket.socket:
        """A TCP (or, with the PS's pinned certificate, TLS) connection to the PS, not yet authenticated."""
        host, port = self.address
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout_s)
        except OSError as exc:
            raise ParameterServerError(
                f"worker {self.worker} cannot reach the parameter server at {host}:{port} ({exc}); "
                "executors must be able to connect to the driver: check 'spark.driver.host' and firewalls"
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls_cert_pem is None:
            return sock
        # The PS certificate is pinned: it is the only trusted one, whatever its host name.
        context = ssl.create_default_context(cadata=tls_cert_pem)
        context.check_hostname = False
        try:
            return context.wrap_socket(sock)
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            raise ParameterServerError(f"TLS handshake with the parameter server failed: {exc}") from exc

    @property
    def transport(self) -> str:
        """How gradients and weights travelled, from the bytes each path carried: "shared_memory" (only
        headers crossed the socket), "tcp", or "shared_memory+tcp"; before any exchange, the path set up."""
        shared, socket_ = self.shared_payload_bytes > 0, self.socket_payload_bytes > 0
        if shared and socket_:
            return "shared_memory+tcp"
        if shared or socket_:
            return "shared_memory" if shared else "tcp"
        return "shared_memory" if self.segment is not None else "tcp"

    def close(self) -> None:
        self._outbox, self._outbox_tensors, self._pull_after_push = [], [], None
        self.sock.close()

    def _send(self, header: Header, payload: memoryview | bytes | None = None, then: _TablesRequest | None = None
              ) -> None:
        """Send a message, after the table rows waiting for it (and before the pull ``then``), in one system call
        where the kernel takes it."""
        buffers = [*self._outbox, protocol.pack_header(header)] + ([payload] if payload else [])
        if then is not None:
            buffers += [protocol.pack_header(then.header), _byte_view(then.asked)]
        self._outbox, self._outbox_tensors = [], []
        protocol.send_buffers(self.sock, buffers)

    def _send_push(self, header: Header, payload: memoryview | bytes | None = None) -> None:
        """A PUSH, after its table rows, followed by the pull queued for after it (:meth:`pull_after_push`)."""
        then, self._pull_after_push = self._pull_after_push, None
        self._send(header, payload, then)
        self._pull_in_flight, self.rows_after_push = then, None

    def _receive_pull_after_push(self) -> None:
        """After a push's reply: the ROWS of the pull sent with it, if one was."""
        request, self._pull_in_flight = self._pull_in_flight, None
        if request is not None:
            self.rows_after_push = self._receive_tables(request, counted=False)

    def _call(self, fn):
        """Run one exchange, turning socket failures into errors that say what happened."""
        try:
            return fn()
        except TimeoutError:
            raise PSTimeoutError(
                f"worker {self.worker} waited {self.timeout_s:.0f} s for the parameter server at "
                f"{self.address[0]}:{self.address[1]}; it is overloaded, waiting for a straggler, or gone "
                "(raise timeout_s if rounds are legitimately that slow)") from None
        except ConnectionError as exc:
            raise ParameterServerError(
                f"worker {self.worker} lost the parameter server at {self.address[0]}:{self.address[1]} "
                f"({exc}); the driver probably stopped or failed") from None

    def _read_reply(self, max_length: int, *kinds: Msg, counted: bool = True) -> Header:
        """The next reply's header; ``counted``: a round trip of its own (not rows that came with a push's)."""
        header = protocol.recv_header(self.sock, max(max_length, protocol.MAX_TEXT_BYTES))
        if header.type in (Msg.WEIGHTS, Msg.ROWS) and counted:
            self.round_trips += 1
        if header.type == Msg.ERROR:
            text = protocol.recv_small_payload(self.sock, header).decode("utf-8", "replace")
            raise ParameterServerError(f"parameter server: {text}")
        protocol.expect(header, *kinds)
        return header

    def request(self, header: Header, payload: bytes | None = None, reply: Msg | None = None,
                max_length: int = protocol.MAX_TEXT_BYTES) -> tuple[Header, bytes] | None:
        """Send one message; with ``reply``, receive that answer and its payload (``max_length`` bytes at most)."""
        def exchange() -> tuple[Header, bytes] | None:
            self._send(header, payload)
            if reply is None:
                return None
            answer = self._read_reply(max_length, reply)
            return answer, protocol.recv_small_payload(self.sock, answer, max_length)
        return self._call(exchange)

    def hello(self, partition_rows: int, weights: torch.Tensor, task_attempt: int = 0,
              shared_memory: bool = False, part: tuple[int, int] | None = None, double: bool = False,
              wait_for_turn: bool = False, master: bool = False, tables: Sequence[TableSpec] = (),
              table_slots: int = 0) -> Welcome:
        """Register; receive the step plan, the resume position and (past version 0) the weights.

        ``shared_memory``: offer the same-host transport; when the PS is on this host and makes a
        segment, :attr:`segment` holds it afterwards and pushes go through it (``double``: two
        regions of each, see :meth:`push_shared`; ``master``: the caller can compute on the PS's master
        in place, see :attr:`master`; ``tables``: the run's tables, which the caller can step in shared memory,
        ``table_slots`` step counters each, see :attr:`shared_rows`).  ``part``: (stage, stages) of a pipelined
        worker, which pushes and pulls only that stage's key range and always receives its weights.
        ``wait_for_turn``: a work unit's task, whose welcome waits while ``max_workers`` others train (as long
        as a unit's pass takes, so without this client's deadline; the wait ends with the PS's connection).
        """
        def exchange() -> Welcome:
            identity = host_identity() if shared_memory and available() and part is None else b""
            stage, stages = part or (0, 0)
            hello = protocol.Hello(self.worker, task_attempt, partition_rows, identity, stage, stages,
                                   double=double and bool(identity), master=master and bool(identity) and not double,
                                   tables=bool(tables) and bool(identity) and not double)
            self._send(hello.header(), identity or None)
            view = _byte_view(weights)
            if wait_for_turn:
                self.sock.settimeout(None)
            try:
                header = self._read_reply(len(view), Msg.WELCOME)
            finally:
                self.sock.settimeout(self.timeout_s)
            welcome = protocol.Welcome.read(header)
            if welcome.weight_bytes:
                protocol.recv_payload_into(self.sock, header, view)
            if welcome.shared_memory:   # None if it cannot be attached here: pushes then use the socket
                name = segment_name(self._secret, self.worker, task_attempt, self.shard)
                self.segment = SharedSegment.attach(name, weights.numel(), regions=2 if hello.double else 1)
                if self.segment is None:
                    self.transport_note = (
                        f"worker {self.worker}: the parameter server at {self.address[0]} runs on this kernel and "
                        f"made a shared-memory segment, but this process cannot see it in {SHM_DIR} (a container "
                        "or network namespace with a /dev/shm of its own); gradients and weights go over TCP")
                    log.warning("%s", self.transport_note)
            if welcome.master and self.segment is not None:
                self.master = SharedMaster.attach(master_name(self._secret, self.address[1]), weights.numel())
                if self.master is None:   # the replies would have no weights: the socket carries them instead
                    self.segment = None
                    self.transport_note = (f"worker {self.worker}: the parameter server's shared master weights "
                                           f"are not readable in {SHM_DIR}; gradients and weights go over TCP")
                    log.warning("%s", self.transport_note)
            self.table_rate = welcome.table_rate
            if welcome.tables and self.segment is not None:
                self.shared_rows = SharedRows.attach(self._secret, self.address[1], tables, table_slots, self.worker)
                if self.shared_rows is None:
                    log.warning("worker %d: the parameter server's shared tables are not readable in %s; their rows "
                                "travel as messages", self.worker, SHM_DIR)
            return Welcome(welcome.version, welcome.steps_per_epoch, welcome.position, bool(welcome.weight_bytes))
        return self._call(exchange)

    def _shared_exchange(self, push: protocol.Push, grads: torch.Tensor | None,
                         weights_out: torch.Tensor) -> tuple[int, bool]:
        """A push through the segment: the gradient is written before the header is sent (the commit)."""
        segment = self.segment
        assert segment is not None   # a shared exchange is only made through this client's segment
        if grads is not None and grads.data_ptr() != segment.gradient.data_ptr():
            segment.gradient.copy_(grads)
        outcome = self._shared_round_trip(push)
        if self.master is None:    # else the weights are in the master, where the caller computes
            replied = segment.reply_region(push.region)
            if weights_out.data_ptr() != replied.data_ptr():
                weights_out.copy_(replied)
        return outcome

    def push_shared(self, push: protocol.Push) -> tuple[int, bool]:
        """A push whose gradient the caller wrote into the segment's region ``push.region``; the new
        weights are then in ``segment.reply_region(push.region)``.  Returns (new version, accepted)."""
        segment = self.segment
        if segment is None or push.region >= segment.regions or not push.shared:
            raise ValueError("push_shared needs a shared push into a region of this client's segment")
        return self._call(lambda: self._shared_round_trip(push))

    def _shared_round_trip(self, push: protocol.Push) -> tuple[int, bool]:
        """Send a shared push's header (its gradient is already in the segment) and read the header-only reply."""
        segment = self.segment
        assert segment is not None   # a shared push is only made through this client's segment
        self._send_push(push.header())
        reply = protocol.Weights.read(self._read_reply(0, Msg.WEIGHTS))
        self.table_rate = reply.table_rate
        if not reply.shared or reply.master != (self.master is not None):
            raise ProtocolError("the parameter server answered a shared-memory push on the socket, or in the "
                                "shared master when it had not offered it (or the reverse)")
        pushed = 0 if push.nonfinite else 4 * segment.num_params
        pulled = 0 if reply.master else 4 * segment.num_params   # read in place: no weights moved
        self.bytes_pushed += protocol.HEADER.size + pushed
        self.bytes_pulled += protocol.HEADER.size + pulled
        self.shared_payload_bytes += pushed + pulled
        self.stop_requested = reply.stop
        self._receive_pull_after_push()
        return reply.version, reply.accepted

    def _receive_weights(self, weights_out: torch.Tensor, in_order: InOrderReply | None = None
                         ) -> tuple[int, bool]:
        """The WEIGHTS reply to a push over the socket, received into ``weights_out``: (version, accepted).

        With ``in_order`` the reply is announced as soon as its header is in, and each of its spans
        as it lands.
        """
        view = _byte_view(weights_out)
        header = self._read_reply(len(view), Msg.WEIGHTS)
        reply = protocol.Weights.read(header)
        self.stop_requested, self.table_rate = reply.stop, reply.table_rate
        if in_order is None:
            protocol.recv_payload_into(self.sock, header, view)
        else:
            in_order.answered(reply.version, reply.accepted)
            protocol.recv_payload_in_order(self.sock, header, view, in_order.byte_spans, in_order.received)
        self.bytes_pulled += protocol.HEADER.size + len(view)
        self.socket_payload_bytes += header.length
        self._receive_pull_after_push()
        return reply.version, reply.accepted

    def pull_rows(self, table: int, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """The current values (float32 ``[len(ids), dim]``) of rows ``ids`` (distinct) of table ``table``."""
        ids = ids.to(torch.int64).contiguous()
        if self.shared_rows is not None:    # read in place: no round trip
            return self.shared_rows.gather(table, ids)
        values = torch.empty((ids.numel(), dim), dtype=torch.float32)

        def exchange() -> torch.Tensor:
            self._send(protocol.Rows(Msg.PULL_ROWS, self.worker, table, ids.numel(), 8 * ids.numel()).header(),
                       _byte_view(ids))
            header = self._read_reply(4 * values.numel(), Msg.ROWS)
            protocol.Rows.read(header, with_ids=False, dim=dim)
            if header.epoch != table or header.count != ids.numel():
                raise ProtocolError(f"asked for {ids.numel()} rows of table {table}, got {header.count} of "
                                    f"table {header.epoch}")
            protocol.recv_tensor(self.sock, values)
            return values
        result = self._call(exchange)
        self.bytes_pushed += protocol.HEADER.size + 8 * ids.numel()
        self.bytes_pulled += protocol.HEADER.size + 4 * values.numel()
        self.socket_payload_bytes += 8 * ids.numel() + 4 * values.numel()
        return result

    def pull_tables(self, requests: Sequence[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
        """The current rows of several tables in one round trip: for each (table, distinct ids, row width), float32
        ``[len(ids), width]``, all of the same version (one table: a PULL_ROWS, several: one PULL_TABLES)."""
        if len(requests) == 1 or self.shared_rows is not None:
            return [self.pull_rows(*request) for request in requests]
        request = _TablesRequest.of(self.worker, requests)

        def exchange() -> list[torch.Tensor]:
            self._send(request.header, _byte_view(request.asked))
            return self._receive_tables(request)
        return self._call(exchange)

    def pull_after_push(self, requests: Sequence[tuple[int, torch.Tensor, int]]) -> None:
        """Pull these rows (as :meth:`pull_tables`) right after the next push, in the same write: the PS answers
        it once the push is answered, so the rows are at least as new as the weights of the push's reply (under
        ``sync``, the round's: what a pull before the next forward would read).  They are in
        :attr:`rows_after_push` once the push returns; the step waits on one round trip for both."""
        self._pull_after_push = _TablesRequest.of(self.worker, requests) if requests else None

    def _receive_tables(self, request: _TablesRequest, counted: bool = True) -> list[torch.Tensor]:
        values = request.values
        header = self._read_reply(4 * values.numel(), Msg.ROWS, counted=counted)
        if header.epoch != protocol.ALL_TABLES or header.length != 4 * values.numel():
            raise ProtocolError(f"asked for {values.numel() * 4} bytes of rows of {len(request.shapes)} tables, got "
                                f"{header.length} bytes for table {header.epoch}")
        protocol.recv_tensor(self.sock, values)
        self.bytes_pushed += protocol.HEADER.size + 8 * request.asked.numel()
        self.bytes_pulled += protocol.HEADER.size + 4 * values.numel()
        self.socket_payload_bytes += 8 * request.asked.numel() + 4 * values.numel()
        return [part.view(shape) for part, shape in
                zip(values.split([rows * dim for rows, dim in request.shapes]), request.shapes, strict=True)]

    def push_rows(self, table: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Table ``table``'s touched rows and their gradients, for the PS to take with the next push: sent with
        that push, in the same system call (a step's rows and push are one write, whatever the tables).  Tables
        in shared memory are stepped here and now instead, at the rate of the PS's last reply."""
        ids = ids.to(torch.int64).contiguous()
        grads = grads.to(torch.float32).contiguous()
        if self.shared_rows is not None:
            self.shared_rows.step(table, ids, grads, self.table_rate)
            return
        payload = 8 * ids.numel() + 4 * grads.numel()
        self._outbox += [protocol.pack_header(protocol.Rows(Msg.ROWS, self.worker, table, ids.numel(),
                                                            payload).header()), _byte_view(ids), _byte_view(grads)]
        self._outbox_tensors += [ids, grads]
        self.bytes_pushed += protocol.HEADER.size + payload
        self.socket_payload_bytes += payload

    def push_pull(self, grads: torch.Tensor, computed_on: int, samples: int, loss: float, epoch: int,
                  weights_out: torch.Tensor, weight: float | None = None) -> tuple[int, bool]:
        """Push a gradient the caller found finite (with the rows it sent) and receive fresh weights in the same
        round trip; the PS does not check it again.

        Returns (new version, whether the gradient was accepted).  ``weight``: the rows' sum of
        weights (None: the gradient weighs its samples).  ``grads`` is the encoded
        gradient (the float32 gradient itself without compression); it and ``weights_out``
        may be the very buffers the replica trains with.
        """
        if self.segment is not None and grads.numel() == self.segment.num_params:
            return self._call(lambda: self._shared_exchange(
                protocol.Push(self.worker, epoch, computed_on, samples, loss, 0, shared=True, weight=weight,
                              checked=True), grads, weights_out))

        def exchange() -> tuple[int, bool]:
            out = _byte_view(grads)
            self._send_push(protocol.Push(self.worker, epoch, computed_on, samples, loss, len(out), weight=weight,
                                          checked=True).header(), out)
            self.bytes_pushed += protocol.HEADER.size + len(out)
            self.socket_payload_bytes += len(out)
            return self._receive_weights(weights_out)
        return self._call(exchange)

    def stream_push(self, push: protocol.Push, spans: Iterable[memoryview], weights_out: torch.Tensor,
                    reply: InOrderReply | None = None) -> tuple[int, bool]:
        """Send a reversed-order PUSH whose payload ``spans`` yields piece by piece (as backward makes them).

        Then receive the fresh weights into ``weights_out``: whole, or with ``reply`` piece by
        piece in forward order, announcing the reply and each piece as it lands.  Returns (new
        version, accepted).
        """
        def exchange() -> tuple[int, bool]:
            self._send(push.header())
            for span in spans:
                self.sock.sendall(span)
            self.bytes_pushed += protocol.HEADER.size + push.gradient_bytes
            self.socket_payload_bytes += push.gradient_bytes
            return self._receive_weights(weights_out, reply)
        return self._call(exchange)

    def push_nonfinite(self, computed_on: int, samples: int, loss: float, epoch: int,
                       weights_out: torch.Tensor, weight: float | None = None) -> tuple[int, bool]:
        """Tell the PS this step's gradient held NaN/Inf (it was not encoded) and pull fresh weights."""
        if self.segment is not None:
            return self._call(lambda: self._shared_exchange(
                protocol.Push(self.worker, epoch, computed_on, samples, loss, 0, nonfinite=True, shared=True,
                              weight=weight), None,
                weights_out))

        def exchange() -> tuple[int, bool]:
            self._send_push(protocol.Push(self.worker, epoch, computed_on, samples, loss, 0, nonfinite=True,
                                          weight=weight).header())
            self.bytes_pushed += protocol.HEADER.size
            return self._receive_weights(weights_out)
        return self._call(exchange)

    def validation(self, epoch: int, samples: int, loss_sum: float, metric_sum: float) -> bool:
        """Report this worker's validation score after ``epoch``; returns whether training stops early."""
        def exchange() -> bool:
            report = protocol.Validation(self.worker, epoch, samples, loss_sum, metric_sum)
            self._send(report.header(), report.payload())
            reply = self._read_reply(0, Msg.ACK)
            self.stop_requested = bool(reply.flags & protocol.FLAG_STOP)
            return self.stop_requested
        return self._call(exchange)

    def epoch_end(self, epoch: int, rows: int, sums: dict[str, float]) -> bool:
        """Report this worker's row-weighted loss and metric sums over ``epoch``; returns whether to stop."""
        def exchange() -> bool:
            report = protocol.EpochReport(self.worker, epoch, rows, sums)
            payload = report.payload()
            self._send(report.header(payload), payload)
            reply = self._read_reply(0, Msg.ACK)
            self.stop_requested = self.stop_requested or bool(reply.flags & protocol.FLAG_STOP)
            return bool(reply.flags & protocol.FLAG_STOP)
        return self._call(exchange)

    def done(self, samples: int, float_buffers: torch.Tensor | None) -> None:
        """Tell the PS this worker is finished; hand over its float buffers for averaging."""
        def exchange() -> None:
            view = _byte_view(float_buffers) if float_buffers is not None and float_buffers.numel() else None
            self._send(protocol.Done(self.worker, samples, len(view) if view is not None else 0).header(), view)
            self._read_reply(0, Msg.ACK)
        self._call(exchange)

    def report_failure(self, text: str, part_attempt: int = -1) -> None:
        """Best effort: hand the worker's traceback to the driver through the PS.

        ``part_attempt``: a pipeline stage task's stage attempt (-1: not a stage task).
        """
        data = text.encode("utf-8", "replace")[:protocol.MAX_TEXT_BYTES]
        try:
            self._send(Header(Msg.FAIL, worker=self.worker, version=part_attempt, length=len(data)), data)
            self._read_reply(0, Msg.ACK)
        except (OSError, ProtocolError, ParameterServerError):
            pass


def report_failure_to(address: tuple[str, int], secret: bytes, worker: int, timeout_s: float,
                      tls_cert_pem: str | None, text: str, attempt: int = -1) -> None:
    """Best effort, on a fresh connection: hand a task's traceback to the PS or coordinator at ``address``.

    ``attempt``: the stage attempt the task belongs to (the coordinator ignores older ones).
    """
    try:
        reporter = PSClient(*address, secret, worker, timeout_s, tls_cert_pem)
    except ParameterServerError:
        return
    try:
        reporter.report_failure(text, attempt)
    finally:
        reporter.close()


@contextlib.contextmanager
def failure_reported(report: Callable[[str], Any]) -> Iterator[None]:
    """Run a task body; if it fails, hand its traceback to ``report`` (so the driver can show the real
    cause instead of Spark's), then re-raise.  A :class:`ParameterServerError` came from the PS, which
    already knows.

    Nested, the innermost reports and the outer ones do not: a pipeline stage reports inside its
    process group, before tearing the group down makes its partners fail with a lost peer.
    """
    try:
        yield
    except ParameterServerError:
        raise
    except BaseException as exc:
        if not getattr(exc, "_sparkdl_reported", False):
            report(traceback.format_exc())
            with contextlib.suppress(AttributeError, TypeError):   # an exception type without a __dict__
                exc._sparkdl_reported = True  # type: ignore[attr-defined]
        raise
