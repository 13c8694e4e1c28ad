"""The parameter server: master weights, optimizer and versioning, on the driver.

One listening socket, one handler thread per worker connection.  All shared state sits
behind one condition variable; the hot path under the lock is a few whole-buffer tensor
operations (accumulate, optimizer step on one flat tensor, copy into the reply buffer).
Sockets are read and written outside the lock.

The server outlives its workers: when a task dies, its worker is marked lost, and a
retried task that says hello again gets the current weights and its data position (the
number of its mini-batches whose gradients the server has already consumed).
"""
from __future__ import annotations

import copy
import logging
import secrets as _secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

import torch

from ..config import TrainConfig
from ..errors import AuthenticationError, ParameterServerError, ProtocolError, PSTimeoutError
from . import protocol
from .checkpoint import save_checkpoint
from .compression import make_codec
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
    workers: list[int] = field(default_factory=list)

    def add(self, worker: int, loss: float, samples: int, staleness: int, epoch: int) -> None:
        self.workers.append(worker)
        self.loss += loss
        self.samples += samples
        self.staleness.append(staleness)
        self.epoch = max(self.epoch, epoch)


@dataclass
class _Worker:
    """What the server knows about one worker id across task attempts."""

    status: str = "absent"      # absent | active | lost | done
    attempt: int = -1           # attempt number of the task that holds the id
    token: int = 0              # bumped at every hello: handlers of older connections go quiet
    shard: int = 0
    consumed: int = 0           # pushes whose fate is final (applied or dropped): the data position
    generation: int = 0         # the server's sync generation at this worker's hello
    buffers: torch.Tensor | None = None


@dataclass
class ServerStats:
    pushes: int = 0
    applied_gradients: int = 0
    dropped_stale: int = 0
    rejected_nonfinite: int = 0
    discarded_on_loss: int = 0
    refused: int = 0
    updates: int = 0
    auth_failures: int = 0
    protocol_errors: int = 0
    workers_lost: int = 0
    rejoins: int = 0
    aggregate_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    #: CPU time of the connection handler threads (receive, check, aggregate, step, reply)
    handler_cpu_seconds: float = 0.0


class _RoundAborted(Exception):
    """A sync round this handler waited on was abandoned because a worker was lost."""


