"""The parameter server: master weights, optimizer and versioning, on the driver.

One listening socket, one handler thread per worker connection.  All shared state sits
behind one condition variable; the hot path under the lock is a few whole-buffer tensor
operations (accumulate, optimizer step on one flat tensor, copy into the reply buffer).
Sockets are read and written outside the lock.
"""
from __future__ import annotations

import copy
import logging
import secrets as _secrets
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from ..config import TrainConfig
from ..errors import AuthenticationError, ParameterServerError, ProtocolError, PSTimeoutError
from . import protocol
from .checkpoint import save_checkpoint
from .policy import PushDecision, Update, UpdatePolicy, steps_per_epoch
from .protocol import FLAG_ACCEPTED, FLAG_DROPPED, Header, Msg

log = logging.getLogger(__name__)

UPDATE_COLUMNS = ("version", "time_s", "epoch", "loss", "samples", "gradients",
                  "staleness_mean", "staleness_max", "lr_scale")
GRADIENT_COLUMNS = ("time_s", "worker", "epoch", "computed_on", "staleness", "accepted")


def make_optimizer(config: TrainConfig, master: torch.Tensor) -> torch.optim.Optimizer:
    """The PS-side optimizer over the single flat master tensor (element-wise, so exact)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD([master], lr=config.learning_rate, momentum=config.momentum,
                               weight_decay=config.weight_decay)
    return torch.optim.Adam([master], lr=config.learning_rate, weight_decay=config.weight_decay)


@dataclass
class _Pending:
    """Statistics of the gradients buffered for the next update."""

    loss: float = 0.0
    samples: int = 0
    staleness: list[int] = field(default_factory=list)
    epoch: int = 0

    def add(self, loss: float, samples: int, staleness: int, epoch: int) -> None:
        self.loss += loss
        self.samples += samples
        self.staleness.append(staleness)
        self.epoch = max(self.epoch, epoch)


@dataclass
class ServerStats:
    pushes: int = 0
    applied_gradients: int = 0
    dropped_stale: int = 0
    rejected_nonfinite: int = 0
    refused: int = 0
    updates: int = 0
    auth_failures: int = 0
    protocol_errors: int = 0
    aggregate_seconds: float = 0.0
    optimizer_seconds: float = 0.0


class ParameterServer:
    """Serves ``push``/``pull`` for one training run; started and stopped by the launcher."""

    def __init__(self, config: TrainConfig, initial_weights: torch.Tensor, secret: bytes,
                 host: str = "127.0.0.1", port: int = 0, buffer_count: int = 0) -> None:
        if initial_weights.dim() != 1 or initial_weights.dtype != torch.float32:
            raise ValueError("initial_weights must be a flat float32 tensor")
        self.config = config
        self.secret = secret
        self.host = host
        self.port = port
        self.num_params = initial_weights.numel()
        self.buffer_count = buffer_count
        self.policy = UpdatePolicy.from_config(config)
        self.master = torch.nn.Parameter(initial_weights.detach().clone().contiguous())
        self.master.grad = torch.zeros_like(self.master)
        self._accum = torch.zeros_like(self.master.data)
        self.optimizer = make_optimizer(config, self.master)
        self._buffer_sum = torch.zeros(buffer_count, dtype=torch.float64)
        self._buffer_contributors = 0
        self.stats = ServerStats()
        self.update_rows: list[tuple] = []
        self.gradient_rows: list[tuple] = []
        self.worker_failures: dict[int, str] = {}
        self.failure: BaseException | None = None
        self._pending = _Pending()
        self._cond = threading.Condition()
        self._shards: dict[int, int] = {}
        self._plan: dict[int, int] | None = None
        self._done: set[int] = set()
        self._connected: set[int] = set()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._t0 = time.perf_counter()
        self._due_snapshot: dict | None = None
        self._checkpoint_lock = threading.Lock()
        self.checkpoints_written = 0

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> tuple[str, int]:
        """Bind, listen and start accepting; returns the (host, port) workers connect to."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self.port))
        except OSError as exc:
            listener.close()
            raise ParameterServerError(
                f"cannot bind the parameter server to {self.host}:{self.port} ({exc}); set "
                "'spark.driver.host' to an address of this machine or change ps_port") from exc
        listener.listen(max(16, self.config.num_workers * 2))
        listener.settimeout(0.2)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._t0 = time.perf_counter()
        thread = threading.Thread(target=self._accept_loop, name="sparkdl-ps-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self.host, self.port

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def fail(self, error: BaseException) -> None:
        """Mark the run failed; every waiting or later request gets an ERROR reply."""
        with self._cond:
            if self.failure is None:
                self.failure = error
                log.error("parameter server: %s", error)
            self._cond.notify_all()

    @property
    def finished(self) -> bool:
        with self._cond:
            return len(self._done) == self.config.num_workers

    @property
    def workers_seen(self) -> int:
        """Workers that have said hello so far."""
        with self._cond:
            return len(self._connected)

    @property
    def version(self) -> int:
        return self.policy.version

    def weights(self) -> torch.Tensor:
        """A consistent copy of the current master weights."""
        with self._cond:
            return self.master.detach().clone()

    def snapshot(self) -> dict:
        """A consistent copy of everything a checkpoint holds (caller may hold the lock)."""
        with self._cond:
            return {"version": self.policy.version, "weights": self.master.detach().clone(),
                    "optimizer": copy.deepcopy(self.optimizer.state_dict()), "updates": self.stats.updates,
                    "applied_gradients": self.stats.applied_gradients, "policy": self.config.policy,
                    "num_params": self.num_params}

    def write_checkpoint(self, snapshot: dict | None = None) -> None:
        """Write a snapshot (default: the current state) to ``config.checkpoint_dir``."""
        if not self.config.checkpoint_dir:
            return
        snapshot = snapshot if snapshot is not None else self.snapshot()
        with self._checkpoint_lock:
            save_checkpoint(self.config.checkpoint_dir, snapshot, keep=self.config.checkpoint_keep)
            self.checkpoints_written += 1

    def averaged_buffers(self) -> torch.Tensor | None:
        """Mean of the float buffers (BatchNorm statistics ...) the workers reported, if any."""
        with self._cond:
            if not self._buffer_contributors:
                return None
            return (self._buffer_sum / self._buffer_contributors).to(torch.float32)

    # ----------------------------------------------------------------- network
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), name="sparkdl-ps-conn", daemon=True)
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _serve(self, conn: socket.socket) -> None:
        worker: int | None = None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(self.config.timeout_s)
        try:
            try:
                protocol.server_authenticate(conn, self.secret, _secrets.token_bytes(protocol.NONCE_BYTES))
            except (AuthenticationError, ProtocolError, ConnectionError, socket.timeout, OSError) as exc:
                with self._cond:
                    self.stats.auth_failures += 1
                log.warning("parameter server refused a connection: %s", exc)
                return
            worker = self._handle_hello(conn)
            if worker is not None:
                self._session(conn, worker)
        except socket.timeout:
            if worker is not None and worker not in self._done:
                self.fail(PSTimeoutError(
                    f"worker {worker} sent nothing for {self.config.timeout_s:.0f} s; raise timeout_s "
                    "if its mini-batches are that slow"))
        except ProtocolError as exc:
            with self._cond:
                self.stats.protocol_errors += 1
            self._try_send_error(conn, str(exc))
            if worker is not None:
                self.fail(ParameterServerError(f"worker {worker} broke the protocol: {exc}"))
        except (ConnectionError, OSError) as exc:
            if worker is not None and worker not in self._done and not self._stopping.is_set():
                self.fail(ParameterServerError(f"worker {worker} disconnected before finishing ({exc})"))
        finally:
            conn.close()

    def _try_send_error(self, conn: socket.socket, message: str) -> None:
        text = message.encode("utf-8", "replace")[:protocol.MAX_TEXT_BYTES]
        try:
            protocol.send_message(conn, Header(Msg.ERROR, length=len(text)), text)
        except OSError:
            pass

    def _failure_text(self) -> str:
        return f"the training run failed: {self.failure}"

    def _handle_hello(self, conn: socket.socket) -> int | None:
        header = protocol.recv_header(conn, protocol.MAX_TEXT_BYTES)
        if header.type == Msg.FAIL:   # a worker that failed before it could say hello
            self._record_worker_failure(header.worker, protocol.recv_small_payload(conn, header))
            protocol.send_message(conn, Header(Msg.ACK))
            return None
        protocol.expect(header, Msg.HELLO)
        worker = header.worker
        if worker >= self.config.num_workers:
            raise ProtocolError(f"worker id {worker} is outside [0, {self.config.num_workers})")
        with self._cond:
            if worker in self._connected:
                raise ProtocolError(f"worker {worker} is already connected")
            self._connected.add(worker)
            self._shards[worker] = header.count
            if len(self._shards) == self.config.num_workers:
                self._plan = steps_per_epoch(self.config.policy, self._shards, self.config.batch_size)
                self.policy.set_active({w for w, n in self._plan.items() if n > 0})
                self._cond.notify_all()
            ready = self._cond.wait_for(lambda: self._plan is not None or self.failure is not None,
                                        timeout=self.config.timeout_s)
            if self.failure is not None:
                self._try_send_error(conn, self._failure_text())
                return None
            if not ready:
                missing = sorted(set(range(self.config.num_workers)) - set(self._shards))
                self.fail(PSTimeoutError(
                    f"workers {missing} did not reach the parameter server within {self.config.timeout_s:.0f} s; "
                    "check that executors can connect to the driver ('spark.driver.host') and that "
                    "the cluster has enough free task slots"))
                self._try_send_error(conn, self._failure_text())
                return None
            assert self._plan is not None
            steps = self._plan[worker]
            version = self.policy.version
            send = None if version == 0 else self.master.detach().clone()
        payload = memoryview(send.numpy()) if send is not None else None
        protocol.send_message(conn, Header(Msg.WELCOME, version=version, count=steps,
                                           length=0 if send is None else send.numel() * 4), payload)
        return worker

    def _session(self, conn: socket.socket, worker: int) -> None:
        grad = torch.empty(self.num_params, dtype=torch.float32)
        grad_view = memoryview(grad.numpy()).cast("B")
        reply = torch.empty(self.num_params, dtype=torch.float32)
        reply_view = memoryview(reply.numpy()).cast("B")
        max_length = max(self.num_params * 4, self.buffer_count * 4, protocol.MAX_TEXT_BYTES)
        while not self._stopping.is_set():
            header = protocol.recv_header(conn, max_length)
            if header.worker != worker:
                raise ProtocolError(f"connection of worker {worker} sent a message as worker {header.worker}")
            if header.type == Msg.PUSH:
                protocol.recv_payload_into(conn, header, grad_view)
                flags, version = self._push(worker, header, grad, reply)
                if version < 0:
                    self._try_send_error(conn, self._failure_text())
                    return
                protocol.send_message(conn, Header(Msg.WEIGHTS, flags=flags, worker=worker, version=version,
                                                   length=len(reply_view)), reply_view)
            elif header.type == Msg.PULL:
                with self._cond:
                    reply.copy_(self.master.detach())
                    version = self.policy.version
                protocol.send_message(conn, Header(Msg.WEIGHTS, worker=worker, version=version,
                                                   length=len(reply_view)), reply_view)
            elif header.type == Msg.DONE:
                self._done_message(conn, worker, header)
                protocol.send_message(conn, Header(Msg.ACK, worker=worker))
                return
            elif header.type == Msg.FAIL:
                self._record_worker_failure(worker, protocol.recv_small_payload(conn, header))
                protocol.send_message(conn, Header(Msg.ACK, worker=worker))
                return
            else:
                raise ProtocolError(f"unexpected {header.type.name} from worker {worker}")

    # ----------------------------------------------------------------- state changes
    def _record_worker_failure(self, worker: int, text: bytes) -> None:
        message = text.decode("utf-8", "replace")
        with self._cond:
            self.worker_failures[worker] = message
        self.fail(ParameterServerError(f"worker {worker} failed"))

    def _push(self, worker: int, header: Header, grad: torch.Tensor, reply: torch.Tensor) -> tuple[int, int]:
        """Apply one pushed gradient per the policy; fill ``reply``; return (flags, version)."""
        finite = bool(torch.isfinite(grad).all())
        with self._cond:
            if self.failure is not None:
                return 0, -1
            self.stats.pushes += 1
            now = time.perf_counter() - self._t0
            if not finite:
                self.stats.rejected_nonfinite += 1
                decision = PushDecision(False, self.policy.version - header.version, 0.0, None, None, "not finite")
            else:
                decision = self.policy.on_push(worker, header.version)
            self.gradient_rows.append((now, worker, header.epoch, header.version, decision.staleness,
                                       decision.accepted))
            if decision.accepted:
                t = time.perf_counter()
                self._accum.add_(grad, alpha=decision.scale)
                self.stats.aggregate_seconds += time.perf_counter() - t
                self.stats.applied_gradients += 1
                self._pending.add(header.value, header.count, decision.staleness, header.epoch)
                if decision.update is not None:
                    self._apply(decision.update)
            elif finite:
                if decision.reason.startswith("staleness"):
                    self.stats.dropped_stale += 1
                else:
                    self.stats.refused += 1
                    log.warning("parameter server refused a gradient from worker %d: %s", worker, decision.reason)
            if decision.wait_for_version is not None:
                target = decision.wait_for_version
                ok = self._cond.wait_for(lambda: self.policy.version >= target or self.failure is not None,
                                         timeout=self.config.timeout_s)
                if self.failure is not None:
                    return 0, -1
                if not ok:
                    waiting_for = self.policy.missing_from_round()
                    self.fail(PSTimeoutError(
                        f"sync round {target - 1} waited {self.config.timeout_s:.0f} s for workers "
                        f"{waiting_for}; a worker is gone or far slower than the others (raise timeout_s, "
                        "or use policy='async'/'softsync' for stragglers)"))
                    return 0, -1
            reply.copy_(self.master.detach())
            version = self.policy.version
            due, self._due_snapshot = self._due_snapshot, None
        if due is not None:   # written outside the lock: other workers keep training meanwhile
            self.write_checkpoint(due)
        return (FLAG_ACCEPTED if decision.accepted else FLAG_DROPPED), version

    def _apply(self, update: Update) -> None:
        """Average the buffered gradients and step the optimizer (caller holds the lock)."""
        t = time.perf_counter()
        torch.mul(self._accum, 1.0 / update.weight_sum, out=self.master.grad)
        self._accum.zero_()
        group = self.optimizer.param_groups[0]
        group["lr"] = self.config.learning_rate * update.lr_scale
        self.optimizer.step()
        self.stats.optimizer_seconds += time.perf_counter() - t
        self.stats.updates += 1
        pending, self._pending = self._pending, _Pending()
        staleness = pending.staleness
        self.update_rows.append((update.version, time.perf_counter() - self._t0, pending.epoch,
                                 pending.loss / update.num_gradients, pending.samples, update.num_gradients,
                                 sum(staleness) / len(staleness), max(staleness), update.lr_scale))
        if self.config.checkpoint_dir and update.version % self.config.checkpoint_every == 0:
            self._due_snapshot = self.snapshot()
        self._cond.notify_all()

    def _done_message(self, conn: socket.socket, worker: int, header: Header) -> None:
        buffers = None
        if header.length:
            buffers = torch.empty(self.buffer_count, dtype=torch.float32)
            protocol.recv_payload_into(conn, header, memoryview(buffers.numpy()).cast("B"))
        with self._cond:
            if buffers is not None and header.count > 0:
                self._buffer_sum += buffers.to(torch.float64)
                self._buffer_contributors += 1
            self._done.add(worker)
            update = self.policy.on_worker_done(worker)
            if update is not None:
                self._apply(update)
            self._cond.notify_all()
