"""The authentication gate in front of every sparkdl listening port.

A connection that has not yet proved knowledge of the job's secret costs one entry in a
selector, not a thread: the gate runs TLS (when configured) and the HMAC challenge
non-blocking for every pending connection at once, and hands a connection over only once it
has answered correctly.  Each pending connection has a short deadline, independent of the
run's ``timeout_s``; the number pending is bounded per peer address and in total (at a bound
the oldest pending connection is closed).  :meth:`HandshakeGate.close` closes everything
still pending without waiting.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import selectors
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.protocol import DIGEST_BYTES, HEADER, NONCE_BYTES, Header, Msg
from sparkdl.errors import AuthenticationError, ProtocolError

log = logging.getLogger(__name__)

#: seconds a new connection has to finish TLS and answer the challenge
HANDSHAKE_TIMEOUT_S = 5.0
#: the selector key data of the wake-up socket
_WAKE = object()


@dataclass
class _Pending:
    """One connection between accept and authentication."""

    sock: socket.socket
    peer: str
    deadline: float
    nonce: bytes
    tls_done: bool
    outgoing: bytearray = field(default_factory=bytearray)
    incoming: bytearray = field(default_factory=bytearray)
    answered: bool = False      # AUTH received and verified; AUTH_OK queued
    wants_write: bool = True    # TLS or an unsent message waits for the socket to be writable


class HandshakeGate:
    """Authenticates new connections without a thread each; see the module docstring."""

    def __init__(self, secret: bytes, on_authenticated: Callable[[socket.socket], None],
                 on_refused: Callable[[str], None], tls: ssl.SSLContext | None = None,
                 timeout_s: float = HANDSHAKE_TIMEOUT_S, max_pending: int = 64, max_pending_per_peer: int = 16) -> None:
        self.secret = secret
        self.tls = tls
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_pending_per_peer = max_pending_per_peer
        self._on_authenticated = on_authenticated
        self._on_refused = on_refused
        self._selector = selectors.DefaultSelector()
        self._pending: dict[int, _Pending] = {}
        # wake() makes a blocked poll() return at once (a stopping server does not wait out its timeout)
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, _WAKE)

    @property
    def pending(self) -> int:
        """Connections accepted but not yet authenticated."""
        return len(self._pending)

    def listen(self, listener: socket.socket) -> None:
        """Accept connections from ``listener`` (non-blocking) inside :meth:`poll`."""
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, None)

    def _accept_all(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:   # the listener was closed
                return
            self.admit(sock, str(address[0]))

    def admit(self, sock: socket.socket, peer: str) -> None:
        """Take a freshly accepted connection; at a bound, the oldest pending one makes room.

        Evicting the oldest rather than refusing the newest keeps the port usable under a
        flood from the workers' own address (local mode): an honest worker answers within
        milliseconds, so the connection that has waited longest is the likeliest to be idle.  An honest
        worker descheduled for longer than the flood takes to fill its peer's bound is told so (BUSY) and
        connects again.
        """
        from_peer = [e for e in self._pending.values() if e.peer == peer]
        if len(from_peer) >= self.max_pending_per_peer:
            self._evict(min(from_peer, key=lambda e: e.deadline), f"too many unauthenticated connections from {peer}")
        elif len(self._pending) >= self.max_pending:
            self._evict(min(self._pending.values(), key=lambda e: e.deadline),
                        "too many unauthenticated connections")
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            self._on_refused(f"could not set up the connection from {peer}: {exc}")
            return
        nonce = secrets.token_bytes(NONCE_BYTES)
        entry = _Pending(sock, peer, time.monotonic() + self.timeout_s, nonce, tls_done=self.tls is None)
        entry.outgoing += protocol.pack_header(Header(Msg.CHALLENGE, length=len(nonce))) + nonce
        self._pending[sock.fileno()] = entry
        self._selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, entry)
        self._advance(entry)


    def poll(self, timeout_s: float) -> None:
        """Accept new connections, advance every pending handshake that can, expire overdue ones."""
        for key, _ in self._selector.select(timeout_s):
            if key.data is _WAKE:
                with contextlib.suppress(OSError):
                    self._wake_reader.recv(64)
            elif key.data is None:   # only listeners are registered without data
                self._accept_all(cast(socket.socket, key.fileobj))
            elif self._pending.get(key.fd) is key.data:   # data is not None here: a pending entry
                self._advance(cast(_Pending, key.data))
        now = time.monotonic()
        for entry in [e for e in self._pending.values() if e.deadline <= now]:
            self._drop(entry, f"no answer to the challenge within {self.timeout_s:.0f} s")

    def wake(self) -> None:
        """Make a :meth:`poll` in progress (on another thread) return now."""
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")

    def close(self) -> None:
        """Close every pending connection and the listener (nothing waits for them)."""
        for entry in list(self._pending.values()):
            self._forget(entry)
            entry.sock.close()
        for key in list(self._selector.get_map().values()):
            cast(socket.socket, key.fileobj).close()   # everything registered is a socket
        self._selector.close()
        self._wake_writer.close()

    # ----------------------------------------------------------------- one connection's steps
    def _advance(self, entry: _Pending) -> None:
        """Do whatever this connection allows now without blocking."""
        wants_write = False
        try:
            if not entry.tls_done:   # only with TLS: the socket is an SSLSocket then
                cast(ssl.SSLSocket, entry.sock).do_handshake()
                entry.tls_done = True
            self._flush(entry)
            if not entry.answered:
                self._read_answer(entry)
                self._flush(entry)
            if entry.answered and not entry.outgoing:
                self._forget(entry)
                entry.sock.setblocking(True)
                self._on_authenticated(entry.sock)
                return
        except ssl.SSLWantWriteError:
            wants_write = True
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            pass
        except (AuthenticationError, ProtocolError, ConnectionError, OSError, ssl.SSLError, ValueError) as exc:
            self._drop(entry, str(exc) or type(exc).__name__)
            return
        wants_write = wants_write or bool(entry.outgoing)
        if wants_write != entry.wants_write:   # never poll for writability without a reason: it would spin
            entry.wants_write = wants_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wants_write else 0)
            self._selector.modify(entry.sock, events, entry)

    def _flush(self, entry: _Pending) -> None:
        while entry.outgoing:
            sent = entry.sock.send(entry.outgoing)
            del entry.outgoing[:sent]

    def _read_answer(self, entry: _Pending) -> None:
        wanted = HEADER.size + DIGEST_BYTES
        while len(entry.incoming) < wanted:
            chunk = entry.sock.recv(wanted - len(entry.incoming))
            if not chunk:
                raise ConnectionError("closed before answering the challenge")
            entry.incoming += chunk
            if len(entry.incoming) >= HEADER.size:   # refuse garbage as soon as the header is in
                header = protocol.parse_header(entry.incoming[:HEADER.size], DIGEST_BYTES)
                if header.type != Msg.AUTH or header.length != DIGEST_BYTES:
                    raise AuthenticationError(f"expected an AUTH message first, got {header.type.name}")
        answer = bytes(entry.incoming[HEADER.size:wanted])
        if not hmac.compare_digest(answer, protocol.auth_digest(self.secret, entry.nonce)):
            raise AuthenticationError("wrong HMAC answer to the challenge")
        entry.answered = True
        entry.outgoing += protocol.pack_header(Header(Msg.AUTH_OK))

    def _forget(self, entry: _Pending) -> None:
        self._pending.pop(entry.sock.fileno(), None)
        try:
            self._selector.unregister(entry.sock)
        except (KeyError, ValueError):
            pass

    def _evict(self, entry: _Pending, reason: str) -> None:
        """Close a pending connection to make room, telling its peer (best effort, never blocking) to connect
        again: its challenge is out, so the next thing an honest client reads is this BUSY."""
        if entry.tls_done and not entry.outgoing:
            with contextlib.suppress(OSError, ssl.SSLError):
                entry.sock.send(protocol.pack_header(Header(Msg.BUSY)))
                # an answer already here is read off, so the close is a FIN after the BUSY, not a reset
                entry.sock.recv(HEADER.size + DIGEST_BYTES)
        self._drop(entry, f"evicted: {reason}")

    def _drop(self, entry: _Pending, reason: str) -> None:
        self._forget(entry)
        # counted before the socket closes, so a refused peer never sees its refusal before the count does
        self._on_refused(f"refused a connection from {entry.peer}: {reason}")
        entry.sock.close()
