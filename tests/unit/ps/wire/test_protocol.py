"""Framing and authentication over a real socket pair."""
import socket
import threading

import pytest
import torch

from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl.errors import ProtocolError


def test_header_round_trip_and_payload_into_existing_buffer():
    a, b = socket.socketpair()
    data = torch.arange(1000, dtype=torch.float32)
    protocol.send_message(a, Header(Msg.PUSH, flags=1, worker=3, epoch=2, version=41, count=32,
                                    length=4000, value=0.25), memoryview(data.numpy()))
    header = protocol.recv_header(b, 4000)
    assert (header.type, header.worker, header.epoch, header.version, header.count, header.value) == \
        (Msg.PUSH, 3, 2, 41, 32, 0.25)
    out = torch.empty(1000)
    protocol.recv_payload_into(b, header, memoryview(out.numpy()).cast("B"))
    assert torch.equal(out, data)


def test_a_push_says_its_rows_weight_or_that_it_weighs_its_samples():
    weighted = protocol.Push(1, 0, 5, 32, 0.5, 0, weight=7.25)
    assert protocol.Push.read(protocol.parse_header(protocol.pack_header(weighted.header()), 0)).weight == 7.25
    plain = protocol.Push(1, 0, 5, 32, 0.5, 0)
    assert protocol.Push.read(protocol.parse_header(protocol.pack_header(plain.header()), 0)).weight is None
    zero = protocol.Push(1, 0, 5, 32, 0.5, 0, weight=0.0)     # every row weighed 0: not "its samples"
    assert protocol.Push.read(protocol.parse_header(protocol.pack_header(zero.header()), 0)).weight == 0.0


@pytest.mark.parametrize("checked", [True, False])
def test_a_push_says_whether_its_sender_checked_it_finite(checked):
    push = protocol.Push(1, 0, 5, 32, 0.5, 0, shared=True, region=1, checked=checked)
    read = protocol.Push.read(protocol.parse_header(protocol.pack_header(push.header()), 0))
    assert (read.checked, read.shared, read.region) == (checked, True, 1)


def test_shared_tables_are_asked_for_offered_and_carry_the_tables_rate():
    hello = protocol.Hello(2, 0, 64, b"host", tables=True)
    read = protocol.Hello.read(protocol.parse_header(protocol.pack_header(hello.header()), 64), b"host")
    assert (read.tables, read.master, read.double) == (True, False, False)
    with pytest.raises(ProtocolError, match="shared tables without offering shared memory"):
        protocol.Hello.read(protocol.parse_header(protocol.pack_header(protocol.Hello(2, 0, 64, b"", tables=True)
                                                                       .header()), 0))
    welcome = protocol.Welcome(2, 5, 10, 0, shared_memory=True, tables=True, table_rate=0.0125)
    read_welcome = protocol.Welcome.read(protocol.parse_header(protocol.pack_header(welcome.header()), 0))
    assert (read_welcome.tables, read_welcome.master, read_welcome.table_rate) == (True, False, 0.0125)
    with pytest.raises(ProtocolError, match="shared tables without a shared-memory segment"):
        protocol.Welcome.read(protocol.parse_header(protocol.pack_header(protocol.Welcome(2, 5, 10, 0, tables=True)
                                                                         .header()), 0))
    reply = protocol.Weights(2, 6, True, 0, shared=True, table_rate=0.01)
    assert protocol.Weights.read(protocol.parse_header(protocol.pack_header(reply.header()), 0)).table_rate == 0.01


@pytest.mark.parametrize("raw, message", [
    (b"XXXX" + bytes(protocol.HEADER.size - 4), "bad magic"),
    (protocol.HEADER.pack(protocol.MAGIC, 99, 0, 0, 0, 0, 0, 0, 0.0, 0.0), "unknown message type 99"),
    (protocol.HEADER.pack(protocol.MAGIC, Msg.PUSH, 0, 0, 0, 0, 0, 10**12, 0.0, 0.0), "more than the allowed"),
    (protocol.HEADER.pack(protocol.MAGIC, Msg.PUSH, 128, 0, 0, 0, 0, 0, 0.0, float("nan")), "weight nan"),
    (protocol.HEADER.pack(protocol.MAGIC, Msg.PUSH, 128, 0, 0, 0, 0, 0, 0.0, -2.0), "weight -2.0"),
])
def test_malformed_headers_are_refused(raw, message):
    a, b = socket.socketpair()
    a.sendall(raw)
    with pytest.raises(ProtocolError, match=message):
        protocol.recv_header(b, 1 << 20)


def test_truncated_message_is_a_connection_error():
    a, b = socket.socketpair()
    a.sendall(protocol.pack_header(Header(Msg.PUSH))[:10])
    a.close()
    with pytest.raises(ConnectionError):
        protocol.recv_header(b, 100)


def test_payload_length_must_match_the_buffer():
    a, b = socket.socketpair()
    protocol.send_message(a, Header(Msg.PUSH, length=8), b"\0" * 8)
    header = protocol.recv_header(b, 100)
    with pytest.raises(ProtocolError, match="expected 16"):
        protocol.recv_payload_into(b, header, memoryview(bytearray(16)))


def test_buffers_larger_than_the_socket_takes_at_once_arrive_whole_and_in_order():
    """sendmsg takes what the kernel's buffer holds: the rest of a buffer sent in part goes next."""
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    left.settimeout(10)      # as the PS's sockets: a write then takes what fits and says how much
    buffers = [bytes([i]) * size for i, size in enumerate([52, 3_000_001, 7, 1_500_000])]
    received = bytearray()

    def read() -> None:
        while len(received) < sum(map(len, buffers)):
            received.extend(right.recv(1 << 16))
    reader = threading.Thread(target=read)
    reader.start()
    try:
        protocol.send_buffers(left, [memoryview(b) for b in buffers[:2]] + [b"", *buffers[2:]])
        reader.join(10)
    finally:
        left.close()
        right.close()
    assert bytes(received) == b"".join(buffers)
