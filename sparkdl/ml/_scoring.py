"""Executor side of TorchModel.transform: Arrow batches in, the same batches plus predictions out."""
from __future__ import annotations

import hashlib
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
from sparkdl.ml._model_sources import SavedProgram, carries_weights
from sparkdl.ml._outputs import OutputSpec
from sparkdl.transforms import BatchTransform, resolve_transform


@dataclass(frozen=True)
class ScoringSpec:
    """What every scoring task needs; shipped once per executor (see :func:`make_scorer`)."""

    model_fn: Callable[[], nn.Module]
    state: bytes               # torch.save(state_dict); empty when the factory's modules carry their weights
    columns: ColumnSpec
    outputs: OutputSpec        # what each row gets
    device: str
    batch_size: int
    batch_transform: BatchTransform | str | None = None    # applied without its random parts
    #: rows with null, NaN or infinite features: "error", "skip" (left out) or "keep" (prediction NaN)
    handle_invalid: str = "error"
    padding: Padding = DEFAULT_PADDING      # ragged inputs are padded as in training


#: TorchModel's handleInvalid values
HANDLE_INVALID = ("error", "skip", "keep")


def scoring_key(spec_bytes: bytes) -> str:
    """The per-worker model cache key of a pickled spec: the same model, weights and settings give the same key,
    so later transforms (and queries) of it reuse the model a Python worker built."""
    return hashlib.sha256(spec_bytes).hexdigest()


# One model per Python worker process: built on first use, reused by later tasks, queries and transforms of it.
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
    if carries_weights(spec.model_fn):
        return spec.model_fn()
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
        model = (spec.model_fn.module_on(device) if isinstance(spec.model_fn, SavedProgram)
                 else scoring_model(spec).to(device).eval())
        cached = (model, device, spec)
        _MODELS.clear()     # a new model replaces the previous one: bounded memory per worker
        _MODELS[key] = cached
    return cached


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


def predict_arrays(model: nn.Module, device: torch.device, block: RowBlock, outputs: OutputSpec, batch_size: int,
                   transform: BatchTransform | None = None, call: ModelCall | None = None,
                   padding: Padding = DEFAULT_PADDING) -> dict[str, np.ndarray]:
    """The added columns' values (``outputs.columns_of``) for a block of rows, padded and called as in training.

    ``transform`` is the training's batch transform, called without a generator (no random parts).
    """
    call = call or ModelCall()
    parts: dict[str, list[torch.Tensor]] = {}
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
                          [None if mask is None else mask.to(device) for mask in masks])
            for name, values in outputs.columns_of(output).items():
                parts.setdefault(name, []).append(values.cpu())
    if not parts:   # no rows (all left out as invalid): empty columns, still there
        return {name: np.zeros((0, 0)) for name in outputs.names}
    return {name: torch.cat(values).numpy() for name, values in parts.items()}


class BatchScorer:
    """One task's scoring: the worker's model (built once per Python worker), applied to Arrow batches."""

    def __init__(self, key: str, shared_spec: Any) -> None:
        from pyspark import TaskContext

        context = TaskContext.get()
        torch.set_num_threads(max(1, context.cpus()) if context else 1)
        addresses = gpu_addresses(context.resources()) if context else []
        self.model, self.device, self.spec = _model_for(key, shared_spec, addresses)
        self.call = ModelCall.for_module(self.model, self.spec.columns.input_args)
        self.transform = resolve_transform(self.spec.batch_transform)
        self.first_row = 0     # of the partition, for error messages

    def score(self, batch: pa.RecordBatch) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(a mask of the invalid rows, the valid rows' added columns); fails on invalid rows under "error"."""
        spec = self.spec
        invalid, block = invalid_rows(batch, spec.columns, spec.padding.length)
        if invalid.any() and spec.handle_invalid == "error":
            raise _invalid_rows_error(invalid, self.first_row, spec.columns)
        self.first_row += batch.num_rows
        return invalid, predict_arrays(self.model, self.device, block, spec.outputs, spec.batch_size, self.transform,
                                       self.call, spec.padding)


def shared_scoring_spec(spec: ScoringSpec, backend: SparkBackend) -> tuple[str, Any]:
    """(the spec's cache key, the spec as ``backend.share`` ships it: a broadcast in classic PySpark, the bytes
    themselves, inside the query plan, under Spark Connect)."""
    spec_bytes = cloudpickle.dumps(spec)
    return scoring_key(spec_bytes), backend.share(spec_bytes)


def make_scorer(spec: ScoringSpec, backend: SparkBackend) -> Callable[[Iterator[pa.RecordBatch]],
                                                                     Iterator[pa.RecordBatch]]:
    """The mapInArrow function of transform: appends the columns ``spec.outputs`` names.

    The broadcast lives as long as the transformed DataFrame may run, so it is not released here.
    """
    key, shared_spec = shared_scoring_spec(spec, backend)

    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        scorer = BatchScorer(key, shared_spec)
        outputs, handle_invalid = scorer.spec.outputs, scorer.spec.handle_invalid
        for batch in batches:
            if batch.num_rows == 0:
                continue
            invalid, values = scorer.score(batch)
            if handle_invalid == "skip" and invalid.any():
                batch = batch.filter(pa.array(~invalid))
            missing = invalid if handle_invalid == "keep" and invalid.any() else None
            yield pa.RecordBatch.from_arrays(batch.columns + outputs.to_arrow(values, missing),
                                             names=batch.schema.names + outputs.names)

    return score
