"""Wire format between workers and the parameter server.

Every message is one fixed-size header followed by ``length`` payload bytes.  Tensor
payloads are raw little-endian float32 bytes, sent from and received into existing buffers
(no pickling, no intermediate ``bytes``).  A connection is authenticated first: the server
sends a random nonce, the client answers with HMAC-SHA256(secret, nonce).
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sparkdl.errors import AuthenticationError, ProtocolError

MAGIC = b"SDL2"
#: magic, type, flags, worker, epoch, version, count, payload length, value, weight
HEADER = struct.Struct("<4sBBHIqqQdd")
NONCE_BYTES = 32
DIGEST_BYTES = 32
#: largest non-tensor payload (error texts, tracebacks)
MAX_TEXT_BYTES = 1 << 20


class Msg(enum.IntEnum):
    """Message types.  The generic header fields are read through the typed views below."""

    CHALLENGE = 1   # server -> client: nonce
    AUTH = 2        # client -> server: HMAC of the nonce
    AUTH_OK = 3     # server -> client
    HELLO = 4       # client -> server: see Hello
    WELCOME = 5     # server -> client: see Welcome, payload = weights past version 0
    PUSH = 6        # client -> server: see Push, payload = (encoded) gradient
    # 7 was PULL; the number stays reserved so old and new peers never confuse a type
    WEIGHTS = 8     # server -> client: see Weights, payload = weights
    DONE = 9        # client -> server: see Done, payload = float buffers
    ACK = 10        # server -> client
    FAIL = 11       # client -> server: worker failed; payload = traceback text
    ERROR = 12      # server -> client: the run failed; payload = message text
    VALIDATION = 13  # client -> server: see Validation; answered by ACK (flags FLAG_STOP: early stopping)
    # executor-hosted PS shards <-> the driver's coordinator (sparkdl._internal.ps.shards.coordinator)
    SHARD_HELLO = 14   # shard host -> driver: worker = shard index, version = stage attempt, count = task attempt id
    SHARD_STATE = 15   # driver -> shard host: version = the cut's version (-1: none), payload = torch.save'd snapshot
    SHARD_REPORT = 16  # shard host -> driver: flags = a Report kind, payload per kind; only FINAL is answered (ACK)
    # a user function's tasks <-> the driver's function server (sparkdl._internal.ps.server.function_server)
    SPACE = 17      # task -> driver: see Space; payload = rank 0's initial weights (empty from the other ranks)
    SPACE_AT = 18   # driver -> task: count = the port of that key space's parameter server
    REPORT = 19     # task -> driver: flags = FLAG_STARTED or 0, payload = JSON metrics; answered by ACK
    EPOCH = 20      # worker -> PS: see EpochReport; answered by ACK (flags FLAG_STOP: a callback stopped training)
    # embedding tables held as rows (sparkdl._internal.ps.server.embedding_table): see Rows
    PULL_ROWS = 21  # worker -> PS: payload = int64 row ids; answered by ROWS with their float32 values
    ROWS = 22       # PS -> worker: the pulled rows; worker -> PS: a table's touched rows, part of its next PUSH
    PULL_TABLES = 23  # worker -> PS: see TablePull; answered by one ROWS (table ALL_TABLES) with every table's rows
    #: server -> client, in place of AUTH_OK: the pending connection was closed to make room for newer ones (a
    #: flood from the peer's address); an honest client connects again
    BUSY = 24


FLAG_ACCEPTED = 1   # WEIGHTS after PUSH: the gradient was accepted
FLAG_DROPPED = 2    # WEIGHTS after PUSH: the gradient was refused (too stale, not finite ...)
FLAG_STOP = 4       # WEIGHTS after PUSH: the run's sample budget is spent; the worker stops
#: PUSH: the worker found the gradient and its rows finite before sending; the PS does not check them again
#: (a streamed push, sent while backward runs, is checked by the PS)
FLAG_CHECKED = 1
FLAG_NONFINITE = 8  # PUSH without payload: the worker's gradient held NaN/Inf (caught before encoding)
#: HELLO: the worker can use a shared-memory segment (payload: its host identity); WELCOME: one was
#: made for it; PUSH / WEIGHTS: the gradient / the weights are in the segment, not in the payload
FLAG_SHARED = 16
#: PUSH: the payload is the gradient's tensors in reverse parameter order (streamed during backward)
FLAG_REVERSED = 32
#: HELLO (with FLAG_SHARED): the worker can compute on the PS's master weights in place (see
#: ps.wire.shared_memory.SharedMaster); WELCOME: the PS keeps its master there, and answers this worker's
#: pushes with no weights copied; WEIGHTS: the new weights are in the master, not in the segment
FLAG_MASTER = 32
#: HELLO (with FLAG_SHARED): the worker asks for a double-buffered segment (two gradient and two
#: weight regions, for overlapped exchanges); PUSH (shared): the gradient is in region 1, not 0
FLAG_SECOND = 64
#: PUSH: the header's weight is the gradient's weight in an average (its rows' sum of weights); without
#: it the gradient weighs its samples
FLAG_WEIGHTED = 128
#: HELLO (with FLAG_SHARED): the worker can read and step the embedding tables in place; WELCOME: the PS keeps
#: them in shared memory (ps.wire.shared_tables), so this worker's rows travel in no message
FLAG_TABLES = 128
#: REPORT: the task has started (no payload); without it, the payload holds metrics the function reported
FLAG_STARTED = 1
#: bytes of a HELLO's host identity payload at most
MAX_HOST_IDENTITY_BYTES = 64


@dataclass(frozen=True)
class Header:
    type: Msg
    flags: int = 0
    worker: int = 0
    epoch: int = 0
    version: int = 0
    count: int = 0
    length: int = 0
    value: float = 0.0
    weight: float = 0.0


# Typed views over the generic header: the byte layout stays HEADER, the names say what each
# field carries for each message type.

@dataclass(frozen=True)
class Hello:
    worker: int
    task_attempt: int   # Spark's task attempt id (pipelines: the stage attempt): a larger one takes the slot over
    partition_rows: int     # rows in this worker's partition
    host_identity: bytes = b""   # non-empty: the worker offers shared memory (see ps.shared_memory)
    part: int = 0       # pipelines: which stage (key range) of the worker's model this connection pushes
    parts: int = 0      # pipelines: the worker's model is pushed in this many parts; 0: whole
    double: bool = False   # with a host identity: a segment of two regions each (overlapped exchanges)
    master: bool = False   # with a host identity: the worker can compute on the PS's shared master in place
    tables: bool = False   # with a host identity: the worker can step the embedding tables in shared memory

    def header(self) -> Header:
        flags = ((FLAG_SHARED if self.host_identity else 0) | (FLAG_SECOND if self.double else 0)
                 | (FLAG_MASTER if self.master else 0) | (FLAG_TABLES if self.tables else 0))
        return Header(Msg.HELLO, flags=flags, worker=self.worker,
                      epoch=self.part << 16 | self.parts, version=self.task_attempt, count=self.partition_rows,
                      length=len(self.host_identity))

    @classmethod
    def read(cls, header: Header, payload: bytes = b"") -> Hello:
        expect(header, Msg.HELLO)
        if bool(header.flags & FLAG_SHARED) != bool(payload):
            raise ProtocolError("HELLO offers shared memory without a host identity, or the reverse")
        part, parts = header.epoch >> 16, header.epoch & 0xFFFF
        if parts and (part >= parts or payload):
            raise ProtocolError(f"HELLO for part {part} of {parts}: a part must be below the count and use TCP")
        double, master = bool(header.flags & FLAG_SECOND), bool(header.flags & FLAG_MASTER)
        tables = bool(header.flags & FLAG_TABLES)
        if (double or master or tables) and not payload:
            raise ProtocolError("HELLO asks for a double-buffered segment, the shared master or shared tables "
                                "without offering shared memory")
        return cls(header.worker, header.version, header.count, payload, part, parts, double, master, tables)


@dataclass(frozen=True)
class Welcome:
    worker: int
    version: int
    steps_per_epoch: int
    position: int           # this worker's mini-batches already consumed (where a retry resumes)
    weight_bytes: int = 0   # 0 at version 0: start from the broadcast weights (a part always gets its range)
    shared_memory: bool = False   # a segment was made for this worker
    master: bool = False          # with a segment: its pushes are answered in the PS's shared master
    tables: bool = False          # with a segment: the embedding tables are in shared memory for this worker
    table_rate: float = 0.0       # the tables' learning rate for the next update (shared tables step at it)

    def header(self) -> Header:
        flags = ((FLAG_SHARED if self.shared_memory else 0) | (FLAG_MASTER if self.master else 0)
                 | (FLAG_TABLES if self.tables else 0))
        return Header(Msg.WELCOME, flags=flags, worker=self.worker,
                      epoch=min(self.position, 2**32 - 1), version=self.version, count=self.steps_per_epoch,
                      length=self.weight_bytes, value=self.table_rate)

    @classmethod
    def read(cls, header: Header) -> Welcome:
        expect(header, Msg.WELCOME)
        shared, master = bool(header.flags & FLAG_SHARED), bool(header.flags & FLAG_MASTER)
        tables = bool(header.flags & FLAG_TABLES)
        if (master or tables) and not shared:
            raise ProtocolError("WELCOME offers the shared master or shared tables without a shared-memory segment")
        return cls(header.worker, header.version, header.count, header.epoch, header.length, shared, master, tables,
                   header.value)


@dataclass(frozen=True)
class Push:
    worker: int
    epoch: int
    computed_on: int   # weight version the gradient was computed on
    samples: int
    loss: float        # mean loss of the mini-batches behind the gradient
    gradient_bytes: int
    nonfinite: bool = False   # no payload: the gradient held NaN/Inf
    shared: bool = False      # no payload: the gradient is in the worker's shared-memory segment
    reversed: bool = False    # the payload holds the parameter tensors last to first
    region: int = 0           # shared: which gradient region of a double-buffered segment holds it
    #: the gradient's weight in an average: its rows' sum of weights (None: its samples, every row weighing 1)
    weight: float | None = None
    checked: bool = False     # the worker found the gradient and its rows finite (one check per gradient)

    def header(self) -> Header:
        flags = ((FLAG_NONFINITE if self.nonfinite else 0) | (FLAG_SHARED if self.shared else 0)
                 | (FLAG_CHECKED if self.checked else 0)
                 | (FLAG_REVERSED if self.reversed else 0) | (FLAG_SECOND if self.region else 0)
                 | (FLAG_WEIGHTED if self.weight is not None else 0))
        return Header(Msg.PUSH, flags=flags, worker=self.worker, epoch=self.epoch,
                      version=self.computed_on, count=self.samples, length=self.gradient_bytes, value=self.loss,
                      weight=self.weight or 0.0)

    @classmethod
    def read(cls, header: Header) -> Push:
        expect(header, Msg.PUSH)
        return cls(header.worker, header.epoch, header.version, header.count, header.value, header.length,
                   bool(header.flags & FLAG_NONFINITE), bool(header.flags & FLAG_SHARED),
                   bool(header.flags & FLAG_REVERSED), int(bool(header.flags & FLAG_SECOND)),
                   header.weight if header.flags & FLAG_WEIGHTED else None, bool(header.flags & FLAG_CHECKED))


@dataclass(frozen=True)
class Weights:
    worker: int
    version: int
    accepted: bool     # after a push: whether its gradient was used
    weight_bytes: int
    stop: bool = False  # the sample budget is spent: train no further
    shared: bool = False  # no payload: the weights were written into the worker's shared-memory segment
    master: bool = False  # (shared) no copy: the weights are in the PS's shared master the worker computes on
    table_rate: float = 0.0  # the tables' learning rate for the next update (shared tables step at it)

    def header(self) -> Header:
        flags = ((FLAG_ACCEPTED if self.accepted else FLAG_DROPPED) | (FLAG_STOP if self.stop else 0)
                 | (FLAG_SHARED if self.shared else 0) | (FLAG_MASTER if self.master else 0))
        return Header(Msg.WEIGHTS, flags=flags, worker=self.worker, version=self.version, length=self.weight_bytes,
                      value=self.table_rate)

    @classmethod
    def read(cls, header: Header) -> Weights:
        expect(header, Msg.WEIGHTS)
        return cls(header.worker, header.version, bool(header.flags & FLAG_ACCEPTED), header.length,
                   bool(header.flags & FLAG_STOP), bool(header.flags & FLAG_SHARED), bool(header.flags & FLAG_MASTER),
                   header.value)


@dataclass(frozen=True)
class Done:
    worker: int
    samples: int             # samples this worker trained
    float_buffer_bytes: int  # 0 when it trained nothing (its buffers say nothing)

    def header(self) -> Header:
        return Header(Msg.DONE, worker=self.worker, count=self.samples, length=self.float_buffer_bytes)

    @classmethod
    def read(cls, header: Header) -> Done:
        expect(header, Msg.DONE)
        return cls(header.worker, header.count, header.length)


@dataclass(frozen=True)
class Validation:
    worker: int
    epoch: int           # the epoch just completed
    samples: int         # validation rows scored
    loss_sum: float      # sum of the per-row loss
    metric_sum: float    # sum of the per-row metric (correct predictions, or squared errors)

    PAYLOAD = struct.Struct("<d")

    def header(self) -> Header:
        return Header(Msg.VALIDATION, worker=self.worker, epoch=self.epoch, count=self.samples,
                      length=self.PAYLOAD.size, value=self.loss_sum)

    def payload(self) -> bytes:
        return self.PAYLOAD.pack(self.metric_sum)

    @classmethod
    def read(cls, header: Header, payload: bytes) -> Validation:
        expect(header, Msg.VALIDATION)
        if len(payload) != cls.PAYLOAD.size:
            raise ProtocolError(f"VALIDATION payload has {len(payload)} bytes, expected {cls.PAYLOAD.size}")
        return cls(header.worker, header.epoch, header.count, header.value, cls.PAYLOAD.unpack(payload)[0])


@dataclass(frozen=True)
class Space:
    """A task asks for the parameter server of one key space of a user function's run."""

    worker: int
    space: int          # which of the function's PS optimizers (0, 1, ... in the order they are made)
    num_params: int     # the values of that key space (its model's parameters)
    weight_bytes: int   # rank 0 sends the initial weights (4 * num_params); the other ranks 0

    def header(self) -> Header:
        return Header(Msg.SPACE, worker=self.worker, epoch=self.space, version=self.num_params,
                      length=self.weight_bytes)

    @classmethod
    def read(cls, header: Header) -> Space:
        expect(header, Msg.SPACE)
        if header.length not in (0, 4 * header.version) or header.version < 1:
            raise ProtocolError(f"SPACE for {header.version} values carries {header.length} payload bytes; "
                                "expected none or the initial weights")
        return cls(header.worker, header.epoch, header.version, header.length)


