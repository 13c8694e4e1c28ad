"""One exception hierarchy for run-time failures of sparkdl.

Programmer errors (bad arguments) raise built-in exceptions such as ``ValueError``;
everything that goes wrong while a job runs raises a :class:`SparkDLError` subclass whose
message says what happened and which setting to change.  All of them pickle, so they
cross process boundaries (executor -> driver) intact.
"""
from __future__ import annotations

__all__ = [
    "SparkDLError", "ClusterConfigError", "WorkerError", "DataError", "ParameterServerError",
    "PSTimeoutError", "AuthenticationError", "ProtocolError",
]


class SparkDLError(RuntimeError):
    """Base class of every run-time failure raised by sparkdl."""


class ClusterConfigError(SparkDLError):
    """The Spark cluster cannot run the job as configured (slots, dynamic allocation, Python)."""


class WorkerError(SparkDLError):
    """A training task failed on an executor; carries the worker's own traceback."""

    def __init__(self, message: str, worker_id: int | None = None, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.worker_traceback = worker_traceback

    def __reduce__(self):  # keep the extra fields when pickled
        return (type(self), (self.args[0], self.worker_id, self.worker_traceback))

    def __str__(self) -> str:
        text = self.args[0]
        if self.worker_traceback:
            text += "\n--- worker traceback ---\n" + self.worker_traceback.rstrip()
        return text


class DataError(WorkerError, ValueError):
    """A training task found rows that break the data's rules (null, NaN/Inf, unequal lengths, labels
    outside the model's classes) while loading its partition, before any update.  Also a ``ValueError``:
    bad input, which no retry mends."""


class ParameterServerError(SparkDLError):
    """The parameter server failed, went away, or refused the run."""


class PSTimeoutError(ParameterServerError):
    """A blocking wait on or in the parameter server ran past its configured bound."""


class AuthenticationError(ParameterServerError):
    """A connection did not prove knowledge of the job's secret."""


class ProtocolError(ParameterServerError):
    """A malformed or unexpected message reached the parameter server or a worker."""
