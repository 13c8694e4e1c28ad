"""The driver's side of a user function's run: its key spaces, its reports and its failures.

A function run (:func:`sparkdl.run`, :class:`sparkdl.TorchDistributor`) trains with the user's own
loop, so the driver cannot know the models in advance.  Each task keeps one authenticated
connection to this server, over which it

* says it has started (REPORT with ``FLAG_STARTED``): the stage runner's watchdog hears it;
* asks for the parameter server of key space k (SPACE): the k-th PS optimizer the function
  makes.  Rank 0 sends its model's initial weights, which start a :class:`ParameterServer` of
  their own (own versions, own sync rounds, own checkpoints under ``space-k``); the other
  ranks wait for it and get its address.  Every rank's model must have rank 0's size;
* reports metrics (REPORT): kept in order of arrival for the result and the progress line;
* hands over its traceback when the function fails (FAIL).

Spaces outlive a stage attempt: a retried function finds the weights, versions and data
positions its spaces reached.
"""
from __future__ import annotations

import collections
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from sparkdl._internal.ps.server.checkpoint import LOCAL, CheckpointFiles, load_latest_checkpoint
from sparkdl._internal.ps.server.limits import check_ps_memory
from sparkdl._internal.ps.server.server import ParameterServer, ServerSetup
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.handshake import HANDSHAKE_TIMEOUT_S
from sparkdl._internal.ps.wire.listener import Listener, send_error
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError, ProtocolError, PSTimeoutError, SparkDLError

log = logging.getLogger(__name__)

#: largest SPACE payload the server reads (rank 0's initial weights); the memory check bounds it further
MAX_SPACE_BYTES = 1 << 40


def space_config(config: TrainConfig, space: int) -> TrainConfig:
    """The settings of key space ``space``: the run's, with its own checkpoint folder and any free port."""
    def under(path: str | None) -> str | None:
        return None if path is None else f"{path.rstrip('/')}/space-{space}"
    return config.replace(ps_port=0, checkpoint_dir=under(config.checkpoint_dir), resume_from=under(config.resume_from))


@dataclass
class MetricsRow:
    """One ``report(**metrics)`` of one rank."""

    rank: int
    seconds: float      # since the run started
    metrics: dict[str, Any]