@dataclass(frozen=True)
class EpochReport:
    """A worker finished an epoch: its rows, and the loss and metrics summed over them (row-weighted)."""

    worker: int
    epoch: int
    rows: int
    sums: dict[str, float]

    def payload(self) -> bytes:
        return json.dumps(self.sums).encode("utf-8")

    def header(self, payload: bytes) -> Header:
        return Header(Msg.EPOCH, worker=self.worker, epoch=self.epoch, count=self.rows, length=len(payload))

    @classmethod
    def read(cls, header: Header, payload: bytes) -> EpochReport:
        expect(header, Msg.EPOCH)
        try:
            sums = json.loads(payload.decode("utf-8"))
        except ValueError:
            raise ProtocolError("EPOCH payload is not JSON") from None
        if not isinstance(sums, dict) or not all(isinstance(v, (int, float)) for v in sums.values()):
            raise ProtocolError("EPOCH payload must map metric names to numbers")
        return cls(header.worker, header.epoch, header.count, {str(k): float(v) for k, v in sums.items()})


@dataclass(frozen=True)
class Rows:
    """Rows of one embedding table: ``count`` int64 ids, then (ROWS from a worker) ``count x dim`` float32
    gradients, or (ROWS from the PS) only the ``count x dim`` float32 values of the ids pulled.

    A worker sends one ROWS per table it touched right before its PUSH; the PS takes them with that
    gradient (accepted, buffered or refused together).
    """

    type: Msg
    worker: int
    table: int      # the table's index in the run's table list
    count: int      # rows
    payload_bytes: int
    version: int = 0   # ROWS from the PS: the version of the values

    def header(self) -> Header:
        return Header(self.type, worker=self.worker, epoch=self.table, version=self.version, count=self.count,
                      length=self.payload_bytes)

    @classmethod
    def read(cls, header: Header, with_ids: bool, dim: int) -> Rows:
        """Check the payload's size: ``count`` int64 ids (``with_ids``) and ``count x dim`` float32 values."""
        expect(header, Msg.PULL_ROWS, Msg.ROWS)
        expected = header.count * ((8 if with_ids else 0) + 4 * dim)
        if header.count < 0 or header.length != expected:
            raise ProtocolError(f"{header.type.name} of {header.count} rows carries {header.length} bytes, "
                                f"expected {expected}")
        return cls(header.type, header.worker, header.epoch, header.count, header.length, header.version)


