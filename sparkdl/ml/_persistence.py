"""Saving and loading TorchEstimator / TorchModel with pyspark.ml's reader/writer machinery.

Layout of a saved instance at PATH (any Hadoop-compatible file system Spark can reach):
  PATH/metadata/      Params as JSON (DefaultParamsWriter's format), plus sparkdl and torch
                      versions and ``sparkdlFormat``
  PATH/weights.pt     the weights (torch.save bytes); absent when there are none
  PATH/objects.json   the model factory, a callable loss if any, the training history, summary
                      and per-gradient log
  PATH/program.pt     a TorchScript or torch.export model's file, as it was loaded (TorchModel.load_torch)
Every file is written and read by the driver through the JVM's Hadoop FileSystem API: saving
runs no Spark job, so the weights never travel inside a task.  The model factory is stored as
an importable ``module:qualname`` reference when it is one, and with cloudpickle otherwise.

Models saved before ``sparkdlFormat`` 2 keep all of this except the metadata in one Parquet row
at PATH/data/; they still load.
"""
from __future__ import annotations

import base64
import importlib
import io
import json
from typing import Any

import pyspark
import torch
from pyspark import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter
from pyspark.sql import SparkSession

import sparkdl
from sparkdl._internal.spark.hadoop_files import HadoopFiles
from sparkdl.ml._model_sources import SavedProgram

#: Params whose values are Python objects, stored in the data file instead of the JSON metadata
OBJECT_PARAMS = ("model", "loss", "batchTransform", "trainStep", "callbacks")
#: the file a saved program (TorchModel.load_torch) is written to
PROGRAM_FILE = "program.pt"
#: the layout written by TorchWriter (metadata key ``sparkdlFormat``); 1 (absent) is the Parquet row
FORMAT = 2


def object_params(instance: Any) -> list[tuple[str, Any]]:
    """The object-valued Params this estimator or model has (trainStep and callbacks are the estimator's only),
    with their values (None when unset)."""
    return [(name, instance.getOrDefault(name) if instance.isDefined(name) else None)
            for name in OBJECT_PARAMS if instance.hasParam(name)]


def factory_reference(fn: Any) -> str | None:
    """``module:qualname`` when ``fn`` can be re-imported by that name, else None."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if target is fn else None


def encode_object(value: Any) -> tuple[str, bytes]:
    if value is None or isinstance(value, str):
        return "json", json.dumps(value).encode()
    reference = factory_reference(value)
    if reference is not None:
        return "ref", reference.encode()
    return "cloudpickle", cloudpickle.dumps(value)


def decode_object(kind: str, payload: bytes) -> Any:
    if kind == "json":
        return json.loads(payload.decode())
    if kind == "ref":
        module, qualname = payload.decode().split(":", 1)
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        return target
    if kind == "cloudpickle":
        return cloudpickle.loads(payload)
    if kind.startswith("program:"):
        return SavedProgram(payload, kind.split(":", 1)[1])
    raise ValueError(f"unknown stored object kind {kind!r}")


def state_to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _payload(value: Any) -> tuple[str, str]:
    """``encode_object``'s kind and bytes, the bytes as base64 text for JSON."""
    kind, data = encode_object(value)
    return kind, base64.b64encode(data).decode("ascii")


