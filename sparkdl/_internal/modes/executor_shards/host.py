"""Executor side of ``ps_hosts="executors"``: barrier task i serves PS shard i next to its worker.

The shard is an ordinary :class:`~sparkdl._internal.ps.server.server.ParameterServer` over one key range,
running on threads of the task's Python worker.  It starts from its part of the driver's
newest consistent cut (or the broadcast initial weights), sends snapshots and progress to
the driver's :class:`~sparkdl._internal.ps.shards.coordinator.ShardCoordinator`, and stays up until every
worker of the run is done, then hands its final state to the driver.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, cast

import torch

from sparkdl._internal.ps.server.core import PSCore
from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.server.server import ParameterServer, ServerSetup
from sparkdl._internal.ps.shards.coordinator import Report, decode_state, encode_state
from sparkdl._internal.ps.shards.ranges import clip_tensor_sizes
from sparkdl._internal.ps.tables import rows_digest, shard_message_bytes
from sparkdl._internal.ps.wire.protocol import Header, Msg
from sparkdl._internal.ps.wire.tls import server_context
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl._internal.ps.worker.remote_embedding import detach_tables
from sparkdl._internal.spark.preflight import bind_address
from sparkdl._internal.spark.task import TaskEnv
from sparkdl._internal.training.optim import clip_layout
from sparkdl._internal.training.pipeline_cuts import build_whole
from sparkdl.errors import ParameterServerError

log = logging.getLogger(__name__)
#: seconds between two progress reports of shard 0
PROGRESS_EVERY_S = 0.5


def task_host(env: TaskEnv) -> str:
    """The address of this task's executor, as the other tasks of the stage reach it."""
    return env.context.getTaskInfos()[env.rank].address.rsplit(":", 1)[0]