#: the table field of the ROWS that answers a PULL_TABLES: the values of several tables, in the order asked
ALL_TABLES = 0xFFFFFFFF   # the largest table field (an unsigned 32-bit header field): no table has that index


@dataclass(frozen=True)
class TablePull:
    """The rows of several embedding tables in one request (a step's lookups in one round trip).

    The payload opens with the ``tables`` table indices and then their row counts (``2 x tables`` int64),
    followed by each table's int64 row ids in that order.  The PS answers with one ROWS whose table is
    :data:`ALL_TABLES`: each table's ``count x dim`` float32 values, in the same order.
    """

    worker: int
    tables: int
    payload_bytes: int

    def header(self) -> Header:
        return Header(Msg.PULL_TABLES, worker=self.worker, count=self.tables, length=self.payload_bytes)

    @classmethod
    def read(cls, header: Header, known_tables: int) -> TablePull:
        """Check the table count (each of the run's ``known_tables`` at most once) and the payload's shape."""
        expect(header, Msg.PULL_TABLES)
        if not 1 <= header.count <= known_tables:
            raise ProtocolError(f"PULL_TABLES asks for {header.count} tables, and the run has {known_tables}")
        if header.length < 16 * header.count or header.length % 8:
            raise ProtocolError(f"PULL_TABLES of {header.count} tables carries {header.length} bytes: not a table "
                                "list followed by int64 ids")
        return cls(header.worker, header.count, header.length)


