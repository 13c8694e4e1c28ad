"""What a training run or a scoring pass needs from Spark, for classic PySpark and Spark Connect alike.

A classic session reaches the JVM through py4j (SparkContext, job groups, RDDs); a Spark
Connect client has none of that: it talks gRPC to a server, reads settings through
``spark.conf`` and cancels work by tag.  :class:`SparkBackend` hides the difference from the
launcher, the stage runner and the preflight checks.
"""
from __future__ import annotations

import abc
import contextlib
import os
import pickle
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

CONNECT_RDD_MESSAGE = (
    "sparkdl.train(rdd, ...) needs an RDD, and Spark Connect has no RDDs (nor a SparkContext); "
    "train through the DataFrame API instead: TorchEstimator(model=model_fn, ...).fit(df), with the "
    "features in one column (array or Vector) or several numeric columns (featuresCols)")


def _connect_session_class() -> type[Any] | None:
    # A Connect session exists only once its module was imported; looking it up in sys.modules
    # keeps classic runs from importing grpc just to find out that they are classic.
    module = sys.modules.get("pyspark.sql.connect.session")
    return getattr(module, "SparkSession", None) if module is not None else None


def is_connect_session(session: Any) -> bool:
    """True for a Spark Connect ``SparkSession`` (a gRPC client, no SparkContext)."""
    cls = _connect_session_class()
    return cls is not None and isinstance(session, cls)


def is_connect_dataframe(df: Any) -> bool:
    """True for a DataFrame of a Spark Connect session."""
    module = sys.modules.get("pyspark.sql.connect.dataframe")
    return module is not None and isinstance(df, module.DataFrame)


def active_connect_session() -> Any | None:
    """The Spark Connect session active in this thread (or the default one), if any."""
    cls = _connect_session_class()
    if cls is None:
        return None
    return cls.getActiveSession()


class SparkBackend(abc.ABC):
    """The Spark operations sparkdl's driver side uses, whichever way it reaches Spark."""

    #: True under Spark Connect
    connect: bool = False

    @property
    def session(self) -> Any:
        """The SparkContext or Spark Connect session this backend drives: what :meth:`share`'s values belong to."""
        return self

    @property
    @abc.abstractmethod
    def master(self) -> str:
        """The cluster's master URL (``local[2]``, ``spark://...``, ``yarn`` ...)."""

    @abc.abstractmethod
    def conf(self, key: str, default: str | None = None) -> str | None:
        """A Spark setting of the running application, or ``default`` when it is not set."""

    @abc.abstractmethod
    def job_group(self, group: str, description: str) -> AbstractContextManager[None]:
        """Label the Spark jobs this thread starts inside the block, so that :meth:`cancel` finds them."""

    @abc.abstractmethod
    def cancel(self, group: str) -> None:
        """Cancel the running jobs of ``group`` (callable from any thread)."""

    @abc.abstractmethod
    def share(self, data: bytes) -> Any:
        """``data`` as tasks receive it: a broadcast variable (classic) or the bytes themselves (Connect).

        Tasks read it back with :func:`shared_bytes`, or unpickle it with :func:`load_shared`.
        """

    def release(self, shared: Any) -> None:  # noqa: B027 (optional: only backends that made files free them)
        """Free what :meth:`share` made, once no task needs it."""

    def driver_heap_bytes(self) -> int | None:
        """The largest heap the driver's JVM may take (None where this process cannot ask it: Connect)."""
        return None


class ClassicBackend(SparkBackend):
    """A SparkContext in this process (py4j)."""

    connect = False

    def __init__(self, sc: Any) -> None:
        self.sc = sc

    @property
    def session(self) -> Any:
        return self.sc

    @property
    def master(self) -> str:
        return self.sc.master

    def conf(self, key: str, default: str | None = None) -> str | None:
        # the context's own (fixed) conf: getConf() copies every setting over Py4J first, ~25 ms a call
        return self.sc._conf.get(key, default)

    @contextlib.contextmanager
    def job_group(self, group: str, description: str) -> Iterator[None]:
        self.sc.setJobGroup(group, description, interruptOnCancel=True)
        try:
            yield
        finally:
            self.sc.setLocalProperty("spark.jobGroup.id", None)
            self.sc.setLocalProperty("spark.job.description", None)

    def cancel(self, group: str) -> None:
        self.sc.cancelJobGroup(group)

    def share(self, data: bytes) -> Any:
        # Measured (benchmarks/spec_transport.py, local[2], two runs of 5): the barrier stage of a
        # 171 MB model took a median 2.4 / 4.5 s with its job spec in a broadcast and 5.8 / 7.1 s with
        # it in the task closure, so classic sessions keep the broadcast.
        return self.sc.broadcast(data)

    def driver_heap_bytes(self) -> int | None:
        return int(self.sc._jvm.java.lang.Runtime.getRuntime().maxMemory())

    def release(self, shared: Any) -> None:
        shared.destroy()