class ParameterServer:
    """Serves ``push``/``pull`` for one training run; started and stopped by the launcher."""

    def __init__(self, config: TrainConfig, initial_weights: torch.Tensor, secret: bytes,
                 host: str = "127.0.0.1", port: int = 0, buffer_count: int = 0,
                 tls: ssl.SSLContext | None = None) -> None:
        if initial_weights.dim() != 1 or initial_weights.dtype != torch.float32:
            raise ValueError("initial_weights must be a flat float32 tensor")
        self.config = config
        self.secret = secret
        self.host = host
        self.port = port
        self.tls = tls
        self.num_params = initial_weights.numel()
        self.buffer_count = buffer_count
        self.policy = UpdatePolicy.from_config(config)
        self.master = torch.nn.Parameter(initial_weights.detach().clone().contiguous())
        self.master.grad = None   # set to the averaged gradient buffer for each step
        self._accum = torch.zeros_like(self.master.data)
        self._accum_empty = True   # the next buffered gradient overwrites instead of adding
        self.optimizer = make_optimizer(config, self.master)
        self.stats = ServerStats()
        self.update_rows: list[tuple] = []
        self.gradient_rows: list[tuple] = []
        self.events: list[dict] = []
        self.worker_failures: dict[int, str] = {}
        self.failure: BaseException | None = None
        self._pending = _Pending()
        self._cond = threading.Condition()
        self._workers = [_Worker() for _ in range(config.num_workers)]
        self._plan: dict[int, int] | None = None
        # Sync only: bumped when a worker is lost. Connections that said hello in an older
        # generation belong to a dead attempt; their pushes are refused so they fail fast and
        # cannot advance rounds (and data positions) without the lost worker.
        self._generation = 0
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
        listener.listen(max(64, self.config.num_workers * 2))
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
        for thread in list(self._threads):
            thread.join(timeout=5)

    def fail(self, error: BaseException) -> None:
        """Mark the run failed; every waiting or later request gets an ERROR reply."""
        with self._cond:
            if self.failure is None:
                self.failure = error
                log.error("parameter server: %s", error)
            self._cond.notify_all()

    def restore(self, checkpoint: dict) -> None:
        """Continue from a checkpoint: weights, optimizer state, version, data positions."""
        if checkpoint["num_params"] != self.num_params:
            raise ValueError(f"the checkpoint holds {checkpoint['num_params']} parameters, the model has "
                             f"{self.num_params}: it belongs to another model")
        positions = checkpoint.get("consumed", [])
        if len(positions) != len(self._workers):
            raise ValueError(f"the checkpoint was written by a run with {len(positions)} workers; resume with "
                             f"num_workers={len(positions)}")
        with self._cond:
            self.master.data.copy_(checkpoint["weights"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.policy.version = int(checkpoint["version"])
            self.stats.updates = int(checkpoint.get("updates", 0))
            self.stats.applied_gradients = int(checkpoint.get("applied_gradients", 0))
            for worker, consumed in zip(self._workers, positions):
                worker.consumed = int(consumed)
            self._event("resumed", path=checkpoint.get("path", ""))

    @property
    def finished(self) -> bool:
        with self._cond:
            return all(w.status == "done" for w in self._workers)

    @property
    def workers_seen(self) -> int:
        """Workers that have said hello so far."""
        with self._cond:
            return sum(w.status != "absent" for w in self._workers)

    @property
    def version(self) -> int:
        return self.policy.version

    def progress(self) -> dict:
        """A cheap view of the run for progress displays (no Spark jobs involved)."""
        with self._cond:
            last = self.update_rows[-1] if self.update_rows else None
            planned = None
            if self._plan is not None:
                planned = sum(-(-steps * self.config.epochs // self.config.local_steps)
                              for steps in self._plan.values())
            recent = self.gradient_rows[-200:]
            return {"pushes": sum(w.consumed for w in self._workers) if self.config.policy == "sync"
                    else self.stats.pushes, "planned_pushes": planned, "version": self.policy.version,
                    "epoch": last[2] if last else 0, "loss": last[3] if last else float("nan"),
                    "samples": sum(row[4] for row in self.update_rows[-50:]),
                    "window_s": (last[1] - self.update_rows[-50][1]) if len(self.update_rows) >= 50 else None,
                    "staleness": sum(r[4] for r in recent) / len(recent) if recent else 0.0,
                    "retries": self.stats.rejoins}

    def positions(self) -> list[int]:
        """Per worker: pushes whose gradients the server has consumed."""
        with self._cond:
            return [w.consumed for w in self._workers]

    def weights(self) -> torch.Tensor:
        """A consistent copy of the current master weights."""
        with self._cond:
            return self.master.detach().clone()

    def snapshot(self) -> dict:
        """A consistent copy of everything a checkpoint holds."""
        with self._cond:
            return {"version": self.policy.version, "weights": self.master.detach().clone(),
                    "optimizer": copy.deepcopy(self.optimizer.state_dict()), "updates": self.stats.updates,
                    "applied_gradients": self.stats.applied_gradients, "policy": self.config.policy,
                    "num_params": self.num_params, "consumed": [w.consumed for w in self._workers],
                    "time_s": self._now()}

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
            reported = [w.buffers for w in self._workers if w.buffers is not None]
            if not reported:
                return None
            return torch.stack(reported).to(torch.float64).mean(dim=0).to(torch.float32)

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
        token = -1
        conn.settimeout(self.config.timeout_s)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            protocol.server_authenticate(conn, self.secret, _secrets.token_bytes(protocol.NONCE_BYTES))
        except (AuthenticationError, ProtocolError, ConnectionError, OSError, ssl.SSLError) as exc:
            with self._cond:
                self.stats.auth_failures += 1
            log.warning("parameter server refused a connection: %s", exc)
            conn.close()
            return
        cpu_started = time.thread_time()
        try:
            hello = self._handle_hello(conn)
            if hello is not None:
                worker, token = hello
                self._session(conn, worker, token)
        except socket.timeout:
            if worker is not None:
                self._worker_lost(worker, token, f"sent nothing for {self.config.timeout_s:.0f} s")
        except ProtocolError as exc:
            with self._cond:
                self.stats.protocol_errors += 1
            log.warning("parameter server: protocol error from %s: %s",
                        "an unregistered connection" if worker is None else f"worker {worker}", exc)
            self._try_send_error(conn, str(exc))
            if worker is not None:
                self._worker_lost(worker, token, f"broke the protocol: {exc}")
        except _RoundAborted as exc:
            self._try_send_error(conn, str(exc))
        except (ConnectionError, OSError) as exc:
            if worker is not None:
                self._worker_lost(worker, token, f"disconnected ({exc})")
        finally:
            conn.close()
            with self._cond:
                self.stats.handler_cpu_seconds += time.thread_time() - cpu_started

    def _try_send_error(self, conn: socket.socket, message: str) -> None:
        text = message.encode("utf-8", "replace")[:protocol.MAX_TEXT_BYTES]
        try:
            protocol.send_message(conn, Header(Msg.ERROR, length=len(text)), text)
        except (OSError, ValueError):
            pass

    def _failure_text(self) -> str:
        return f"the training run failed: {self.failure}"

    def _handle_hello(self, conn: socket.socket) -> tuple[int, int] | None:
        """Register a worker (first attempt or a retry); reply with its plan, position and weights."""
        header = protocol.recv_header(conn, protocol.MAX_TEXT_BYTES)
        if header.type == Msg.FAIL:   # a worker that failed before it could say hello
            if header.worker >= len(self._workers):
                raise ProtocolError(f"worker id {header.worker} is outside [0, {len(self._workers)})")
            if self._workers[header.worker].status == "active":
                raise ProtocolError(f"FAIL for worker {header.worker}, which is connected on another connection")
            self._record_worker_failure(header.worker, protocol.recv_small_payload(conn, header))
            protocol.send_message(conn, Header(Msg.ACK))
            return None
        protocol.expect(header, Msg.HELLO)
        worker, attempt = header.worker, header.version
        if worker >= len(self._workers):
            raise ProtocolError(f"worker id {worker} is outside [0, {len(self._workers)})")
        with self._cond:
            state = self._workers[worker]
            if state.status == "active" and attempt <= state.attempt:
                raise ProtocolError(f"worker {worker} is already connected (attempt {state.attempt})")
            rejoining = state.status != "absent"
            state.status, state.attempt, state.shard = "active", attempt, header.count
            state.generation = self._generation
            state.token += 1
            token = state.token
            if rejoining:
                self.stats.rejoins += 1
                self._event("rejoined", worker=worker, attempt=attempt)
            if self._plan is None:
                if all(w.status != "absent" for w in self._workers):
                    shards = {i: w.shard for i, w in enumerate(self._workers)}
                    self._plan = steps_per_epoch(self.config.policy, shards, self.config.batch_size)
                    self.policy.set_active({w for w, n in self._plan.items() if n > 0})
                    self._cond.notify_all()
                ready = self._cond.wait_for(lambda: self._plan is not None or self.failure is not None,
                                            timeout=self.config.timeout_s)
                if self.failure is None and not ready:
                    missing = [i for i, w in enumerate(self._workers) if w.status == "absent"]
                    self.fail(PSTimeoutError(
                        f"workers {missing} did not reach the parameter server within {self.config.timeout_s:.0f} s;"
                        " check that executors can connect to the driver ('spark.driver.host') and that the "
                        "cluster has enough free task slots"))
            elif self._plan.get(worker, 0) > 0:
                self.policy.on_worker_joined(worker)
            if self.failure is not None:
                self._try_send_error(conn, self._failure_text())
                return None
            assert self._plan is not None
            steps = self._plan[worker]
            version = self.policy.version
            position = state.consumed * self.config.local_steps
            send = None if version == 0 else self.master.detach().clone()
        payload = memoryview(send.numpy()) if send is not None else None
        protocol.send_message(conn, Header(Msg.WELCOME, worker=worker, epoch=min(position, 2**32 - 1),
                                           version=version, count=steps,
                                           length=0 if send is None else send.numel() * 4), payload)
        return worker, token

    def _session(self, conn: socket.socket, worker: int, token: int) -> None:
        grad = torch.empty(self.num_params, dtype=torch.float32)
        codec = make_codec(self.config.compression, self.num_params, self.config.topk_ratio)
        # Uncompressed gradients land straight in ``grad``; encoded ones in a byte buffer first.
        encoded = grad if not codec.lossy else torch.empty(codec.encoded_bytes(), dtype=torch.uint8)
        grad_view = memoryview(encoded.numpy()).cast("B")
        reply = torch.empty(self.num_params, dtype=torch.float32)
        reply_view = memoryview(reply.numpy()).cast("B")
        max_length = max(self.num_params * 4, self.buffer_count * 4, protocol.MAX_TEXT_BYTES)
        while not self._stopping.is_set():
            header = protocol.recv_header(conn, max_length)
            if header.worker != worker:
                raise ProtocolError(f"connection of worker {worker} sent a message as worker {header.worker}")
            if header.type == Msg.PUSH:
                protocol.recv_payload_into(conn, header, grad_view)
                if codec.lossy:
                    try:
                        codec.decode_into(encoded, grad)
                    except ValueError as exc:
                        raise ProtocolError(f"undecodable {codec.name} gradient: {exc}") from None
                outcome = self._push(worker, token, header, grad, reply)
                if outcome is None:
                    self._try_send_error(conn, self._failure_text() if self.failure else "this connection was "
                                         "replaced by a newer attempt of the same worker")
                    return
                flags, version = outcome
                protocol.send_message(conn, Header(Msg.WEIGHTS, flags=flags, worker=worker, version=version,
                                                   length=len(reply_view)), reply_view)
            elif header.type == Msg.PULL:
                with self._cond:
                    reply.copy_(self.master.detach())
                    version = self.policy.version
                protocol.send_message(conn, Header(Msg.WEIGHTS, worker=worker, version=version,
                                                   length=len(reply_view)), reply_view)
            elif header.type == Msg.DONE:
                self._done_message(conn, worker, token, header)
                protocol.send_message(conn, Header(Msg.ACK, worker=worker))
                return
            elif header.type == Msg.FAIL:
                self._record_worker_failure(worker, protocol.recv_small_payload(conn, header), token)
                protocol.send_message(conn, Header(Msg.ACK, worker=worker))
                return
            else:
                raise ProtocolError(f"unexpected {header.type.name} from worker {worker}")

    # ----------------------------------------------------------------- state changes
    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _event(self, event: str, **fields) -> None:
        """Record what happened to the run (caller holds the lock)."""
        self.events.append({"event": event, "time_s": self._now(), "wall_time": time.time(),
                            "version": self.policy.version, **fields})

    def _current(self, worker: int, token: int) -> bool:
        return self._workers[worker].token == token

    def _worker_lost(self, worker: int, token: int, reason: str) -> None:
        """A worker's task died or went silent; the run may continue when the stage is retried."""
        with self._cond:
            state = self._workers[worker]
            if state.token != token or state.status != "active" or self._stopping.is_set():
                return
            state.status = "lost"
            self.stats.workers_lost += 1
            discarded = self.policy.on_worker_lost(worker)
            if self.config.policy == "sync":   # every worker redoes the interrupted round
                self._accum_empty = True
                self._pending = _Pending()
                self.stats.discarded_on_loss += discarded
                self._generation += 1
            self._event("lost", worker=worker, reason=reason)
            log.warning("parameter server: worker %d %s", worker, reason)
            self._cond.notify_all()

    def _record_worker_failure(self, worker: int, text: bytes, token: int | None = None) -> None:
        message = text.decode("utf-8", "replace")
        last_line = (message.strip().splitlines() or ["?"])[-1]
        with self._cond:
            self.worker_failures[worker] = message
            self._event("failed", worker=worker, reason=last_line)
            current = self._workers[worker].token if token is None else token
        self._worker_lost(worker, current, "failed: " + last_line)

    def _push(self, worker: int, token: int, header: Header, grad: torch.Tensor,
              reply: torch.Tensor) -> tuple[int, int] | None:
        """Apply one pushed gradient per the policy; fill ``reply``; return (flags, version).

        None means: do not answer with weights (the run failed, or this connection is stale).
        """
        # One vectorised pass: NaN/Inf propagate into the sum (so does a float32 overflow, which is
        # refused too); torch.isfinite(grad).all() costs ~40x more on large gradients.
        finite = bool(torch.isfinite(grad.sum()))
        with self._cond:
            if self.failure is not None or not self._current(worker, token):
                return None
            if self.config.policy == "sync" and self._workers[worker].generation != self._generation:
                raise _RoundAborted("a worker was lost; this attempt's sync rounds are over and the stage "
                                    "will be retried")
            self.stats.pushes += 1
            if not finite:
                self.stats.rejected_nonfinite += 1
                if self.config.nonfinite == "fail":
                    self.fail(ParameterServerError(
                        f"worker {worker} pushed a gradient with NaN/Inf values (nonfinite='fail'); lower the "
                        "learning rate, check the data, or set nonfinite='skip'"))
                    return None
                decision = PushDecision(False, self.policy.version - header.version, 0.0, None, None, "not finite")
            else:
                decision = self.policy.on_push(worker, header.version)
            self.gradient_rows.append((self._now(), worker, header.epoch, header.version, decision.staleness,
                                       decision.accepted))
            if decision.accepted:
                self._pending.add(worker, header.value, header.count, decision.staleness, header.epoch)
                if self.config.policy != "sync":   # async/softsync buffers are never discarded
                    self._workers[worker].consumed += 1
                update = decision.update
                if update is not None and update.num_gradients == 1:
                    self._apply(update, grad)      # one gradient: step on it directly, no buffer pass
                else:
                    t = time.perf_counter()
                    if self._accum_empty:
                        torch.mul(grad, decision.scale, out=self._accum)
                        self._accum_empty = False
                    else:
                        self._accum.add_(grad, alpha=decision.scale)
                    self.stats.aggregate_seconds += time.perf_counter() - t
                    if update is not None:
                        self._apply(update)
            else:
                self._workers[worker].consumed += 1
                if decision.reason.startswith("staleness"):
                    self.stats.dropped_stale += 1
                elif finite:
                    self.stats.refused += 1
                    log.warning("parameter server refused a gradient from worker %d: %s", worker, decision.reason)
            if decision.wait_for_version is not None:
                self._wait_for_round(worker, token, decision.wait_for_version)
            if self.failure is not None or not self._current(worker, token):
                return None
            reply.copy_(self.master.detach())
            version = self.policy.version
            due, self._due_snapshot = self._due_snapshot, None
        if due is not None:   # written outside the lock: other workers keep training meanwhile
            self.write_checkpoint(due)
        return (FLAG_ACCEPTED if decision.accepted else FLAG_DROPPED), version

    def _wait_for_round(self, worker: int, token: int, target: int) -> None:
        """Block (lock held, released while waiting) until the sync round reaches ``target``."""
        generation = self._workers[worker].generation
        # A silent worker is caught first by its own connection's timeout_s (it is then lost and
        # the round abandoned); this longer bound is the backstop that keeps the wait finite.
        ok = self._cond.wait_for(lambda: self.policy.version >= target or self.failure is not None
                                 or self._generation != generation or not self._current(worker, token),
                                 timeout=2 * self.config.timeout_s)
        if self.failure is not None or not self._current(worker, token) or self.policy.version >= target:
            return
        if self._generation != generation:
            raise _RoundAborted(f"sync round {target - 1} was abandoned because a worker was lost; "
                                "the stage will be retried")
        if not ok:
            self.fail(PSTimeoutError(
                f"sync round {target - 1} waited {2 * self.config.timeout_s:.0f} s for workers "
                f"{self.policy.missing_from_round()}; a worker is gone or far slower than the others "
                "(raise timeout_s, or use policy='async'/'softsync' for stragglers)"))

    def _apply(self, update: Update, single: torch.Tensor | None = None) -> None:
        """Average the buffered gradients (or take ``single``) and step (caller holds the lock)."""
        t = time.perf_counter()
        # The s-weighted mean: sum(s_i g_i) / sum(s_i). For one gradient that is g itself.
        gradient = single if single is not None else self._accum
        if single is None and update.weight_sum != 1.0:
            gradient.mul_(1.0 / update.weight_sum)
        self._accum_empty = True
        group = self.optimizer.param_groups[0]
        group["lr"] = self.config.learning_rate * update.lr_scale
        self.master.grad = gradient            # no copy: the optimizer reads the buffer itself
        self.optimizer.step()
        self.master.grad = None
        self.stats.optimizer_seconds += time.perf_counter() - t
        self.stats.updates += 1
        self.stats.applied_gradients += update.num_gradients
        pending, self._pending = self._pending, _Pending()
        if self.config.policy == "sync":   # a sync round's gradients become final only now
            for member in pending.workers:
                self._workers[member].consumed += 1
        staleness = pending.staleness
        self.update_rows.append((update.version, self._now(), pending.epoch,
                                 pending.loss / update.num_gradients, pending.samples, update.num_gradients,
                                 sum(staleness) / len(staleness), max(staleness), update.lr_scale))
        if self.config.checkpoint_dir and update.version % self.config.checkpoint_every == 0:
            self._due_snapshot = self.snapshot()
        self._cond.notify_all()

    def _done_message(self, conn: socket.socket, worker: int, token: int, header: Header) -> None:
        buffers = None
        if header.length:
            buffers = torch.empty(self.buffer_count, dtype=torch.float32)
            protocol.recv_payload_into(conn, header, memoryview(buffers.numpy()).cast("B"))
        with self._cond:
            if not self._current(worker, token):
                return
            state = self._workers[worker]
            if buffers is not None and header.count > 0:
                state.buffers = buffers
            state.status = "done"
            update = self.policy.on_worker_done(worker)
            if update is not None:
                self._apply(update)
            self._cond.notify_all()