def pack_header(header: Header) -> bytes:
    return HEADER.pack(MAGIC, header.type, header.flags, header.worker, header.epoch,
                       header.version, header.count, header.length, header.value, header.weight)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError("peer closed the connection in the middle of a message")
        got += n


def recv_header(sock: socket.socket, max_length: int) -> Header:
    """Read and check one header; ``max_length`` bounds the payload it may announce."""
    raw = bytearray(HEADER.size)
    _recv_exactly(sock, memoryview(raw))
    return parse_header(raw, max_length)


def parse_header(raw: bytes | bytearray, max_length: int) -> Header:
    """Check and decode ``HEADER.size`` bytes; ``max_length`` bounds the payload they may announce."""
    magic, mtype, flags, worker, epoch, version, count, length, value, weight = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a sparkdl parameter-server message")
    try:
        kind = Msg(mtype)
    except ValueError:
        raise ProtocolError(f"unknown message type {mtype}") from None
    if length > max_length:
        raise ProtocolError(f"{kind.name} announces {length} payload bytes, more than the allowed {max_length}")
    if not 0.0 <= weight < math.inf:      # NaN fails too
        raise ProtocolError(f"{kind.name} carries the weight {weight}; a gradient's weight is a finite number >= 0")
    return Header(kind, flags, worker, epoch, version, count, length, value, weight)


