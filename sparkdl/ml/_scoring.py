"""Executor side of TorchModel.transform: Arrow batches in, the same batches plus predictions out."""
from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from pyspark import cloudpickle
from torch import nn

from sparkdl._internal.data.arrow import arrow_to_block, null_feature_rows
from sparkdl._internal.data.block import Ragged, RowBlock, is_encoded
from sparkdl._internal.data.cache import in_memory_partition
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl._internal.data.partitions import DEFAULT_PADDING, Padding, transformed
from sparkdl._internal.memory import require_address_space
from sparkdl._internal.spark.backend import SparkBackend, load_shared
from sparkdl._internal.spark.devices import gpu_addresses, select_device
from sparkdl._internal.training.inputs import ModelCall
from sparkdl._internal.training.pipeline_cuts import whole_model
from sparkdl.errors import DataError
from sparkdl.transforms import BatchTransform, resolve_transform

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
    padding: Padding = DEFAULT_PADDING      # ragged inputs are padded as in training


#: TorchModel's handleInvalid values
HANDLE_INVALID = ("error", "skip", "keep")


# One model per Python worker process and transform call: built on first use, reused by later tasks.
_MODELS: dict[str, tuple[nn.Module, torch.device, ScoringSpec]] = {}


#: bytes a Python worker allocates per byte of the saved state while it builds the model to score: the
#: module's own tensors, and the loaded state they are copied from
SCORING_BYTES_PER_STATE_BYTE = 2


#: what to do when the model to score cannot fit a Python worker
SCORING_MEMORY_ADVICE = ("Scoring builds the whole model in every Python worker, embedding tables included: give the "
                         "executors more memory (spark.executor.pyspark.memory) or fewer task slots each")


def scoring_model(spec: ScoringSpec) -> nn.Module:
    """The fitted model, whole, on the CPU; a clear error first when it cannot fit this Python worker."""
    require_address_space(SCORING_BYTES_PER_STATE_BYTE * len(spec.state), "the model for scoring",
                          SCORING_MEMORY_ADVICE)
    model = whole_model(spec.model_fn)   # scored unsplit: pipelines are for training
    model.load_state_dict(torch.load(io.BytesIO(spec.state), map_location="cpu", weights_only=True))
    return model


def _model_for(key: str, shared_spec: Any, addresses: list[str]) -> tuple[nn.Module, torch.device, ScoringSpec]:
    cached = _MODELS.get(key)
    if cached is None:
        # once per worker process, not per task
        spec: ScoringSpec = load_shared(shared_spec, "loading the model to score (its saved state)",
                                        SCORING_MEMORY_ADVICE)
        device = select_device(spec.device, addresses)
        model = scoring_model(spec)
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


def _bad_values(field: np.ndarray | Ragged, typed: bool) -> np.ndarray:
    """Per row: it holds NaN/Inf (floating values) or a negative id (integer inputs)."""
    values = field.values if isinstance(field, Ragged) else field.reshape(len(field), -1)
    if values.dtype.kind == "f":
        bad_values = ~np.isfinite(values)
    elif values.dtype.kind == "i" and typed:
        bad_values = values < 0
    else:
        return np.zeros(len(field), dtype=bool)
    if not isinstance(field, Ragged):
        return bad_values.any(axis=1)
    rows = np.zeros(len(field), dtype=bool)
    rows[np.searchsorted(field.offsets, np.flatnonzero(bad_values), side="right") - 1] = True
    return rows


def invalid_rows(batch: pa.RecordBatch, columns: ColumnSpec, max_length: int | None = None
                 ) -> tuple[np.ndarray, RowBlock]:
    """(a mask of the rows whose inputs are null, hold nulls, NaN or infinite values or negative ids, or
    sequences longer than ``max_length``; the other rows, converted)."""
    invalid = null_feature_rows(batch, columns)
    block = arrow_to_block([batch.filter(pa.array(~invalid)) if invalid.any() else batch], columns)
    if not len(block):
        return invalid, block
    bad = np.zeros(len(block), dtype=bool)
    for field in block.inputs:
        if not is_encoded(field):
            bad |= _bad_values(field, columns.typed)
        if isinstance(field, Ragged) and max_length is not None:
            bad |= field.lengths > max_length
    if bad.any():
        invalid[np.flatnonzero(~invalid)[bad]] = True
        block = block.take(np.flatnonzero(~bad))
    return invalid, block


