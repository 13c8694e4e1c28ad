"""What the parameter server records about a run: update and gradient rows, counters, events."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class UpdateRow:
    """One optimizer step of the PS (one row of ``TrainResult.history``)."""

    version: int              # version the weights have after this step
    time_s: float             # since the run started
    epoch: int                # newest epoch among the averaged gradients
    loss: float               # sample-weighted mean training loss of the averaged gradients
    samples: int
    gradients: int            # gradients averaged into the step
    staleness_mean: float
    staleness_max: int
    lr_scale: float           # mean per-gradient staleness factor s_i of the step (1 without staleness_lr)
    lr: float                 # the PS optimizer's learning rate for the step (schedule, scaling; 0: local SGD)


@dataclass(frozen=True)
class GradientRow:
    """One pushed gradient and its fate (one row of ``TrainResult.gradients``)."""

    time_s: float
    worker: int
    epoch: int
    computed_on: int          # weight version the worker computed it on
    staleness: int
    accepted: bool


@dataclass(frozen=True)
class ValidationRow:
    """The validation score of one epoch, over every worker's held-out rows."""

    epoch: int
    version: int              # PS version when the last worker's score for the epoch arrived
    time_s: float
    samples: int
    val_loss: float
    val_metric: float         # accuracy for classifiers, RMSE for regression


@dataclass(frozen=True)
class EpochRow:
    """One epoch's training loss and ``trainStep`` metrics, row-weighted means over every worker."""

    epoch: int
    version: int              # PS version when the last worker's report for the epoch arrived
    time_s: float
    samples: int
    metrics: dict[str, float]  # "loss" and the trainStep's metrics


def row_values(row: Any) -> tuple:
    """A row's values in field order (``dataclasses.astuple`` deep-copies each value: ~20x slower, and a
    long run's log has hundreds of thousands of rows)."""
    return tuple(vars(row).values())


UPDATE_COLUMNS = tuple(f.name for f in dataclasses.fields(UpdateRow))
VALIDATION_COLUMNS = tuple(f.name for f in dataclasses.fields(ValidationRow))
GRADIENT_COLUMNS = tuple(f.name for f in dataclasses.fields(GradientRow))


@dataclass
class ServerStats:
    """Counters of one PS (or PS shard); the run summary reports them."""

    pushes: int = 0
    applied_gradients: int = 0
    dropped_stale: int = 0
    dropped_late: int = 0     # sync with backup workers: gradients whose round completed without them
    past_end: int = 0         # pushes not applied because the run ended (sample budget spent, early stopping)
    rejected_nonfinite: int = 0
    discarded_on_loss: int = 0
    refused_gradients: int = 0   # refused for a reason other than staleness or NaN/Inf
    updates: int = 0
    auth_failures: int = 0
    protocol_errors: int = 0
    workers_lost: int = 0
    rejoins: int = 0
    #: elastic runs with min_workers: workers whose first attempt said hello after training had begun
    late_joins: int = 0
    checkpoint_failures: int = 0
    aggregate_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    #: CPU time of the connection handler threads (receive, check, aggregate, step, reply)
    handler_cpu_seconds: float = 0.0