def _expect_length(header: Header, buffer: memoryview) -> None:
    if header.length != len(buffer):
        raise ProtocolError(f"{header.type.name} payload has {header.length} bytes, expected {len(buffer)}")


def recv_payload_into(sock: socket.socket, header: Header, buffer: memoryview) -> None:
    """Receive the payload straight into ``buffer``, which must be exactly its size."""
    _expect_length(header, buffer)
    _recv_exactly(sock, buffer)


def recv_payload_reversed(sock: socket.socket, header: Header, buffer: memoryview, spans: list[tuple[int, int]]) -> None:
    """Receive a payload sent as the ``(offset, length)`` byte spans of ``buffer`` in reverse order."""
    _expect_length(header, buffer)
    for offset, length in reversed(spans):
        _recv_exactly(sock, buffer[offset:offset + length])


def recv_payload_in_order(sock: socket.socket, header: Header, buffer: memoryview, spans: Sequence[tuple[int, int]],
                          received: Callable[[int], None]) -> None:
    """Receive a payload into ``buffer`` span by span (``(offset, length)`` bytes, in order); ``received(i)``
    runs as soon as span i is complete, so a reader may use it while the rest is still on the wire."""
    _expect_length(header, buffer)
    for index, (offset, length) in enumerate(spans):
        _recv_exactly(sock, buffer[offset:offset + length])
        received(index)