class ConnectBackend(SparkBackend):
    """A Spark Connect session: settings through ``spark.conf``, cancellation by operation tag."""

    connect = True

    def __init__(self, spark: Any) -> None:
        self.spark = spark

    @property
    def session(self) -> Any:
        return self.spark

    @property
    def master(self) -> str:
        return self.conf("spark.master", "") or ""

    def conf(self, key: str, default: str | None = None) -> str | None:
        return self.spark.conf.get(key, default)

    @contextlib.contextmanager
    def job_group(self, group: str, description: str) -> Iterator[None]:
        # Tags are per client thread: every operation this thread sends inside the block carries it.
        self.spark.addTag(group)
        try:
            yield
        finally:
            self.spark.removeTag(group)

    def cancel(self, group: str) -> None:
        self.spark.interruptTag(group)

    def share(self, data: bytes) -> Any:
        # No broadcast variables here: the bytes travel inside the task function, in the query plan,
        # whose gRPC message Spark Connect caps at 128 MiB; larger ones go as a session file.
        if len(data) <= INLINE_LIMIT_BYTES:
            return data
        return SessionFile.upload(self.spark, data)


#: Spark Connect: shared data up to this size travels inside the task function (the query plan)
INLINE_LIMIT_BYTES = 32 << 20


class SessionFile:
    """Bytes uploaded to the Spark Connect session as a file artifact; tasks read them with SparkFiles.

    The server keeps session artifacts until the session ends (Spark Connect cannot remove one).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def upload(cls, spark: Any, data: bytes) -> SessionFile:
        """Upload ``data`` (in chunks, so no gRPC message limit applies) under a fresh name."""
        with tempfile.TemporaryDirectory(prefix="sparkdl-") as folder:
            path = os.path.join(folder, f"sparkdl-{uuid.uuid4().hex}.bin")
            with open(path, "wb") as out:
                out.write(data)
            spark.addArtifacts(path, file=True)
        return cls(os.path.basename(path))

    @property
    def value(self) -> bytes:
        """On an executor: the uploaded bytes."""
        from pyspark import SparkFiles

        with open(SparkFiles.get(self.name), "rb") as source:
            return source.read()


def shared_bytes(shared: Any) -> bytes | bytearray:
    """On an executor: the bytes behind what :meth:`SparkBackend.share` returned (bytes, a broadcast, a file)."""
    return shared if isinstance(shared, (bytes, bytearray)) else shared.value


def load_shared(shared: Any, what: str, advice: str) -> Any:
    """On an executor: the object pickled behind what :meth:`SparkBackend.share` returned, unpickled here so
    that one this Python worker's memory limit cannot hold is refused with ``advice`` (a ``ClusterConfigError``
    naming ``what``), not a bare ``MemoryError``."""
    from sparkdl._internal.memory import require_address_space
    from sparkdl.errors import ClusterConfigError

    try:
        data = shared_bytes(shared)
        # unpickling copies the tensors it holds: about as many bytes again as the pickle
        require_address_space(len(data), what, advice)
        return pickle.loads(data)
    except MemoryError as exc:   # a limit reached while Spark read the broadcast, or between the check and now
        raise ClusterConfigError(f"{what} ran out of this task's Python worker memory (spark.executor.pyspark.memory "
                                 f"over the executor's task slots). {advice}") from exc


def backend_for(spark_or_sc: Any) -> SparkBackend:
    """The backend of a SparkSession (classic or Connect) or a SparkContext."""
    if is_connect_session(spark_or_sc):
        return ConnectBackend(spark_or_sc)
    sc = getattr(spark_or_sc, "sparkContext", spark_or_sc)
    return ClassicBackend(sc)
