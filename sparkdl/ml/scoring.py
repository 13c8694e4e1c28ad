"""Executor side of TorchModel.transform: Arrow batches in, the same batches plus predictions out."""
from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch
from pyspark import cloudpickle
from torch import nn

from ..data.arrow import ColumnSpec, arrow_to_arrays, null_feature_rows
from ..errors import DataError
from ..spark.backend import SparkBackend, shared_bytes
from ..spark.devices import gpu_addresses, select_device
from ..training.pipeline_cuts import whole_model
from ..transforms import BatchTransform, resolve_transform

#: Arrow layout of a dense pyspark.ml Vector (VectorUDT's struct)
VECTOR_TYPE = pa.struct([pa.field("type", pa.int8(), nullable=False), pa.field("size", pa.int32()),
                         pa.field("indices", pa.list_(pa.field("element", pa.int32(), nullable=False))),
                         pa.field("values", pa.list_(pa.field("element", pa.float64(), nullable=False)))])


@dataclass(frozen=True)
class ScoringSpec:
    """What every scoring task needs; shipped once per executor (see :func:`make_scorer`)."""

    model_fn: Callable[[], nn.Module]
    state: bytes               # torch.save(state_dict)
    columns: ColumnSpec
    task: str                  # "multiclass" | "binary" | "regression"
    device: str
    batch_size: int
    prediction_col: str
    probability_col: str | None   # None: no probability column
    key: str                      # unique per transform call: the per-worker model cache key
    batch_transform: BatchTransform | str | None = None    # applied without its random parts
    #: rows with null, NaN or infinite features: "error", "skip" (left out) or "keep" (prediction NaN)
    handle_invalid: str = "error"


#: TorchModel's handleInvalid values
HANDLE_INVALID = ("error", "skip", "keep")


# One model per Python worker process and transform call: built on first use, reused by later tasks.
_MODELS: dict[str, tuple[nn.Module, torch.device, ScoringSpec]] = {}


def _model_for(key: str, shared_spec: Any, addresses: list[str]) -> tuple[nn.Module, torch.device, ScoringSpec]:
    cached = _MODELS.get(key)
    if cached is None:
        spec: ScoringSpec = pickle.loads(shared_bytes(shared_spec))   # once per worker process, not per task
        device = select_device(spec.device, addresses)
        model = whole_model(spec.model_fn)   # scored unsplit: pipelines are for training
        model.load_state_dict(torch.load(io.BytesIO(spec.state), map_location="cpu", weights_only=True))
        cached = (model.to(device).eval(), device, spec)
        _MODELS.clear()     # a new model replaces the previous one: bounded memory per worker
        _MODELS[key] = cached
    return cached


def dense_vectors(rows: np.ndarray, missing: np.ndarray | None = None) -> pa.StructArray:
    """A float matrix as an Arrow column of dense Spark ML vectors (null where ``missing``)."""
    n, width = rows.shape
    values = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * width),
                                      pa.array(rows.reshape(-1).astype(np.float64)))
    return pa.StructArray.from_arrays(
        [pa.array(np.ones(n, dtype=np.int8)), pa.nulls(n, pa.int32()), pa.nulls(n, VECTOR_TYPE.field("indices").type),
         values.cast(VECTOR_TYPE.field("values").type)], fields=list(VECTOR_TYPE),
        mask=None if missing is None or not missing.any() else pa.array(missing))


def invalid_rows(batch: pa.RecordBatch, columns: ColumnSpec) -> tuple[np.ndarray, np.ndarray]:
    """(a mask of the rows whose features are null, hold nulls, NaN or infinite values; the features of
    the other rows, converted)."""
    invalid = null_feature_rows(batch, columns)
    features, _ = arrow_to_arrays([batch.filter(pa.array(~invalid)) if invalid.any() else batch], columns)
    if features.dtype != object and len(features):
        finite = np.isfinite(features.reshape(len(features), -1)).all(axis=1)
        if not finite.all():
            invalid[np.flatnonzero(~invalid)[~finite]] = True
            features = features[finite]
    return invalid, features