def recv_tensor(sock: socket.socket, tensor) -> None:
    """Receive the next ``tensor.nbytes`` payload bytes into the contiguous CPU ``tensor`` (one part of a
    payload whose whole length was checked, as :meth:`Rows.read` does)."""
    _recv_exactly(sock, memoryview(tensor.numpy().reshape(-1)).cast("B"))   # flat: a tensor may have no rows


def recv_small_payload(sock: socket.socket, header: Header, limit: int = MAX_TEXT_BYTES) -> bytes:
    if header.length > limit:
        raise ProtocolError(f"{header.type.name} payload of {header.length} bytes exceeds {limit}")
    data = bytearray(header.length)
    _recv_exactly(sock, memoryview(data))
    return bytes(data)


def send_message(sock: socket.socket, header: Header, payload: memoryview | bytes | None = None) -> None:
    """Send header and payload without joining them into one new buffer."""
    send_buffers(sock, [pack_header(header), payload] if payload else [pack_header(header)])


def send_buffers(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """Send ``buffers`` back to back in as few system calls as the kernel takes (one, for a few small messages),
    without joining them into one new buffer."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):   # no sendmsg over TLS
        for view in views:
            sock.sendall(view)
        return
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):      # whole buffers sent
            sent -= len(views.pop(0))
        if views:                                     # a buffer sent in part: the rest of it first
            views[0] = views[0][sent:]


def expect(header: Header, *kinds: Msg) -> None:
    if header.type not in kinds:
        names = " or ".join(k.name for k in kinds)
        raise ProtocolError(f"expected {names}, got {header.type.name}")


def auth_digest(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"sparkdl-ps-auth:" + nonce, hashlib.sha256).digest()


class HandshakeEvicted(Exception):
    """The server closed this connection before it was authenticated, to make room for newer ones."""


def client_authenticate(sock: socket.socket, secret: bytes) -> None:
    """Answer the server's challenge; raise AuthenticationError when refused, HandshakeEvicted when the
    server dropped the connection under a flood (connecting again is the answer)."""
    header = recv_header(sock, NONCE_BYTES)
    expect(header, Msg.CHALLENGE)
    if header.length != NONCE_BYTES:
        raise ProtocolError(f"CHALLENGE with {header.length} bytes, expected {NONCE_BYTES}")
    nonce = recv_small_payload(sock, header, NONCE_BYTES)
    send_message(sock, Header(Msg.AUTH, length=DIGEST_BYTES), auth_digest(secret, nonce))
    try:
        reply = recv_header(sock, MAX_TEXT_BYTES)
    except ConnectionError:
        raise AuthenticationError("the parameter server refused this connection's credentials "
                                  "(wrong job secret)") from None
    if reply.type == Msg.BUSY:
        raise HandshakeEvicted("the server closed the connection before authenticating it, under a flood of "
                               "connections from this address")
    expect(reply, Msg.AUTH_OK)
