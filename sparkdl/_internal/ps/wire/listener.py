"""A listening socket whose authenticated connections are each served on their own thread.

The parameter server (and each of its shards) and the driver's shard coordinator both take
connections this way: a :class:`~sparkdl._internal.ps.wire.handshake.HandshakeGate` authenticates on the
accept thread (an unauthenticated peer costs no thread), then each session gets a handler
thread, within a bound on open sessions.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.handshake import HandshakeGate
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl.errors import ParameterServerError

log = logging.getLogger(__name__)


def send_error(conn: socket.socket, message: str) -> None:
    """Best effort: tell the peer why its request or session ends."""
    text = message.encode("utf-8", "replace")[:protocol.MAX_TEXT_BYTES]
    try:
        protocol.send_message(conn, Header(Msg.ERROR, length=len(text)), text)
    except (OSError, ValueError):
        pass


class Listener:
    """Accepts, authenticates and serves connections until :meth:`stop`.

    ``serve(conn)`` runs on the session's thread (it closes nothing: the listener does);
    ``on_refused(reason)`` counts a refused peer.  ``stopping`` is set from :meth:`stop`
    on, so that handlers waiting on something else can give up.
    """

    def __init__(self, secret: bytes, serve: Callable[[socket.socket], None], on_refused: Callable[[str], None],
                 tls: ssl.SSLContext | None, handshake_timeout_s: float, connections: int, name: str) -> None:
        self._serve = serve
        self._on_refused = on_refused
        self.name = name
        # Workers of one host (all of them in local mode) share a peer address: the bounds on
        # pending handshakes leave room for every expected connection arriving at once.
        self._gate = HandshakeGate(secret, self._start_handler, on_refused, tls, handshake_timeout_s,
                                   max_pending=max(64, 4 * connections),
                                   max_pending_per_peer=max(16, 2 * connections))
        # Every expected connection, plus room for retried attempts whose old connections have not
        # noticed yet that they were replaced.
        self.max_sessions = 2 * connections + 8
        self.stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self._handlers: dict[threading.Thread, socket.socket] = {}
        self._handlers_lock = threading.Lock()

    def start(self, host: str, port: int, bind_advice: str) -> int:
        """Bind, listen and start accepting; returns the bound port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as exc:
            listener.close()
            raise ParameterServerError(f"cannot bind the {self.name} to {host}:{port} ({exc}); {bind_advice}") from exc
        listener.listen(max(64, self.max_sessions))
        self._gate.listen(listener)
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"sparkdl-{self.name}-accept",
                                               daemon=True)
        self._accept_thread.start()
        return listener.getsockname()[1]

    def stop(self) -> None:
        """Close every socket and return promptly (handshakes are not waited for; handlers 5 s at most)."""
        self.stopping.set()
        self._gate.wake()
        if self._accept_thread is not None:
            self._accept_thread.join()   # it closes the listener and every pending handshake
        with self._handlers_lock:
            handlers = dict(self._handlers)
        for conn in handlers.values():
            try:   # wakes a handler blocked in recv
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for thread in handlers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _accept_loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self._gate.poll(0.2)
        finally:
            self._gate.close()

    def _start_handler(self, conn: socket.socket) -> None:
        """Serve an authenticated connection on its own thread, within the bound on sessions."""
        thread = threading.Thread(target=self._run, args=(conn,), name=f"sparkdl-{self.name}-conn", daemon=True)
        with self._handlers_lock:
            self._handlers = {t: c for t, c in self._handlers.items() if t.is_alive()}
            full = len(self._handlers) >= self.max_sessions
            if not full:
                self._handlers[thread] = conn
        if full:   # only peers that know the secret get here; a retry storm must not exhaust threads
            self._on_refused(f"refused an authenticated connection: {self.max_sessions} sessions are open")
            send_error(conn, f"too many connections ({self.max_sessions}) to the {self.name}")
            conn.close()
            return
        thread.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            conn.close()
