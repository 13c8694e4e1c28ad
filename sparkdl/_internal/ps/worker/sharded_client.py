"""Worker side of a sharded parameter server: one connection per shard, all exchanged at once."""
from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from sparkdl._internal.ps.tables import TableSpec
from sparkdl._internal.ps.wire.compression import Codec
from sparkdl._internal.ps.worker.client import PSClient, Welcome, report_failure_to
from sparkdl.errors import ParameterServerError


class ShardedClient:
    """Pushes and pulls every shard's key range concurrently, with the interface of :class:`PSClient`.

    Each shard keeps its own version, so ``computed_on`` is tracked per shard here (the
    argument of :meth:`push_pull` is ignored): a shard's staleness is measured against the
    weights this worker last received from that shard.  Gradients are compressed per range
    (``codecs``: one per shard, each with its own error-feedback residual); slices of the
    flat buffers go on the wire without copies.  Failures are reported to the driver's
    coordinator (``report_to``), which outlives the shards.
    """

    def __init__(self, clients: list[PSClient], spans: list[tuple[int, int]], codecs: list[Codec],
                 report_to: tuple[str, int], secret: bytes, timeout_s: float, tls_cert_pem: str | None,
                 barrier_attempt: int = 0) -> None:
        self.clients = clients
        self.spans = spans
        self.codecs = codecs
        self.worker = clients[0].worker
        self.versions = [0] * len(clients)
        self.segment = None   # the replica trains in its own buffers; each shard may use its own segment
        self._report_to = report_to
        self._secret = secret
        self._timeout_s = timeout_s
        self._tls_cert_pem = tls_cert_pem
        self._barrier_attempt = barrier_attempt
        # shard 0 is exchanged on the calling thread, the others on these (sockets release the GIL)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(clients) - 1), thread_name_prefix="sparkdl-shard")

    # ----------------------------------------------------------------- views
    @property
    def bytes_pushed(self) -> int:
        return sum(c.bytes_pushed for c in self.clients)

    @property
    def bytes_pulled(self) -> int:
        return sum(c.bytes_pulled for c in self.clients)

    @property
    def round_trips(self) -> int:
        """The round trips a step waited on: the shards' run side by side, so the most any one shard made."""
        return max(c.round_trips for c in self.clients)

    @property
    def stop_requested(self) -> bool:
        return any(c.stop_requested for c in self.clients)

    @property
    def transport(self) -> str:
        return ",".join(sorted({c.transport for c in self.clients}))

    @property
    def transport_note(self) -> str | None:
        """Why some shards' exchanges go over TCP although their PS offered shared memory (None: none)."""
        notes = sorted({c.transport_note for c in self.clients if c.transport_note})
        return "; ".join(notes) or None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()

    # ----------------------------------------------------------------- exchanges
    def _each(self, call) -> list:
        """``call(i, client)`` for every shard at once; raises the first error (in time) after all have ended.

        On the first error every shard's socket is shut down, so no exchange waits out a sync
        round (up to ``timeout_s``) that can no longer complete for this worker.
        """
        errors: list[BaseException] = []
        lock = threading.Lock()

        def guarded(i: int, client: PSClient):
            try:
                return call(i, client)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                    first = len(errors) == 1
                if first:
                    self._abort()
                raise

        futures = [self._pool.submit(guarded, i, c) for i, c in enumerate(self.clients) if i]
        try:
            results = [guarded(0, self.clients[0])]
        except BaseException:
            results = [None]
        wait(futures)
        if errors:
            raise errors[0]
        return results + [future.result() for future in futures]

    def _abort(self) -> None:
        for client in self.clients:
            try:
                client.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def hello(self, partition_rows: int, weights: torch.Tensor, task_attempt: int = 0,
              shared_memory: bool = False, double: bool = False, wait_for_turn: bool = False,
              master: bool = False, tables: Sequence[TableSpec] = (), table_slots: int = 0) -> Welcome:
        """Say hello to every shard; weights (past version 0) arrive range by range.

        A retried run resumes from a consistent cut, where every shard has the same plan and
        data positions; the smallest position is taken, should they ever differ.  (``double``:
        overlapped exchanges, which a sharded PS does not serve; refused before launch; ``wait_for_turn``: work
        units, which executor-hosted shards do not serve either; ``master``: ignored, each shard copies its range
        of the weights into the replies, as the range's master is only part of the model; ``tables``,
        ``table_slots``: ignored, shared tables need one PS, refused before launch.)
        """
        if double or wait_for_turn:
            raise ValueError("a sharded PS serves neither overlapped exchanges (double-buffered segments) nor work "
                             "units")
        welcomes = self._each(lambda i, c: c.hello(partition_rows, weights[self.spans[i][0]:self.spans[i][1]],
                                                   task_attempt, shared_memory))
        self.versions = [w.version for w in welcomes]
        first = welcomes[0]
        if any(w.has_weights != first.has_weights for w in welcomes):
            raise ParameterServerError("PS shards disagree on whether the run starts from the initial weights")
        return Welcome(first.version, first.steps_per_epoch, min(w.position for w in welcomes), first.has_weights)

    def push_pull(self, grads: torch.Tensor, computed_on: int, samples: int, loss: float, epoch: int,
                  weights_out: torch.Tensor, weight: float | None = None) -> tuple[int, bool]:
        """Push every range of ``grads`` and receive every range of the new weights into ``weights_out``.

        Returns (shard 0's new version, whether every shard accepted its range).
        """
        def exchange(i: int, client: PSClient) -> tuple[int, bool]:
            lo, hi = self.spans[i]
            return client.push_pull(self.codecs[i].encode(grads[lo:hi]), self.versions[i], samples, loss, epoch,
                                    weights_out[lo:hi], weight)
        return self._settle(self._each(exchange))

    def pull_rows(self, table: int, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """Rows ``ids`` of table ``table``, each from the shard that holds it (row r: shard r % S), at once."""
        return self.pull_tables([(table, ids, dim)])[0]

    def pull_tables(self, requests: Sequence[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
        """The rows of several tables, each from the shard that holds it: one request per shard, all at once."""
        ids = [table_ids.to(torch.int64) for _, table_ids, _ in requests]
        owners = [table_ids % len(self.clients) for table_ids in ids]
        values = [torch.empty((table_ids.numel(), dim), dtype=torch.float32)
                  for table_ids, (_, _, dim) in zip(ids, requests, strict=True)]

        def pull(i: int, client: PSClient) -> None:
            mine = [(r, owner == i) for r, owner in enumerate(owners)]
            asked = [(r, held) for r, held in mine if bool(held.any())]   # a shard holding none of a table's ids
            if asked:
                pulled = client.pull_tables([(requests[r][0], ids[r][held], requests[r][2]) for r, held in asked])
                for (r, held), rows in zip(asked, pulled, strict=True):
                    values[r][held] = rows
        self._each(pull)
        return values

    def push_rows(self, table: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Send each shard its part of a table's touched rows, ahead of the push they belong to.

        A shard that holds none of them still gets its (empty) part: the table took a step, and lazy Adam's
        bias correction counts every step of the table, as ``torch.optim.SparseAdam`` does, so every shard's
        step count stays the table's."""
        owner = ids % len(self.clients)
        for i, client in enumerate(self.clients):
            mine = owner == i
            client.push_rows(table, ids[mine], grads[mine])

    def push_nonfinite(self, computed_on: int, samples: int, loss: float, epoch: int,
                       weights_out: torch.Tensor, weight: float | None = None) -> tuple[int, bool]:
        """Tell every shard this step's gradient held NaN/Inf; receive the weights."""
        return self._settle(self._each(lambda i, c: c.push_nonfinite(
            self.versions[i], samples, loss, epoch, weights_out[self.spans[i][0]:self.spans[i][1]], weight)))

    def _settle(self, replies: list[tuple[int, bool]]) -> tuple[int, bool]:
        self.versions = [version for version, _ in replies]
        return self.versions[0], all(accepted for _, accepted in replies)

    def validation(self, epoch: int, samples: int, loss_sum: float, metric_sum: float) -> bool:
        """Every shard records the epoch's score (each keeps its range of the best weights)."""
        return any(self._each(lambda i, c: c.validation(epoch, samples, loss_sum, metric_sum)))

    def done(self, samples: int, float_buffers: torch.Tensor | None) -> None:
        """Finished: the float buffers (BatchNorm statistics) go to shard 0, which pools them."""
        self._each(lambda i, c: c.done(samples, float_buffers if i == 0 else None))

    def report_failure(self, text: str, part_attempt: int = -1) -> None:
        """Best effort: hand the traceback to the driver's coordinator."""
        report_failure_to(self._report_to, self._secret, self.worker, self._timeout_s, self._tls_cert_pem, text,
                          self._barrier_attempt)