@dataclass
class RunLog:
    """Rows, counters and events of one run, stamped relative to its start."""

    started: float = field(default_factory=time.perf_counter)
    updates: list[UpdateRow] = field(default_factory=list)
    gradients: list[GradientRow] = field(default_factory=list)
    validation: list[ValidationRow] = field(default_factory=list)
    #: per epoch, the workers' mean training loss and trainStep metrics (the driver PS only)
    epochs: list[EpochRow] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    stats: ServerStats = field(default_factory=ServerStats)
    #: update and gradient rows recorded before the first one held here (a restarted executor-hosted
    #: shard holds only the tail of the run's log; the driver holds the rest)
    rows_before: tuple[int, int] = (0, 0)

    def now(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started

    def event(self, event: str, version: int, **fields: Any) -> None:
        """Record something that happened to the run (a worker lost, a rejoin, a resume)."""
        self.events.append({"event": event, "time_s": self.now(), "wall_time": time.time(),
                            "version": version, **fields})

    def row_counts(self) -> tuple[int, int, int, int]:
        """How many update, gradient and validation rows and events there are (a position for :meth:`export`)."""
        return (self.rows_before[0] + len(self.updates), self.rows_before[1] + len(self.gradients),
                len(self.validation), len(self.events))

    def export(self, since: tuple[int, int, int, int] = (0, 0, 0, 0)
               ) -> tuple[dict[str, Any], tuple[int, int, int, int]]:
        """The rows and events after ``since``, and the counters, as plain values; and the new position.

        An executor-hosted shard 0 sends its log to the driver this way, a delta at a time, so
        that a long run's log crosses the network once.  Rows are only ever appended, so this
        may run while other threads append.
        """
        ends = self.row_counts()
        u, g, v, e = since
        (u0, g0), (u1, g1) = self.rows_before, ends[:2]
        return {"updates": [row_values(r) for r in self.updates[u - u0:u1 - u0]],
                "gradients": [row_values(r) for r in self.gradients[g - g0:g1 - g0]],
                "validation": [row_values(r) for r in self.validation[v:ends[2]]],
                "events": self.events[e:ends[3]], "stats": dataclasses.asdict(self.stats),
                "time_s": self.now()}, ends

    def load(self, state: dict[str, Any]) -> None:
        """Continue the log :meth:`export` (or :func:`log_tail`) made: rows, events and the clock; counters
        stay this run's."""
        self.rows_before = tuple(state.get("rows_before", (0, 0)))
        self.updates = [UpdateRow(*row) for row in state["updates"]]
        self.gradients = [GradientRow(*row) for row in state["gradients"]]
        self.validation = [ValidationRow(*row) for row in state["validation"]]
        self.events = list(state["events"])
        self.started = time.perf_counter() - float(state["time_s"])


def empty_log() -> dict[str, Any]:
    """An exported log without rows (what :func:`extend_log` starts from)."""
    return {"updates": [], "gradients": [], "validation": [], "events": [], "stats": {}, "time_s": 0.0}


def extend_log(log: dict[str, Any], delta: dict[str, Any]) -> None:
    """Append an exported delta to an exported log (the counters and the clock are the delta's)."""
    for key in ("updates", "gradients", "validation", "events"):
        log[key].extend(delta[key])
    log["stats"], log["time_s"] = delta["stats"], delta["time_s"]


#: update and gradient rows a restarted shard gets back (its progress view reads the last 50 and 200)
TAIL_ROWS = 200


def log_tail(log: dict[str, Any]) -> dict[str, Any]:
    """The exported log with only its last :data:`TAIL_ROWS` update and gradient rows (validation rows,
    one per epoch, and events stay whole): what a restarted log shard needs to continue it, however
    long the run was.  ``rows_before`` keeps the shard's row positions the run's."""
    updates, gradients = log["updates"][-TAIL_ROWS:], log["gradients"][-TAIL_ROWS:]
    return {**log, "updates": updates, "gradients": gradients,
            "rows_before": (len(log["updates"]) - len(updates), len(log["gradients"]) - len(gradients))}


def trimmed_log(log: dict[str, Any], rows: tuple[int, int, int] | None) -> dict[str, Any]:
    """The exported log cut back to its first ``rows`` (updates, gradients, validation) rows: those a
    snapshot's PS had recorded when it was taken (None: no rows).  A run resumed from the snapshot
    redoes the rest.  Events are all kept: the failure that caused the resume is part of the story.
    """
    updates, gradients, validation = rows or (0, 0, 0)
    return {**log, "updates": log["updates"][:updates], "gradients": log["gradients"][:gradients],
            "validation": log["validation"][:validation]}
