"""Saving and loading TorchEstimator / TorchModel from a Spark Connect session.

A Connect client has no JVM, so it cannot open files through Hadoop's FileSystem API as the
classic writer does.  Everything goes through Spark on the server instead, so a path means
what it means to Spark there (its default file system, its credentials), exactly as for the
metadata of an enclosing Pipeline or CrossValidator:

* saving writes the single-row Parquet layout (format 1: ``PATH/metadata/`` plus one row at
  ``PATH/data/`` holding the model factory, a callable loss, the weights and the training
  logs), which every sparkdl version, classic or Connect, loads; one task emits that row;
* loading reads that layout, and the files layout (format 2: ``PATH/weights.pt`` and
  ``PATH/objects.json``) through the ``binaryFile`` and ``text`` sources.

Large binary values come back in chunks of :data:`CHUNK_BYTES` rows, so no single gRPC
message has to hold the weights.
"""
from __future__ import annotations

import base64
import functools
import json
import pickle
from typing import Any
from urllib.parse import urlparse

import torch
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter
from pyspark.sql import DataFrame

import sparkdl
from sparkdl._internal.spark.backend import ConnectBackend, is_connect_session, load_shared
from sparkdl._internal.spark.hadoop_files import HadoopFiles, has_scheme
from sparkdl._internal.spark.task import read_to_the_end
from sparkdl.ml._persistence import (
    OBJECT_PARAMS,
    TorchReader,
    TorchWriter,
    encode_object,
    instance_from_saved,
    object_params,
    state_to_bytes,
)

#: bytes per row when a binary value is read back (well below gRPC's 128 MiB message limit)
CHUNK_BYTES = 16 << 20
_ROW_COLUMNS = ("model_kind", "model", "loss_kind", "loss", "state", "history", "summary", "gradients")
_ROW_SCHEMA = ("model_kind string, model binary, loss_kind string, loss binary, state binary, "
               "history string, summary string, gradients string")


class ConnectAwareWriter(TorchWriter):
    """:class:`TorchWriter` for a classic session; through Spark (:func:`save`) for a Spark Connect one."""

    def save(self, path: str) -> None:
        """Save the instance to ``path``."""
        if is_connect_session(self.sparkSession):
            save(self.instance, path, self.sparkSession, self.shouldOverwrite)
        else:
            super().save(path)


class ConnectAwareReader(TorchReader):
    """:class:`TorchReader` for a classic session; through Spark (:func:`load`) for a Spark Connect one."""

    def load(self, path: str) -> Any:
        """The instance saved at ``path``."""
        if is_connect_session(self.sparkSession):
            return load(self.cls, path, self.sparkSession)
        return super().load(path)


def save(instance: Any, path: str, spark: Any, overwrite: bool) -> None:
    """Write ``instance`` (a TorchEstimator or TorchModel) at ``path`` through Spark (format 1)."""
    if overwrite:
        _remove(path)
    json_params = {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}
    extra = {"sparkdlVersion": sparkdl.__version__, "torchVersion": torch.__version__, "sparkdlFormat": 1}
    try:
        DefaultParamsWriter.saveMetadata(instance, path, spark, extraMetadata=extra, paramMap=json_params)
    except Exception as exc:
        if "PATH_ALREADY_EXISTS" in str(exc) or "already exists" in str(exc):
            raise FileExistsError(f"{path} already exists; use write().overwrite().save(path) to replace it, or "
                                  "choose another path") from exc
        raise
    row: dict[str, Any] = {}
    for name, value in object_params(instance):
        row[f"{name}_kind"], row[name] = encode_object(value)
    state = getattr(instance, "state_dict", None)
    row["state"] = state_to_bytes(state) if state is not None else None
    history = getattr(instance, "_history_records", None)
    row["history"] = json.dumps(history, default=float) if history is not None else None
    row["summary"] = json.dumps(getattr(instance, "_summary", None), default=float)
    gradients = getattr(instance, "_gradient_records", None)
    row["gradients"] = json.dumps(gradients, default=float) if gradients is not None else None
    # One task emits the row: the weights reach Spark as one Arrow batch on an executor (shipped
    # like a job spec, as a session file when large) instead of a local relation built on the driver.
    shared = ConnectBackend(spark).share(pickle.dumps(row))
    frame = spark.range(0, 1, 1, 1).mapInArrow(functools.partial(_emit_row, shared), _ROW_SCHEMA)
    frame.write.mode("overwrite").parquet(f"{path}/data")


#: what to do when the task that writes the saved row cannot hold the model's weights
SAVE_MEMORY_ADVICE = ("Saving from a Spark Connect session writes the weights from one task: give the executors more "
                      "memory (spark.executor.pyspark.memory) or fewer task slots each")


