"""A failed barrier stage -> the most informative sparkdl error (the worker's traceback, not Py4J)."""
from __future__ import annotations

import re

from sparkdl.errors import ClusterConfigError, DataError, SparkDLError, WorkerError

#: how a task's DataError ends its traceback
_DATA_ERROR = "sparkdl.errors.DataError: "
#: how a task's ClusterConfigError ends its traceback (a memory or GPU check that refused the task)
_CONFIG_ERROR = "sparkdl.errors.ClusterConfigError: "


def worker_traceback(text: str) -> str:
    """The Python traceback inside a Py4J/Spark error message, if there is one."""
    start = text.find("Traceback (most recent call last)")
    if start < 0:
        return ""
    end = min((i for i in (text.find("\n\tat ", start), text.find(" SQLSTATE", start)) if i > 0),
              default=len(text))
    return text[start:end].strip()


#: the line of a traceback that names the exception: "module.Type: message" (message lines may follow)
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")


def exception_line(trace: str) -> str:
    """The "Type: message" line of a Python traceback (its last such line: a message may span lines)."""
    lines = trace.strip().splitlines()
    return next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)),
                lines[-1] if lines else "unknown error")


def barrier_stage_failure(exc: BaseException, worker_failures: dict[int, str] | None = None,
                  ps_failure: BaseException | None = None) -> SparkDLError:
    """Turn a failed barrier stage into a sparkdl error.

    Preference: a worker's own traceback reported through the PS (the first one reported: the
    others are usually its partners losing a peer), then the PS's failure, then what Spark's
    exception says (a Python traceback, a missing module, the JVM cause).
    """
    if worker_failures:
        worker, trace = next(iter(worker_failures.items()))     # dicts keep the order of the reports
        last = exception_line(trace)
        if last.startswith(_CONFIG_ERROR):   # the same settings would fail again: not worth a retry
            return ClusterConfigError(f"training worker {worker}: {last[len(_CONFIG_ERROR):]}")
        if last.startswith(_DATA_ERROR):    # nor would the same data
            return DataError(f"training worker {worker} failed: {last[len(_DATA_ERROR):]}", worker, trace)
        return WorkerError(f"training worker {worker} failed: {last}", worker, trace)
    if isinstance(ps_failure, SparkDLError):
        return ps_failure
    text = str(exc)
    if re.search(r"No module named '(sparkdl|torch)'", text):
        return ClusterConfigError(
            "executors cannot import sparkdl or torch: ship the environment to the cluster "
            "(spark-submit --archives venv.tar.gz#env with PYSPARK_PYTHON=./env/bin/python) or install it "
            "on every node, and point PYSPARK_PYTHON at it")
    trace = worker_traceback(text)
    if trace:
        last = exception_line(trace)
        if last.startswith(_CONFIG_ERROR):   # refused before the task reached the PS (loading its spec)
            return ClusterConfigError(f"the training stage failed: {last[len(_CONFIG_ERROR):]}")
        if last.startswith(_DATA_ERROR):
            return DataError(f"the training stage failed: {last[len(_DATA_ERROR):]}", None, trace)
        return WorkerError(f"the training stage failed: {last}", None, trace)
    java = re.search(r"^: ([\w.$]+): (.*)$", text, re.MULTILINE)   # the JVM-side cause
    cause = f"{java.group(1).rsplit('.', 1)[-1]}: {java.group(2)}" if java else (text.strip() or repr(exc))
    return SparkDLError(f"the training stage failed: {cause}")


def after_attempts(error: SparkDLError, attempts: int) -> SparkDLError:
    """The same error, its message saying how many stage attempts were made."""
    if attempts == 1:
        return error
    message = f"{error.args[0]} (failed in all {attempts} stage attempts)"
    if isinstance(error, WorkerError):
        return type(error)(message, error.worker_id, error.worker_traceback)
    return type(error)(message)