class FunctionServer:
    """Serves one function run's tasks; the stage runner's view of the run (failure, workers seen)."""

    def __init__(self, config: TrainConfig, secret: bytes, host: str, tls: ssl.SSLContext | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, checkpoint_files: CheckpointFiles = LOCAL) -> None:
        self.config = config
        self.checkpoint_files = checkpoint_files
        self.secret = secret
        self.host = host
        self.port = config.ps_port
        self.tls = tls
        self._cond = threading.Condition()
        #: key space -> ranks waiting for rank 0 to start it
        self._awaited: collections.Counter[int] = collections.Counter()
        # each task's own connection, plus a failure report from every task at once
        self._listener = Listener(secret, self._serve, self._refused, tls, handshake_timeout_s,
                                  connections=2 * config.num_workers, name="function server")
        self.spaces: dict[int, ParameterServer] = {}
        self.metrics: list[MetricsRow] = []
        self.worker_failures: dict[int, str] = {}
        self.events: list[dict[str, Any]] = []
        self.refused_connections = 0
        self._failure: BaseException | None = None
        self._started: set[int] = set()
        self._t0 = time.monotonic()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> tuple[str, int]:
        self.port = self._listener.start(self.host, self.port, "set 'spark.driver.host' (or ps_host) to an address "
                                         "of this machine or change ps_port")
        return self.host, self.port

    def stop(self) -> None:
        self._listener.stopping.set()
        with self._cond:
            self._cond.notify_all()
            spaces = list(self.spaces.values())
        for space in spaces:
            space.stop()
        self._listener.stop()

    def begin_attempt(self) -> None:
        """A new stage attempt: its tasks say again that they started."""
        with self._cond:
            self._started.clear()

    # ----------------------------------------------------------------- the stage runner's view
    @property
    def failure(self) -> BaseException | None:
        """The run's failure: this server's, or the first failed key space's."""
        with self._cond:
            spaces = list(self.spaces.values())
            own = self._failure
        return own or next((s.failure for s in spaces if s.failure is not None), None)

    @property
    def workers_seen(self) -> int:
        with self._cond:
            return len(self._started)

    @property
    def version(self) -> int:
        """Updates applied over every key space."""
        with self._cond:
            spaces = list(self.spaces.values())
        return sum(s.version for s in spaces)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()
            spaces = list(self.spaces.values())
        for space in spaces:
            space.fail(error)

    # ----------------------------------------------------------------- sessions
    def _refused(self, reason: str) -> None:
        self.refused_connections += 1
        log.warning("function server: %s", reason)

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._listener.stopping.is_set():
                try:
                    header = protocol.recv_header(conn, MAX_SPACE_BYTES)
                except ConnectionError:
                    return
                if header.type == Msg.REPORT:
                    self._on_report(header, protocol.recv_small_payload(conn, header))
                    protocol.send_message(conn, Header(Msg.ACK))
                elif header.type == Msg.FAIL:
                    self._on_fail(header.worker, protocol.recv_small_payload(conn, header))
                    protocol.send_message(conn, Header(Msg.ACK))
                elif header.type == Msg.SPACE:
                    self._on_space(conn, protocol.Space.read(header))
                else:
                    raise ProtocolError(f"the function server takes REPORT, SPACE or FAIL, not {header.type.name}")
        except ProtocolError as exc:
            send_error(conn, str(exc))
            log.warning("function server: %s", exc)
        except (OSError, SparkDLError) as exc:
            send_error(conn, str(exc))

    def _check_rank(self, worker: int) -> None:
        if not 0 <= worker < self.config.num_workers:
            raise ProtocolError(f"rank {worker} is outside [0, {self.config.num_workers})")

    def _on_report(self, header: Header, payload: bytes) -> None:
        self._check_rank(header.worker)
        try:
            values = json.loads(payload.decode("utf-8")) if payload else {}
        except ValueError:
            raise ProtocolError("REPORT payload is not JSON") from None
        if not isinstance(values, dict):
            raise ProtocolError("REPORT payload must be a JSON object")
        with self._cond:
            if header.flags & protocol.FLAG_STARTED:
                self._started.add(header.worker)
            else:
                self.metrics.append(MetricsRow(header.worker, time.monotonic() - self._t0, values))

    def _on_fail(self, worker: int, text: bytes) -> None:
        self._check_rank(worker)
        message = text.decode("utf-8", "replace")
        last = (message.strip().splitlines() or ["?"])[-1]
        with self._cond:
            self.worker_failures.setdefault(worker, message)
            self.events.append({"event": "failed", "worker": worker, "reason": last})

    def spaces_awaited(self) -> set[int]:
        """The key spaces some rank is waiting for rank 0 to start."""
        with self._cond:
            return {space for space, ranks in self._awaited.items() if ranks}

    def _on_space(self, conn: socket.socket, request: protocol.Space) -> None:
        self._check_rank(request.worker)
        initial = None
        if request.weight_bytes:
            if request.worker != 0:
                raise ProtocolError(f"rank {request.worker} sent initial weights; only rank 0's start a key space")
            check_ps_memory(self.config, request.num_params, 0)
            initial = torch.empty(request.num_params, dtype=torch.float32)
            protocol.recv_payload_into(conn, protocol.Header(Msg.SPACE, length=request.weight_bytes),
                                       memoryview(initial.numpy()).cast("B"))  # type: ignore[arg-type]  # numpy#26783
        server = self._space(request, initial)
        protocol.send_message(conn, Header(Msg.SPACE_AT, worker=request.worker, epoch=request.space,
                                           count=server.port))

    def _space(self, request: protocol.Space, initial: torch.Tensor | None) -> ParameterServer:
        """Key space ``request.space``'s server: started from rank 0's weights, or waited for."""
        with self._cond:
            server = self.spaces.get(request.space)
            if server is None and initial is not None:
                server = self._start_space(request.space, initial)
            if server is None:
                self._awaited[request.space] += 1
                try:
                    ready = self._cond.wait_for(lambda: request.space in self.spaces or self._failure is not None
                                                or self._listener.stopping.is_set(), self.config.timeout_s)
                finally:
                    self._awaited[request.space] -= 1
                if self._failure is not None or self._listener.stopping.is_set():
                    raise ParameterServerError("the run ended before rank 0 made this PS optimizer")
                if not ready:
                    raise PSTimeoutError(
                        f"rank {request.worker} made PS optimizer {request.space} but rank 0 did not within "
                        f"{self.config.timeout_s:.0f} s: every rank must make the same PS optimizers in the same "
                        "order (rank 0's model gives the initial weights)")
                server = self.spaces[request.space]
        if server.num_params != request.num_params:
            raise ProtocolError(f"rank {request.worker}'s PS optimizer {request.space} has {request.num_params} "
                                f"parameters, rank 0's has {server.num_params}: every rank must build the same model")
        return server

    def _start_space(self, space: int, initial: torch.Tensor) -> ParameterServer:
        """Start key space ``space`` (under the lock); resumed from its checkpoint folder when asked."""
        config = space_config(self.config, space)
        server = ParameterServer(config, initial, self.secret, ServerSetup(
            host=self.host, tls=self.tls, welcome_weights=True, checkpoint_files=self.checkpoint_files))
        if config.resume_from:
            checkpoint = load_latest_checkpoint(config.resume_from, self.checkpoint_files)
            if checkpoint is None:
                raise SparkDLError(f"resume_from={self.config.resume_from!r} holds no complete checkpoint for PS "
                                   f"optimizer {space} (expected ckpt-*.pt under {config.resume_from})")
            server.restore(checkpoint)
        server.start()
        self.spaces[space] = server
        self.events.append({"event": "space", "space": space, "parameters": int(initial.numel())})
        self._cond.notify_all()
        return server
