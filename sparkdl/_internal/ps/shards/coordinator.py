"""The driver's side of executor-hosted PS shards: it coordinates and keeps snapshots, never serves a push.

With ``ps_hosts="executors"`` barrier task i hosts PS shard i (:mod:`sparkdl._internal.modes.executor_shards.host`)
and the workers exchange gradients with the shards directly.  Each shard host keeps one
authenticated connection to this coordinator, over which it

* says hello (with its barrier-stage attempt and Spark task attempt id) and receives the state to
  start from: its part of the newest *consistent cut* (one snapshot per shard at one version),
  or nothing at the start of a fresh run;
* sends a snapshot every ``shard_snapshot_every`` updates (and at checkpoint versions);
* sends progress (the log shard: shard 0, or a pipeline's last stage, whose run log records
  every push with its loss, sent as deltas with its snapshots), a failure of its PS, and
  its final state when every worker is done.

A failed stage attempt is retried from the newest consistent cut: under ``sync`` every shard
is at the same version with the same data positions, so the retried run does exactly what
the undisturbed one did; under async policies at most ``shard_snapshot_every`` updates per
shard are redone.  Workers report their failures here too.  Everything arriving is counted
in :attr:`driver_bytes`.
"""
from __future__ import annotations

import enum
import io
import json
import logging
import socket
import ssl
import threading
from collections.abc import Sequence
from typing import Any

import torch

from sparkdl._internal.ps.server.checkpoint import LOCAL, CheckpointFiles, write_run_checkpoint
from sparkdl._internal.ps.server.runlog import empty_log, extend_log, log_tail, trimmed_log
from sparkdl._internal.ps.shards.ranges import merge_snapshots
from sparkdl._internal.ps.shards.snapshot_cuts import ConsistentCuts
from sparkdl._internal.ps.tables import TableSpec, rows_digest, shard_message_bytes
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.wire.handshake import HANDSHAKE_TIMEOUT_S
from sparkdl._internal.ps.wire.listener import Listener, send_error
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl.config import TrainConfig
from sparkdl.errors import ParameterServerError, ProtocolError

log = logging.getLogger(__name__)


#: counters of a PS that count events (not restored from a snapshot, unlike updates and applied gradients)
ADDITIVE_COUNTERS = ("pushes", "dropped_stale", "dropped_late", "past_end", "rejected_nonfinite",
                     "discarded_on_loss", "refused_gradients", "auth_failures", "protocol_errors", "workers_lost",
                     "rejoins")


class Report(enum.IntEnum):
    """What a SHARD_REPORT carries (its header's flags)."""

    PROGRESS = 1   # JSON: shard 0's progress view
    SNAPSHOT = 2   # torch.save'd snapshot of the shard at header.version
    FINAL = 3      # torch.save'd final state of the shard; answered by ACK
    FAILURE = 4    # text: the shard's PS failed the run
    ROWS = 5       # empty: the rows the shard built differ from the driver's; answered by SHARD_STATE with them


def encode_state(state: Any) -> bytes:
    """Tensors, numbers, strings and containers of them, as bytes (no code: loaded with weights_only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def decode_state(data: bytes) -> Any:
    """What :func:`encode_state` made; refuses anything but tensors and plain values."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:   # an authenticated but broken peer: say so, never run its bytes
        raise ProtocolError(f"undecodable shard state: {exc}") from None