class ShardHost:
    """Serves PS shard ``shard`` from this task for the run; reports to the driver's coordinator."""

    def __init__(self, env: TaskEnv, shard: int, tensor_sizes: list[int], float_buffer_count: int) -> None:
        """``float_buffer_count``: the BatchNorm statistics ... this shard pools (all of them on shard 0, a
        pipeline stage's on its shard, else none)."""
        spec = env.spec
        self.env = env
        self.shard = shard
        self.span = spec.ps_shards[shard]
        self.config = spec.config.replace(ps_port=0)   # ps_port is the driver's coordinator's; a shard takes any
        self._tensor_sizes = clip_tensor_sizes(tensor_sizes, self.span)
        # AdamW's decay rule over this shard's range (a spec without the flags: every tensor decays)
        decays = spec.tensor_decays or (True,) * len(tensor_sizes)
        self._tensor_layout = clip_layout(tuple(zip(tensor_sizes, decays, strict=True)), self.span)
        self._float_buffer_count = float_buffer_count
        self.keeps_log = shard == spec.log_shard   # its run log is the run's (it sees every push's loss)
        self._link = PSClient(spec.ps_host, spec.ps_port, spec.secret, shard, spec.config.timeout_s, spec.tls_cert_pem)
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None
        self._failure_reported = False
        self._final_sent = False   # the FINAL report went: later snapshots are not sent
        self._log_sent = (0, 0, 0, 0)   # the log rows already sent to the driver
        self.server: ParameterServer | None = None

    def start(self) -> str:
        """Start the shard from the driver's state; returns the "host:port" workers connect to."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> str:
        spec, (lo, hi) = self.env.spec, self.span
        # with a reply asked for, request returns it
        header, payload = cast("tuple[Header, bytes]", self._link.request(
            Header(Msg.SHARD_HELLO, worker=self.shard, version=spec.barrier_attempt, count=self.env.task_attempt),
            reply=Msg.SHARD_STATE,
            max_length=shard_message_bytes(spec.tables, len(spec.ps_shards), dense_params=hi - lo)))
        state = decode_state(payload) if payload else None
        snapshot = state if header.version >= 0 else None
        # a pipeline's spec carries no weights: then the driver sends the shard's initial range
        if snapshot is not None:      # the cut's weights (a pipeline's spec carries none at all)
            initial = snapshot["weights"].clone()
        elif state is not None and "initial" in state:   # a pipeline's fresh start: the initial range
            initial = state["initial"]
        else:
            initial = torch.from_numpy(spec.initial_weights[lo:hi]).clone()
        # the embedding tables' rows this shard holds: the cut's, or at a fresh start built here
        table_rows = ([table["weight"] for table in snapshot.get("tables", [])] if snapshot is not None
                      else self._initial_rows(state["table_digests"]) if state is not None and "table_digests" in state
                      else [])
        shards = len(spec.ps_shards)
        tables = [EmbeddingTable(table, self.shard, shards, self.config.learning_rate, rows=rows)
                  for table, rows in zip(spec.tables, table_rows, strict=True)]
        advertised = task_host(self.env)
        self.server = ParameterServer(self.config, initial, spec.secret, ServerSetup(
            host=bind_address(advertised), tls=server_context(spec.tls_cert_pem, spec.tls_key_pem),
            float_buffer_count=self._float_buffer_count, tensor_sizes=self._tensor_sizes,
            tensor_layout=self._tensor_layout, tables=tables, shard=self.shard, welcome_weights=spec.pipeline is not None,
            snapshot_sink=self._send_snapshot))
        core = self.server.core
        # the driver keeps the cut's rows: a snapshot carries only the table rows changed since the last
        core.snapshots.table_changes_only = True
        core.snapshots.every = (self.config.shard_snapshot_every,) + (
            (self.config.checkpoint_every,) if self.config.checkpoint_dir else ())
        if snapshot is not None:
            if "log" in snapshot:   # the run's history up to the cut continues (the driver holds it)
                core.log.load(snapshot["log"])
                self._log_sent = core.log.row_counts()
            self.server.restore(snapshot)
        _, port = self.server.start()
        self._reporter = threading.Thread(target=self._report_loop, name="sparkdl-shard-report", daemon=True)
        self._reporter.start()
        return f"{advertised}:{port}"

    def _initial_rows(self, digests: list[str]) -> list[torch.Tensor]:
        """This shard's rows of every table at a fresh start: built here by the model's own code, seeded as the
        driver built them, so they need not cross the driver's link (twice the table's bytes over all shards);
        the driver's own when they differ (a model that draws them otherwise on an executor)."""
        spec, shards = self.env.spec, len(self.env.spec.ps_shards)
        try:
            rows = self._built_rows(shards)
            if [rows_digest(part) for part in rows] == list(digests):
                return rows
            why = ("differ from the driver's (the model's code draws them from another source than torch's "
                   "seeded generator)")
            del rows
        except Exception as exc:   # noqa: BLE001 (a build that fails here, out of memory among them: ask the driver)
            why = f"could not be built here ({type(exc).__name__}: {exc})"
        log.warning("PS shard %d: the model's tables %s; the driver sends its rows", self.shard, why)
        with self._send_lock:
            _, payload = cast("tuple[Header, bytes]", self._link.request(
                Header(Msg.SHARD_REPORT, flags=Report.ROWS, worker=self.shard), reply=Msg.SHARD_STATE,
                max_length=shard_message_bytes(spec.tables, shards)))
        return decode_state(payload)["tables"]

    def _built_rows(self, shards: int) -> list[torch.Tensor]:
        """This shard's rows of every table, from the whole model built as the driver built it (for a moment the
        whole tables)."""
        spec = self.env.spec
        with torch.random.fork_rng(devices=[]):     # the task's own random state stays as it was
            torch.manual_seed(self.config.seed)
            template, _ = build_whole(spec.model_fn)
        modules = detach_tables(template)
        return [modules[table.name].weight.detach()[self.shard::shards].to("cpu", copy=True) for table in spec.tables]

    def _send(self, kind: Report, payload: bytes, version: int = 0) -> None:
        with self._send_lock:
            self._send_locked(kind, payload, version)

    def _send_locked(self, kind: Report, payload: bytes, version: int = 0) -> None:
        self._link.request(Header(Msg.SHARD_REPORT, flags=kind, worker=self.shard, version=version,
                                  length=len(payload)), payload, reply=Msg.ACK if kind is Report.FINAL else None)

    def _send_snapshot(self, snapshot: dict) -> None:
        """The PS's snapshot sink (a worker's handler thread, outside the PS lock).

        The log delta is cut and sent under the send lock, so deltas arrive whole and in order
        when two handlers deliver snapshots at once.
        """
        assert self.server is not None   # the sink of the server _start made
        try:
            with self._send_lock:
                if self._final_sent:
                    # a snapshot made due by the last DONE's flush, after the FINAL report (which holds
                    # the whole state, and after which the coordinator reads nothing of this shard)
                    return
                if self.keeps_log:   # the log rows since the last snapshot ride along
                    delta, self._log_sent = self.server.core.log.export(self._log_sent)
                    snapshot = {**snapshot, "log": delta}
                self._send_locked(Report.SNAPSHOT, encode_state(snapshot), snapshot["version"])
        except (OSError, ParameterServerError) as exc:   # without the driver the run cannot be saved or end well
            self.server.fail(ParameterServerError(f"PS shard {self.shard} lost the driver's coordinator: {exc}"))

    def _report_loop(self) -> None:
        assert self.server is not None   # started by _start once the server is up
        while not self._stop.wait(PROGRESS_EVERY_S):
            try:
                self._report_failure()
                # every shard reports at least this often: the driver knows its hosts are alive
                progress = (json.dumps({**self.server.progress(), "stats": dataclasses.asdict(self.server.stats)})
                            .encode() if self.keeps_log else b"")
                self._send(Report.PROGRESS, progress)
            except (OSError, ParameterServerError) as exc:
                log.warning("PS shard %d: progress report failed: %s", self.shard, exc)
                return

    def _report_failure(self) -> None:
        assert self.server is not None   # called once the shard started
        failure = self.server.failure
        if failure is not None and not self._failure_reported:
            self._failure_reported = True
            self._send(Report.FAILURE, str(failure).encode("utf-8", "replace"))

    def finish(self) -> None:
        """Serve until every worker of the run is done, then hand the shard's final state to the driver."""
        server = self.server
        assert server is not None   # finish follows a successful start
        # other workers may train on long after this one (async): only a shard that sees no push for
        # 2 x timeout_s gives up (a silent worker's own connection times out before that)
        seen, deadline = None, 0.0
        while not server.wait_finished(timeout_s=1.0):     # woken at once when the last worker is done
            pushes = server.stats.pushes
            if pushes != seen:
                seen, deadline = pushes, time.monotonic() + 2 * self.config.timeout_s
            elif time.monotonic() > deadline:
                server.fail(ParameterServerError(
                    f"PS shard {self.shard}: no worker pushed for {2 * self.config.timeout_s:.0f} s, and not every "
                    "worker is done (raise timeout_s if steps are legitimately that slow)"))
        if server.failure is not None:
            try:
                self._report_failure()
            except (OSError, ParameterServerError) as exc:
                log.warning("PS shard %d: could not report its failure: %s", self.shard, exc)
            raise ParameterServerError(f"PS shard {self.shard}: {server.failure}")
        with self._send_lock:   # the last log delta, cut and sent in order after every snapshot's
            self._send_locked(Report.FINAL, encode_state(self._final_state()))
            self._final_sent = True

    def _final_state(self) -> dict[str, Any]:
        assert self.server is not None   # called by finish
        return self.server.read(self._state_of)

    def _state_of(self, core: PSCore) -> dict[str, Any]:
        best_kept = bool(self.config.restore_best_weights and core.epochs.best_validation)
        state: dict[str, Any] = {
            # the result's weights are the snapshot's unless the best validation epoch's are kept; its
            # tables are the rows changed since the shard started, laid over its start state by the driver,
            # with their optimizer state only for the final checkpoint (the result needs the rows alone)
            "snapshot": core.snapshots.take("since_start", table_optimizer_state=bool(self.config.checkpoint_dir)),
            "final_weights": core.final_weights() if best_kept else None,
            "final_tables": list(core.final_tables().values()) if best_kept else None,
            "samples_consumed": core.members.samples_consumed, "sample_budget": core.members.sample_budget,
            "stopped_early": core.epochs.stopped_early, "stats": dataclasses.asdict(core.stats),
            "best_validation": (dataclasses.astuple(core.epochs.best_validation) if core.epochs.best_validation else None)}
        state["float_buffers"] = core.members.reported_float_buffers()
        if self.keeps_log:
            state["log"], self._log_sent = core.log.export(self._log_sent)
        return state

    def close(self) -> None:
        """Stop serving (promptly; at the end of the task, whatever happened)."""
        self._stop.set()
        if self._reporter is not None:
            self._reporter.join(timeout=5)
        if self.server is not None:
            self.server.stop()
        self._link.close()