def _invalid_rows_error(invalid: np.ndarray, first_row: int, columns: ColumnSpec) -> DataError:
    i = first_row + int(np.argmax(invalid))
    names = ", ".join(map(repr, columns.input_columns))
    return DataError(f"TorchModel.transform: row {i} of the partition has null, NaN or infinite (as float32) "
                     f"features in {names} ({int(invalid.sum())} such rows in this Arrow batch); "
                     "drop or impute them, or set handleInvalid to 'skip' (leave them out of the output) or "
                     "'keep' (prediction NaN, probability null)")


def predict_arrays(model: nn.Module, device: torch.device, features: np.ndarray, task: str,
                   batch_size: int, transform: BatchTransform | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(prediction, probability or None) for a feature array (encoded rows: an object array of bytes).

    ``transform`` is the training's batch transform, called without a generator (no random parts).
    """
    predictions, probabilities = [], []
    probability: torch.Tensor | np.ndarray | None   # a batch's tensor in the loop, then the result's array
    encoded = features.dtype == object
    # Arrow memory is read-only; torch wants writable memory
    x = features if encoded else torch.from_numpy(np.require(features, requirements=["W"]))
    with torch.inference_mode():
        for start in range(0, len(x), batch_size):
            batch = x[start:start + batch_size]
            if transform is not None:
                batch = transform(list(batch) if encoded else batch, None)
            elif encoded:
                raise ValueError("the features are encoded bytes: set batchTransform to decode them")
            # a tensor by now: the transform's output, or a slice of the float features
            output = model(cast(torch.Tensor, batch).to(device)).float()
            if task == "multiclass":
                probability = torch.softmax(output, dim=1)
                predictions.append(output.argmax(dim=1).double().cpu())
                probabilities.append(probability.double().cpu())
            elif task == "binary":
                p = torch.sigmoid(output.reshape(len(output)))
                predictions.append((p > 0.5).double().cpu())
                probabilities.append(torch.stack([1 - p, p], dim=1).double().cpu())
            else:
                predictions.append(output.reshape(len(output), -1)[:, 0].double().cpu())
    prediction = torch.cat(predictions).numpy() if predictions else np.zeros(0)
    if probabilities:
        probability = torch.cat(probabilities).numpy()
    else:   # no rows (all left out as invalid): an empty column, still there
        probability = None if task == "regression" else np.zeros((0, 0))
    return prediction, probability


def _spread(values: np.ndarray, invalid: np.ndarray) -> np.ndarray:
    """The valid rows' ``values`` in their places among all rows, NaN at the invalid ones."""
    out = np.full((len(invalid), *values.shape[1:]), np.nan)
    out[~invalid] = values
    return out


def make_scorer(spec: ScoringSpec, backend: SparkBackend) -> Callable[[Iterator[pa.RecordBatch]],
                                                                     Iterator[pa.RecordBatch]]:
    """The mapInArrow function of transform: appends prediction (and probability) columns.

    The spec (weights included) travels as ``backend.share`` ships it: a broadcast in classic
    PySpark, inside this function (the query plan) under Spark Connect.  The broadcast lives as
    long as the transformed DataFrame may run, so it is not released here.
    """
    key, shared_spec = spec.key, backend.share(cloudpickle.dumps(spec))

    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        torch.set_num_threads(max(1, context.cpus()) if context else 1)
        addresses = gpu_addresses(context.resources()) if context else []
        model, device, spec = _model_for(key, shared_spec, addresses)
        first_row = 0
        for batch in batches:
            if batch.num_rows == 0:
                continue
            invalid, features = invalid_rows(batch, spec.columns)
            if invalid.any() and spec.handle_invalid == "error":
                raise _invalid_rows_error(invalid, first_row, spec.columns)
            first_row += batch.num_rows
            prediction, probability = predict_arrays(model, device, features, spec.task, spec.batch_size,
                                                     resolve_transform(spec.batch_transform))
            if spec.handle_invalid == "skip" and invalid.any():
                batch = batch.filter(pa.array(~invalid))
            elif invalid.any():     # keep: every row, the invalid ones without a prediction
                prediction = _spread(prediction, invalid)
                probability = None if probability is None else _spread(probability, invalid)
            columns = batch.columns + [pa.array(prediction, pa.float64())]
            names = batch.schema.names + [spec.prediction_col]
            if spec.probability_col and probability is not None:
                columns.append(dense_vectors(probability, invalid if spec.handle_invalid == "keep" else None))
                names.append(spec.probability_col)
            yield pa.RecordBatch.from_arrays(columns, names=names)

    return score