def _invalid_rows_error(invalid: np.ndarray, first_row: int, columns: ColumnSpec) -> DataError:
    i = first_row + int(np.argmax(invalid))
    names = ", ".join(map(repr, columns.input_columns))
    what = "values, negative ids or sequences over sequenceLength" if columns.typed else "features"
    return DataError(f"TorchModel.transform: row {i} of the partition has null, NaN or infinite (as float32) "
                     f"{what} in {names} ({int(invalid.sum())} such rows in this Arrow batch); drop or impute them, "
                     "or set handleInvalid to 'skip' (leave them out of the output) or 'keep' (prediction NaN, "
                     "probability null)")


def predict_arrays(model: nn.Module, device: torch.device, block: RowBlock, task: str, batch_size: int,
                   transform: BatchTransform | None = None, call: ModelCall | None = None,
                   padding: Padding = DEFAULT_PADDING) -> tuple[np.ndarray, np.ndarray | None]:
    """(prediction, probability or None) for a block of rows, padded and called as in training.

    ``transform`` is the training's batch transform, called without a generator (no random parts).
    """
    call = call or ModelCall()
    predictions, probabilities = [], []
    probability: torch.Tensor | np.ndarray | None   # a batch's tensor in the loop, then the result's array
    rows = len(block)
    partition = in_memory_partition([block], torch.device("cpu")) if rows else None
    with torch.inference_mode():
        for start in range(0, rows, batch_size):
            assert partition is not None   # made when there are rows
            batch = partition.gather(torch.arange(start, min(start + batch_size, rows)), padding)
            inputs, masks = batch.inputs, batch.masks
            if transform is not None:
                inputs, masks = transformed(transform, inputs, masks, None)
            elif not all(isinstance(value, torch.Tensor) for value in inputs):
                raise ValueError("the features are encoded bytes: set batchTransform to decode them")
            output = call(model, [value.to(device) for value in inputs],
                          [None if mask is None else mask.to(device) for mask in masks]).float()
            if task == "multiclass":
                probability = torch.softmax(output, dim=1)
                predictions.append(output.argmax(dim=1).double().cpu())
                probabilities.append(probability.double().cpu())
            elif task == "binary":
                p = torch.sigmoid(output.reshape(len(output)))
                predictions.append((p > 0.5).double().cpu())
                probabilities.append(torch.stack([1 - p, p], dim=1).double().cpu())
            elif task == "multilabel":      # one probability per label; predicted labels as a 0/1 Vector
                p = torch.sigmoid(output.reshape(len(output), -1))
                predictions.append((p > 0.5).double().cpu())
                probabilities.append(p.double().cpu())
            elif task == "multioutput":
                predictions.append(output.reshape(len(output), -1).double().cpu())
            else:
                predictions.append(output.reshape(len(output), -1)[:, 0].double().cpu())
    vector = task in ("multilabel", "multioutput")
    prediction = torch.cat(predictions).numpy() if predictions else np.zeros((0, 0) if vector else 0)
    if probabilities:
        probability = torch.cat(probabilities).numpy()
    else:   # no rows (all left out as invalid): an empty column, still there
        probability = None if task in ("regression", "multioutput") else np.zeros((0, 0))
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
        call = ModelCall.for_module(model, spec.columns.input_args)
        first_row = 0
        for batch in batches:
            if batch.num_rows == 0:
                continue
            invalid, block = invalid_rows(batch, spec.columns, spec.padding.length)
            if invalid.any() and spec.handle_invalid == "error":
                raise _invalid_rows_error(invalid, first_row, spec.columns)
            first_row += batch.num_rows
            prediction, probability = predict_arrays(model, device, block, spec.task, spec.batch_size,
                                                     resolve_transform(spec.batch_transform), call, spec.padding)
            if spec.handle_invalid == "skip" and invalid.any():
                batch = batch.filter(pa.array(~invalid))
            elif invalid.any():     # keep: every row, the invalid ones without a prediction
                prediction = _spread(prediction, invalid)
                probability = None if probability is None else _spread(probability, invalid)
            missing = invalid if spec.handle_invalid == "keep" else None
            columns = batch.columns + [dense_vectors(prediction, missing) if prediction.ndim == 2
                                       else pa.array(prediction, pa.float64())]
            names = batch.schema.names + [spec.prediction_col]
            if spec.probability_col and probability is not None:
                columns.append(dense_vectors(probability, missing))
                names.append(spec.probability_col)
            yield pa.RecordBatch.from_arrays(columns, names=names)

    return score