def _emit_row(shared: Any, batches: Any) -> Any:
    """mapInArrow body of :func:`save`: the saved row as one Arrow batch."""
    import pyarrow as pa

    read_to_the_end(batches)   # its one placeholder row
    row = load_shared(shared, "saving the model (its weights, in the saved row)", SAVE_MEMORY_ADVICE)
    types = {"model": pa.binary(), "loss": pa.binary(), "state": pa.binary()}
    yield pa.RecordBatch.from_pydict({c: pa.array([row[c]], types.get(c, pa.string())) for c in _ROW_COLUMNS})


def load(cls: type, path: str, spark: Any) -> Any:
    """A new ``cls`` instance from what was saved at ``path`` (either format)."""
    metadata = DefaultParamsReader.loadMetadata(path, spark)
    version = int(metadata.get("sparkdlFormat", 1))
    if version > 2:
        raise ValueError(f"{path} was saved by sparkdl {metadata.get('sparkdlVersion')} in format {version}; "
                         f"this sparkdl ({sparkdl.__version__}) reads formats up to 2: upgrade sparkdl")
    saved = _read_files(spark, path) if version == 2 else _read_row(spark, path)
    return instance_from_saved(cls, metadata, saved)


def _remove(path: str) -> None:
    """Delete ``path`` on the server side (what ``write().overwrite()`` does for pyspark.ml's own models)."""
    from pyspark.ml.util import ML_CONNECT_HELPER_ID
    from pyspark.ml.wrapper import JavaWrapper

    JavaWrapper(java_obj=ML_CONNECT_HELPER_ID)._call_java("handleOverwrite", path, True)


def _read_row(spark: Any, path: str) -> dict[str, Any]:
    """Format 1: the Parquet row, its weights column fetched in chunks."""
    frame = spark.read.parquet(f"{path}/data")
    row = frame.drop("state").collect()[0].asDict()
    for name in ("history", "summary", "gradients"):
        row[name] = json.loads(row[name]) if row.get(name) else None
    for name in OBJECT_PARAMS:
        if name in row:       # models saved before a Param existed lack it
            row[name] = bytes(row[name])
    row["state"] = read_binary(frame, "state")
    return row


def _read_files(spark: Any, path: str) -> dict[str, Any]:
    """Format 2: ``objects.json`` and ``weights.pt``, read through Spark's text and binaryFile sources."""
    text = spark.read.text(f"{path}/objects.json", wholetext=True).collect()[0][0]
    objects = json.loads(text)
    saved = {name: objects[name] for name in ("history", "summary", "gradients")}
    for name in OBJECT_PARAMS:
        kind = objects.get(f"{name}_kind")
        if kind is None:
            continue
        saved[f"{name}_kind"] = kind
        saved[name] = (read_binary(spark.read.format("binaryFile").load(f"{path}/{objects[name]}"), "content")
                       if kind.startswith("program:") else base64.b64decode(objects[name]))
    weights = objects.get("weights")
    saved["state"] = (read_binary(spark.read.format("binaryFile").load(f"{path}/{weights}"), "content")
                      if weights else None)
    return saved


def read_binary(frame: DataFrame, column: str, chunk_bytes: int = CHUNK_BYTES) -> bytes | None:
    """The binary ``column`` of the one-row ``frame``, fetched as rows of at most ``chunk_bytes`` each."""
    from pyspark.sql import functions as F

    length = frame.select(F.length(column).alias("n")).collect()[0].n
    if length is None:
        return None
    chunks = -(-length // chunk_bytes)
    if chunks <= 1:
        return bytes(frame.select(column).collect()[0][0])
    parts = (frame.select(F.explode(F.sequence(F.lit(0), F.lit(chunks - 1))).alias("i"), column)
             .select("i", F.expr(f"substring(`{column}`, i * {chunk_bytes} + 1, {chunk_bytes})").alias("part"))
             .collect())
    return b"".join(bytes(r.part) for r in sorted(parts, key=lambda r: r.i))


def read_file_bytes(path: str) -> bytes:
    """The whole file at ``path``: a local path (or ``file:`` URI) read here, any other URI through the active
    session (the driver's Hadoop FileSystem in a classic session, a one-file ``binaryFile`` read under Spark
    Connect)."""
    from pyspark.sql import SparkSession

    if not has_scheme(path) or path.startswith("file:"):
        with open(urlparse(path).path if has_scheme(path) else path, "rb") as handle:
            return handle.read()
    session = SparkSession.getActiveSession()
    if session is None:
        raise RuntimeError(f"reading {path!r} needs an active SparkSession (its Hadoop file systems); start one "
                           "first, or give a local path")
    if getattr(session, "_jvm", None) is not None:
        return HadoopFiles(session).read(path)
    frame = session.read.format("binaryFile").load(path)
    found = frame.limit(2).count()
    if found != 1:
        raise FileNotFoundError(f"{path!r} is not one file ({found} found there)")
    return read_binary(frame, "content") or b""   # in chunks: gRPC bounds one message
