"""Saving and loading TorchEstimator / TorchModel with pyspark.ml's reader/writer machinery.

Layout of a saved instance at PATH (any Hadoop file system Spark can write):
  PATH/metadata/  Params as JSON (DefaultParamsWriter), plus sparkdl and torch versions
  PATH/data/      one Parquet row: the model factory, a callable loss if any, the weights
                  (torch.save bytes) and the training history (JSON)
The model factory is stored as an importable ``module:qualname`` reference when it is one,
and with cloudpickle otherwise.
"""
from __future__ import annotations

import importlib
import io
import json
from typing import Any

import torch
from pyspark import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter
from pyspark.sql import SparkSession

import sparkdl

#: Params whose values are Python objects, stored in the data file instead of the JSON metadata
OBJECT_PARAMS = ("model", "loss")


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
    raise ValueError(f"unknown stored object kind {kind!r}")


def state_to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class TorchWriter(MLWriter):
    """Writes an instance's Params as metadata and its Python objects/weights as Parquet."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        instance = self.instance
        json_params = {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}
        extra = {"sparkdlVersion": sparkdl.__version__, "torchVersion": torch.__version__}
        DefaultParamsWriter.saveMetadata(instance, path, self.sparkSession, extraMetadata=extra,
                                         paramMap=json_params)
        row: dict[str, Any] = {}
        for name in OBJECT_PARAMS:
            value = instance.getOrDefault(name) if instance.isDefined(name) else None
            row[f"{name}_kind"], row[name] = encode_object(value)
        state = getattr(instance, "state_dict", None)
        row["state"] = state_to_bytes(state) if state is not None else None
        history = getattr(instance, "_history_records", None)
        row["history"] = json.dumps(history) if history is not None else None
        row["summary"] = json.dumps(getattr(instance, "_summary", None), default=float)
        gradients = getattr(instance, "_gradient_records", None)
        row["gradients"] = json.dumps(gradients, default=float) if gradients is not None else None
        spark: SparkSession = self.sparkSession
        schema = ("model_kind string, model binary, loss_kind string, loss binary, state binary, "
                  "history string, summary string, gradients string")
        frame = spark.createDataFrame([tuple(row[c] for c in ("model_kind", "model", "loss_kind", "loss", "state",
                                                               "history", "summary", "gradients"))], schema)
        frame.coalesce(1).write.mode("overwrite").parquet(f"{path}/data")


class TorchReader(MLReader):
    """Reads what :class:`TorchWriter` wrote into a new instance of ``cls``."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        row = self.sparkSession.read.parquet(f"{path}/data").collect()[0]
        instance = self.cls._from_saved(
            state=state_from_bytes(row["state"]) if row["state"] is not None else None,
            history=json.loads(row["history"]) if row["history"] else None,
            summary=json.loads(row["summary"]) if row["summary"] else None,
            gradients=json.loads(row["gradients"]) if row["gradients"] else None)
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        for name in OBJECT_PARAMS:
            value = decode_object(row[f"{name}_kind"], bytes(row[name]))
            if value is not None:
                instance._set(**{name: value})
        return instance