class ShardCoordinator:
    """Coordinates ``len(spans)`` executor-hosted shards; the stage runner's view of the run's state."""

    def __init__(self, config: TrainConfig, secret: bytes, spans: list[tuple[int, int]], host: str,
                 tls: ssl.SSLContext | None = None, resume: dict | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, initial: torch.Tensor | None = None,
                 log_shard: int = 0, checkpoint_files: CheckpointFiles = LOCAL,
                 tables: Sequence[torch.Tensor] = (), table_specs: Sequence[TableSpec] = ()) -> None:
        """``initial``: the initial weights, sent to each shard at a fresh start (pipelines, whose job
        spec carries none); ``log_shard``: the shard whose run log is the run's; ``tables``: the embedding
        tables' initial rows, each shard sent every S-th row at a fresh start; ``table_specs``: theirs."""
        self.config = config
        #: where checkpoints are written (a local directory, or a Hadoop file system)
        self.checkpoint_files = checkpoint_files
        self.spans = spans
        self.initial = initial
        if len(tables) != len(table_specs):
            raise ValueError(f"{len(tables)} tables' rows for {len(table_specs)} table specs")
        self.tables = list(tables)
        self.table_specs = list(table_specs)
        self.log_shard = log_shard
        self.host = host
        self.port = config.ps_port
        self._cond = threading.Condition()
        # shard hosts, plus a failure report from every worker at once
        self._listener = Listener(secret, self._serve, self._refused, tls, handshake_timeout_s,
                                  connections=len(spans) + config.num_workers, name="shard coordinator")
        #: the newest consistent cut of the shards' snapshots, and the snapshots waiting for theirs
        self.cuts = ConsistentCuts(spans, resume, self.tables)
        #: the run's log (updates, gradients, validation, events), assembled from shard 0's deltas
        self._log = empty_log()
        self.finals: dict[int, dict] = {}
        self.barrier_attempt = 0
        self._registered: set[int] = set()
        #: shard -> the Spark task attempt id hosting it in this stage attempt (a larger one supersedes)
        self._hosts: dict[int, int] = {}
        #: shards whose hosts Spark's own re-run of the stage has replaced so far
        self._rerun: set[int] = set()
        self._checkpoint_writers: list[threading.Thread] = []
        self._checkpoint_lock = threading.Lock()
        self._progress: dict[str, Any] = {}
        self.failure: BaseException | None = None
        self.worker_failures: dict[int, str] = {}
        #: bytes the driver received and sent for training (snapshots, progress, reports, final states)
        self.driver_bytes = 0
        self.snapshots_received = 0
        #: fresh shard starts that were sent their tables' initial rows (they differed where built on the executor)
        self.rows_sent = 0
        self._digests: dict[int, list[str]] = {}
        self.checkpoints_written = 0
        self.checkpoint_failures = 0
        self.refused_connections = 0
        self.events: list[dict[str, Any]] = []
        #: counters of the log shard in stage attempts that were given up (a restored shard restarts them)
        self.prior_stats: dict[str, int] = {}

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> tuple[str, int]:
        self.port = self._listener.start(self.host, self.port, "set 'spark.driver.host' (or ps_host) to an address "
                                         "of this machine or change ps_port")
        return self.host, self.port

    def stop(self) -> None:
        self._listener.stopping.set()
        with self._cond:
            self._cond.notify_all()
        self._listener.stop()

    def begin_attempt(self, barrier_attempt: int) -> None:
        """A new barrier-stage attempt starts: older attempts' hosts are no longer heard."""
        with self._cond:
            if barrier_attempt:
                self._close_given_up_attempt(barrier_attempt)
            self.barrier_attempt = barrier_attempt
            self._registered.clear()
            self._rerun = set()
            self._hosts.clear()
            self.cuts.forget_pending()
            self.finals.clear()

    def _close_given_up_attempt(self, next_attempt: int) -> None:
        """Record where the given-up attempt got to, and add up its counters (its newest report or snapshot)."""
        reached = max([self._progress.get("version", 0), self.cuts.newest_pending(),
                       *(row[0] for row in self._log["updates"][-1:])])
        reports = [self._progress.pop("stats", None), self._log.pop("stats", None)]   # each counted once
        newest: dict[str, Any] = max((r for r in reports if r), key=lambda r: r.get("pushes", 0), default={})
        for name, value in newest.items():
            if name in ADDITIVE_COUNTERS:
                self.prior_stats[name] = self.prior_stats.get(name, 0) + value
        if self.cuts.cut is not None:
            self.events.append({"event": "resumed_from_cut", "version": self.version, "attempt": next_attempt,
                                "reached_version": reached})

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._fail_locked(error)

    def _fail_locked(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
            log.error("shard coordinator: %s", error)
        self._cond.notify_all()

    # ----------------------------------------------------------------- views
    @property
    def workers_seen(self) -> int:
        """Shard hosts of the current attempt that said hello (the watchdog's sign of life)."""
        with self._cond:
            return len(self._registered)

    def progress(self) -> dict[str, Any]:
        with self._cond:
            return dict(self._progress) or {"pushes": 0, "planned_pushes": None, "version": self.version, "epoch": 0,
                                            "loss": float("nan"), "samples": 0, "window_s": None, "staleness": 0.0,
                                            "retries": 0, "val_loss": None}

    def final_states(self) -> list[dict]:
        """Every shard's final state, in range order; raises when one is missing."""
        with self._cond:
            missing = [i for i in range(len(self.spans)) if i not in self.finals]
            if missing:
                raise ParameterServerError(f"PS shards {missing} ended without handing their final state to the "
                                           "driver")
            for shard, final in self.finals.items():   # whole tables: each shard's changes over the cut's
                final["snapshot"] = self.cuts.final_snapshot(shard, final["snapshot"])
            return [self.finals[i] for i in range(len(self.spans))]

    # ----------------------------------------------------------------- connections
    def _refused(self, reason: str) -> None:
        with self._cond:
            self.refused_connections += 1
        log.warning("shard coordinator: %s", reason)

    def _count(self, header: Header) -> None:
        self.driver_bytes += protocol.HEADER.size + header.length

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.config.timeout_s)
        shard: int | None = None
        try:
            header = protocol.recv_header(conn, protocol.MAX_TEXT_BYTES)
            with self._cond:
                self._count(header)
            if header.type == Msg.FAIL:   # a worker reports its traceback (version: its stage attempt)
                text = protocol.recv_small_payload(conn, header).decode("utf-8", "replace")
                with self._cond:
                    if header.version == self.barrier_attempt:   # a leftover of an older attempt explains nothing now
                        self.worker_failures.setdefault(header.worker, text)   # the first is the cause
                protocol.send_message(conn, Header(Msg.ACK))
                return
            protocol.expect(header, Msg.SHARD_HELLO)
            shard, attempt, task_attempt = header.worker, header.version, header.count
            self._welcome(conn, shard, attempt, task_attempt)
            self._reports(conn, shard, attempt, task_attempt)
        except ProtocolError as exc:
            log.warning("shard coordinator: protocol error from %s: %s",
                        "an unregistered connection" if shard is None else f"shard {shard}", exc)
            send_error(conn, str(exc))
        except (TimeoutError, ConnectionError, OSError) as exc:
            if shard is not None and not self._listener.stopping.is_set():
                log.warning("shard coordinator: lost the host of shard %d (%s)", shard, exc)

    def _welcome(self, conn: socket.socket, shard: int, attempt: int, task_attempt: int) -> None:
        if not 0 <= shard < len(self.spans):
            raise ProtocolError(f"shard {shard} is outside [0, {len(self.spans)})")
        with self._cond:
            if attempt != self.barrier_attempt:
                raise ProtocolError(f"stage attempt {attempt} is over (the run is at attempt {self.barrier_attempt})")
            known = self._hosts.get(shard)
            if known is not None and task_attempt <= known:
                raise ProtocolError(f"shard {shard} is already hosted by task attempt {known}")
            if known is not None:
                # Spark re-ran the barrier stage itself: every shard restarts from the cut, and what the
                # older hosts sent past it must not mix with what the new ones send
                if not self._rerun or shard in self._rerun:   # the first hello of this re-run
                    self._close_given_up_attempt(self.barrier_attempt)
                    self._rerun = set()
                self._rerun.add(shard)
                self.cuts.forget_pending()
                self.finals.clear()
            self._hosts[shard] = task_attempt
            self._registered.add(shard)
            if shard == self.log_shard:   # the run's log up to the cut; its tail goes back to the shard that continues it
                rows = self.cuts.cut[shard].get("log_rows") if self.cuts.cut is not None else None
                self._log = trimmed_log(self._log, tuple(rows) if rows else None)
            lo, hi = self.spans[shard]
            start = self.cuts.start_state(shard)
            if start is not None:
                state = encode_state({**start, "log": log_tail(self._log)} if shard == self.log_shard else start)
            else:
                fresh: dict[str, Any] = {}
                if self.initial is not None:
                    fresh["initial"] = self.initial[lo:hi].clone()
                if self.tables:
                    # the shard builds its rows from the model's code, seeded as here, and checks them by these
                    fresh["table_digests"] = self._table_digests(shard)
                state = encode_state(fresh) if fresh else b""
            version = -1 if start is None else self.version
            self.driver_bytes += protocol.HEADER.size + len(state)
        protocol.send_message(conn, Header(Msg.SHARD_STATE, worker=shard, version=version, length=len(state)), state)

    def _table_digests(self, shard: int) -> list[str]:
        if shard not in self._digests:
            self._digests[shard] = [rows_digest(rows[shard::len(self.spans)]) for rows in self.tables]
        return self._digests[shard]

    def _initial_rows(self, shard: int) -> bytes:
        """A fresh shard's tables' initial rows, when those it built differ from the driver's (under the lock;
        sent outside it: other shards' reports go on meanwhile)."""
        if self.cuts.cut is not None or not self.tables:
            raise ProtocolError(f"shard {shard} asked for initial rows, but it starts from a cut or holds no table")
        state = encode_state({"tables": [rows[shard::len(self.spans)].clone() for rows in self.tables]})
        self.driver_bytes += protocol.HEADER.size + len(state)
        self.rows_sent += 1
        return state

    def _current(self, shard: int, attempt: int, task_attempt: int) -> bool:
        """Whether this host still serves the run (not an attempt given up, nor one Spark re-ran); under the lock."""
        return attempt == self.barrier_attempt and self._hosts.get(shard) == task_attempt

    def _reports(self, conn: socket.socket, shard: int, attempt: int, task_attempt: int) -> None:
        lo, hi = self.spans[shard]
        max_length = shard_message_bytes(self.table_specs, len(self.spans), dense_params=hi - lo)
        while True:
            header = protocol.recv_header(conn, max_length)
            protocol.expect(header, Msg.SHARD_REPORT)
            payload = protocol.recv_small_payload(conn, header, max_length)
            with self._cond:
                self._count(header)
            kind = Report(header.flags) if header.flags in Report._value2member_map_ else None
            if kind is None:
                raise ProtocolError(f"unknown shard report kind {header.flags}")
            try:   # an authenticated peer's malformed report is a protocol error, never a crash
                state: dict = {}
                if kind in (Report.SNAPSHOT, Report.FINAL):
                    decoded = decode_state(payload)
                    if not isinstance(decoded, dict):
                        raise ProtocolError(f"a {kind.name} report must hold a mapping")
                    state = decoded
                due: dict | None = None
                rows: bytes | None = None
                with self._cond:
                    if not self._current(shard, attempt, task_attempt):
                        # a straggler of an attempt given up or superseded: heard, never used
                        if kind in (Report.FINAL, Report.ROWS):   # answered: the asker learns it is over
                            raise ProtocolError(f"shard {shard}'s stage attempt is over")
                        continue
                    if kind is Report.PROGRESS and payload:   # the log shard's view; others only say they live
                        progress = json.loads(payload)
                        if not isinstance(progress, dict):
                            raise ProtocolError("a PROGRESS report must hold a JSON object")
                        self._progress = progress
                    elif kind is Report.ROWS:
                        rows = self._initial_rows(shard)
                    elif kind is Report.FAILURE:
                        self._fail_locked(ParameterServerError(
                            f"PS shard {shard}: {payload.decode('utf-8', 'replace')}"))
                    elif kind is Report.SNAPSHOT:
                        formable = self._snapshot(shard, header.version, state)
                        # of the cuts it completes, the newest due a checkpoint is written (one merged copy
                        # held at a time; an older one formed at the same moment is superseded at once)
                        due_version = max((v for v in formable if v % self.config.checkpoint_every == 0),
                                          default=None) if self.config.checkpoint_dir else None
                        for version in formable:   # in order: each cut is laid over the one before
                            cut = self.cuts.advance()
                            assert cut is not None and cut[0]["version"] == version
                            if version == due_version:
                                # merged under the lock: the cut's tables change in place when the next forms
                                due = merge_snapshots(cut)
                    elif kind is Report.FINAL:
                        self.cuts.check_final(shard, state["snapshot"])
                        if shard == self.log_shard:   # the whole log: what came with the snapshots, and the rest
                            extend_log(self._log, state["log"])
                            state["log"] = self._log
                        self.finals[shard] = state
                        self._cond.notify_all()
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ProtocolError(f"malformed {kind.name} report from shard {shard}: {exc!r}") from None
            if rows is not None:
                protocol.send_message(conn, Header(Msg.SHARD_STATE, worker=shard, version=-1, length=len(rows)), rows)
            if due is not None:
                # written on a thread of its own: this connection keeps reading the shard's reports
                writer = threading.Thread(target=lambda due=due: self.write_checkpoint(due),
                                          name="sparkdl-checkpoint", daemon=True)
                with self._cond:
                    self._checkpoint_writers.append(writer)
                writer.start()
            if kind is Report.FINAL:
                protocol.send_message(conn, Header(Msg.ACK))
                return

    def _snapshot(self, shard: int, version: int, snapshot: dict) -> list[int]:
        """Keep a shard's snapshot (under the lock); returns the versions of the cuts it lets form, oldest first."""
        log_delta = snapshot.pop("log") if shard == self.log_shard else None
        cut = self.cuts.offer(shard, version, snapshot)   # refuses a mislabelled snapshot
        if log_delta is not None:
            extend_log(self._log, log_delta)
        self.snapshots_received += 1
        return cut

    @property
    def version(self) -> int:
        """The version of the newest consistent cut (where a retried barrier stage restarts)."""
        return self.cuts.version

    @property
    def resumed_from(self) -> int | None:
        return self.cuts.resumed_from

    def write_checkpoint(self, snapshot: dict, final: bool = False) -> None:
        """A whole-model checkpoint (the same files a driver PS writes); a failed periodic write is only counted.

        The final one waits for the periodic writes still running, so it is the newest file.
        """
        if final:
            with self._cond:
                writers = list(self._checkpoint_writers)
            for writer in writers:
                writer.join()
        assert self.config.checkpoint_dir is not None   # called only when checkpoints are on
        with self._checkpoint_lock:
            failed = write_run_checkpoint(self.config.checkpoint_dir, snapshot, self.config.checkpoint_keep, final,
                                          "shard coordinator", self.checkpoint_files)
        with self._cond:
            if failed is None:
                self.checkpoints_written += 1
            else:
                self.checkpoint_failures += 1