class TorchWriter(MLWriter):
    """Writes an instance's Params as metadata, its weights and Python objects as files next to it."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        """Write ``path``/metadata, ``path``/weights.pt and ``path``/objects.json without a Spark job."""
        instance = self.instance
        spark: SparkSession = self.sparkSession
        files = HadoopFiles(spark)
        if not self.shouldOverwrite and files.exists(path):
            raise FileExistsError(f"{path} already exists; use write().overwrite().save(path) to replace it, or "
                                  "choose another path")
        objects: dict[str, Any] = {}
        for name, value in object_params(instance):
            if isinstance(value, SavedProgram):   # its own file, as loaded: not base64 inside the JSON
                files.write(f"{path}/{PROGRAM_FILE}", value.data)
                objects[f"{name}_kind"], objects[name] = f"program:{value.format}", PROGRAM_FILE
            else:
                objects[f"{name}_kind"], objects[name] = _payload(value)
        objects["history"] = getattr(instance, "_history_records", None)
        objects["summary"] = getattr(instance, "_summary", None)
        objects["gradients"] = getattr(instance, "_gradient_records", None)
        state = getattr(instance, "state_dict", None)
        objects["weights"] = "weights.pt" if state is not None else None
        if state is not None:
            files.write(f"{path}/weights.pt", state_to_bytes(state))
        files.write(f"{path}/objects.json", json.dumps(objects, default=float).encode())
        json_params = {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}
        extra = {"sparkdlVersion": sparkdl.__version__, "torchVersion": torch.__version__, "sparkdlFormat": FORMAT}
        # The JSON and text file DefaultParamsWriter.saveMetadata writes, written here directly
        # because saveMetadata ships it through a one-row DataFrame (a Spark job).  Written last:
        # a save cut short leaves no metadata, so it is not mistaken for a complete model.
        metadata = DefaultParamsWriter._get_metadata_to_save(instance, spark, extraMetadata=extra,
                                                             paramMap=json_params)
        files.write(f"{path}/metadata/part-00000", (metadata + "\n").encode())
        files.write(f"{path}/metadata/_SUCCESS", b"")


def _read_metadata(spark: SparkSession, path: str) -> dict[str, Any]:
    """The Params metadata at ``path``/metadata: the one file :class:`TorchWriter` writes, read without a
    Spark job; else (a model of format 1) through pyspark: with the reader's session on pyspark 4,
    its SparkContext on 3.5 (which takes only a context there)."""
    files = HadoopFiles(spark)
    written = f"{path}/metadata/part-00000"
    if files.exists(written):
        return DefaultParamsReader._parseMetaData(files.read(written).decode("utf-8").strip(), "")
    takes_session = int(pyspark.__version__.split(".")[0]) >= 4
    return DefaultParamsReader.loadMetadata(path, spark if takes_session else spark.sparkContext)


def _read_files(spark: SparkSession, path: str) -> dict[str, Any]:
    """What TorchWriter wrote (format 2), as the fields of the format-1 Parquet row."""
    files = HadoopFiles(spark)
    objects = json.loads(files.read(f"{path}/objects.json"))
    saved = {name: objects[name] for name in ("history", "summary", "gradients")}
    for name in OBJECT_PARAMS:
        kind = objects.get(f"{name}_kind")
        if kind is None:     # models saved before a Param existed lack it
            continue
        saved[f"{name}_kind"] = kind
        saved[name] = (files.read(f"{path}/{objects[name]}") if kind.startswith("program:")
                       else base64.b64decode(objects[name]))
    saved["state"] = files.read(f"{path}/{objects['weights']}") if objects["weights"] else None
    return saved


def _read_parquet_row(spark: SparkSession, path: str) -> dict[str, Any]:
    """A model saved in format 1: one Parquet row at PATH/data with JSON text columns."""
    row = spark.read.parquet(f"{path}/data").collect()[0].asDict()
    for name in ("history", "summary", "gradients"):
        row[name] = json.loads(row[name]) if row.get(name) else None
    for name in OBJECT_PARAMS:
        if name in row:
            row[name] = bytes(row[name])
    row["state"] = bytes(row["state"]) if row["state"] is not None else None
    return row


def instance_from_saved(cls: type[Any], metadata: dict[str, Any], saved: dict[str, Any]) -> Any:
    """A TorchEstimator / TorchModel rebuilt from its metadata and its saved objects (either layout)."""
    instance = cls._from_saved(
        state=state_from_bytes(saved["state"]) if saved["state"] is not None else None,
        history=saved["history"], summary=saved["summary"], gradients=saved["gradients"])
    instance._resetUid(metadata["uid"])
    DefaultParamsReader.getAndSetParams(instance, metadata)
    for name in OBJECT_PARAMS:
        if f"{name}_kind" not in saved:
            continue
        value = decode_object(saved[f"{name}_kind"], saved[name])
        if value is not None:
            instance._set(**{name: value})
    return instance


class TorchReader(MLReader):
    """Reads what :class:`TorchWriter` wrote (either format) into a new instance of ``cls``."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        """The instance saved at ``path``."""
        metadata = _read_metadata(self.sparkSession, path)
        version = int(metadata.get("sparkdlFormat", 1))
        if version > FORMAT:
            raise ValueError(f"{path} was saved by sparkdl {metadata.get('sparkdlVersion')} in format {version}; "
                             f"this sparkdl ({sparkdl.__version__}) reads formats up to {FORMAT}: upgrade sparkdl")
        saved = _read_files(self.sparkSession, path) if version >= 2 else _read_parquet_row(self.sparkSession, path)
        return instance_from_saved(self.cls, metadata, saved)
